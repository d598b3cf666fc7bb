//! The tuning model: what a communicator chooses from what the machine
//! is (`transport::machine`, measured once per machine) and how its ranks
//! sit on it, with the reason for each choice (`RDIST_DEBUG=INFO` prints
//! it at init). Options and `algo` still override it.
//!
//! Two kinds of choice, kept apart because of who must agree:
//! - **Crossovers** (at which size an algorithm gives way to another)
//!   must be the same on every rank, or they would run different
//!   algorithms: they come from one profile every rank has, the one of
//!   rank 0's host as the roster carries it.
//! - **Local choices** (single copy, yielding while idle) are this rank's
//!   own: they come from its host's profile and its neighbours.
//!
//! A crossover between a latency-bound algorithm (fewer steps) and a
//! bandwidth-bound one (fewer bytes) lies where the steps saved cost as
//! much as the bytes added, so it scales with the medium's
//! latency-bandwidth product: the bytes it moves in the time of one step.
//! The crossovers were measured on a reference machine (`REFERENCE`);
//! another machine's are the reference's, scaled by the ratio of its
//! product to the reference's, rounded to a power of two and held within
//! a factor of four (a noisy measurement moves a choice by at most that).

use crate::transport::machine::Machine;
use crate::transport::tagged::ReadCost;

/// The machine the reference crossovers were measured on: the Sapphire
/// Rapids VM, 2 cores (see docs/performance.md, "The tuning model" and
/// its 2026-11-29 remeasurement), its profile as measured undisturbed.
pub const REFERENCE: Machine = Machine {
    cores: 2,
    copy_one_mbs: 12_500,
    copy_all_mbs: 14_500,
    handoff_ns: 60,
    tcp_latency_ns: 1_900,
    tcp_mbs: 9_000,
    // The first reference's: no crossover reads it, and this VM's sysfs
    // lists a 480 MiB cache no machine has.
    cache_kib: 32 << 10,
    // The rest left unknown: a machine that cannot say gets the rings
    // (on the first reference, an AMD VM, a 1 MiB ping-pong took 42 us
    // through them, Open MPI's single copy 101 us).
    ..crate::transport::machine::UNKNOWN
};

/// A step on shared memory costs the cache lines' trip plus rdist's own
/// work around it (publishing, the doorbell, matching the label): about
/// this much on the reference machine, measured as 2-rank 8-byte
/// allreduces.
const SHM_STEP_WORK_NS: u64 = 700;

/// The sizes at which the algorithms hand over (bytes), per medium.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crossovers {
    /// Allreduces up to this size take recursive doubling (log2 n
    /// steps), larger ones the ring (2(n-1)/n of the data a rank).
    pub small_allreduce_shm: usize,
    pub small_allreduce_tcp: usize,
    /// Allgathers up to this size (the result) take Bruck (ceil(log2 n)
    /// rounds) instead of the ring's n - 1.
    pub small_allgather_shm: usize,
    pub small_allgather_tcp: usize,
    /// Over TCP, allreduces from this size with a power-of-two world of 4
    /// or more take halving-doubling (the ring's bytes in fewer steps).
    pub halving_doubling_tcp: usize,
    /// Over TCP, broadcasts and reduces from this size (3+ ranks) go
    /// along a pipelined chain: every link carries the data once, where
    /// the tree's root sends it log2 n times.
    pub chain_tcp: usize,
}

/// The crossovers as measured on the reference machine.
pub const REFERENCE_CROSSOVERS: Crossovers = Crossovers {
    small_allreduce_shm: 16 << 10,
    small_allreduce_tcp: 64 << 10,
    small_allgather_shm: 8 << 10,
    small_allgather_tcp: 64 << 10,
    halving_doubling_tcp: 256 << 10,
    chain_tcp: 4 << 20,
};

/// Single copy, when chosen, from this size at least, and from twice the
/// last-level cache: below, the rings' second copy stays in cache and is
/// cheap, while a single copy pays its system call and page pinning
/// (measured on the reference machine, 32 MiB of cache, 4 ranks on 2
/// cores: broadcast of 32 MiB 14.0 ms single copy against 11.3 through
/// the rings, of 64 MiB 24.4 against 28.8). Payloads their receiver
/// combines stay on the rings (see `transport::stream::Tuning`).
pub const SINGLE_COPY_MIN: usize = 4 << 20;

/// From which size single copy pays on a machine whose copies are the
/// bound (see `SINGLE_COPY_MIN`).
fn single_copy_from(m: &Machine) -> usize {
    SINGLE_COPY_MIN.max((m.cache_kib as usize) << 11)
}

/// Single copy must move bytes this much faster than the rings (one
/// core's copy out of another's memory against two cores passing them
/// through a ring) before it is chosen for that alone: measurements of
/// either scatter by a tenth or two between runs.
const SINGLE_COPY_PER_BYTE_FACTOR: f64 = 1.25;

/// Where single copy beats the rings per byte on machine `m` (one core
/// copying straight out of another's memory against two cores passing
/// the bytes through a ring), the size from which it also makes up for
/// its fixed cost: its system call, and its descriptor's and answer's
/// trips. None where it does not, or where that was not measured.
fn single_copy_pays_from(m: &Machine) -> Option<usize> {
    if !m.knows_single_copy() {
        return None;
    }
    let (pass, cma) = (f64::from(m.pass_mbs), f64::from(m.cma_mbs));
    if cma < pass * SINGLE_COPY_PER_BYTE_FACTOR {
        return None;
    }
    // ns per byte saved, and ns paid per message.
    let saved = 1000.0 / pass - 1000.0 / cma;
    let handoff = if m.handoff_ns > 0 { m } else { &REFERENCE };
    let fixed =
        f64::from(m.cma_call_ns) + 2.0 * (SHM_STEP_WORK_NS as f64 + f64::from(handoff.handoff_ns));
    let from = (fixed / saved).min((64u64 << 20) as f64) as usize;
    Some(from.next_power_of_two().max(16 << 10))
}

