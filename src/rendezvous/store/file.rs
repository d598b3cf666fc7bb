//! The file store ("file:///path" rendezvous): one file per key in a
//! directory on a shared file system, no server.

use std::fs;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{add_to_counter, deadline_after, key_timeout_error, seconds, Store, OPERATION_TIMEOUT};
use crate::error::{Error, ErrorKind, Result};

/// Longest key a FileStore takes: its hex form must fit in a file name.
const MAX_FILE_KEY_LEN: usize = 120;
const FILE_POLL_START: Duration = Duration::from_millis(5);
const FILE_POLL_MAX: Duration = Duration::from_millis(50);
const LOCK_FILE: &str = "lock";

/// A store in a directory on a shared file system ("file:///path"
/// rendezvous): one file per key, named after the key in hex.
///
/// Values are written to a temporary file and renamed into place, so readers
/// never see a partial value; add() is serialised with flock() on a lock file.
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Opens the store in directory `path`, creating it if missing.
    pub fn new(path: &Path) -> Result<FileStore> {
        fs::create_dir_all(path).map_err(|e| {
            Error::system(
                format!("cannot create the rendezvous directory {}", path.display()),
                &e,
            )
        })?;
        Ok(FileStore {
            dir: path.to_path_buf(),
        })
    }

    /// Removes the store's files (the whole directory).
    pub fn remove(&self) -> Result<()> {
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(self.io_error("cannot remove the rendezvous directory", &err)),
        }
    }

    fn io_error(&self, what: &str, err: &io::Error) -> Error {
        Error::system(format!("{what} {}", self.dir.display()), err)
    }

    fn key_path(&self, key: &str) -> Result<PathBuf> {
        if key.len() > MAX_FILE_KEY_LEN {
            return Err(Error::invalid_argument(format!(
                "key '{key}' is too long for a file rendezvous store ({} bytes; at most \
                 {MAX_FILE_KEY_LEN})",
                key.len()
            )));
        }
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        Ok(self.dir.join(format!("key-{hex}")))
    }

    /// The value of `key`, or `None` while it does not exist.
    fn read_key(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.key_path(key)?) {
            Ok(value) => Ok(Some(value)),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(self.io_error(&format!("cannot read key '{key}' from"), &err)),
        }
    }

    fn key_exists(&self, key: &str) -> Result<bool> {
        match fs::metadata(self.key_path(key)?) {
            Ok(_) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(err) => Err(self.io_error(&format!("cannot look up key '{key}' in"), &err)),
        }
    }

    fn missing_keys(&self, keys: &[&str]) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for key in keys {
            if !self.key_exists(key)? {
                missing.push(key.to_string());
            }
        }
        Ok(missing)
    }

    /// Writes a whole value under a unique temporary name, then renames it
    /// over the key's file (atomic within one directory).
    fn write_key(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.key_path(key)?;
        let temp = self.dir.join(temp_file_name());
        let written = fs::write(&temp, value).and_then(|()| fs::rename(&temp, &path));
        written.map_err(|err| {
            let _ = fs::remove_file(&temp);
            self.io_error(&format!("cannot write key '{key}' to"), &err)
        })
    }

    /// Calls `probe` until it gives a value or `timeout` passes, sleeping a
    /// little longer each time. `Err(missing)` from `probe` means not yet.
    fn poll<T>(
        &self,
        timeout: Duration,
        mut probe: impl FnMut() -> Result<std::result::Result<T, Vec<String>>>,
    ) -> Result<T> {
        let deadline = deadline_after(timeout);
        let mut pause = FILE_POLL_START;
        loop {
            let missing = match probe()? {
                Ok(found) => return Ok(found),
                Err(missing) => missing,
            };
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => pause,
            };
            if left.is_zero() {
                return Err(key_timeout_error(timeout, &missing));
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(FILE_POLL_MAX);
        }
    }

    /// Takes the store's exclusive lock, waiting at most OPERATION_TIMEOUT.
    fn lock_store(&self) -> Result<fs::File> {
        let path = self.dir.join(LOCK_FILE);
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| self.io_error("cannot open the lock file in", &e))?;
        let deadline = Instant::now() + OPERATION_TIMEOUT;
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: flock on a descriptor that `file` keeps open.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                // Closing `file` releases the lock.
                return Ok(file);
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {}
                _ => return Err(self.io_error("cannot lock the rendezvous directory", &err)),
            }
            if Instant::now() >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "could not lock the rendezvous directory {} within {}",
                        self.dir.display(),
                        seconds(OPERATION_TIMEOUT)
                    ),
                ));
            }
            thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

