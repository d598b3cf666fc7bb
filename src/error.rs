//! The one error type of the crate, and its one mapping to `rdist_result_t`.

use std::fmt;

/// What went wrong, in the categories of the C API's `rdist_result_t`
/// (the discriminants are the C values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorKind {
    /// Bad pointer, count, rank, dtype, op or option.
    InvalidArgument = 1,
    /// The call is not allowed in this state.
    InvalidUsage = 2,
    /// A bounded wait ran out.
    Timeout = 3,
    /// A rank exited, crashed or disconnected.
    PeerLost = 4,
    /// Ranks called different collectives, counts or dtypes.
    Mismatch = 5,
    /// The communicator was aborted.
    Aborted = 6,
    /// The requested backend is not usable here.
    Unavailable = 7,
    /// An OS or network call failed.
    System = 8,
    /// NCCL or CUDA reported an error.
    Backend = 9,
    /// A peer failed the job's authentication.
    Auth = 10,
    /// A bug in rdist.
    Internal = 11,
}

impl ErrorKind {
    /// Every kind, in C value order.
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::InvalidArgument,
        ErrorKind::InvalidUsage,
        ErrorKind::Timeout,
        ErrorKind::PeerLost,
        ErrorKind::Mismatch,
        ErrorKind::Aborted,
        ErrorKind::Unavailable,
        ErrorKind::System,
        ErrorKind::Backend,
        ErrorKind::Auth,
        ErrorKind::Internal,
    ];

    /// The C value (`rdist_result_t`).
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The kind for a C value; `None` for 0 (success) and unknown values.
    pub fn from_code(code: i32) -> Option<ErrorKind> {
        ErrorKind::ALL.iter().copied().find(|k| k.code() == code)
    }

    /// Short static description, as `rdist_result_string` returns it.
    pub fn describe(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::InvalidUsage => "invalid usage",
            ErrorKind::Timeout => "timed out",
            ErrorKind::PeerLost => "peer lost",
            ErrorKind::Mismatch => "mismatched calls between ranks",
            ErrorKind::Aborted => "communicator aborted",
            ErrorKind::Unavailable => "backend unavailable",
            ErrorKind::System => "system error",
            ErrorKind::Backend => "backend (NCCL/CUDA) error",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Internal => "internal error",
        }
    }
}

/// An error with its category and a human-readable cause.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `context: ` put in front of its message.
    pub fn context(self, context: impl fmt::Display) -> Error {
        Error {
            kind: self.kind,
            message: format!("{context}: {}", self.message),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    pub fn invalid_usage(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidUsage, message)
    }

    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
    }

    /// An OS error, with what was being done when it happened.
    pub fn system(what: impl fmt::Display, err: &std::io::Error) -> Error {
        Error::new(ErrorKind::System, format!("{what}: {}", describe_io(err)))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Crate-wide result.
pub type Result<T> = std::result::Result<T, Error>;

/// An io::Error as a short lowercase phrase ("connection reset", "address
/// already in use"), without Rust's "(os error 104)" suffix.
pub fn describe_io(err: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    let s = match err.kind() {
        K::ConnectionReset => "connection reset",
        K::ConnectionRefused => "connection refused",
        K::ConnectionAborted => "connection aborted",
        K::BrokenPipe => "broken pipe",
        K::AddrInUse => "address already in use",
        K::AddrNotAvailable => "address not available",
        K::TimedOut | K::WouldBlock => "timed out",
        K::UnexpectedEof => "connection closed",
        K::PermissionDenied => "permission denied",
        K::NotFound => "not found",
        _ => "",
    };
    if !s.is_empty() {
        return s.to_string();
    }
    let text = err.to_string();
    match text.find(" (os error") {
        Some(i) => text[..i].to_lowercase(),
        None => text,
    }
}