/// Single copy against the rings on machine `m`, for weighing a copy's
/// measured time (its system call included): the rings' pass rate, and
/// what single copy costs a message beyond the copy and the rings' own
/// step: its answer's trip (its descriptor's stands for the message's).
/// Messages up to a core's own cache (`SINGLE_COPY_MIN` where sysfs
/// names none): a larger one cannot wait whole in the receiver's cache.
/// The full pass rate even where the ranks share cores, though the rings'
/// two copies then take turns: at half of it, buffers just written passed
/// too, and lost (docs/performance.md, "Point-to-point one way, ranks
/// sharing cores").
fn single_copy_read_cost(m: &Machine, core_cache_kib: u32) -> ReadCost {
    let handoff = if m.handoff_ns > 0 { m } else { &REFERENCE };
    let fixed = SHM_STEP_WORK_NS + u64::from(handoff.handoff_ns);
    ReadCost {
        pass_mbs: m.pass_mbs,
        fixed_ns: u32::try_from(fixed).unwrap_or(u32::MAX),
        max_bytes: match core_cache_kib {
            0 => SINGLE_COPY_MIN,
            kib => (kib as usize) << 10,
        },
    }
}

/// Where single copy beats the rings for a rank that sends and receives
/// at once (an exchange, every step of a ring). Where the machine's swaps
/// were measured (`Machine::swaps`): from the smallest size swapped at
/// which single copy was `SWAP_FACTOR` as fast and no larger size found
/// it slower; None where no such size was. (A clear win, beyond the
/// rounds' scatter, where it starts; no loss where it goes on: where the
/// swaps leave a cache both ways slow down alike, and the largest size's
/// ratio drifts towards 1.) (Through the rings a core copies
/// its outgoing bytes in and its incoming bytes out, with single copy only
/// the incoming ones; but the copy in is cheap while its payload sits in
/// a cache the core has nearly to itself, and the swaps show where that
/// ends.) Else inferred from one way's rates: from half a core's own
/// cache, within `TWO_WAY_SINGLE_COPY_FLOOR`..`SINGLE_COPY_MIN`
/// (`SINGLE_COPY_MIN` where sysfs names no such cache), where one copy out
/// of another's memory is that much faster than half a ring's pass; None
/// where it is not, or where nothing was measured.
fn two_way_single_copy_from(m: &Machine, core_cache_kib: u32) -> Option<usize> {
    if m.knows_swaps() {
        let mut from = None;
        for (size, permille) in m.swaps().into_iter().rev() {
            if permille > 1000 {
                break;
            }
            if f64::from(permille) * SWAP_FACTOR <= 1000.0 {
                from = Some(size);
            }
        }
        return from;
    }
    if !m.knows_single_copy() {
        return None;
    }
    let (pass, cma) = (f64::from(m.pass_mbs), f64::from(m.cma_mbs));
    let from = match core_cache_kib {
        0 => SINGLE_COPY_MIN,
        kib => ((kib as usize) << 9).clamp(TWO_WAY_SINGLE_COPY_FLOOR, SINGLE_COPY_MIN),
    };
    (cma >= pass / 2.0 * SINGLE_COPY_PER_BYTE_FACTOR).then_some(from)
}

/// Whether one copy straight out of another's memory (single copy's
/// way, its system call and page pinning included) outpaces a core
/// copying its own memory, by `OWN_COPY_FACTOR`; false where either was
/// not measured. Where the ranks outnumber the cores every copy waits for
/// a core, so a rank that sends while it receives pays for both of the
/// rings' copies of each byte (its send in, its receive out) against one
/// single copy; single copy won there on a machine where it outpaced a
/// core's own copy and lost on one where it did not (docs/performance.md,
/// "Ranks that share cores").
fn single_copy_outpaces_own_copy(m: &Machine) -> bool {
    m.knows_single_copy()
        && m.knows_memory()
        && f64::from(m.cma_mbs) >= f64::from(m.copy_one_mbs) * OWN_COPY_FACTOR
}

/// How much faster single copy must copy than a core copies its own
/// memory (`single_copy_outpaces_own_copy`): profiles scatter by a tenth.
const OWN_COPY_FACTOR: f64 = 1.1;

/// How much faster single copy must swap payloads than the rings at the
/// size it is chosen from: the swaps' rounds scatter by up to a tenth.
const SWAP_FACTOR: f64 = 1.1;

/// The smallest size from which the two-way rules (the swaps, one way's
/// rates and a core's own cache, ranks sharing cores) send a rank's
/// payloads single copy while it also receives (one-way rules and the
/// option may go lower): below it, single copy was not seen to pay with
/// data just made, with a core per rank or with ranks sharing cores
/// (docs/performance.md).
const TWO_WAY_SINGLE_COPY_FLOOR: usize = 1 << 20;

/// Where ranks share cores and single copy outpaces a core's own copy
/// (`single_copy_outpaces_own_copy`), the size from which a
/// point-to-point message goes single copy one way: from there it won or
/// tied with data just made and won with a buffer sent unchanged; below
/// it, with data just made, the rings won (docs/performance.md, "Ranks
/// that share cores"). Smaller unchanged buffers are left to the
/// per-buffer choice.
const SHARED_CORES_TAGGED_SINGLE_COPY_MIN: usize = 1 << 20;

