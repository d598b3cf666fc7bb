//! The rendezvous key-value store: how ranks find each other.
//!
//! Rank 0 hosts a [`TcpStoreServer`]; every rank (rank 0 included) talks to it
//! through a [`TcpStoreClient`]. On a shared file system a [`FileStore`] does
//! the same job without a server.
//!
//! Server and client speak PyTorch's TCPStore protocol (see the `protocol`
//! module), so rdist meets through a store torch hosts (torchrun's agent
//! store) and torch's clients use rdist's.

mod client;
mod file;
pub mod hosted;
#[cfg(test)]
pub(crate) mod old_torch;
mod protocol;
mod server;

pub use client::TcpStoreClient;
pub use file::FileStore;
pub use server::{Limits, StoreLease, TcpStoreServer};

use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// Bound on the operations that never wait for other ranks (set, add, check).
pub(crate) const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How many missing keys a timeout message names before "and N more".
const MAX_NAMED_KEYS: usize = 8;

/// One change of [`Store::apply`].
pub enum Update<'a> {
    Set(&'a str, &'a [u8]),
    Add(&'a str, i64),
}

/// A key-value store shared by all ranks of a job.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` exists (up to `timeout`), then returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically adds `delta` to the integer stored at key (missing = 0;
    /// stored as decimal ASCII), returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// True when all keys exist. Never blocks (beyond one round trip).
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Waits until all keys exist, up to `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// The values of `keys`, which all exist: one query where the store
    /// has one (a wide job's roster is every rank reading every rank's
    /// key; one round trip each made that quadratic).
    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        keys.iter().map(|k| self.get(k, timeout)).collect()
    }
    /// Carries out `updates` in order and returns each `Add`'s new value:
    /// one round trip where the store takes queries back to back (each
    /// rank of a wide job publishing its keys one query at a time kept
    /// rank 0's store and the cores busy).
    fn apply(&self, updates: &[Update<'_>]) -> Result<Vec<i64>> {
        let mut added = Vec::new();
        for w in updates {
            match *w {
                Update::Set(key, value) => self.set(key, value)?,
                Update::Add(key, delta) => added.push(self.add(key, delta)?),
            }
        }
        Ok(added)
    }
    /// `add` when its new value is not needed: where the store can, the
    /// answer is not waited for (each rank of a wide job waiting at the end
    /// of its init for rank 0's store, busy with every other rank, took a
    /// quarter of a second).
    fn add_no_wait(&self, key: &str, delta: i64) -> Result<()> {
        self.add(key, delta).map(drop)
    }
    /// Waits until `key` exists (up to `timeout`) and returns its value:
    /// one query, answered when the key is set, where the store is rdist's
    /// own (whose server answers every rank waiting for a wide job's roster
    /// in one turn; a wait and then a get took the store a turn per rank,
    /// most of a second at 1024 ranks). Call it only on a store known to
    /// be rdist's: torch's drops a client that asks.
    fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.get_present(key)
    }
    /// Adds 1 to `counter`; the caller whose add brings it to `last` sets
    /// `key` to `value` (unless `key` is set already); then waits (up to
    /// `timeout`) for `key` and returns its value: a barrier whose release
    /// says something. As `wait_get`: one query on rdist's own store,
    /// which alone may be asked.
    fn arrive(
        &self,
        counter: &str,
        last: i64,
        key: &str,
        value: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        if self.add(counter, 1)? >= last && !self.check(&[key])? {
            self.set(key, value)?;
        }
        self.wait(&[key], timeout)?;
        self.get_present(key)
    }
    /// Sets `key` to `value` unless it is set already; returns the value
    /// it holds afterwards (the first writer's). Where the store cannot
    /// do it at once, a check and then a set.
    fn set_if_absent(&self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        if !self.check(&[key])? {
            self.set(key, value)?;
        }
        self.get_present(key)
    }
    /// `arrive` without the wait: counts this caller (setting `key` when
    /// it is the last) and returns, the answer not waited for.
    fn arrive_quietly(&self, counter: &str, last: i64, key: &str, value: &[u8]) -> Result<()> {
        if self.add(counter, 1)? >= last && !self.check(&[key])? {
            self.set(key, value)?;
        }
        Ok(())
    }
    /// The value of `key`, which a wait has already seen: no second wait.
    fn get_present(&self, key: &str) -> Result<Vec<u8>> {
        self.get(key, Duration::from_secs(1))
    }
    /// Ranks below `size` that joined this store more often than this
    /// meeting counts: two processes were given the same rank. (Stores
    /// that do not count meetings know none.)
    fn duplicated_ranks(&self, _size: usize) -> Vec<usize> {
        Vec::new()
    }
    /// The values of `keys` that exist (None for the others), giving up
    /// after `bound` in all (for reads on an error path, which must not
    /// hang on a store whose host stopped).
    fn read_within(&self, keys: &[&str], _bound: Duration) -> Result<Vec<Option<Vec<u8>>>> {
        keys.iter()
            .map(|k| match self.check(&[k])? {
                true => self.get(k, Duration::from_secs(1)).map(Some),
                false => Ok(None),
            })
            .collect()
    }
    /// `set`, giving up after `bound` (for writes that must not hold up
    /// their caller, such as the flight recorder's).
    fn set_within(&self, key: &str, value: &[u8], _bound: Duration) -> Result<()> {
        self.set(key, value)
    }
}

// ---------------------------------------------------------------------------
// Helpers shared by every store
// ---------------------------------------------------------------------------

/// A duration as people read it in messages: "2.0 s".
fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// The deadline `timeout` from now; `None` when it is too far to represent
/// (which means: wait without a deadline).
fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// The error for a get/wait that ran out of time, naming the missing keys.
fn key_timeout_error(timeout: Duration, missing: &[String]) -> Error {
    let mut named: Vec<String> = missing
        .iter()
        .take(MAX_NAMED_KEYS)
        .map(|k| format!("'{k}'"))
        .collect();
    let what = match missing.len() {
        0 => String::from("keys"),
        1 => format!("key {}", named.remove(0)),
        n if n <= MAX_NAMED_KEYS => format!("keys {}", named.join(", ")),
        n => format!("keys {} and {} more", named.join(", "), n - MAX_NAMED_KEYS),
    };
    Error::new(
        ErrorKind::Timeout,
        format!(
            "timed out after {} waiting for {what} in the rendezvous store",
            seconds(timeout)
        ),
    )
}

/// `current + delta` for add(): the stored value must be a decimal integer.
fn add_to_counter(key: &str, current: Option<&[u8]>, delta: i64) -> Result<i64> {
    let current = match current {
        None => 0,
        Some(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.trim().parse::<i64>().ok())
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "the value of key '{key}' in the rendezvous store is not a decimal integer, \
                     so add() cannot update it"
                ))
            })?,
    };
    current.checked_add(delta).ok_or_else(|| {
        Error::invalid_argument(format!(
            "adding {delta} to key '{key}' (now {current}) would overflow a 64-bit integer"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    pub(super) const PATIENCE: Duration = Duration::from_secs(5);

    pub(super) fn start_server() -> TcpStoreServer {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
        TcpStoreServer::bind(addr).expect("bind the store server")
    }

    pub(super) fn connect(server: &TcpStoreServer) -> TcpStoreClient {
        let addr = server.local_addr().to_string();
        TcpStoreClient::connect(&addr, Instant::now() + PATIENCE).expect("connect")
    }

    pub(super) fn assert_in_range(elapsed: Duration, low_ms: u64, high_ms: u64) {
        assert!(
            elapsed >= Duration::from_millis(low_ms) && elapsed <= Duration::from_millis(high_ms),
            "took {elapsed:?}, expected {low_ms}..{high_ms} ms"
        );
    }

    #[test]
    fn timeout_message_names_at_most_eight_keys() {
        let keys: Vec<String> = (0..11).map(|i| format!("k{i}")).collect();
        let err = key_timeout_error(Duration::from_secs(2), &keys);
        assert_eq!(
            err.message(),
            "timed out after 2.0 s waiting for keys 'k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', \
             'k7' and 3 more in the rendezvous store"
        );
    }
}
