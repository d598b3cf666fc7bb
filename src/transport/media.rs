//! The table of media, and the one place a medium is registered (`open`),
//! as NCCL's table of transports. Every pair first meets over TCP (the
//! hello, the token's proof); then both sides go down the table, in the
//! same order, through the media that apply to the pair (decided from
//! what both know alike: whether they share a host), each running its
//! agreement over that connection, until one gives both sides a channel.
//! TCP, last, always does.
//!
//! A new medium (RDMA, a second TCP stream per pair) is a folder beside
//! `tcp/` and `shm/` holding a `Medium` and a `Channel`, and one line in
//! `open`: nothing above the transport changes, and the algorithms see it
//! only through `Caps`.

use super::channel::{Caps, Channel};
use super::medium::{Layout, Medium, Pair, Wanted};
use super::shm;
use super::tcp;
use std::io;
use std::net::TcpStream;

/// The media a pair tries, in order: where a medium is registered.
pub fn open(layout: Layout, wanted: Wanted) -> Vec<Box<dyn Medium>> {
    vec![
        Box::new(shm::SharedMemory::open(layout, wanted)),
        Box::new(tcp::Tcp),
    ]
}

/// The abilities a pair of this kind gets when every medium that applies
/// works on both sides: what every rank assumes alike (the algorithms
/// choose by it), whatever one rank's own channels turned out to be.
pub fn nominal(media: &[Box<dyn Medium>], near: bool) -> Caps {
    let pair = Pair { peer: 0, near };
    media
        .iter()
        .find(|m| m.applies(&pair) && m.wanted())
        .map_or(Caps::default(), |m| m.caps())
}

/// Runs the agreement on the dialing (`dialing`) or answering side:
/// the channel of the first medium both sides take.
pub fn agree(
    media: &[Box<dyn Medium>],
    pair: &Pair,
    mut stream: TcpStream,
    dialing: bool,
) -> io::Result<Box<dyn Channel>> {
    let mut tried = Vec::new();
    for m in media.iter().filter(|m| m.applies(pair)) {
        tried.push(m.name());
        let got = match dialing {
            true => m.offer(pair, stream)?,
            false => m.answer(pair, stream)?,
        };
        match got {
            Ok(chan) => return Ok(chan),
            Err(back) => stream = back,
        }
    }
    Err(io::Error::other(format!(
        "no medium took the pair (tried {})",
        tried.join(", ")
    )))
}
