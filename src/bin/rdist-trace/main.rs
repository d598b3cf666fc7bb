//! rdist-trace: merges the per-rank `trace_file` timelines of one job into
//! one Chrome trace and says which rank made the others wait, and for how
//! long.
//!
//! ```text
//! rdist-trace [-o merged.json] TRACE_FILE...
//! ```
//!
//! Ranks' clocks need not agree (across hosts they do not): operations are
//! matched by their sequence number, and the clocks are aligned on the
//! moment every rank leaves a symmetric collective (allreduce, barrier,
//! ...: no rank can leave before the last has arrived), the median over
//! the job. On the aligned clocks the last rank to enter each operation
//! is the one the others waited for; a rank's wait is its time in the call
//! before that rank came. The merged trace carries each event's wait.

mod analysis;
mod trace_file;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: rdist-trace [-o merged.json] TRACE_FILE...\n\n\
Merges rdist trace files (option trace_file / RDIST_TRACE_FILE, one per rank) into one\n\
Chrome trace (-o; open it in chrome://tracing or ui.perfetto.dev) and prints which rank\n\
arrived last at the collectives, making the others wait, and for how long.\n";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut out: Option<PathBuf> = None;
    let mut files = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "-o" => match args.next() {
                Some(path) => out = Some(path.into()),
                None => return usage_error("-o needs a file name"),
            },
            _ if arg.starts_with('-') => return usage_error(&format!("unknown option '{arg}'")),
            _ => files.push(PathBuf::from(arg)),
        }
    }
    if files.is_empty() {
        return usage_error("no trace files given");
    }
    let mut ranks = Vec::new();
    for file in &files {
        match trace_file::read(file) {
            Ok(timeline) => ranks.push(timeline),
            Err(why) => {
                eprintln!("rdist-trace: {}: {why}", file.display());
                return ExitCode::from(1);
            }
        }
    }
    let merged = analysis::merge(ranks);
    print!("{}", analysis::report(&merged));
    if let Some(path) = out {
        if let Err(e) = std::fs::write(&path, analysis::chrome_trace(&merged)) {
            eprintln!("rdist-trace: cannot write {}: {e}", path.display());
            return ExitCode::from(1);
        }
        println!(
            "merged timeline: {} (chrome://tracing, ui.perfetto.dev)",
            path.display()
        );
    }
    ExitCode::SUCCESS
}

fn usage_error(what: &str) -> ExitCode {
    eprint!("rdist-trace: {what}\n{USAGE}");
    ExitCode::from(2)
}
