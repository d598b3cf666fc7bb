//! The NCCL backend: finding and loading NCCL (`loader`), deciding whether
//! it can run here (`probe`, `readiness`), the communicator for device
//! buffers (`communicator`) and its watchdog (`watchdog`). Host buffers
//! always run on the socket backend, which every communicator also has.

pub mod communicator;
pub mod loader;
pub mod probe;

pub use loader::{NcclLibrary, NcclVersion, Search};
pub use probe::{availability, NcclInfo};

use crate::call::{Call, Data, RawBuf};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::log;
use crate::options::{Backend, LogLevel, Options};
use communicator::NcclComm;

/// Whether NCCL could run in this process at all: the options allow it,
/// the library loads with what rdist needs, and a CUDA device is visible
/// (which device is this rank's is decided after the rendezvous). Each
/// rank publishes it when it joins, so that a job where no rank can
/// (every CPU job) skips the agreement at init, a collective over every
/// rank that cost 1024 ranks on one host as much as the rendezvous.
pub(crate) fn may_run(options: &Options) -> bool {
    options.backend != Backend::Socket
        && availability().is_ok_and(|i| i.devices > 0)
        && loader::load().is_ok_and(|lib| {
            !lib.missing()
                .iter()
                .any(|m| communicator::REQUIRED.contains(m))
        })
}

/// What this rank can offer for an NCCL communicator: NCCL's library and
/// the device to drive, or why not (for people).
pub(crate) fn readiness(
    options: &Options,
    local_rank: usize,
) -> std::result::Result<(&'static NcclLibrary, i32), String> {
    let device = options.device;
    if options.backend == Backend::Socket {
        return Err("backend=socket was requested".to_string());
    }
    let info = availability()?;
    let lib = loader::load()?;
    let missing: Vec<&str> = lib
        .missing()
        .into_iter()
        .filter(|m| communicator::REQUIRED.contains(m))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "NCCL {} at {} lacks {} (rdist needs NCCL 2.14 or newer)",
            lib.version,
            lib.path.display(),
            missing.join(", ")
        ));
    }
    let ordinal = match device {
        Some(d) => d,
        None => local_rank as i32,
    };
    if ordinal as usize >= info.devices {
        return Err(match device {
            Some(d) => format!(
                "device {d} does not exist (this node has {} CUDA device{})",
                info.devices,
                if info.devices == 1 { "" } else { "s" }
            ),
            None => format!(
                "local rank {local_rank} has no GPU of its own (this node has {} CUDA device{}; NCCL needs one per rank)",
                info.devices,
                if info.devices == 1 { "" } else { "s" }
            ),
        });
    }
    blocking_override(options.tuning.nccl_comm_blocking.as_deref())?;
    Ok((lib, ordinal))
}

/// NCCL lets `NCCL_COMM_BLOCKING` override a communicator's config. rdist
/// runs NCCL non-blocking so that its timeout can end a stuck call (even
/// `ncclCommInitRankConfig` waiting for a rank that never comes); with
/// blocking forced, that call would hang past every timeout.
fn blocking_override(set: Option<&str>) -> std::result::Result<(), String> {
    match set {
        Some(v) if !v.trim().is_empty() && v.trim() != "0" => Err(format!(
            "NCCL_COMM_BLOCKING={v} is set, which makes NCCL calls block past rdist's timeout (rdist runs NCCL non-blocking so that a stuck call can be ended); unset it"
        )),
        _ => Ok(()),
    }
}

/// Decides, with every rank, whether the communicator gets NCCL, and
/// creates it: each rank says whether it can run NCCL (an allgather over
/// the sockets), rank 0 makes the unique id and broadcasts it, and every
/// rank initialises NCCL on its device. `auto` falls back to sockets (one
/// INFO line saying why) unless every rank can; `nccl` fails on every
/// rank with Unavailable and the reason. `exchange` runs a host call on
/// the sockets. `nobody_can`: every rank published at the rendezvous that
/// NCCL cannot run in its process (`may_run`), so every rank knows the
/// answer without asking.
pub(crate) fn establish(
    exchange: &mut dyn FnMut(&Call) -> Result<()>,
    options: &Options,
    rank: usize,
    size: usize,
    local_rank: usize,
    nobody_can: bool,
) -> Result<Option<NcclComm>> {
    let requested = options.backend;
    // A rank asked for sockets still answers when others ask: ranks with
    // `auto` and a GPU would otherwise wait for it until the timeout.
    if requested == Backend::Socket && nobody_can {
        return Ok(None);
    }
    let ready = readiness(options, local_rank);
    let mine = [ready.is_ok() as u8];
    // Nobody can: no rank is asked, nor listed (each rank of a wide job
    // wrote out every rank's number, for a message nobody reads).
    let mut all = vec![0u8; if nobody_can { 0 } else { size }];
    if !nobody_can {
        let byte = Data {
            count: 1,
            dtype: DType::Uint8,
        };
        exchange(&Call::AllGather {
            send: RawBuf::of(&mine),
            recv: RawBuf::new(all.as_mut_ptr(), size),
            data: byte,
        })?;
    }
    if requested == Backend::Socket {
        return Ok(None);
    }
    let lacking: Vec<String> = match nobody_can {
        true => vec![String::from("every rank")],
        false => (0..size)
            .filter(|&r| all[r] == 0)
            .map(|r| r.to_string())
            .collect(),
    };
    if !lacking.is_empty() {
        let whose = match (&ready, lacking.len()) {
            (Err(why), _) => why.clone(),
            (Ok(_), _) if nobody_can => {
                "no rank published that it can run it (their logs say why)".to_string()
            }
            (Ok(_), 1) => format!("rank {} cannot run it (its log says why)", lacking[0]),
            (Ok(_), _) => format!(
                "ranks {} cannot run it (their logs say why)",
                lacking.join(", ")
            ),
        };
        return match requested {
            Backend::Nccl => Err(Error::new(
                ErrorKind::Unavailable,
                format!("backend 'nccl' is unavailable: {whose} (use backend=auto or socket to run on sockets)"),
            )),
            _ => {
                log::emit(
                    LogLevel::Info,
                    Some(rank),
                    &format!("NCCL unavailable: {whose}; using sockets"),
                );
                Ok(None)
            }
        };
    }
    let (lib, ordinal) = ready.map_err(Error::internal)?;
    let mut id = [0u8; 128];
    if rank == 0 {
        let made = lib
            .unique_id()
            .map_err(|e| Error::new(ErrorKind::Backend, e))?;
        for (d, s) in id.iter_mut().zip(made.internal.iter()) {
            *d = *s as u8;
        }
    }
    exchange(&Call::Broadcast {
        send: RawBuf::new(id.as_mut_ptr(), id.len()),
        recv: RawBuf::new(id.as_mut_ptr(), id.len()),
        data: Data {
            count: id.len(),
            dtype: DType::Uint8,
        },
        root: 0,
    })?;
    let comm = NcclComm::init(lib, &id, rank, size, ordinal, options.timeout).map_err(|e| {
        e.context(format!(
            "rank {rank}: creating the NCCL communicator on device {ordinal}"
        ))
    })?;
    log::emit(
        LogLevel::Info,
        Some(rank),
        &format!(
            "NCCL {} from {} on device {ordinal}: device buffers run on NCCL, host buffers on sockets",
            lib.version,
            lib.path.display()
        ),
    );
    Ok(Some(comm))
}
