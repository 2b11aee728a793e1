//! A few threads that run the store's background reads
//! ([`TieredStore::read_prefix_async`](crate::TieredStore::read_prefix_async)),
//! so the caller's thread (an engine's scheduler) keeps working while a
//! prefix is read from G3 or G4.
//!
//! The threads are not joined: they end when the pool is dropped and their
//! current job returns. A job may hold the last handle on the store, whose
//! drop then runs on a worker thread; joining would wait on itself.

use std::sync::Arc;
use std::sync::mpsc;

use parking_lot::Mutex;

type Job = Box<dyn FnOnce() + Send>;

/// The pool.
pub(crate) struct Workers {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Workers {
    /// Starts `n` (at least one) threads named `name`.
    pub(crate) fn spawn(name: &str, n: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..n.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    loop {
                        // The lock is held only to take one job.
                        let job = rx.lock().recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => break,
                        }
                    }
                })?;
        }
        Ok(Self {
            tx: Mutex::new(Some(tx)),
        })
    }

    /// Runs `job` on a worker; hands it back when the pool is shut.
    pub(crate) fn submit(&self, job: Job) -> Result<(), Job> {
        match self.tx.lock().as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        drop(self.tx.lock().take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_on_the_workers_and_a_shut_pool_hands_them_back() {
        let pool = Workers::spawn("kvtier-test-worker", 2).unwrap();
        let (tx, rx) = mpsc::channel();
        for i in 0..10 {
            let tx = tx.clone();
            let sent = pool.submit(Box::new(move || {
                let name = std::thread::current().name().map(str::to_string);
                tx.send((i, name)).unwrap();
            }));
            assert!(sent.is_ok());
        }
        let mut got: Vec<_> = (0..10).map(|_| rx.recv().unwrap()).collect();
        got.sort();
        assert!(
            got.iter()
                .all(|(_, n)| n.as_deref() == Some("kvtier-test-worker"))
        );
        assert_eq!(
            got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        pool.tx.lock().take();
        assert!(pool.submit(Box::new(|| {})).is_err());
    }
}
