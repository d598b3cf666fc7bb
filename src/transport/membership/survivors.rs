//! A shrink's membership: what each surviving rank brings (its ballot:
//! the ranks it leaves out, those it knows failed, the port it listens on
//! for the new communicator), how the coordinating rank tallies them into
//! one decision, and the decision every survivor builds the same roster
//! from. The agreement that carries them is `transport::shrink`.

use super::reader::Reader;
use super::roster::{fnv1a, Roster};
use std::collections::{BTreeMap, BTreeSet};

/// One survivor's ballot for shrink number `epoch` of a communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ballot {
    pub epoch: u16,
    /// Where it listens for the new communicator.
    pub port: u16,
    /// The ranks its caller asked to leave out (a healthy shrink).
    pub exclude: Vec<usize>,
    /// The ranks it knows to have failed.
    pub failed: Vec<usize>,
}

/// What the coordinator decided: the new communicator's members (parent
/// ranks, ascending: the new ranks keep the old order) with their ports,
/// and its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub epoch: u16,
    pub comm_id: u64,
    pub members: Vec<(usize, u16)>,
}

/// What the rank a ballot went to answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Decided(Decision),
    /// "I am not coordinating: rank R is": ask R.
    AskRank(usize),
    /// The shrink cannot go on (ballots that disagree, another shrink).
    Refused(String),
}

fn put_ranks(b: &mut Vec<u8>, ranks: &[usize]) {
    b.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
    for r in ranks {
        b.extend_from_slice(&(*r as u32).to_le_bytes());
    }
}

impl Ballot {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12 + 4 * (self.exclude.len() + self.failed.len()));
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.port.to_le_bytes());
        put_ranks(&mut b, &self.exclude);
        put_ranks(&mut b, &self.failed);
        b
    }

    /// None when the bytes are not a ballot of a world of `size`.
    pub fn decode(bytes: &[u8], size: usize) -> Option<Ballot> {
        let mut r = Reader::new(bytes);
        let ballot = Ballot {
            epoch: r.u16()?,
            port: r.u16()?,
            exclude: r.ranks(size)?,
            failed: r.ranks(size)?,
        };
        r.is_done().then_some(ballot)
    }
}

const DECIDED: u8 = 1;
const ASK_RANK: u8 = 2;
const REFUSED: u8 = 3;

impl Answer {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Answer::Decided(d) => {
                b.push(DECIDED);
                b.extend_from_slice(&d.epoch.to_le_bytes());
                b.extend_from_slice(&d.comm_id.to_le_bytes());
                b.extend_from_slice(&(d.members.len() as u32).to_le_bytes());
                for (rank, port) in &d.members {
                    b.extend_from_slice(&(*rank as u32).to_le_bytes());
                    b.extend_from_slice(&port.to_le_bytes());
                }
            }
            Answer::AskRank(r) => {
                b.push(ASK_RANK);
                b.extend_from_slice(&(*r as u32).to_le_bytes());
            }
            Answer::Refused(why) => {
                b.push(REFUSED);
                b.extend_from_slice(why.as_bytes());
            }
        }
        b
    }

    /// None when the bytes are no answer about a world of `size`.
    pub fn decode(bytes: &[u8], size: usize) -> Option<Answer> {
        let (&tag, rest) = bytes.split_first()?;
        let mut r = Reader::new(rest);
        let answer = match tag {
            DECIDED => {
                let epoch = r.u16()?;
                let comm_id = r.u64()?;
                let n = r.count(6)?;
                let members = (0..n)
                    .map(|_| Some((r.u32()? as usize, r.u16()?)))
                    .collect::<Option<Vec<_>>>()?;
                if members.iter().any(|(rank, _)| *rank >= size) {
                    return None;
                }
                Answer::Decided(Decision {
                    epoch,
                    comm_id,
                    members,
                })
            }
            ASK_RANK => Answer::AskRank(Some(r.u32()? as usize).filter(|x| *x < size)?),
            REFUSED => return Some(Answer::Refused(String::from_utf8_lossy(rest).into_owned())),
            _ => return None,
        };
        r.is_done().then_some(answer)
    }
}

/// The coordinator's count: every rank of the parent ends up a member
/// (its ballot came), failed (a ballot named it, or it did not answer a
/// probe) or excluded (every ballot asked to leave it out).
#[derive(Debug)]
pub struct Tally {
    size: usize,
    epoch: u16,
    /// Ranks whose ballot came, with their ports and the ranks they ask to
    /// leave out.
    members: BTreeMap<usize, (u16, Vec<usize>)>,
    failed: BTreeSet<usize>,
}

impl Tally {
    /// The coordinator's own ballot counts first.
    pub fn new(size: usize, me: usize, mine: &Ballot) -> Tally {
        let mut t = Tally {
            size,
            epoch: mine.epoch,
            members: BTreeMap::new(),
            failed: BTreeSet::new(),
        };
        t.count(me, mine);
        t
    }

