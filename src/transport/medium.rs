//! What a medium is: how a pair of ranks that met over TCP agrees on a
//! channel of its kind, and what that channel can do. The media and the
//! order pairs try them are in `media` (the one place a medium is
//! registered).

use super::channel::{Caps, Channel};
use super::doorbell::Doorbell;
use crate::options::ShmTuning;
use std::io;
use std::net::TcpStream;

/// A pair as the media see it: the same on both sides.
#[derive(Clone, Copy, Debug)]
pub struct Pair {
    /// The rank on the other side.
    pub peer: usize,
    /// Both ranks are on one host (by the roster).
    pub near: bool,
}

/// How a communicator's ranks are laid out, for the media's setup.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub rank: usize,
    pub size: usize,
    /// Ranks on this rank's host, itself included.
    pub local_ranks: usize,
}

/// One medium, as one rank of one communicator holds it.
pub trait Medium: Send + Sync + std::panic::RefUnwindSafe {
    fn name(&self) -> &'static str;
    /// What its channels can do when a pair gets one.
    fn caps(&self) -> Caps;
    /// Whether a pair tries this medium (both sides decide alike).
    fn applies(&self, pair: &Pair) -> bool;
    /// Whether the options ask for it (every rank is given the same; a
    /// medium not wanted still runs its agreement, and declines).
    fn wanted(&self) -> bool {
        true
    }
    /// The dialing side's part of the agreement, over the pair's welcomed
    /// connection (blocking, bounded by the stream's timeouts): the
    /// channel when both sides take this medium, or the stream back to
    /// try the next one.
    #[allow(clippy::type_complexity)]
    fn offer(
        &self,
        pair: &Pair,
        stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>>;
    /// The answering side's part of `offer`.
    #[allow(clippy::type_complexity)]
    fn answer(
        &self,
        pair: &Pair,
        stream: TcpStream,
    ) -> io::Result<Result<Box<dyn Channel>, TcpStream>>;
    /// What this rank sleeps on while it waits on this medium's channels,
    /// when they wake no descriptor (memory does not).
    fn doorbell(&self) -> Option<Doorbell> {
        None
    }
}

/// What the media need to set up, besides the layout.
#[derive(Clone, Copy, Debug)]
pub struct Wanted {
    /// Shared memory with the ranks of this host (transport `auto`).
    pub shm: bool,
    pub tuning: ShmTuning,
}