/// The ranks' demand on the memory system (each rank's core copying at
/// full speed) must exceed what all cores together copy by this factor
/// before halving the copies pays for single copy's system calls.
const MEMORY_BOUND_FACTOR: u64 = 2;

/// How one communicator's ranks sit on the machine.
#[derive(Clone, Copy, Debug)]
pub struct Inputs {
    /// The profile every rank chooses its crossovers from.
    pub agreed: Machine,
    /// This rank's host's profile.
    pub here: Machine,
    /// Ranks of the communicator on this rank's host.
    pub host_ranks: usize,
    /// Ranks of the whole job on this rank's host (they run there, in
    /// whatever communicator; 0: unknown).
    pub host_job_ranks: usize,
    /// Ranks on this machine (network namespaces of one machine share it).
    pub machine_ranks: usize,
    /// Cores the job's ranks on this host may use together (the union of
    /// their CPU sets: each may be bound to one), and the machine's.
    pub cores: usize,
    pub machine_cores: usize,
    /// The cache one of this host's cores has to itself, in KiB (0:
    /// unknown; see `transport::machine::core_cache_kib`).
    pub core_cache_kib: u32,
}

/// What the model chose, and why.
#[derive(Clone, Debug)]
pub struct Plan {
    pub crossovers: Crossovers,
    /// Ranks outnumber cores: waiting ranks yield their core, and the
    /// total copying work is what counts.
    pub oversubscribed: bool,
    /// Ranks per core, rounded up (1 unless oversubscribed): how many
    /// times rarer a thread that looks now and then (the endpoint's)
    /// looks, so that the ranks' looks do not take the cores they share.
    pub ranks_per_core: usize,
    /// From which size shared-memory payloads go single copy when the
    /// option leaves it to rdist (usize::MAX: never).
    pub single_copy_min: usize,
    /// The same for payloads a rank sends while it also receives (see
    /// `two_way_single_copy_from`); never above `single_copy_min`.
    pub two_way_single_copy_min: usize,
    /// The same for point-to-point messages one way, tagged or in a group
    /// (a collective's one-way payloads keep `single_copy_min`); never
    /// above it.
    pub tagged_single_copy_min: usize,
    /// Below those sizes, a tagged message goes single copy while its
    /// buffer's receiver copies it faster than the rings pass it, by this
    /// measure (`transport::tagged::choice`); None: not measured.
    pub read_cost: Option<ReadCost>,
    /// The inputs and choices, one clause each, for the log.
    pub why: String,
}

/// A profile's latency-bandwidth product on shared memory and on TCP, in
/// bytes (ns x MB/s / 1000); the reference's where it was not measured.
fn products(m: &Machine) -> (u64, u64) {
    let copy = if m.knows_memory() { m } else { &REFERENCE };
    // One core's processes learn nothing of the trip between cores.
    let handoff = if m.handoff_ns > 0 { m } else { &REFERENCE };
    let shm = (SHM_STEP_WORK_NS + u64::from(handoff.handoff_ns))
        .saturating_mul(u64::from(copy.copy_one_mbs))
        / 1000;
    let r = if m.knows_tcp() { m } else { &REFERENCE };
    let tcp = u64::from(r.tcp_latency_ns).saturating_mul(u64::from(r.tcp_mbs)) / 1000;
    (shm.max(1), tcp.max(1))
}

/// `reference` scaled by `ratio` in powers of two, held within 4x either
/// way; a ratio within 2^0.75 (1.7x) either way moves nothing, so that a
/// measurement on a busy machine does not.
fn scaled(reference: usize, ratio: f64) -> usize {
    let l = ratio.log2();
    let steps = (l.signum() * (l.abs() + 0.25).floor()).clamp(-2.0, 2.0) as i32;
    if steps >= 0 {
        reference << steps
    } else {
        reference >> -steps
    }
}

/// The crossovers for a machine profile (the reference's for what was
/// not measured).
pub fn crossovers(m: &Machine) -> Crossovers {
    let (shm, tcp) = products(m);
    let (ref_shm, ref_tcp) = products(&REFERENCE);
    let s = shm as f64 / ref_shm as f64;
    let t = tcp as f64 / ref_tcp as f64;
    let r = REFERENCE_CROSSOVERS;
    Crossovers {
        small_allreduce_shm: scaled(r.small_allreduce_shm, s),
        small_allreduce_tcp: scaled(r.small_allreduce_tcp, t),
        small_allgather_shm: scaled(r.small_allgather_shm, s),
        small_allgather_tcp: scaled(r.small_allgather_tcp, t),
        halving_doubling_tcp: scaled(r.halving_doubling_tcp, t),
        chain_tcp: scaled(r.chain_tcp, t),
    }
}