    /// Counts `rank`'s ballot. A rank that sent one is alive whatever
    /// another believed; what it believes failed is failed unless it
    /// sent a ballot too.
    pub fn count(&mut self, rank: usize, ballot: &Ballot) {
        self.failed.remove(&rank);
        let mut exclude = ballot.exclude.clone();
        exclude.sort_unstable();
        exclude.dedup();
        self.members.insert(rank, (ballot.port, exclude));
        for f in &ballot.failed {
            if !self.members.contains_key(f) {
                self.failed.insert(*f);
            }
        }
    }

    /// Whether every ballot so far asks to leave `rank` out.
    fn excluded_by_all(&self, rank: usize) -> bool {
        self.members
            .values()
            .all(|(_, ex)| ex.binary_search(&rank).is_ok())
    }

    /// The first rank whose ballot asks to leave `rank` out, if any.
    fn excluded_by(&self, rank: usize) -> Option<usize> {
        self.members
            .iter()
            .find(|(_, (_, ex))| ex.binary_search(&rank).is_ok())
            .map(|(r, _)| *r)
    }

    /// Notes that `rank` did not answer (its ballot, if it sent one, no
    /// longer counts: it died after sending it).
    pub fn lost(&mut self, rank: usize) {
        self.members.remove(&rank);
        self.failed.insert(rank);
    }

    /// Drops `rank`'s ballot (its sender hung up): undecided again, until
    /// a probe or a new ballot tells.
    pub fn forget(&mut self, rank: usize) {
        self.members.remove(&rank);
    }

    /// `rank`, which a ballot named failed, answered a probe: undecided
    /// again (the coordinator waits for its ballot).
    pub fn revive(&mut self, rank: usize) {
        self.failed.remove(&rank);
    }

    /// The ranks counted failed.
    pub fn failed(&self) -> impl Iterator<Item = usize> + '_ {
        self.failed.iter().copied()
    }

    /// Ranks neither counted, failed nor excluded by every ballot: the
    /// coordinator waits for their ballots (and probes them). A rank some
    /// ballots leave out and others do not is among them: lists may
    /// differ by a failed rank (a probe finds it dead), not by a live one.
    pub fn undecided(&self) -> Vec<usize> {
        (0..self.size)
            .filter(|r| {
                !self.members.contains_key(r)
                    && !self.failed.contains(r)
                    && !self.excluded_by_all(*r)
            })
            .collect()
    }

    /// The decision once nobody is undecided (or the caller gives up on
    /// them: they are left out): the members, renumbered in the parent's
    /// order, and the new communicator's id, derived from the parent's
    /// id, the shrink's number and the members; a refusal when a ballot
    /// asked to leave out a rank that called rdist_comm_shrink.
    pub fn decide(&self, parent_comm_id: u64) -> Answer {
        for r in self.members.keys() {
            if let Some(by) = self.excluded_by(*r) {
                return Answer::Refused(format!(
                    "rank {by} asked to leave out rank {r}, which called rdist_comm_shrink: every rank must pass the same exclude_ranks (ranks that leave do not call it)"
                ));
            }
        }
        let members: Vec<(usize, u16)> = self.members.iter().map(|(r, (p, _))| (*r, *p)).collect();
        let mut id_bytes = Vec::with_capacity(8 * members.len());
        for (r, _) in &members {
            id_bytes.extend_from_slice(&(*r as u32).to_le_bytes());
        }
        let comm_id = fnv1a(&[
            &parent_comm_id.to_le_bytes()[..],
            b"shrink",
            &self.epoch.to_le_bytes(),
            &id_bytes,
        ]);
        Answer::Decided(Decision {
            epoch: self.epoch,
            comm_id,
            members,
        })
    }
}

