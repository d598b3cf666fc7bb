//! A split's membership: what each rank brings (its colour, its key and
//! the port it listens on for the child), exchanged through the parent
//! communicator, and the child's roster made from every rank's record.

use super::roster::{fnv1a, Roster};

/// One rank's record: colour, key (i32 each) and port (u16), little-endian.
pub const RECORD_BYTES: usize = 10;

/// This rank's record.
pub fn record(color: i32, key: i32, port: u16) -> [u8; RECORD_BYTES] {
    let mut r = [0u8; RECORD_BYTES];
    r[0..4].copy_from_slice(&color.to_le_bytes());
    r[4..8].copy_from_slice(&key.to_le_bytes());
    r[8..10].copy_from_slice(&port.to_le_bytes());
    r
}

/// The child communicator `rank` joins with `color` (not negative), from
/// every rank's record side by side (rank order): its rank there and its
/// roster. Members are ordered by (key, parent rank), as MPI_Comm_split
/// does; the child's id comes from the parent's, the split's number
/// `seq` and the colour, alike on every member.
pub fn child(
    parent: &Roster,
    records: &[u8],
    rank: usize,
    seq: u64,
    color: i32,
) -> (usize, Roster) {
    let at = |r: usize, from: usize| &records[r * RECORD_BYTES + from..];
    let field =
        |r: usize, from: usize| i32::from_le_bytes(at(r, from)[..4].try_into().expect("4 bytes"));
    let size = records.len() / RECORD_BYTES;
    let mut members: Vec<usize> = (0..size).filter(|r| field(*r, 0) == color).collect();
    members.sort_by_key(|r| (field(*r, 4), *r));
    let new_rank = members
        .iter()
        .position(|r| *r == rank)
        .expect("a rank is a member of its own colour");
    let comm_id = fnv1a(&[
        &parent.comm_id.to_le_bytes()[..],
        &seq.to_le_bytes(),
        &color.to_le_bytes(),
    ]);
    let port_of = |r: usize| u16::from_le_bytes([at(r, 8)[0], at(r, 8)[1]]);
    (new_rank, parent.subset(&members, port_of, comm_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::membership::HostId;

    #[test]
    fn members_are_ordered_by_key_then_rank_and_listen_on_their_new_port() {
        let parent = Roster {
            job: [1; 16],
            comm_id: 5,
            addrs: (0..4)
                .map(|r| format!("10.0.0.{r}:9").parse().unwrap())
                .collect(),
            hosts: (0..4).map(|r| HostId::from(format!("h{r}"))).collect(),
            machines: Vec::new().into(),
            cpus: Vec::new().into(),
        };
        // Colours 1, 2, 1, 1; keys 3, 0, 1, 3.
        let records: Vec<u8> = [(1, 3, 100), (2, 0, 101), (1, 1, 102), (1, 3, 103)]
            .iter()
            .flat_map(|(c, k, p)| record(*c, *k, *p))
            .collect();
        let (me, roster) = child(&parent, &records, 3, 7, 1);
        // Order: rank 2 (key 1), rank 0 (key 3), rank 3 (key 3, later rank).
        assert_eq!(me, 2);
        let addrs: Vec<String> = roster.addrs.iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.2:102", "10.0.0.0:100", "10.0.0.3:103"]);
        let hosts: Vec<&str> = roster.hosts.iter().map(|h| &**h).collect();
        assert_eq!(hosts, ["h2", "h0", "h3"]);
        // Every member derives the same id; another colour or split differs.
        assert_eq!(roster.comm_id, child(&parent, &records, 0, 7, 1).1.comm_id);
        assert_ne!(roster.comm_id, child(&parent, &records, 1, 7, 2).1.comm_id);
        assert_ne!(roster.comm_id, child(&parent, &records, 0, 8, 1).1.comm_id);
    }
}