/// Runs the model.
pub fn plan(i: &Inputs) -> Plan {
    let crossovers = crossovers(&i.agreed);
    let mut why = Vec::new();
    let m = i.agreed;
    if m.knows_memory() || m.knows_tcp() {
        let (shm, tcp) = products(&m);
        why.push(format!(
            "crossovers from rank 0's host ({} cores, one core copies {:.1} GB/s, a step {} ns on shared memory \
             and {:.1} us over TCP at {:.2} GB/s: {} B and {} B move in one step's time)",
            m.cores,
            f64::from(m.copy_one_mbs) / 1000.0,
            SHM_STEP_WORK_NS + u64::from(m.handoff_ns),
            f64::from(m.tcp_latency_ns) / 1000.0,
            f64::from(m.tcp_mbs) / 1000.0,
            shm,
            tcp,
        ));
    } else {
        why.push("crossovers of the reference machine (no measured profile)".into());
    }
    let c = crossovers;
    why.push(format!(
        "allreduce by recursive doubling up to {} on shared memory and {} over TCP, then ring \
         (halving-doubling over TCP from {} at 4, 8, 16.. ranks); allgather by Bruck up to {} / {}; \
         broadcast and reduce along a chain over TCP from {}",
        bytes(c.small_allreduce_shm),
        bytes(c.small_allreduce_tcp),
        bytes(c.halving_doubling_tcp),
        bytes(c.small_allgather_shm),
        bytes(c.small_allgather_tcp),
        bytes(c.chain_tcp),
    ));
    let sharing = i.host_ranks.max(i.host_job_ranks);
    let oversubscribed = sharing > i.cores || i.machine_ranks > i.machine_cores;
    let ranks_per_core = sharing
        .div_ceil(i.cores.max(1))
        .max(i.machine_ranks.div_ceil(i.machine_cores.max(1)))
        .max(1);
    let here = i.here;
    // The ranks' copies at one core's speed each, all at once, asking
    // well more than the memory system gives: memory is the bound, the
    // total copying work counts, and single copy halves it.
    let demand = (i.host_ranks as u64).saturating_mul(u64::from(here.copy_one_mbs));
    let memory_bound = here.knows_memory()
        && demand > MEMORY_BOUND_FACTOR.saturating_mul(u64::from(here.copy_all_mbs));
    let from = single_copy_from(&here);
    let per_byte = single_copy_pays_from(&here);
    let single_copy_min = if oversubscribed || memory_bound {
        from
    } else {
        usize::MAX
    }
    .min(per_byte.unwrap_or(usize::MAX));
    let swapped_two_way = two_way_single_copy_from(&here, i.core_cache_kib);
    // Ranks sharing cores: what a core copies is what counts.
    let shared_cores = oversubscribed && single_copy_outpaces_own_copy(&here);
    let shared_cores_two_way = shared_cores
        .then_some(TWO_WAY_SINGLE_COPY_FLOOR)
        .filter(|n| swapped_two_way.is_none_or(|m| *n < m));
    let two_way = shared_cores_two_way.or(swapped_two_way);
    let two_way_single_copy_min = single_copy_min.min(two_way.unwrap_or(usize::MAX));
    let tagged_single_copy_min = match shared_cores {
        true => single_copy_min.min(SHARED_CORES_TAGGED_SINGLE_COPY_MIN),
        false => single_copy_min,
    };
    why.push(if oversubscribed {
        format!(
            "{} ranks here on {} cores ({} on the machine's {}): oversubscribed, so waiting ranks yield, \
             the endpoint's thread looks up to {}x less often (at most its idle wake), and shared-memory payloads from {} (twice the \
             {} cache) that are not reduced go single copy (one copy instead of the rings' two)",
            sharing,
            i.cores,
            i.machine_ranks,
            i.machine_cores,
            ranks_per_core,
            bytes(from),
            bytes((here.cache_kib as usize) << 10),
        )
    } else if memory_bound {
        format!(
            "{} ranks here on {} cores, waiting ranks spinning before they sleep, copying {:.1} GB/s each \
             would ask {:.1} GB/s of a memory system that gives {:.1} GB/s: memory-bound, so \
             shared-memory payloads from {} that are not reduced go single copy",
            i.host_ranks,
            i.cores,
            f64::from(here.copy_one_mbs) / 1000.0,
            demand as f64 / 1000.0,
            f64::from(here.copy_all_mbs) / 1000.0,
            bytes(from)
        )
    } else {
        format!(
            "{} ranks here on {} cores, memory not the bound: waiting ranks spin before sleeping, \
             and payloads go through the rings (their two copies run on both ranks' cores at once)",
            sharing, i.cores
        )
    });
    if here.knows_single_copy() {
        why.push(format!(
            "two cores pass {:.1} GB/s through the rings, one copies {:.1} GB/s straight out of \
             another's memory ({} ns a call): {}",
            f64::from(here.pass_mbs) / 1000.0,
            f64::from(here.cma_mbs) / 1000.0,
            here.cma_call_ns,
            match per_byte {
                Some(n) => format!(
                    "single copy pays from {} (its fixed cost made up), for messages and \
                     payloads that are not reduced",
                    bytes(n)
                ),
                None => "the rings, unless the ranks outnumber the cores or memory is the bound"
                    .to_string(),
            }
        ));
    }
    if here.knows_single_copy() || here.knows_swaps() {
        why.push(two_way_why(
            &here,
            swapped_two_way,
            single_copy_min,
            i.core_cache_kib,
        ));
    }
    if let Some(n) = shared_cores_two_way.filter(|n| *n < single_copy_min) {
        why.push(format!(
            "but with the cores shared, where one copy out of another's memory ({:.1} GB/s) \
             outpaces a core's own ({:.1} GB/s), a rank that sends while it receives, which through \
             the rings copies each byte twice (its send in, its receive out), sends its payloads \
             from {} that are not reduced single copy",
            f64::from(here.cma_mbs) / 1000.0,
            f64::from(here.copy_one_mbs) / 1000.0,
            bytes(n)
        ));
    }
    if tagged_single_copy_min < single_copy_min {
        why.push(format!(
            "and a point-to-point message from {} goes single copy one way too (the rings' two \
             copies of it take the cores the ranks share; a collective's one-way payload keeps \
             the rings, which pipeline it along the ranks)",
            bytes(tagged_single_copy_min)
        ));
    }
    let read_cost = here
        .knows_single_copy()
        .then(|| single_copy_read_cost(&here, i.core_cache_kib));
    if let Some(c) = read_cost {
        why.push(format!(
            "below that, a tagged message up to {} (a core's own cache) goes single copy while its \
             buffer's last copy by its receiver (timed) and its answer's {} ns trip beat the rings' \
             {:.1} GB/s, and its sender waited no more than twice the rings' time for the answer (a \
             buffer sent unchanged, in the receiver's cache; not one just written, nor to a receiver \
             that comes late); tried while the peer talks back",
            bytes(c.max_bytes),
            c.fixed_ns,
            f64::from(c.pass_mbs) / 1000.0,
        ));
    }
    Plan {
        crossovers,
        oversubscribed,
        ranks_per_core,
        single_copy_min,
        two_way_single_copy_min,
        tagged_single_copy_min,
        read_cost,
        why: why.join("; "),
    }
}

