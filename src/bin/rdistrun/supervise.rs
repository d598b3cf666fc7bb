//! Watching the ranks: reaping them, stopping the rest after a failure or a
//! signal (report period, SIGTERM, SIGKILL), and the final summary.

use crate::args::OnFailure;
use crate::output::Quote;
use crate::signals::{self, describe_signal, signal_exit_code};
use crate::EXIT_LAUNCHER_ERROR;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

/// How often children are polled for exit and pending signals are looked at.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How a rank ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RankExit {
    Code(i32),
    Signal {
        signal: i32,
        core_dumped: bool,
    },
    /// waitpid failed; should not happen for our own child.
    Unknown(String),
}

impl RankExit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(signal)) => RankExit::Signal {
                signal,
                core_dumped: status.core_dumped(),
            },
            (None, None) => RankExit::Unknown(format!("unrecognized wait status {status}")),
        }
    }

    fn is_success(&self) -> bool {
        matches!(self, RankExit::Code(0))
    }

    /// rdistrun's own exit status when this exit is what stopped the job.
    fn exit_code(&self) -> u8 {
        match self {
            RankExit::Code(code) => u8::try_from(*code).unwrap_or(EXIT_LAUNCHER_ERROR),
            RankExit::Signal { signal, .. } => signal_exit_code(*signal),
            RankExit::Unknown(_) => EXIT_LAUNCHER_ERROR,
        }
    }

    fn describe(&self) -> String {
        match self {
            RankExit::Code(code) => format!("exited with code {code}"),
            RankExit::Signal {
                signal,
                core_dumped,
            } => {
                let core = if *core_dumped { " (core dumped)" } else { "" };
                format!("killed by {}{core}", describe_signal(*signal))
            }
            RankExit::Unknown(reason) => format!("could not be waited for: {reason}"),
        }
    }
}

/// One started rank.
pub struct RankProcess {
    pub rank: usize,
    pub child: Child,
    /// `Some` once the rank has been reaped.
    exit: Option<RankExit>,
}

impl RankProcess {
    pub fn new(rank: usize, child: Child) -> RankProcess {
        RankProcess {
            rank,
            child,
            exit: None,
        }
    }

    fn is_running(&self) -> bool {
        self.exit.is_none()
    }

    /// How the rank ended; `None` while it runs.
    pub fn exit(&self) -> Option<&RankExit> {
        self.exit.as_ref()
    }

    fn pid(&self) -> libc::pid_t {
        // Linux pids fit in pid_t; std only reports them as u32.
        self.child.id() as libc::pid_t
    }

    /// Signals the rank's whole process group. Only while the rank is unreaped:
    /// its pid (= group id) cannot be reused by another process until then.
    fn signal_group(&self, signal: i32) {
        if self.is_running() {
            // SAFETY: kill has no memory-safety preconditions. Failure (the group
            // is already gone) needs no handling.
            unsafe {
                libc::kill(-self.pid(), signal);
            }
        }
    }

    /// Stops a rank at once; used when start-up is abandoned.
    pub fn kill_and_reap(&mut self) {
        self.signal_group(libc::SIGKILL);
        if let Ok(status) = self.child.wait() {
            self.exit = Some(RankExit::from_status(status));
        }
    }

    /// Records how the rank ended (reaped by `reap_exited`).
    fn reaped(&mut self, status: ExitStatus) -> RankExit {
        let exit = RankExit::from_status(status);
        self.exit = Some(exit.clone());
        exit
    }
}

/// Why the job is being stopped.
#[derive(Debug)]
pub enum StopCause {
    RankFailed {
        rank: usize,
        pid: libc::pid_t,
        exit: RankExit,
    },
    Signal(i32),
}

/// Where a stop is.
#[derive(Debug)]
enum Phase {
    /// After a failure: the other ranks may still report their own errors and
    /// exit; `None` for a period too long to matter.
    Reporting { until: Option<Instant> },
    /// The survivors were signalled; SIGKILL follows at `deadline`.
    Stopping { deadline: Option<Instant> },
    /// After a failure, the others run on to their own end
    /// (`--on-failure continue`).
    Continuing,
}

/// A job being (or having been) stopped before all ranks succeeded.
#[derive(Debug)]
pub struct Stop {
    cause: StopCause,
    /// Ranks still running when the stop began.
    running: Vec<usize>,
    /// Ranks still running when rdistrun signalled them.
    stopped: Vec<usize>,
    /// Ranks that had to be sent SIGKILL.
    killed: Vec<usize>,
    phase: Phase,
}

impl Stop {
    fn new(ranks: &[RankProcess], cause: StopCause, report: Duration) -> Stop {
        Stop {
            cause,
            running: running(ranks).map(|p| p.rank).collect(),
            stopped: Vec::new(),
            killed: Vec::new(),
            phase: Phase::Reporting {
                until: Instant::now().checked_add(report),
            },
        }
    }

