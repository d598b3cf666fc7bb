//! A byte stream between two ranks, non-blocking in both directions, as a
//! medium makes it (a TCP connection, tcp/; a pair of shared-memory rings,
//! shm/). The stream core frames messages on top and asks the channel
//! what it can do (`Caps`), never which medium it is.

use std::io;
use std::net::Shutdown;
use std::os::fd::RawFd;

/// What a channel can do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Writes are copied into the kernel's socket buffers: poll() wakes
    /// when data comes, and large payloads get padding that places them
    /// well there (`frame::pad_for`).
    pub through_kernel: bool,
    /// Keeps message boundaries: a small message is written, and lent to
    /// the reader, whole (`write_whole`, `peek_whole`).
    pub whole_messages: bool,
    /// Incoming bytes can be combined straight into the destination, in
    /// place, without a copy (`read_combine`).
    pub lends: bool,
    /// The receiver can copy a payload straight out of the sender's
    /// memory (`peer_pid` says whose): single copy.
    pub single_copy: bool,
}

pub trait Channel: Send {
    /// What this channel can do: fixed for its life (a connection reads
    /// it once, `stream::Conn`).
    fn caps(&self) -> Caps;
    /// Reads what is available; `WouldBlock` when nothing is, `Ok(0)` at
    /// end of stream (the peer closed or died).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes as much of `a` then `b` as fits; `WouldBlock` when nothing does.
    fn write2(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize>;
    /// The socket whose readiness poll() watches (for shared memory: the
    /// TCP connection kept to notice the peer's death).
    fn fd(&self) -> RawFd;
    /// True when data (or end of stream) is waiting, checked without
    /// blocking (cheaply for shared memory, with poll() for TCP).
    fn has_data(&self) -> bool;
    /// Bytes already read from `fd()` wait in the channel: poll() on it
    /// would not wake for them, so nobody may sleep on it for reading
    /// (a read takes them first).
    fn buffered(&self) -> bool {
        false
    }
    fn shutdown(&self, how: Shutdown);
    /// Has the next read look whether the peer is gone, for a caller
    /// about to sleep (channels that look only now and then while
    /// spinning).
    fn look_for_departure(&mut self) {}
    /// A large payload is arriving: acknowledge what comes promptly (TCP:
    /// the sender's buffer frees only as it is acknowledged).
    fn expect_bulk(&mut self) {}
    /// The peer's pid when its memory can be read directly
    /// (process_vm_readv), for single-copy transfers of large payloads;
    /// fixed for the channel's life, as `caps`.
    fn peer_pid(&self) -> Option<i32> {
        None
    }
    /// Writes `a` then `b` as one message if all of it fits now (channels
    /// that keep message boundaries: shared memory); false, with nothing
    /// written, when it does not or the channel cannot.
    fn write_whole(&mut self, _a: &[u8], _b: &[u8]) -> bool {
        false
    }
    /// The next whole message, lent without a copy, when one has arrived
    /// and none of it was read yet (shared memory only). Release it with
    /// `consume_whole(its length)`.
    fn peek_whole(&self) -> Option<&[u8]> {
        None
    }
    fn consume_whole(&mut self, _len: usize) {}
    /// Combines incoming bytes straight into `dst` (`combine(part of dst,
    /// incoming)`), in whole multiples of `unit` bytes, where the channel
    /// can lend them without a copy; returns how many bytes it combined
    /// (0: none available that way, so read() them instead).
    fn read_combine(
        &mut self,
        _dst: &mut [u8],
        _unit: usize,
        _combine: &mut dyn FnMut(&mut [u8], &[u8]),
    ) -> usize {
        0
    }
}

/// Copies `dest.len()` bytes at `addr` in process `pid` into `dest`.
pub fn read_remote(pid: i32, addr: u64, dest: &mut [u8]) -> io::Result<()> {
    // Pieces of 1 MiB: measured here, process_vm_readv of 16 MiB at once
    // runs at a third of the speed of the same bytes in 1-2 MiB pieces.
    const PIECE: usize = 1 << 20;
    let mut done = 0;
    while done < dest.len() {
        let len = (dest.len() - done).min(PIECE);
        let local = libc::iovec {
            iov_base: dest[done..].as_mut_ptr().cast(),
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: `local` covers our live buffer; the kernel checks the
        // remote range and fails with EFAULT rather than touching memory.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n <= 0 {
            return Err(if n == 0 {
                io::ErrorKind::UnexpectedEof.into()
            } else {
                io::Error::last_os_error()
            });
        }
        done += n as usize;
    }
    Ok(())
}

/// `read_remote` of `dest`, then the 8-byte word at `word` in the same
/// process, in the system call that reads the last piece: the kernel
/// reads a call's remote pieces in their order, so the word is read after
/// every byte of `dest` (one system call fewer than reading it alone).
/// The word, or None where it could not be read (the bytes were).
pub fn read_remote_then_word(
    pid: i32,
    addr: u64,
    dest: &mut [u8],
    word: u64,
) -> io::Result<Option<u64>> {
    const PIECE: usize = 1 << 20;
    let last = dest.len().saturating_sub(1) / PIECE * PIECE;
    read_remote(pid, addr, &mut dest[..last])?;
    let mut w = [0u8; 8];
    let mut done = last;
    while done < dest.len() {
        let len = dest.len() - done;
        let local = [
            libc::iovec {
                iov_base: dest[done..].as_mut_ptr().cast(),
                iov_len: len,
            },
            libc::iovec {
                iov_base: w.as_mut_ptr().cast(),
                iov_len: 8,
            },
        ];
        let remote = [
            libc::iovec {
                iov_base: (addr as usize + done) as *mut libc::c_void,
                iov_len: len,
            },
            libc::iovec {
                iov_base: word as usize as *mut libc::c_void,
                iov_len: 8,
            },
        ];
        // SAFETY: as in `read_remote`; both local pieces are live.
        let n = unsafe { libc::process_vm_readv(pid, local.as_ptr(), 2, remote.as_ptr(), 2, 0) };
        if n <= 0 {
            return Err(if n == 0 {
                io::ErrorKind::UnexpectedEof.into()
            } else {
                io::Error::last_os_error()
            });
        }
        let n = n as usize;
        if n == len + 8 {
            return Ok(Some(u64::from_le_bytes(w)));
        }
        done += n.min(len);
    }
    // The bytes came, the word not with them: read alone, after them.
    Ok(read_remote(pid, word, &mut w)
        .ok()
        .map(|_| u64::from_le_bytes(w)))
}

/// One writev of `a` then `b` (either may be empty).
pub fn writev(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    let (iov, cnt) = if a.is_empty() {
        (&iov[1..], 1)
    } else {
        (&iov[..], 2)
    };
    // SAFETY: the iovecs point into live slices for the duration of the
    // call. SIGPIPE is ignored (see stream::ignore_sigpipe), so a broken
    // connection is an EPIPE error, not a signal.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), cnt) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_read_brings_the_bytes_and_then_the_word_or_says_it_could_not() {
        let pid = std::process::id() as i32;
        let word = 0x0123_4567_89ab_cdefu64;
        // Under one piece, whole pieces, and pieces and a rest.
        for n in [0usize, 5, 1 << 20, 2 << 20, (3 << 20) + 5] {
            let src: Vec<u8> = (0..n).map(|i| (i * 7 + 1) as u8).collect();
            let mut dst = vec![0u8; n];
            let w = &word as *const u64 as u64;
            let got = read_remote_then_word(pid, src.as_ptr() as u64, &mut dst, w).unwrap();
            assert_eq!(got, Some(word), "{n} B");
            assert!(dst == src, "{n} B arrived wrong");
            // A word that cannot be read: the bytes still come.
            dst.fill(0);
            let got = read_remote_then_word(pid, src.as_ptr() as u64, &mut dst, 8).unwrap();
            assert_eq!(got, None, "{n} B");
            assert!(dst == src, "{n} B arrived wrong without its word");
        }
    }
}