/// What the plan says of a rank that sends while it receives.
fn two_way_why(
    here: &Machine,
    two_way: Option<usize>,
    single_copy_min: usize,
    core_cache_kib: u32,
) -> String {
    let swapped = || {
        let took: Vec<String> = here
            .swaps()
            .iter()
            .map(|(size, p)| format!("{} {:.2}x", bytes(*size), f64::from(*p) / 1000.0))
            .collect();
        format!(
            "two cores swapping payloads they just wrote took, single copy against the rings, {}",
            took.join(", ")
        )
    };
    match two_way {
        Some(n) if n < single_copy_min && here.knows_swaps() => format!(
            "{}: a rank that sends while it receives sends its payloads from {} that are not \
             reduced single copy",
            swapped(),
            bytes(n)
        ),
        Some(n) if n < single_copy_min => format!(
            "a rank that sends while it receives copies both ways through the rings and one way \
             with single copy, which is {:.2}x as fast then: its payloads from {} ({}) that are \
             not reduced go single copy",
            f64::from(here.cma_mbs) / (f64::from(here.pass_mbs) / 2.0),
            bytes(n),
            match core_cache_kib {
                0 => "no core's own cache listed".to_string(),
                k => format!(
                    "half a core's own {} cache, within 1 MiB..4 MiB",
                    bytes((k as usize) << 10)
                ),
            }
        ),
        _ if here.knows_swaps() => format!(
            "{}: the same for a rank that sends while it receives",
            swapped()
        ),
        _ => "the same for a rank that sends while it receives".to_string(),
    }
}

/// The memory-bandwidth model of a large allreduce on shared memory (the
/// ring), in seconds: each rank copies 2(n-1)/n of the data into the
/// rings and as much out of them (reducing as it goes, counted as a
/// copy), half that when the receiver reads the sender's memory itself
/// (single copy); the time is the longer of one core doing its rank's
/// copies and all cores together doing every rank's.
pub fn allreduce_bound_s(bytes: usize, ranks: usize, m: &Machine, single_copy: bool) -> f64 {
    if ranks < 2 || !m.knows_memory() {
        return 0.0;
    }
    let n = ranks as f64;
    let copies = if single_copy { 2.0 } else { 4.0 };
    let per_rank = copies * (n - 1.0) / n * bytes as f64;
    let one = per_rank / (f64::from(m.copy_one_mbs) * 1e6);
    let all = n * per_rank / (f64::from(m.copy_all_mbs) * 1e6);
    one.max(all)
}