    /// After a failure, with `--on-failure continue`: the others go on.
    fn go_on(ranks: &[RankProcess], cause: StopCause) -> Stop {
        Stop {
            phase: Phase::Continuing,
            ..Stop::new(ranks, cause, Duration::ZERO)
        }
    }

    /// Sends `signal` to every running rank and starts the grace period.
    fn terminate(&mut self, ranks: &[RankProcess], signal: i32, grace: Duration) {
        for process in running(ranks) {
            process.signal_group(signal);
            self.stopped.push(process.rank);
        }
        self.phase = Phase::Stopping {
            deadline: Instant::now().checked_add(grace),
        };
    }

    fn kill_survivors(&mut self, ranks: &[RankProcess]) {
        for process in running(ranks) {
            if !self.killed.contains(&process.rank) {
                process.signal_group(libc::SIGKILL);
                self.killed.push(process.rank);
            }
        }
    }

    /// Moves on when the report period or the grace period is over.
    fn advance(&mut self, ranks: &[RankProcess], grace: Duration) {
        let now = Instant::now();
        match self.phase {
            Phase::Reporting { until } if until.is_some_and(|until| now >= until) => {
                self.terminate(ranks, libc::SIGTERM, grace)
            }
            Phase::Stopping { deadline } if deadline.is_some_and(|deadline| now >= deadline) => {
                self.kill_survivors(ranks)
            }
            _ => {}
        }
    }

    /// The failure the first one to be reaped reported, if that one was a
    /// consequence: its error names another rank (rdist's errors name the
    /// rank lost or failed) that failed on its own too, and so on. A rank
    /// that crashes is reaped only after its address space is torn down,
    /// which can take longer than its peers take to see its connections
    /// close and exit.
    pub fn follow_blame(&mut self, ranks: &[RankProcess], quote: impl Fn(usize) -> Option<Quote>) {
        let StopCause::RankFailed { rank: first, .. } = self.cause else {
            return;
        };
        let failed_on_its_own = |rank: usize| {
            self.running.contains(&rank)
                && !self.stopped.contains(&rank)
                && ranks
                    .iter()
                    .any(|p| p.rank == rank && p.exit().is_some_and(|e| !e.is_success()))
        };
        // A rank that names this one in turn (say, as the one whose failure
        // report it heard) is no origin: the blame stays.
        let names = |rank: usize, other: usize| match quote(rank) {
            Some(Quote::Error(line)) => named_ranks(&line).any(|r| r == other),
            _ => false,
        };
        let mut origin = first;
        let mut seen = vec![first];
        while let Some(Quote::Error(line)) = quote(origin) {
            match named_ranks(&line).find(|r| *r != origin) {
                Some(blamed)
                    if failed_on_its_own(blamed)
                        && !seen.contains(&blamed)
                        && !names(blamed, origin) =>
                {
                    seen.push(blamed);
                    origin = blamed;
                }
                _ => break,
            }
        }
        let Some(process) = ranks.iter().find(|p| p.rank == origin && origin != first) else {
            return;
        };
        let Some(exit) = process.exit().cloned() else {
            return;
        };
        self.running.retain(|r| *r != origin);
        self.running.push(first);
        self.running.sort_unstable();
        self.cause = StopCause::RankFailed {
            rank: origin,
            pid: process.pid(),
            exit,
        };
    }

    /// rdistrun's exit status for a stopped job.
    pub fn exit_code(&self) -> u8 {
        match &self.cause {
            StopCause::RankFailed { exit, .. } => exit.exit_code(),
            StopCause::Signal(signal) => signal_exit_code(*signal),
        }
    }
}

fn running(ranks: &[RankProcess]) -> impl Iterator<Item = &RankProcess> {
    ranks.iter().filter(|p| p.is_running())
}

/// Polls the ranks until all have exited. On the first failure the others get
/// `report` to report and exit on their own, then SIGTERM and, `grace` later,
/// SIGKILL; SIGINT/SIGTERM sent to rdistrun is forwarded at once. Returns `None`
/// when every rank exited 0 undisturbed.
pub fn supervise(
    ranks: &mut [RankProcess],
    report: Duration,
    grace: Duration,
    on_failure: OnFailure,
) -> Option<Stop> {
    let mut signals_handled = 0;
    let mut stop: Option<Stop> = None;
    let reaper = start_reaper();
    while ranks.iter().any(RankProcess::is_running) {
        // Signals first: a rank dying of a forwarded signal is not the cause.
        handle_signals(ranks, &mut signals_handled, &mut stop, grace);
        if let Some(failure) = reap_exited(ranks, reaper.as_ref()) {
            if stop.is_none() {
                stop = Some(match on_failure {
                    OnFailure::Stop => Stop::new(ranks, failure, report),
                    OnFailure::Continue => Stop::go_on(ranks, failure),
                });
            }
        }
        if let Some(stop) = &mut stop {
            stop.advance(ranks, grace);
        }
        thread::sleep(POLL_INTERVAL);
    }
    stop
}

