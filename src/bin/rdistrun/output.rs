//! Rank output: the pseudo-terminal or pipes it goes through, and the threads
//! that stream it line by line, prefixed, to rdistrun's own stdout and stderr,
//! noting each rank's first error line for the summary.
//!
//! A rank's stdout is a pseudo-terminal, so that C stdio (and Python) buffer it
//! by line, as on a terminal, instead of in 4 KiB blocks; the terminal is raw
//! (no "\n" to "\r\n", no echo, no signal characters) and is not the rank's
//! controlling terminal. Its stderr stays a pipe of its own (stderr is
//! unbuffered in C). With `--no-tty`, or where no pseudo-terminal can be had,
//! stdout is a pipe too.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// A line longer than this is passed on in pieces of this size.
const MAX_LINE: usize = 1 << 20;
/// Quoted error lines are cut to this many characters.
const MAX_QUOTE: usize = 500;
/// How often `wait_for_readers` looks at its threads.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, PartialEq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A rank's stdout: what the child gets, and our end when it is a
/// pseudo-terminal (`None`: a pipe, which `Command` makes). A pseudo-terminal
/// when asked for and possible, else a pipe (with one warning per run).
pub fn stdout_channel(tty: bool) -> (Stdio, Option<File>) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !tty {
        return (Stdio::piped(), None);
    }
    match open_pty() {
        // The child's end lives in the `Command` only, so that it is closed
        // here once the command is dropped, and the rank's exit shows.
        Ok((ours, theirs)) => (Stdio::from(theirs), Some(ours)),
        Err(error) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "rdistrun: warning: no pseudo-terminal for the ranks' stdout ({error}); \
                     using pipes, so C stdio in the ranks buffers stdout in blocks"
                );
            }
            (Stdio::piped(), None)
        }
    }
}

