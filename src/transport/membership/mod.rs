//! Membership: who the ranks of a communicator are, where they listen and
//! which share a host, built in one place from records the ranks
//! exchange, whatever carried them: the store at init (`packed`, used by
//! rendezvous), the parent communicator at a split (`split`, used by the
//! backend), the survivors' ballots at a shrink (`survivors`, carried by
//! `transport::shrink`).

pub mod cpus;
pub mod hosts;
pub mod packed;
mod reader;
pub mod roster;
pub mod split;
pub mod survivors;

pub(crate) use hosts::{host_id, HostId, Placement};
pub(crate) use roster::Roster;
