//! The store's background writers (G3 write-back, G4 write-through): one
//! thread each, fed by a channel of jobs. A writer coalesces queued writes
//! into batches and answers flush markers in order, once every write queued
//! before the marker is done.

use std::sync::mpsc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::store_error::StoreError;

/// Largest number of blocks a writer hands to its tier at once.
pub(super) const WRITE_BATCH: usize = 64;

/// Work for a writer.
enum Job<T> {
    /// Blocks to write.
    Write(Vec<T>),
    /// Answer once every write queued before it is done.
    Flush(mpsc::Sender<()>),
}

/// A writer thread and the sender that feeds it.
pub(super) struct Writer<T> {
    tx: Mutex<Option<mpsc::Sender<Job<T>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    name: &'static str,
}

impl<T: Send + 'static> Writer<T> {
    /// Starts thread `name`, which hands batches of up to [`WRITE_BATCH`]
    /// blocks to `write`.
    pub(super) fn spawn(
        name: &'static str,
        mut write: impl FnMut(Vec<T>) + Send + 'static,
    ) -> Result<Self, StoreError> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run_jobs(&rx, WRITE_BATCH, &mut write))
            .map_err(|e| StoreError::Task(format!("cannot start the {name} thread: {e}")))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            name,
        })
    }

    /// Queues blocks; false (and nothing queued) once the writer stopped.
    pub(super) fn send(&self, blocks: Vec<T>) -> bool {
        self.tx
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Write(blocks)).is_ok())
    }

    /// Waits until every write queued before it is done; false when the
    /// writer is gone (stopped, or its thread failed).
    pub(super) fn flush(&self) -> bool {
        let (done_tx, done_rx) = mpsc::channel();
        let sent = self
            .tx
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(Job::Flush(done_tx)).is_ok());
        sent && done_rx.recv().is_ok()
    }

    /// True once [`stop`](Self::stop) ran.
    pub(super) fn is_stopped(&self) -> bool {
        self.tx.lock().is_none()
    }

    /// Stops taking jobs, lets the queued ones finish and joins the thread.
    pub(super) fn stop(&self) {
        drop(self.tx.lock().take());
        if let Some(h) = self.thread.lock().take()
            && h.join().is_err()
        {
            tracing::error!("{} thread panicked", self.name);
        }
    }
}

/// A writer thread's loop: coalesces queued writes into batches of up to
/// `max_batch` blocks for `write`, keeping each flush marker in order
/// behind the writes queued before it. Ends when every sender is gone.
fn run_jobs<T>(rx: &mpsc::Receiver<Job<T>>, max_batch: usize, write: &mut impl FnMut(Vec<T>)) {
    let mut next: Option<Job<T>> = None;
    loop {
        let job = match next.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => break,
            },
        };
        match job {
            Job::Flush(done) => {
                let _ = done.send(());
            }
            Job::Write(mut batch) => {
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(Job::Write(more)) => batch.extend(more),
                        Ok(flush) => {
                            next = Some(flush);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                write(batch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn writes_are_coalesced_and_a_flush_waits_for_earlier_ones() {
        let written = Arc::new(AtomicUsize::new(0));
        let batches = Arc::new(Mutex::new(Vec::new()));
        let w = {
            let (written, batches) = (written.clone(), batches.clone());
            Writer::spawn("kvtier-test-writer", move |batch: Vec<u32>| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                written.fetch_add(batch.len(), Ordering::SeqCst);
                batches.lock().push(batch.len());
            })
            .unwrap()
        };
        for i in 0..100 {
            assert!(w.send(vec![i]));
        }
        assert!(w.flush());
        assert_eq!(written.load(Ordering::SeqCst), 100);
        assert!(batches.lock().iter().all(|&n| n <= WRITE_BATCH));
        w.stop();
        assert!(!w.send(vec![1]), "stopped");
        assert!(!w.flush());
    }
}