fn bytes(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::machine::UNKNOWN;

    fn inputs(m: Machine, host_ranks: usize, cores: usize) -> Inputs {
        Inputs {
            agreed: m,
            here: m,
            host_ranks,
            host_job_ranks: 0,
            machine_ranks: host_ranks,
            cores,
            machine_cores: cores,
            core_cache_kib: 0,
        }
    }

    #[test]
    fn the_reference_machine_and_an_unknown_one_keep_the_reference_crossovers() {
        assert_eq!(crossovers(&REFERENCE), REFERENCE_CROSSOVERS);
        assert_eq!(crossovers(&UNKNOWN), REFERENCE_CROSSOVERS);
        // What was not measured (loopback TCP in a namespace without it)
        // counts as the reference's.
        let no_tcp = Machine {
            tcp_latency_ns: 0,
            tcp_mbs: 0,
            copy_one_mbs: 4 * REFERENCE.copy_one_mbs,
            ..REFERENCE
        };
        let c = crossovers(&no_tcp);
        assert_eq!(
            c.small_allreduce_tcp,
            REFERENCE_CROSSOVERS.small_allreduce_tcp
        );
        assert_eq!(
            c.small_allreduce_shm,
            4 * REFERENCE_CROSSOVERS.small_allreduce_shm
        );
        // Measurement noise within a factor of 1.6 changes nothing.
        let noisy = Machine {
            copy_one_mbs: 19_500,
            tcp_latency_ns: 2_900,
            ..REFERENCE
        };
        assert_eq!(crossovers(&noisy), REFERENCE_CROSSOVERS);
        let noisy = Machine {
            copy_one_mbs: 8_000,
            tcp_latency_ns: 1_250,
            ..REFERENCE
        };
        assert_eq!(crossovers(&noisy), REFERENCE_CROSSOVERS);
    }

    #[test]
    fn crossovers_follow_the_latency_bandwidth_product_within_bounds() {
        // A network four times faster at the same latency: the latency-
        // bound algorithms keep larger messages.
        let fast_tcp = Machine {
            tcp_mbs: 4 * REFERENCE.tcp_mbs,
            ..REFERENCE
        };
        let c = crossovers(&fast_tcp);
        assert_eq!(c.small_allreduce_tcp, 256 << 10);
        assert_eq!(c.chain_tcp, 16 << 20);
        assert_eq!(c.small_allreduce_shm, 16 << 10, "shared memory unchanged");
        // A wildly slow measurement moves a choice at most 4x.
        let slow = Machine {
            copy_one_mbs: 1,
            tcp_mbs: 1,
            ..REFERENCE
        };
        let c = crossovers(&slow);
        assert_eq!(c.small_allreduce_shm, 4 << 10);
        assert_eq!(c.halving_doubling_tcp, 64 << 10);
    }

    #[test]
    fn the_allreduce_bound_is_the_slower_of_one_core_and_all_cores() {
        let m = Machine {
            copy_one_mbs: 8000,
            copy_all_mbs: 16000,
            ..REFERENCE
        };
        // 2 ranks, 64 MB through the rings: 128 MB a rank at 8 GB/s is
        // 16 ms; 256 MB at 16 GB/s is 16 ms too.
        let t = allreduce_bound_s(64_000_000, 2, &m, false);
        assert!((t - 0.016).abs() < 1e-9, "{t}");
        // 4 ranks single copy: 96 MB a rank (12 ms), 384 MB together
        // (24 ms): the memory system bounds it.
        let t = allreduce_bound_s(64_000_000, 4, &m, true);
        assert!((t - 0.024).abs() < 1e-9, "{t}");
        assert_eq!(allreduce_bound_s(64, 1, &m, false), 0.0);
    }

    #[test]
    fn single_copy_when_ranks_outnumber_cores_or_memory_is_the_bound() {
        let p = plan(&inputs(REFERENCE, 4, 2));
        assert!(p.oversubscribed);
        assert_eq!(p.single_copy_min, 64 << 20, "twice the cache");
        let small_cache = Machine {
            cache_kib: 1024,
            ..REFERENCE
        };
        assert_eq!(
            plan(&inputs(small_cache, 4, 2)).single_copy_min,
            SINGLE_COPY_MIN
        );
        assert!(p.why.contains("oversubscribed"), "{}", p.why);
        let p = plan(&inputs(REFERENCE, 2, 2));
        assert!(!p.oversubscribed);
        assert_eq!(p.single_copy_min, usize::MAX);
        // 16 ranks of a host whose cores copy 6 GB/s each and 40 GB/s
        // together ask 96 GB/s: memory-bound.
        let big = Machine {
            cores: 16,
            copy_one_mbs: 6000,
            copy_all_mbs: 40_000,
            ..REFERENCE
        };
        let p = plan(&inputs(big, 16, 16));
        assert!(!p.oversubscribed);
        assert_eq!(p.single_copy_min, 64 << 20);
        assert!(p.why.contains("memory-bound"), "{}", p.why);
        // 4 of them ask 24 GB/s: not.
        assert_eq!(plan(&inputs(big, 4, 16)).single_copy_min, usize::MAX);
        // Another machine's ranks on it count too.
        let mut shared = inputs(REFERENCE, 2, 2);
        shared.machine_ranks = 4;
        assert!(plan(&shared).oversubscribed);
        // So do the job's other ranks on this host, in other communicators.
        let mut split = inputs(REFERENCE, 2, 2);
        split.host_job_ranks = 4;
        let p = plan(&split);
        assert!(p.oversubscribed);
        assert!(p.why.contains("4 ranks here on 2 cores"), "{}", p.why);
    }

    #[test]
    fn a_rank_that_sends_while_it_receives_on_shared_cores_goes_single_copy_from_1_mib() {
        // A machine whose single copy (7.9 GB/s) outpaces a core's own
        // copy (5.8), as the Intel VM's did, and whose swaps keep the
        // rings with a core each (slower at 16 MiB). 4 ranks on 2 cores:
        // one way, from twice the cache as before; both ways at once,
        // from 1 MiB.
        let outpacing = Machine {
            copy_one_mbs: 5_800,
            pass_mbs: 9_200,
            cma_mbs: 7_900,
            cma_call_ns: 785,
            swap_1m_permille: 829,
            swap_4m_permille: 708,
            swap_16m_permille: 1_019,
            ..REFERENCE
        };
        let p = plan(&inputs(outpacing, 4, 2));
        assert_eq!(p.single_copy_min, 64 << 20);
        assert_eq!(p.two_way_single_copy_min, TWO_WAY_SINGLE_COPY_FLOOR);
        // A point-to-point message one way, too; a collective's one-way
        // payload keeps the rings up to twice the cache.
        assert_eq!(p.tagged_single_copy_min, 1 << 20);
        assert!(
            p.why
                .contains("a point-to-point message from 1 MiB goes single copy one way too"),
            "{}",
            p.why
        );
        // Below it, a buffer's copies are weighed against the rings' full
        // pass, as with a core each.
        assert_eq!(p.read_cost.map(|c| c.pass_mbs), Some(9_200));
        assert!(
            p.why
                .contains("outpaces a core's own (5.8 GB/s), a rank that sends while it receives"),
            "{}",
            p.why
        );
        assert_eq!(
            plan(&inputs(outpacing, 3, 2)).two_way_single_copy_min,
            1 << 20
        );
        // Shared through other ranks of the machine, or of the job.
        let mut shared = inputs(outpacing, 2, 2);
        shared.machine_ranks = 4;
        assert_eq!(plan(&shared).two_way_single_copy_min, 1 << 20);
        let mut split = inputs(outpacing, 2, 2);
        split.host_job_ranks = 4;
        assert_eq!(plan(&split).two_way_single_copy_min, 1 << 20);
        // A core each: the swaps decide, as before (none here), and the
        // clause is not said.
        let p = plan(&inputs(outpacing, 2, 2));
        assert_eq!(p.two_way_single_copy_min, usize::MAX);
        assert_eq!(p.tagged_single_copy_min, usize::MAX);
        assert_eq!(p.read_cost.map(|c| c.pass_mbs), Some(9_200));
        assert!(!p.why.contains("with the cores shared"), "{}", p.why);
        assert!(!p.why.contains("one way too"), "{}", p.why);
        // Memory-bound with a core each (16 ranks asking 93 GB/s of 14.5):
        // one way's rule only.
        let p = plan(&inputs(
            Machine {
                cores: 16,
                ..outpacing
            },
            16,
            16,
        ));
        assert!(
            !p.oversubscribed && p.why.contains("memory-bound"),
            "{}",
            p.why
        );
        assert_eq!(p.two_way_single_copy_min, 64 << 20);
        // Swaps that chose 4 MiB: lowered to 1 MiB, both said.
        let from_4m = Machine {
            swap_1m_permille: 1_000,
            swap_4m_permille: 800,
            swap_16m_permille: 800,
            ..outpacing
        };
        assert_eq!(
            plan(&inputs(from_4m, 2, 2)).two_way_single_copy_min,
            4 << 20
        );
        let p = plan(&inputs(from_4m, 4, 2));
        assert_eq!(p.two_way_single_copy_min, 1 << 20);
        assert!(
            p.why
                .contains("from 4 MiB that are not reduced single copy")
                && p.why
                    .contains("from 1 MiB that are not reduced single copy"),
            "{}",
            p.why
        );
        // Single copy must outpace a core's own copy by a tenth.
        let at = |cma_mbs| {
            plan(&inputs(
                Machine {
                    cma_mbs,
                    ..outpacing
                },
                4,
                2,
            ))
        };
        assert_eq!(at(6_381).two_way_single_copy_min, 1 << 20);
        assert_eq!(at(6_370).two_way_single_copy_min, 64 << 20);
        assert_eq!(at(6_381).tagged_single_copy_min, 1 << 20);
        assert_eq!(at(6_370).tagged_single_copy_min, 64 << 20);
        // Slower than a core's own copy (the Sapphire Rapids VM, 9 GB/s
        // against 12.5): as before, from one way's rates (4 MiB); rates not
        // measured, or the memory not: one way's size.
        assert_eq!(
            plan(&inputs(SAPPHIRE_RAPIDS_VM, 4, 2)).two_way_single_copy_min,
            SINGLE_COPY_MIN
        );
        assert_eq!(
            plan(&inputs(SAPPHIRE_RAPIDS_VM, 4, 2)).tagged_single_copy_min,
            plan(&inputs(SAPPHIRE_RAPIDS_VM, 4, 2)).single_copy_min
        );
        assert_eq!(
            plan(&inputs(REFERENCE, 4, 2)).two_way_single_copy_min,
            64 << 20
        );
        let no_memory = Machine {
            copy_all_mbs: 0,
            ..outpacing
        };
        let p = plan(&inputs(no_memory, 4, 2));
        assert_eq!(p.two_way_single_copy_min, p.single_copy_min);
        assert_eq!(p.tagged_single_copy_min, p.single_copy_min);
        assert!(!p.why.contains("with the cores shared"), "{}", p.why);
        // A lower size from one way's rates stays (single copy 2x the
        // rings: from 64 KiB for every payload).
        let fast = Machine {
            cma_mbs: 24_000,
            ..SAPPHIRE_RAPIDS_VM
        };
        let p = plan(&inputs(fast, 4, 2));
        assert_eq!(
            (p.single_copy_min, p.two_way_single_copy_min),
            (64 << 10, 64 << 10)
        );
    }

    #[test]
    fn ranks_per_core_rounds_up_and_counts_every_sharer() {
        assert_eq!(plan(&inputs(REFERENCE, 2, 2)).ranks_per_core, 1);
        assert_eq!(plan(&inputs(REFERENCE, 1, 2)).ranks_per_core, 1);
        assert_eq!(plan(&inputs(REFERENCE, 3, 2)).ranks_per_core, 2);
        let p = plan(&inputs(REFERENCE, 1024, 2));
        assert_eq!(p.ranks_per_core, 512);
        assert!(p.why.contains("looks up to 512x less often"), "{}", p.why);
        let mut split = inputs(REFERENCE, 2, 2);
        split.host_job_ranks = 8;
        assert_eq!(plan(&split).ranks_per_core, 4);
        let mut shared = inputs(REFERENCE, 2, 2);
        shared.machine_ranks = 6;
        assert_eq!(plan(&shared).ranks_per_core, 3);
    }

    /// As measured on the 2-core Sapphire Rapids VM.
    const SAPPHIRE_RAPIDS_VM: Machine = Machine {
        pass_mbs: 12_000,
        cma_mbs: 9_000,
        cma_call_ns: 300,
        ..REFERENCE
    };

    #[test]
    fn single_copy_where_one_core_copies_out_faster_than_two_pass_through_the_rings() {
        // The rings pass data just made faster than single copy copies it
        // out: no change.
        let spr = SAPPHIRE_RAPIDS_VM;
        let p = plan(&inputs(spr, 2, 2));
        assert_eq!(p.single_copy_min, usize::MAX);
        assert!(p.why.contains("the rings, unless"), "{}", p.why);
        // Within the factor: noise, no change either.
        let close = Machine {
            cma_mbs: 14_000,
            ..spr
        };
        assert_eq!(plan(&inputs(close, 2, 2)).single_copy_min, usize::MAX);
        // Twice as fast per byte: 1/12 - 1/24 GB/s saves 41.7 ps a byte,
        // the call and two steps (300 + 2 x 760 ns) are made up by 43.7 KB:
        // from 64 KiB.
        let fast = Machine {
            cma_mbs: 24_000,
            ..spr
        };
        let p = plan(&inputs(fast, 2, 2));
        assert_eq!(p.single_copy_min, 64 << 10);
        assert!(p.why.contains("single copy pays from 64 KiB"), "{}", p.why);
        // Oversubscribed too: the lower of the two sizes.
        assert_eq!(plan(&inputs(fast, 4, 2)).single_copy_min, 64 << 10);
        // Not measured (one core, or an old profile): as before.
        assert_eq!(plan(&inputs(REFERENCE, 2, 2)).single_copy_min, usize::MAX);
        assert!(!plan(&inputs(REFERENCE, 2, 2)).why.contains("pass"));
    }

    #[test]
    fn a_rank_that_sends_while_it_receives_goes_single_copy_where_the_swaps_show_it_faster() {
        let swaps = |one, four, sixteen| Machine {
            swap_1m_permille: one,
            swap_4m_permille: four,
            swap_16m_permille: sixteen,
            ..SAPPHIRE_RAPIDS_VM
        };
        // The AMD VM (1 MiB of cache a core, 32 MiB shared by its two):
        // single copy slower at every size, whatever one way's rates and
        // the cache infer.
        let amd = Inputs {
            core_cache_kib: 1024,
            ..inputs(swaps(1967, 1469, 1111), 2, 2)
        };
        let p = plan(&amd);
        assert_eq!(p.two_way_single_copy_min, usize::MAX);
        assert!(
            p.why.contains(
                "single copy against the rings, 1 MiB 1.97x, 4 MiB 1.47x, 16 MiB 1.11x: \
                 the same for a rank that sends while it receives"
            ),
            "{}",
            p.why
        );
        // Faster from 4 MiB on: from 4 MiB; at every size: from 1 MiB.
        let p = plan(&inputs(swaps(1200, 800, 700), 2, 2));
        assert_eq!(p.two_way_single_copy_min, 4 << 20);
        assert!(
            p.why
                .contains("sends its payloads from 4 MiB that are not reduced single copy"),
            "{}",
            p.why
        );
        let from = |one, four, sixteen| {
            plan(&inputs(swaps(one, four, sixteen), 2, 2)).two_way_single_copy_min
        };
        for (swapped, want, why) in [
            ((800, 700, 600), 1 << 20, "faster at every size"),
            (
                (800, 700, 1200),
                usize::MAX,
                "slower at the largest, where it would run",
            ),
            ((950, 950, 950), usize::MAX, "within the factor everywhere"),
            (
                (829, 708, 919),
                1 << 20,
                "a clear win no larger size loses, if barely",
            ),
            ((1050, 800, 990), 4 << 20, "from the clear win"),
            ((909, 1000, 1000), 1 << 20, "a tie above does not stop it"),
            ((910, 1000, 1000), usize::MAX, "a clear win is 1.1x"),
            (
                (800, 700, 1010),
                usize::MAX,
                "slower at all above: the win below does not count",
            ),
            ((800, 1010, 700), 16 << 20, "from above the loss"),
        ] {
            let (one, four, sixteen) = swapped;
            assert_eq!(from(one, four, sixteen), want, "{swapped:?}: {why}");
        }
        // Never later than single copy one way.
        let fast = Machine {
            cma_mbs: 24_000,
            ..swaps(1200, 800, 700)
        };
        assert_eq!(plan(&inputs(fast, 2, 2)).two_way_single_copy_min, 64 << 10);
    }

    #[test]
    fn single_copy_for_a_rank_that_sends_while_it_receives_where_one_copy_beats_two() {
        // One way, the rings; both ways at once, each core copies twice
        // through them (12 GB/s a pass, 6 each way) and once with single
        // copy (9 GB/s): from 4 MiB where no core's own cache is known.
        let spr = SAPPHIRE_RAPIDS_VM;
        let p = plan(&inputs(spr, 2, 2));
        assert_eq!(p.single_copy_min, usize::MAX);
        assert_eq!(p.two_way_single_copy_min, SINGLE_COPY_MIN);
        assert!(p.why.contains("1.50x as fast then"), "{}", p.why);
        // Single copy barely faster than half a pass: the rings.
        let slow = Machine {
            cma_mbs: 7_000,
            ..spr
        };
        let p = plan(&inputs(slow, 2, 2));
        assert_eq!(p.two_way_single_copy_min, usize::MAX);
        assert!(
            p.why.contains("the same for a rank that sends"),
            "{}",
            p.why
        );
        // Never later than single copy one way.
        let fast = Machine {
            cma_mbs: 24_000,
            ..spr
        };
        assert_eq!(plan(&inputs(fast, 2, 2)).two_way_single_copy_min, 64 << 10);
        // Not measured: as before.
        assert_eq!(
            plan(&inputs(REFERENCE, 2, 2)).two_way_single_copy_min,
            usize::MAX
        );
        // From half a core's own cache, within 1 MiB..4 MiB.
        for (kib, from) in [
            (2048, 1 << 20),
            (4096, 2 << 20),
            (512, 1 << 20),
            (32 << 10, SINGLE_COPY_MIN),
        ] {
            let p = plan(&Inputs {
                core_cache_kib: kib,
                ..inputs(spr, 2, 2)
            });
            assert_eq!(p.two_way_single_copy_min, from, "{kib} KiB");
        }
        let p = plan(&Inputs {
            core_cache_kib: 2048,
            ..inputs(spr, 2, 2)
        });
        assert!(
            p.why
                .contains("from 1 MiB (half a core's own 2 MiB cache, within 1 MiB..4 MiB)"),
            "{}",
            p.why
        );
    }
}
