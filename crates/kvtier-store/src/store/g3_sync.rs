//! Bounded write-back: blocks that live only in G2 are written to G3 within
//! about one sync interval ([`StoreConfig::g3_sync`](super::StoreConfig::g3_sync)),
//! so a kill -9 loses at most the last interval's blocks, not everything G2
//! had not yet evicted.
//!
//! One thread per store wakes every interval, takes the store's G2 blocks
//! that G3 lacks, hands them to the write-back writer (the same queue
//! evictions use, off every reader's and the decode loop's path) and waits
//! until they are written; the writer marks them persisted in G2, so the
//! next round skips them and a later eviction needs no write. Blocks stay in
//! G2 and reads keep finding them there first. A round that takes longer
//! than the interval (a slow disk) delays the next one: the bound is the
//! interval plus the time to write what one interval produced.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::store_error::StoreError;
use super::write_back::LocalBlock;
use super::writer_thread::Writer;
use crate::memory::{MemoryTier, Owner};

/// The sync thread; stopped (and joined) by [`G3Sync::stop`] or on drop.
pub(super) struct G3Sync {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl G3Sync {
    /// Starts syncing `owner`'s dirty G2 blocks through `writer` every
    /// `every`.
    pub(super) fn spawn(
        every: Duration,
        memory: Arc<MemoryTier>,
        owner: Owner,
        writer: Arc<Writer<LocalBlock>>,
    ) -> Result<Self, StoreError> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kvtier-g3-sync".into())
                .spawn(move || {
                    loop {
                        {
                            let mut stopped = stop.0.lock();
                            if !*stopped {
                                stop.1.wait_for(&mut stopped, every);
                            }
                            if *stopped {
                                return;
                            }
                        }
                        let dirty = memory.dirty(owner);
                        if dirty.is_empty() {
                            continue;
                        }
                        // Wait for this round's writes before the next
                        // round looks: it must not queue them twice.
                        if !writer.send(dirty) || !writer.flush() {
                            return;
                        }
                    }
                })
                .map_err(|e| StoreError::Task(format!("cannot start the G3 sync thread: {e}")))?
        };
        Ok(Self {
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Stops the thread (a round in progress finishes first) and joins it.
    pub(super) fn stop(&self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(h) = self.thread.lock().take()
            && h.join().is_err()
        {
            tracing::error!("the G3 sync thread panicked");
        }
    }
}

impl Drop for G3Sync {
    fn drop(&mut self) {
        self.stop();
    }
}
