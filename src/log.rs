//! Logging to stderr at the level of the `debug` option, prefixed with the
//! rank so interleaved output from many processes stays readable.

use crate::options::LogLevel;
use std::sync::atomic::{AtomicU8, Ordering};

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Warn as u8);

/// Raises the process-wide level (the most verbose communicator wins).
pub fn raise_level(level: LogLevel) {
    LEVEL.fetch_max(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: LogLevel) -> bool {
    LEVEL.load(Ordering::Relaxed) >= level as u8
}

pub fn emit(level: LogLevel, rank: Option<usize>, msg: &str) {
    if !enabled(level) {
        return;
    }
    let tag = match level {
        LogLevel::Warn => "WARN",
        LogLevel::Info => "INFO",
        LogLevel::Trace => "TRACE",
    };
    match rank {
        Some(r) => eprintln!("rdist {tag} [rank {r}] {msg}"),
        None => eprintln!("rdist {tag} {msg}"),
    }
}