/// Forwards a newly received SIGINT/SIGTERM to all ranks (ending a report
/// period early); any further one, or one arriving while the ranks are already
/// being stopped, escalates to SIGKILL.
fn handle_signals(
    ranks: &[RankProcess],
    handled: &mut usize,
    stop: &mut Option<Stop>,
    grace: Duration,
) {
    let Some(received) = signals::take_new(handled) else {
        return;
    };
    let stop = stop
        .get_or_insert_with(|| Stop::new(ranks, StopCause::Signal(received.last), Duration::ZERO));
    match stop.phase {
        Phase::Reporting { .. } | Phase::Continuing => {
            stop.terminate(ranks, received.last, grace);
            if received.fresh > 1 {
                stop.kill_survivors(ranks);
            }
        }
        Phase::Stopping { .. } => stop.kill_survivors(ranks),
    }
}

/// What one waitpid for any child found.
enum Reaped {
    Exited(libc::pid_t, i32),
    NoChildLeft,
}

/// One waitpid for any child (the ranks are rdistrun's only children);
/// None when, not blocking, none has exited.
fn wait_any(block: bool) -> Option<Reaped> {
    let flags = if block { 0 } else { libc::WNOHANG };
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into our integer.
        let pid = unsafe { libc::waitpid(-1, &mut status, flags) };
        if pid > 0 {
            return Some(Reaped::Exited(pid, status));
        }
        if pid == 0 {
            return None;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Some(Reaped::NoChildLeft);
        }
    }
}

/// A thread blocked in waitpid for any child, passing on each exit as it
/// happens: one system call per exit (polling every rank every 10 ms was
/// 100,000 a second at 1024 ranks), and exits in the order the ranks
/// ended (a poll finds those of the last 10 ms together, and cannot tell
/// which failed first). None when no thread can be started.
fn start_reaper() -> Option<Receiver<Reaped>> {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("rdistrun-reaper".into())
        .spawn(move || {
            while let Some(reaped) = wait_any(true) {
                let last = matches!(reaped, Reaped::NoChildLeft);
                if tx.send(reaped).is_err() || last {
                    return;
                }
            }
        })
        .ok()?;
    Some(rx)
}

/// Records the ranks that have exited (from `reaper`, or polled without
/// one), up to the first that failed, which it returns.
fn reap_exited(ranks: &mut [RankProcess], reaper: Option<&Receiver<Reaped>>) -> Option<StopCause> {
    loop {
        let reaped = match reaper {
            Some(exits) => exits.try_recv().ok(),
            None => wait_any(false),
        };
        let (pid, status) = match reaped? {
            Reaped::Exited(pid, status) => (pid, status),
            Reaped::NoChildLeft => {
                // Yet some rank was never reaped here (reaped by the kernel,
                // or by someone else): it is gone all the same.
                let mut first = None;
                for process in ranks.iter_mut().filter(|p| p.is_running()) {
                    let exit =
                        RankExit::Unknown("it was reaped elsewhere (is SIGCHLD ignored?)".into());
                    process.exit = Some(exit.clone());
                    first.get_or_insert(StopCause::RankFailed {
                        rank: process.rank,
                        pid: process.pid(),
                        exit,
                    });
                }
                return first;
            }
        };
        let Some(process) = ranks.iter_mut().find(|p| p.is_running() && p.pid() == pid) else {
            continue;
        };
        let exit = process.reaped(ExitStatus::from_raw(status));
        if !exit.is_success() {
            // The exits after it are the others' (reaped next time, once
            // the stop knows who was still running).
            return Some(StopCause::RankFailed {
                rank: process.rank,
                pid,
                exit,
            });
        }
    }
}

