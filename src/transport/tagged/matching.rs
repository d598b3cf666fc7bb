//! MPI's matching rule: a receive takes the oldest arrived message whose
//! source and tag it accepts; an arriving message goes to the oldest posted
//! receive that accepts it. Messages from one rank arrive in the order they
//! were sent, so messages with one tag never overtake each other.

use super::Done;
use crate::call::RawBuf;
use crate::dtype::DType;
use std::collections::VecDeque;
use std::sync::Arc;

/// Who sent a message and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub source: usize,
    pub tag: i32,
    /// The message's number on its connection.
    pub seq: u64,
    pub dtype: DType,
    pub count: u64,
}

/// A message that arrived: its payload (eager), where it lies in its
/// sender's memory (single copy, not copied yet), or only its envelope
/// (the payload waits for clear-to-send).
pub struct Arrival {
    pub env: Envelope,
    pub payload: Option<Vec<u8>>,
    pub remote: Option<Remote>,
}

/// A single-copy message left in its sender's memory, and since when.
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    pub pid: i32,
    pub addr: u64,
    /// Where the sender says which of its messages it withdrew.
    pub withdrawn: u64,
    pub since: std::time::Instant,
}

/// A receive waiting for its message.
pub struct PostedRecv {
    pub id: u64,
    /// None: any source.
    pub source: Option<usize>,
    /// None: any tag.
    pub tag: Option<i32>,
    pub buf: RawBuf,
    pub dtype: DType,
    /// Elements buf holds.
    pub capacity: usize,
    /// The message must fill buf exactly (rdist_recv) rather than fit.
    pub exact: bool,
    pub done: Arc<Done>,
}

impl PostedRecv {
    fn accepts(&self, env: &Envelope) -> bool {
        self.source.is_none_or(|s| s == env.source) && self.tag.is_none_or(|t| t == env.tag)
    }
}

#[derive(Default)]
pub struct Matching {
    pub posted: VecDeque<PostedRecv>,
    pub unexpected: VecDeque<Arrival>,
    /// Eager payload bytes held in `unexpected`.
    pub unexpected_bytes: usize,
    /// Messages in `unexpected` still in their sender's memory.
    pub remote_waiting: usize,
}

impl Matching {
    /// Matches an arriving message, or keeps it for a later receive.
    pub fn arrive(&mut self, a: Arrival) -> Option<(PostedRecv, Arrival)> {
        match self.posted.iter().position(|r| r.accepts(&a.env)) {
            Some(i) => Some((self.posted.remove(i).expect("found"), a)),
            None => {
                self.unexpected_bytes += a.payload.as_ref().map_or(0, Vec::len);
                self.remote_waiting += usize::from(a.remote.is_some());
                self.unexpected.push_back(a);
                None
            }
        }
    }

    /// The oldest posted receive that accepts a message with `env`, taken
    /// (its payload can then go straight into the receive's buffer).
    pub fn claim(&mut self, env: &Envelope) -> Option<PostedRecv> {
        let i = self.posted.iter().position(|r| r.accepts(env))?;
        self.posted.remove(i)
    }

    /// Matches a new receive, or keeps it for a later message.
    pub fn post(&mut self, r: PostedRecv) -> Option<(PostedRecv, Arrival)> {
        match self.unexpected.iter().position(|a| r.accepts(&a.env)) {
            Some(i) => {
                let a = self.unexpected.remove(i).expect("found");
                self.unexpected_bytes -= a.payload.as_ref().map_or(0, Vec::len);
                self.remote_waiting -= usize::from(a.remote.is_some());
                Some((r, a))
            }
            None => {
                self.posted.push_back(r);
                None
            }
        }
    }

    /// Removes a receive that has not matched yet.
    pub fn cancel(&mut self, id: u64) -> Option<PostedRecv> {
        let i = self.posted.iter().position(|r| r.id == id)?;
        self.posted.remove(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(id: u64, source: Option<usize>, tag: Option<i32>) -> PostedRecv {
        PostedRecv {
            id,
            source,
            tag,
            buf: RawBuf::EMPTY,
            dtype: DType::Uint8,
            capacity: 0,
            exact: false,
            done: Arc::default(),
        }
    }

    fn msg(source: usize, tag: i32, seq: u64) -> Arrival {
        Arrival {
            env: Envelope {
                source,
                tag,
                seq,
                dtype: DType::Uint8,
                count: 1,
            },
            payload: Some(vec![seq as u8]),
            remote: None,
        }
    }

    #[test]
    fn receives_take_the_oldest_message_they_accept() {
        let mut m = Matching::default();
        assert!(m.arrive(msg(1, 5, 0)).is_none());
        assert!(m.arrive(msg(1, 7, 1)).is_none());
        assert!(m.arrive(msg(2, 7, 0)).is_none());
        assert_eq!(m.unexpected_bytes, 3);
        // Tag 7 from anyone: rank 1's (it arrived first), not rank 2's.
        let (_, a) = m.post(recv(0, None, Some(7))).unwrap();
        assert_eq!((a.env.source, a.env.seq), (1, 1));
        // From rank 2, any tag.
        let (_, a) = m.post(recv(1, Some(2), None)).unwrap();
        assert_eq!((a.env.source, a.env.tag), (2, 7));
        // Nothing from rank 3 yet: posted, then matched by its message.
        assert!(m.post(recv(2, Some(3), Some(5))).is_none());
        assert!(m.arrive(msg(3, 4, 0)).is_none(), "tag 4 is not accepted");
        let (r, a) = m.arrive(msg(3, 5, 1)).unwrap();
        assert_eq!((r.id, a.env.seq), (2, 1));
        // The remaining one: rank 1, tag 5.
        let (_, a) = m.post(recv(3, None, None)).unwrap();
        assert_eq!((a.env.source, a.env.tag), (1, 5));
        let (_, a) = m.post(recv(4, None, None)).unwrap();
        assert_eq!((a.env.source, a.env.tag), (3, 4));
        assert!(m.unexpected.is_empty() && m.unexpected_bytes == 0);
    }

    #[test]
    fn arrivals_go_to_the_oldest_receive_that_accepts_them() {
        let mut m = Matching::default();
        assert!(m.post(recv(0, Some(1), Some(9))).is_none());
        assert!(m.post(recv(1, None, None)).is_none());
        assert!(m.post(recv(2, Some(1), None)).is_none());
        let (r, _) = m.arrive(msg(1, 3, 0)).unwrap();
        assert_eq!(
            r.id, 1,
            "the wildcard posted before the other rank-1 receive"
        );
        let (r, _) = m.arrive(msg(1, 9, 1)).unwrap();
        assert_eq!(r.id, 0);
        assert!(m.cancel(2).is_some());
        assert!(m.cancel(2).is_none());
        assert!(m.arrive(msg(1, 3, 2)).is_none());
    }
}
