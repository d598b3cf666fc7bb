//! Where a call's buffers live decides where it runs: host buffers on the
//! socket backend; device buffers on NCCL when the communicator has it;
//! device buffers anywhere else through host copies (`staging`), so a
//! program never needs to know which backend it got.

use super::cuda::{Cuda, Memory, Stream};
use super::staging::Staging;
use crate::call::{Call, RawBuf};
use crate::error::Result;

/// How a batch of calls runs.
pub(crate) enum Route {
    /// Every buffer is host memory.
    Host,
    /// Every buffer is device memory of NCCL's device.
    Device,
    /// Device buffers that the socket backend reaches through host copies.
    Staged(Staging),
}

/// Classifies the buffers of `calls` (`streams[i]` is call i's stream).
/// `nccl` is the device and context of the communicator's NCCL, if any.
pub(crate) fn route(
    cuda: &Cuda,
    calls: &[Call],
    streams: &[Stream],
    nccl: Option<(i32, usize)>,
) -> Result<Route> {
    let mut device: Vec<(RawBuf, bool, usize, Stream)> = Vec::new();
    let mut host = 0usize;
    let mut places = Vec::new();
    // An in-place call names its buffer twice: the driver is asked once.
    let mut last: Option<(usize, Memory)> = None;
    for (call, &stream) in calls.iter().zip(streams) {
        for (buf, read) in call.buffers() {
            if buf.is_empty() {
                continue;
            }
            let memory = match last {
                Some((addr, m)) if addr == buf.addr() => m,
                _ => cuda.memory(buf.addr())?,
            };
            last = Some((buf.addr(), memory));
            match memory {
                Memory::Host => host += 1,
                Memory::Device { ordinal, context } => {
                    device.push((buf, read, context, stream));
                    if !places.contains(&(ordinal, context)) {
                        places.push((ordinal, context));
                    }
                }
            }
        }
    }
    if device.is_empty() {
        return Ok(Route::Host);
    }
    if host == 0 && places.len() == 1 && nccl == Some(places[0]) {
        return Ok(Route::Device);
    }
    Ok(Route::Staged(Staging::new(device)))
}