/// The summary: one line on what happened, e.g. "rank 2 (pid 4242) failed
/// first: exited with code 3; ranks 0, 1 then exited with code 1; stopped rank
/// 3", then one line per rank that did not exit 0 and printed something,
/// quoting its first error line, else its last line on stderr (`quote`).
/// `exits`: every rank and how it ended.
pub fn summarize(
    stop: &Stop,
    exits: &[(usize, Option<RankExit>)],
    quote: impl Fn(usize) -> Option<Quote>,
) -> Vec<String> {
    let mut parts = vec![match &stop.cause {
        StopCause::RankFailed { rank, pid, exit } => {
            format!("rank {rank} (pid {pid}) failed first: {}", exit.describe())
        }
        StopCause::Signal(signal) => format!("interrupted by {}", describe_signal(*signal)),
    }];
    // Ranks that ended on their own during the report period, grouped by how.
    let mut on_their_own: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, exit) in exits {
        let Some(exit) = exit else { continue };
        if !stop.running.contains(rank) || stop.stopped.contains(rank) {
            continue;
        }
        let how = exit.describe();
        match on_their_own.iter_mut().find(|(h, _)| *h == how) {
            Some((_, group)) => group.push(*rank),
            None => on_their_own.push((how, vec![*rank])),
        }
    }
    let went_on = matches!(stop.phase, Phase::Continuing) && !on_their_own.is_empty();
    if went_on {
        parts.push("the others went on (--on-failure continue)".to_string());
    }
    for (how, group) in &on_their_own {
        parts.push(format!("{} then {how}", list_ranks(group)));
    }
    if !stop.stopped.is_empty() {
        let mut stopped = format!("stopped {}", list_ranks(&stop.stopped));
        if !stop.killed.is_empty() {
            stopped += &format!(" (SIGKILL needed for {})", list_ranks(&stop.killed));
        }
        parts.push(stopped);
    }
    if stop.running.is_empty() {
        parts.push("no other ranks were running".to_string());
    }
    let mut lines = vec![parts.join("; ")];
    for (rank, exit) in exits {
        if exit.as_ref().is_some_and(RankExit::is_success) {
            continue;
        }
        match quote(*rank) {
            Some(Quote::Error(line)) => lines.push(format!("first error of rank {rank}: {line}")),
            Some(Quote::LastStderr(line)) => {
                lines.push(format!("last line of rank {rank} on stderr: {line}"))
            }
            None => {}
        }
    }
    lines
}

/// The numbers N of "rank N" in `line`, in order.
fn named_ranks(line: &str) -> impl Iterator<Item = usize> + '_ {
    line.match_indices("rank ").filter_map(|(at, word)| {
        let digits: String = line[at + word.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    })
}

/// "rank 3" or "ranks 0, 1, 3".
pub fn list_ranks(ranks: &[usize]) -> String {
    let numbers: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", numbers.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop(cause: StopCause, running: &[usize], stopped: &[usize], killed: &[usize]) -> Stop {
        Stop {
            cause,
            running: running.to_vec(),
            stopped: stopped.to_vec(),
            killed: killed.to_vec(),
            phase: Phase::Stopping { deadline: None },
        }
    }

    fn no_errors(_: usize) -> Option<Quote> {
        None
    }

    #[test]
    fn summary_lines() {
        let failed = || StopCause::RankFailed {
            rank: 2,
            pid: 4242,
            exit: RankExit::Code(3),
        };
        let killed = Some(RankExit::Signal {
            signal: libc::SIGTERM,
            core_dumped: false,
        });
        let exits = [
            (0, killed.clone()),
            (1, killed.clone()),
            (2, Some(RankExit::Code(3))),
            (3, killed.clone()),
        ];
        let s = stop(failed(), &[0, 1, 3], &[0, 1, 3], &[]);
        assert_eq!(
            summarize(&s, &exits, no_errors),
            ["rank 2 (pid 4242) failed first: exited with code 3; stopped ranks 0, 1, 3"]
        );
        assert_eq!(s.exit_code(), 3);

        // Ranks 0 and 1 reported and exited within the report period.
        let exits = [
            (0, Some(RankExit::Code(1))),
            (1, Some(RankExit::Code(1))),
            (2, Some(RankExit::Code(3))),
            (3, killed),
            (4, Some(RankExit::Code(0))),
        ];
        let s = stop(failed(), &[0, 1, 3], &[3], &[]);
        let errors = |rank: usize| match rank {
            0 => Some(Quote::Error("lost rank 2".to_string())),
            1 => Some(Quote::LastStderr("loading shard 1".to_string())),
            2 => Some(Quote::Error("bad input".to_string())),
            4 => Some(Quote::Error("error: ignored, rank 4 succeeded".to_string())),
            _ => None,
        };
        assert_eq!(
            summarize(&s, &exits, errors),
            [
                "rank 2 (pid 4242) failed first: exited with code 3; ranks 0, 1 then exited with code 1; stopped rank 3",
                "first error of rank 0: lost rank 2",
                "last line of rank 1 on stderr: loading shard 1",
                "first error of rank 2: bad input",
            ]
        );

        let s = stop(failed(), &[], &[], &[]);
        assert_eq!(
            summarize(&s, &[(2, Some(RankExit::Code(3)))], no_errors),
            ["rank 2 (pid 4242) failed first: exited with code 3; no other ranks were running"]
        );

        let s = stop(StopCause::Signal(libc::SIGINT), &[0], &[0], &[0]);
        assert_eq!(
            summarize(&s, &[(0, None)], no_errors),
            ["interrupted by signal 2 (SIGINT); stopped rank 0 (SIGKILL needed for rank 0)"]
        );
        assert_eq!(s.exit_code(), 130);
    }
}