/// A temporary file name no other thread, process or host will pick.
fn temp_file_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(".tmp-{}-{count}-{nanos}", std::process::id())
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_key(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.poll(timeout, || {
            Ok(self.read_key(key)?.ok_or_else(|| vec![key.to_string()]))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let _lock = self.lock_store()?;
        let current = self.read_key(key)?;
        let sum = add_to_counter(key, current.as_deref(), delta)?;
        self.write_key(key, sum.to_string().as_bytes())?;
        Ok(sum)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(self.missing_keys(keys)?.is_empty())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.poll(timeout, || {
            let missing = self.missing_keys(keys)?;
            Ok(if missing.is_empty() {
                Ok(())
            } else {
                Err(missing)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_in_range, PATIENCE};
    use super::*;

    fn temp_store_dir(name: &str) -> PathBuf {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        std::env::temp_dir().join(format!(
            "rdist-store-test-{}-{name}-{nanos}",
            std::process::id()
        ))
    }

    #[test]
    fn file_store_set_get_wait_and_timeouts() {
        let dir = temp_store_dir("basic");
        let store = FileStore::new(&dir).unwrap();
        store.set("peer/0", b"addr0").unwrap();
        assert_eq!(store.get("peer/0", PATIENCE).unwrap(), b"addr0");
        store.set("peer/0", b"addr0b").unwrap();
        assert_eq!(store.get("peer/0", PATIENCE).unwrap(), b"addr0b");
        assert!(store.check(&["peer/0"]).unwrap());
        assert!(!store.check(&["peer/0", "peer/1"]).unwrap());

        let start = Instant::now();
        let err = store.get("peer/3", Duration::from_millis(300)).unwrap_err();
        assert_in_range(start.elapsed(), 250, 2000);
        assert_eq!(err.kind(), ErrorKind::Timeout);
        assert_eq!(
            err.message(),
            "timed out after 0.3 s waiting for key 'peer/3' in the rendezvous store"
        );
        let err = store
            .wait(&["peer/0", "peer/1"], Duration::from_millis(100))
            .unwrap_err();
        assert!(err.message().contains("key 'peer/1'"), "{err}");

        // A second handle (another rank) sets a key while this one waits.
        let other = FileStore::new(&dir).unwrap();
        let setter = thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            other.set("peer/1", b"addr1").unwrap();
        });
        store.wait(&["peer/0", "peer/1"], PATIENCE).unwrap();
        setter.join().unwrap();
        assert_eq!(store.get("peer/1", PATIENCE).unwrap(), b"addr1");

        store.set("name", b"x").unwrap();
        assert_eq!(
            store.add("name", 1).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        let long_key = "k".repeat(MAX_FILE_KEY_LEN + 1);
        assert_eq!(
            store.set(&long_key, b"v").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );

        store.remove().unwrap();
        assert!(!dir.exists());
        store.remove().unwrap();
    }

    #[test]
    fn file_store_add_is_atomic_across_threads() {
        let dir = temp_store_dir("add");
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let store = FileStore::new(&dir).unwrap();
                thread::spawn(move || {
                    for _ in 0..25 {
                        store.add("counter", 1).unwrap();
                    }
                })
            })
            .collect();
        for adder in adders {
            adder.join().unwrap();
        }
        let store = FileStore::new(&dir).unwrap();
        assert_eq!(store.add("counter", 0).unwrap(), 100);
        assert_eq!(store.get("counter", PATIENCE).unwrap(), b"100");
        // Only the key, the lock file and no leftover temporary files.
        let entries = fs::read_dir(&dir).unwrap().count();
        assert_eq!(entries, 2);
        store.remove().unwrap();
    }
}