impl Decision {
    /// This rank's place in the new communicator and its roster, or None
    /// when the decision left it out.
    pub fn child(&self, parent: &Roster, rank: usize) -> Option<(usize, Roster)> {
        let new_rank = self.members.iter().position(|(r, _)| *r == rank)?;
        let ranks: Vec<usize> = self.members.iter().map(|(r, _)| *r).collect();
        let port_of = |r: usize| {
            self.members
                .iter()
                .find(|(m, _)| *m == r)
                .map_or(0, |(_, p)| *p)
        };
        Some((new_rank, parent.subset(&ranks, port_of, self.comm_id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::membership::HostId;

    fn parent(size: usize) -> Roster {
        Roster {
            job: [3; 16],
            comm_id: 11,
            addrs: (0..size)
                .map(|r| format!("10.0.0.{r}:9").parse().unwrap())
                .collect(),
            hosts: (0..size).map(|r| HostId::from(format!("h{r}"))).collect(),
            machines: Vec::new().into(),
            cpus: Vec::new().into(),
        }
    }

    fn ballot(port: u16, exclude: &[usize], failed: &[usize]) -> Ballot {
        Ballot {
            epoch: 1,
            port,
            exclude: exclude.to_vec(),
            failed: failed.to_vec(),
        }
    }

    #[test]
    fn ballots_and_answers_survive_the_wire_and_short_or_foreign_bytes_do_not() {
        let b = ballot(700, &[3], &[0, 2]);
        assert_eq!(Ballot::decode(&b.encode(), 4), Some(b.clone()));
        let bytes = b.encode();
        assert_eq!(Ballot::decode(&bytes[..bytes.len() - 1], 4), None);
        // A rank outside the world is no ballot of it.
        assert_eq!(Ballot::decode(&b.encode(), 3), None);
        // A count far beyond the bytes is refused without allocating it.
        let mut huge = b.encode();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Ballot::decode(&huge, 4), None);
        for a in [
            Answer::Decided(Decision {
                epoch: 2,
                comm_id: 99,
                members: vec![(1, 5), (3, 6)],
            }),
            Answer::AskRank(2),
            Answer::Refused("no".into()),
        ] {
            assert_eq!(Answer::decode(&a.encode(), 4), Some(a));
        }
        assert_eq!(Answer::decode(&Answer::AskRank(4).encode(), 4), None);
        assert_eq!(Answer::decode(&[9], 4), None);
    }

    #[test]
    fn the_survivors_are_renumbered_in_the_old_order_whoever_noticed_what() {
        // Rank 0 died; rank 1 coordinates, knowing nothing; rank 3 saw it.
        let mut t = Tally::new(4, 1, &ballot(101, &[], &[]));
        assert_eq!(t.undecided(), [0, 2, 3]);
        t.count(3, &ballot(103, &[], &[0]));
        assert_eq!(t.undecided(), [2]);
        t.count(2, &ballot(102, &[], &[]));
        assert!(t.undecided().is_empty());
        let Answer::Decided(d) = t.decide(parent(4).comm_id) else {
            panic!("no decision")
        };
        assert_eq!(d.members, [(1, 101), (2, 102), (3, 103)]);
        let (me, roster) = d.child(&parent(4), 3).unwrap();
        assert_eq!(me, 2);
        let addrs: Vec<String> = roster.addrs.iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1:101", "10.0.0.2:102", "10.0.0.3:103"]);
        assert_eq!(roster.comm_id, d.comm_id);
        assert_ne!(d.comm_id, parent(4).comm_id);
        assert!(d.child(&parent(4), 0).is_none());
    }

    #[test]
    fn a_ballot_proves_its_sender_alive_and_a_lost_member_drops_out() {
        // Rank 2 wrongly believes rank 3 failed; rank 3's ballot wins.
        let mut t = Tally::new(4, 0, &ballot(100, &[], &[]));
        t.count(2, &ballot(102, &[], &[3]));
        t.count(3, &ballot(103, &[], &[]));
        t.lost(1);
        assert!(t.undecided().is_empty());
        let Answer::Decided(d) = t.decide(parent(4).comm_id) else {
            panic!("no decision")
        };
        assert_eq!(d.members, [(0, 100), (2, 102), (3, 103)]);
        // A member that died after its ballot is left out.
        t.lost(2);
        let Answer::Decided(d2) = t.decide(parent(4).comm_id) else {
            panic!("no decision")
        };
        assert_eq!(d2.members, [(0, 100), (3, 103)]);
        assert_ne!(d.comm_id, d2.comm_id);
    }

    #[test]
    fn exclude_lists_add_up_but_leaving_out_a_caller_is_refused() {
        // Rank 2 also names rank 1, which calls: refused, whichever
        // ballot comes first (rank 1, named by one list and not by
        // another, is waited for).
        let mut t = Tally::new(4, 0, &ballot(100, &[3], &[]));
        t.count(2, &ballot(102, &[1, 3], &[]));
        assert_eq!(t.undecided(), [1]);
        t.count(1, &ballot(101, &[3], &[]));
        let Answer::Refused(why) = t.decide(parent(4).comm_id) else {
            panic!("a caller was left out")
        };
        assert!(why.contains("rank 2 asked to leave out rank 1"), "{why}");
        // Lists that differ by a failed rank add up (the coordinator's
        // probe finds it dead).
        let mut t = Tally::new(4, 0, &ballot(100, &[3], &[]));
        t.count(1, &ballot(101, &[2, 3], &[]));
        assert_eq!(t.undecided(), [2]);
        t.lost(2);
        assert!(t.undecided().is_empty());
        let Answer::Decided(d) = t.decide(parent(4).comm_id) else {
            panic!("no decision")
        };
        assert_eq!(d.members, [(0, 100), (1, 101)]);
    }

    #[test]
    fn a_sender_that_hung_up_is_undecided_until_a_probe_tells() {
        let mut t = Tally::new(3, 0, &ballot(100, &[], &[2]));
        t.count(1, &ballot(101, &[], &[]));
        assert!(t.undecided().is_empty());
        t.forget(1);
        assert_eq!(t.undecided(), [1]);
        // Rank 2, named failed, answers a probe: waited for.
        t.revive(2);
        assert_eq!(t.undecided(), [1, 2]);
        assert_eq!(t.failed().count(), 0);
    }
}
