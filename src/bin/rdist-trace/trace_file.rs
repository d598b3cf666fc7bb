//! Reading one rank's trace file (the format `trace_file` writes: one
//! Chrome-trace event per line).

use std::path::Path;

/// One operation as a rank saw it.
#[derive(Clone, Debug)]
pub struct Op {
    pub name: String,
    pub seq: u64,
    /// Microseconds on the rank's own clock.
    pub start: f64,
    pub dur: f64,
    pub bytes: u64,
    pub ok: bool,
}

/// A rank's operations.
pub struct Timeline {
    pub rank: usize,
    pub ops: Vec<Op>,
}

/// The text after `"key":` up to the next ',' or '}' (quotes removed).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim().trim_matches('"'))
}

pub fn read(path: &Path) -> Result<Timeline, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    if !text.starts_with("{\"traceEvents\":") {
        return Err("not an rdist trace file (no traceEvents)".into());
    }
    let mut rank = None;
    let mut ops = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("\"ph\":\"X\""))
    {
        let bad = |what: &str| format!("line {}: {what}", n + 1);
        let number = |key: &str| -> Result<f64, String> {
            field(line, key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| bad(&format!("no number for {key}")))
        };
        let pid = number("pid")? as usize;
        if *rank.get_or_insert(pid) != pid {
            return Err(bad("events of two ranks in one file"));
        }
        ops.push(Op {
            name: field(line, "name")
                .ok_or_else(|| bad("no name"))?
                .to_string(),
            seq: number("seq")? as u64,
            start: number("ts")?,
            dur: number("dur")?,
            bytes: number("bytes")? as u64,
            ok: field(line, "ok") == Some("true"),
        });
    }
    let rank = rank.ok_or("no events (was the communicator destroyed, so that it was written?)")?;
    Ok(Timeline { rank, ops })
}
