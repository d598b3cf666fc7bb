//! The crate's one policy for mutexes and condition variables: a lock
//! whose holder panicked is taken all the same (the panic was already
//! reported as an error at the boundary, and no state behind rdist's
//! locks is left half-updated by one).

use std::sync::{Condvar, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The lock when it is free now.
pub fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Waits on `cv` for at most `limit` (the caller looks again at what it
/// waits for: wakes may be spurious).
pub fn wait_for<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    limit: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, limit)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

/// Waits on `cv` until woken (the caller looks again).
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|p| p.into_inner())
}
