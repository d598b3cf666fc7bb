//! Membership: who the ranks of a communicator are, where they listen and
//! which share a host, built in one place from records the ranks
//! exchange, whatever carried them: the store at init (`packed`, used by
//! rendezvous), the parent communicator at a split (`split`, used by the
//! backend); a communicator of survivors is a `Roster::subset` too.

pub mod hosts;
pub mod packed;
pub mod roster;
pub mod split;

pub(crate) use hosts::{host_id, HostId, Placement};
pub(crate) use roster::Roster;
