//! Handles on store work running in the background: poll one
//! ([`Handle::is_done`]), wait for it ([`Handle::wait`]) or cancel it
//! ([`Handle::cancel`]); the caller's thread never blocks unless it asks
//! to. A callback given when the work starts runs once it is finished (or
//! abandoned), so an event loop can sleep until then instead of polling.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

/// Where a background operation stands.
enum State<T> {
    Running,
    Done(T),
    /// Cancelled before it ran, or its worker went away.
    Abandoned,
    /// The result was taken.
    Taken,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    finished: Condvar,
    cancelled: AtomicBool,
}

/// The caller's side of a background operation producing a `T`.
pub struct Handle<T> {
    shared: Arc<Shared<T>>,
}

impl<T> std::fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("done", &self.is_done())
            .finish()
    }
}

/// The worker's side: completes the handle (or abandons it when dropped
/// unused), then runs the callback.
pub(crate) struct Completer<T> {
    shared: Arc<Shared<T>>,
    notify: Option<Box<dyn FnOnce() + Send>>,
}

/// A linked handle and completer; `notify` runs once the operation has an
/// outcome.
pub(crate) fn pair<T>(notify: Box<dyn FnOnce() + Send>) -> (Handle<T>, Completer<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Running),
        finished: Condvar::new(),
        cancelled: AtomicBool::new(false),
    });
    (
        Handle {
            shared: shared.clone(),
        },
        Completer {
            shared,
            notify: Some(notify),
        },
    )
}

impl<T> Handle<T> {
    /// True once the operation has an outcome ([`wait`](Self::wait) will
    /// not block).
    pub fn is_done(&self) -> bool {
        !matches!(*self.shared.state.lock(), State::Running)
    }

    /// Waits for the outcome: `None` when the operation was cancelled
    /// before it ran or its worker went away.
    pub fn wait(self) -> Option<T> {
        let mut state = self.shared.state.lock();
        while matches!(*state, State::Running) {
            self.shared.finished.wait(&mut state);
        }
        match std::mem::replace(&mut *state, State::Taken) {
            State::Done(v) => Some(v),
            _ => None,
        }
    }

    /// Asks the operation not to run (or its result to be dropped); a
    /// later [`wait`](Self::wait) returns `None` unless it had finished.
    pub fn cancel(&self) {
        self.shared.cancelled.store(true, Ordering::Release);
    }
}

impl<T> Completer<T> {
    /// True when the caller cancelled: skip the work.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.shared.cancelled.load(Ordering::Acquire)
    }

    /// Hands the result over (dropped if the caller cancelled).
    pub(crate) fn complete(mut self, value: T) {
        self.finish(if self.is_cancelled() {
            State::Abandoned
        } else {
            State::Done(value)
        });
    }

    fn finish(&mut self, outcome: State<T>) {
        {
            let mut state = self.shared.state.lock();
            if matches!(*state, State::Running) {
                *state = outcome;
            }
        }
        self.shared.finished.notify_all();
        if let Some(notify) = self.notify.take() {
            notify();
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if self.notify.is_some() {
            self.finish(State::Abandoned);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn a_result_is_waited_for_and_the_callback_runs_once() {
        let (tx, rx) = mpsc::channel();
        let (handle, completer) = pair::<u32>(Box::new(move || tx.send(()).unwrap()));
        assert!(!handle.is_done());
        let worker = std::thread::spawn(move || completer.complete(7));
        assert_eq!(handle.wait(), Some(7));
        worker.join().unwrap();
        rx.recv().unwrap();
        assert!(rx.try_recv().is_err(), "one callback");
    }

    #[test]
    fn cancelled_or_dropped_work_is_abandoned_never_hung() {
        let (tx, rx) = mpsc::channel();
        let (handle, completer) = pair::<u32>(Box::new(move || tx.send(()).unwrap()));
        handle.cancel();
        assert!(completer.is_cancelled());
        completer.complete(1);
        assert!(handle.is_done());
        assert_eq!(handle.wait(), None);
        rx.recv().unwrap();

        let (handle, completer) = pair::<u32>(Box::new(|| {}));
        drop(completer);
        assert!(handle.is_done());
        assert_eq!(handle.wait(), None);
    }
}