/// A raw pseudo-terminal (controller, child end), both close-on-exec, sized
/// like rdistrun's own terminal when it has one.
fn open_pty() -> io::Result<(File, OwnedFd)> {
    let (mut controller, mut child) = (-1, -1);
    let mut size = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes a winsize into `size`; it fails (ENOTTY) when
    // rdistrun's stdout is no terminal.
    let sized = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } == 0;
    let size_ptr: *const libc::winsize = if sized { &size } else { std::ptr::null() };
    // SAFETY: out-pointers to two ints; a null name and termios are allowed.
    let rc = unsafe {
        libc::openpty(
            &mut controller,
            &mut child,
            std::ptr::null_mut(),
            std::ptr::null(),
            size_ptr,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openpty returned two fresh descriptors that nothing else owns.
    let (controller, child) = unsafe {
        (
            OwnedFd::from_raw_fd(controller),
            OwnedFd::from_raw_fd(child),
        )
    };
    for fd in [&controller, &child] {
        // Close-on-exec, so that other ranks do not inherit them (the child
        // gets its end through dup2, which clears the flag). Only rdistrun's
        // main thread forks, so no fork can come in between.
        // SAFETY: plain fcntl on a descriptor we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    make_raw(&child)?;
    Ok((File::from(controller), child))
}

/// Output bytes pass unchanged ("\n" stays "\n"); no echo, no line editing, no
/// signal characters.
fn make_raw(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: tcgetattr fills the zeroed termios; cfmakeraw and tcsetattr take
    // a valid one.
    unsafe {
        let mut attributes: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(fd.as_raw_fd(), &mut attributes) != 0 {
            return Err(io::Error::last_os_error());
        }
        libc::cfmakeraw(&mut attributes);
        if libc::tcsetattr(fd.as_raw_fd(), libc::TCSANOW, &attributes) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// First error lines
// ---------------------------------------------------------------------------

/// Each rank's first error line, for the summary.
#[derive(Default)]
pub struct ErrorLines {
    ranks: Mutex<Vec<(usize, FirstLines)>>,
}

#[derive(Default, Clone)]
struct FirstLines {
    /// The first line on either stream that reads as an error.
    matched: Option<String>,
    /// The last line on stderr that is not one of rdist's INFO/TRACE lines.
    last_stderr: Option<String>,
}

/// What the summary quotes of a rank that failed.
#[derive(Clone, Debug, PartialEq)]
pub enum Quote {
    /// Its first line that reads as an error.
    Error(String),
    /// None reads as one: its last line on stderr (a program's start-up
    /// line is no error; its last words are the likelier cause).
    LastStderr(String),
}

impl ErrorLines {
    fn lock(&self) -> MutexGuard<'_, Vec<(usize, FirstLines)>> {
        self.ranks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Looks at one line (without its newline) a rank printed.
    fn note(&self, rank: usize, stream: Stream, line: &[u8]) {
        let mut ranks = self.lock();
        let index = match ranks.iter().position(|(r, _)| *r == rank) {
            Some(index) => index,
            None => {
                ranks.push((rank, FirstLines::default()));
                ranks.len() - 1
            }
        };
        let first = &mut ranks[index].1;
        if first.matched.is_some() {
            return;
        }
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with(b"rdist INFO") || line.starts_with(b"rdist TRACE") {
            return;
        }
        if reads_as_error(line) {
            first.matched = Some(quote(line));
        } else if stream == Stream::Stderr {
            first.last_stderr = Some(quote(line));
        }
    }

    /// The rule of the summary: the first line that reads as an error, else
    /// the last line on stderr.
    pub fn quote(&self, rank: usize) -> Option<Quote> {
        let ranks = self.lock();
        let (_, first) = ranks.iter().find(|(r, _)| *r == rank)?;
        match (&first.matched, &first.last_stderr) {
            (Some(line), _) => Some(Quote::Error(line.clone())),
            (None, Some(line)) => Some(Quote::LastStderr(line.clone())),
            (None, None) => None,
        }
    }
}

/// Whether a line reads as an error: it contains "error", "fail",
/// "panicked", "fatal", "exception", or one of the words rdist's own
/// errors use ("lost", "timed out", "mismatch", "abort"), in any case.
fn reads_as_error(line: &[u8]) -> bool {
    const WORDS: [&[u8]; 9] = [
        b"error",
        b"fail",
        b"panicked",
        b"fatal",
        b"exception",
        b"lost",
        b"timed out",
        b"mismatch",
        b"abort",
    ];
    WORDS.iter().any(|word| {
        line.windows(word.len())
            .any(|window| window.eq_ignore_ascii_case(word))
    })
}

fn quote(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    match text.char_indices().nth(MAX_QUOTE) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Forwarding
// ---------------------------------------------------------------------------

/// A thread copying one of a rank's output streams to rdistrun's own output.
pub struct OutputReader {
    rank: usize,
    thread: JoinHandle<()>,
}

/// Starts the thread that forwards `source` (a rank's `stream`).
pub fn spawn_reader(
    rank: usize,
    source: File,
    prefixed: bool,
    stream: Stream,
    errors: Arc<ErrorLines>,
) -> io::Result<OutputReader> {
    let prefix = if prefixed {
        format!("[rank {rank}] ").into_bytes()
    } else {
        Vec::new()
    };
    let thread = thread::Builder::new()
        .name(format!("rank-{rank}-output"))
        .spawn(move || forward_lines(source, rank, &prefix, stream, &errors))?;
    Ok(OutputReader { rank, thread })
}

/// Copies `source` line by line until end of file. Bytes need not be UTF-8.
/// A pseudo-terminal reports EIO instead of end of file once the last process
/// holding its child end exited, after everything written was read.
fn forward_lines(
    mut source: File,
    rank: usize,
    prefix: &[u8],
    stream: Stream,
    errors: &ErrorLines,
) {
    let mut pending = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match source.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            // EIO from a pseudo-terminal: end of output. Any other error means
            // the stream is unusable; what was read is still passed on below.
            Err(_) => break,
        };
        pending.extend_from_slice(&chunk[..n]);
        let whole = match pending.iter().rposition(|&b| b == b'\n') {
            Some(last) => last + 1,
            None if pending.len() >= MAX_LINE => pending.len(),
            None => continue,
        };
        write_lines(stream, rank, prefix, &pending[..whole], errors);
        pending.drain(..whole);
    }
    // The last line may lack its newline.
    if !pending.is_empty() {
        write_lines(stream, rank, prefix, &pending, errors);
    }
}

/// Writes whole lines, each prefixed, adding the newline a final line may lack,
/// in one write under the stream's lock, so that lines of different ranks
/// never mix.
fn write_lines(stream: Stream, rank: usize, prefix: &[u8], lines: &[u8], errors: &ErrorLines) {
    let mut record = Vec::with_capacity(lines.len() + 64);
    for line in lines.split_inclusive(|&b| b == b'\n') {
        let text = line.strip_suffix(b"\n").unwrap_or(line);
        errors.note(rank, stream, text);
        record.extend_from_slice(prefix);
        record.extend_from_slice(text);
        record.push(b'\n');
    }
    // Write errors (say, a closed pipe) are ignored: reading must go on, or the
    // rank would block on a full pipe.
    let _ = match stream {
        Stream::Stdout => {
            let mut stdout = io::stdout().lock();
            stdout.write_all(&record).and_then(|()| stdout.flush())
        }
        Stream::Stderr => io::stderr().lock().write_all(&record),
    };
}

/// Joins the output threads, giving up on those still blocked after `timeout`:
/// their stream is then held open by a background process that outlived its
/// rank.
pub fn wait_for_readers(readers: Vec<OutputReader>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while readers.iter().any(|r| !r.thread.is_finished()) && Instant::now() < deadline {
        thread::sleep(POLL_INTERVAL);
    }
    let mut abandoned = Vec::new();
    for reader in readers {
        if reader.thread.is_finished() {
            // A panic in a reader has already been reported by the panic hook.
            let _ = reader.thread.join();
        } else if !abandoned.contains(&reader.rank) {
            abandoned.push(reader.rank);
        }
    }
    if !abandoned.is_empty() {
        eprintln!(
            "rdistrun: warning: not waiting for the output of {}: held open by a process \
             that outlived its rank",
            crate::supervise::list_ranks(&abandoned)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_lines_follow_the_rule() {
        let errors = ErrorLines::default();
        let error = |line: &str| Some(Quote::Error(line.to_string()));
        errors.note(0, Stream::Stdout, b"step 1 loss 0.5");
        errors.note(0, Stream::Stderr, b"rdist INFO [rank 0] joined 2 ranks");
        errors.note(0, Stream::Stderr, b"worker starting");
        errors.note(0, Stream::Stderr, b"warning: slow disk");
        assert_eq!(
            errors.quote(0),
            Some(Quote::LastStderr("warning: slow disk".into()))
        );
        errors.note(
            0,
            Stream::Stdout,
            b"rank 0: rdist_allreduce failed: lost rank 1\r",
        );
        errors.note(0, Stream::Stderr, b"Error: second");
        assert_eq!(
            errors.quote(0),
            error("rank 0: rdist_allreduce failed: lost rank 1")
        );
        errors.note(1, Stream::Stdout, b"all good");
        assert_eq!(errors.quote(1), None);
        assert_eq!(errors.quote(2), None);
        errors.note(3, Stream::Stderr, "error ".repeat(200).as_bytes());
        let Some(Quote::Error(long)) = errors.quote(3) else {
            panic!("no error quoted")
        };
        assert_eq!(long.len(), MAX_QUOTE + 3);
    }

    #[test]
    fn error_words() {
        for line in [
            "ERROR: x",
            "thread 'main' panicked at src/main.rs:3:5",
            "Fatal Python error: Aborted",
            "RuntimeError: boom",
            "rdist_init failed (rank 3): timed out",
            "rank 0 lost its connection to rank 1 (connection closed)",
            "mismatched calls: rank 1 called allreduce #3",
        ] {
            assert!(reads_as_error(line.as_bytes()), "{line}");
        }
        for line in [
            "step 19 loss 0.1",
            "rank 0: ok",
            "Traceback (most recent call last):",
        ] {
            assert!(!reads_as_error(line.as_bytes()), "{line}");
        }
    }

    #[test]
    fn pty_passes_newlines_unchanged() {
        let (mut ours, theirs) = open_pty().expect("a pseudo-terminal");
        let mut child_end = File::from(theirs);
        child_end.write_all(b"a\nb\r\nc\n").unwrap();
        drop(child_end);
        let mut bytes = Vec::new();
        // Ends in EIO once the child end is closed, after the data.
        let mut chunk = [0u8; 64];
        loop {
            match ours.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            }
        }
        assert_eq!(bytes, b"a\nb\r\nc\n");
    }
}
