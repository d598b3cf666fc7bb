//! Signals sent to rdistrun (Ctrl-C, SIGTERM): recorded here for the supervisor
//! to forward to the ranks; and signal names for messages.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// SIGINT and SIGTERM received so far; the supervisor compares it with the number
/// it has handled.
static SIGNALS_RECEIVED: AtomicUsize = AtomicUsize::new(0);
/// The most recent of those signals.
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Only touches lock-free atomics: nothing else is async-signal-safe.
extern "C" fn record_signal(signal: libc::c_int) {
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    SIGNALS_RECEIVED.fetch_add(1, Ordering::SeqCst);
}

/// Records SIGINT and SIGTERM instead of dying of them. Called before any rank
/// starts, so that a Ctrl-C during start-up is forwarded, not fatal.
pub fn install_handlers() -> io::Result<()> {
    // Exited ranks must stay to be reaped: a parent that ignored SIGCHLD
    // passes that on through exec, and the kernel would reap them itself.
    // SAFETY: setting a signal's disposition to the default.
    if unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is a valid value to fill in, and the handler
        // is async-signal-safe.
        let result = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // Restart interrupted reads and waits instead of failing them.
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if result != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Signals received since the supervisor last asked.
pub struct Received {
    /// How many arrived since the last call.
    pub fresh: usize,
    /// The latest of them.
    pub last: i32,
}

/// Counts the signals received since `handled` (updated to the total so far).
pub fn take_new(handled: &mut usize) -> Option<Received> {
    let received = SIGNALS_RECEIVED.load(Ordering::SeqCst);
    if received == *handled {
        return None;
    }
    let fresh = received - *handled;
    *handled = received;
    Some(Received {
        fresh,
        last: LAST_SIGNAL.load(Ordering::SeqCst),
    })
}

fn signal_name(signal: i32) -> Option<&'static str> {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    };
    Some(name)
}

/// "signal 9 (SIGKILL)", or "signal 40" for a signal without a known name.
pub fn describe_signal(signal: i32) -> String {
    match signal_name(signal) {
        Some(name) => format!("signal {signal} ({name})"),
        None => format!("signal {signal}"),
    }
}

/// The shell convention for "ended by a signal".
pub fn signal_exit_code(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}
