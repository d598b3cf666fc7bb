//! The `trace_file` option: a Chrome-trace (chrome://tracing, Perfetto)
//! timeline of this rank's operations, written when the communicator is
//! destroyed. `{rank}` in the path is replaced by the rank; without it,
//! ranks of a multi-rank job append `.<rank>`.

use std::fmt::Write as _;
use std::time::Instant;

pub struct Trace {
    path: String,
    rank: usize,
    epoch: Instant,
    events: Vec<Event>,
}

struct Event {
    name: &'static str,
    /// The call's number (see `backend::ledger`).
    seq: u64,
    start_us: f64,
    dur_us: f64,
    bytes: usize,
    ok: bool,
}

impl Trace {
    pub fn new(path: &str, rank: usize, size: usize) -> Trace {
        let path = if path.contains("{rank}") {
            path.replace("{rank}", &rank.to_string())
        } else if size > 1 {
            format!("{path}.{rank}")
        } else {
            path.to_string()
        };
        Trace {
            path,
            rank,
            epoch: Instant::now(),
            events: Vec::new(),
        }
    }

    /// Records call `name`, number `seq`, of `bytes`, which started at
    /// `started` and ends now.
    pub fn record(
        &mut self,
        name: &'static str,
        seq: u64,
        bytes: usize,
        started: Instant,
        ok: bool,
    ) {
        self.events.push(Event {
            name,
            seq,
            start_us: started.duration_since(self.epoch).as_secs_f64() * 1e6,
            dur_us: started.elapsed().as_secs_f64() * 1e6,
            bytes,
            ok,
        });
    }

    /// Writes the file; failures are reported on stderr (destroy can't fail).
    pub fn write(&self) {
        let mut s = String::from("{\"traceEvents\":[\n");
        for (i, e) in self.events.iter().enumerate() {
            let _ = write!(
                s,
                "{}{{\"name\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":0,\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"seq\":{},\"bytes\":{},\"ok\":{}}}}}",
                if i == 0 { "" } else { ",\n" },
                e.name,
                self.rank,
                e.start_us,
                e.dur_us,
                e.seq,
                e.bytes,
                e.ok
            );
        }
        s.push_str("\n]}\n");
        if let Err(e) = std::fs::write(&self.path, s) {
            crate::log::emit(
                crate::options::LogLevel::Warn,
                Some(self.rank),
                &format!("cannot write trace_file {}: {e}", self.path),
            );
        }
    }
}
