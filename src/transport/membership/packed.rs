//! The roster as the store holds it: what every rank published, gathered
//! by the last rank to join into one compact value that every rank reads.
//! A host's ranks share its id and address (all but the port), so each
//! is listed once and a rank takes 11 bytes. Every rank of a wide job
//! reads the whole roster: at 1024 ranks the ranks' keys side by side
//! were 60 KiB a rank, and parsing them was most of a rank's init.

use super::cpus::{Cpus, HostCpus};
use super::hosts::HostId;
use super::reader::Reader;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::machine::{self, Machine, UNKNOWN};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::Arc;

/// What one rank published: "SIZE ADDR HOST PID NCCL BOARD MACHINE CPUS".
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Entry {
    /// The world size the rank was started with.
    pub size: String,
    pub addr: SocketAddr,
    pub host: String,
    pub pid: u32,
    /// NCCL may run in its process.
    pub offers_nccl: bool,
    /// The descriptor of its host board (see `host_board`), if it made one.
    pub board: Option<i32>,
    /// Its machine's profile (see `transport::machine`).
    pub machine: Machine,
    /// The CPUs it may run on (None: unknown).
    pub cpus: Option<Cpus>,
}

/// Where the ranks of a host find its board: the process of the host's
/// first rank, and the board's descriptor there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct BoardAt {
    pub pid: u32,
    pub fd: i32,
}

/// The roster's ranks, as every rank reads it.
#[derive(Debug, PartialEq)]
pub(crate) struct Listing {
    pub addrs: Arc<[SocketAddr]>,
    pub hosts: Arc<[HostId]>,
    /// Some rank offered NCCL.
    pub some_offer_nccl: bool,
    /// Each host's board, as its first rank published it.
    pub boards: Vec<(HostId, Option<BoardAt>)>,
    /// Each host's machine profile, as its first rank published it.
    pub machines: Vec<(HostId, Machine)>,
    /// What each host's ranks have together (None: some rank's CPUs are
    /// unknown).
    pub cpus: Vec<(HostId, Option<HostCpus>)>,
}

/// The line a rank publishes as its key: "SIZE ADDR HOST PID NCCL BOARD
/// MACHINE CPUS" (the host id has no spaces: see `host_id`; an option's is
/// checked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn published(
    size: usize,
    addr: SocketAddr,
    host: &str,
    pid: u32,
    offers_nccl: bool,
    board: Option<i32>,
    machine: &Machine,
    cpus: Option<&Cpus>,
) -> String {
    format!(
        "{size} {addr} {host} {pid} {} {} {} {}",
        u8::from(offers_nccl),
        board.unwrap_or(-1),
        machine.to_token(),
        Cpus::token(cpus)
    )
}

/// The roster from every rank's key (rank by rank) as one value, checking
/// that each rank was started with this world size.
pub(crate) fn gather(values: &[Vec<u8>], rank: usize, size: usize) -> Result<Vec<u8>> {
    let ours = size.to_string();
    let mut entries = Vec::with_capacity(values.len());
    for (r, v) in values.iter().enumerate() {
        let e = entry(r, v)?;
        if e.size != ours {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "rank {r} was started with world size {} but rank {rank} with {size}",
                    e.size
                ),
            ));
        }
        entries.push(e);
    }
    Ok(encode(&entries))
}

/// What `rank` published as its key.
pub(crate) fn entry(rank: usize, value: &[u8]) -> Result<Entry> {
    let text = String::from_utf8_lossy(value);
    let mut parts = text.split(' ');
    let (size, addr, host) = (parts.next(), parts.next(), parts.next());
    let pid = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    // Anything but a plain "0" (a key without the field too) counts as an
    // offer: at worst the ranks ask each other, as they always did.
    let offers_nccl = parts.next() != Some("0");
    let board = parts
        .next()
        .and_then(|b| b.parse().ok())
        .filter(|b| *b >= 0);
    let machine = parts.next().map_or(UNKNOWN, Machine::from_token);
    let cpus = parts.next().and_then(Cpus::from_token);
    let addr = addr
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| Error::internal(format!("rank {rank} published a bad address '{text}'")))?;
    Ok(Entry {
        size: size.unwrap_or("?").to_string(),
        addr,
        host: host.unwrap_or("?").to_string(),
        pid,
        offers_nccl,
        board,
        machine,
        cpus,
    })
}

/// Moves on with the layout (R6: each host's CPUs), so that a roster of
/// another release is refused, not misread.
const MAGIC: &[u8; 2] = b"R6";
const V4: u8 = 4;
const V6: u8 = 6;

/// The roster of `entries` (rank by rank) as one value.
pub(crate) fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut hosts: Vec<&str> = Vec::new();
    // Each host's first rank's board and machine (ranks come in order).
    let mut boards: Vec<(u32, i32, Machine)> = Vec::new();
    let mut ips: Vec<(IpAddr, u32)> = Vec::new();
    // Each host's ranks' CPUs.
    let mut cpus: Vec<Vec<Option<&Cpus>>> = Vec::new();
    let mut ranks = Vec::with_capacity(entries.len() * 11);
    for e in entries {
        let host = index_of(&mut hosts, e.host.as_str());
        if cpus.len() < hosts.len() {
            cpus.push(Vec::new());
        }
        cpus[host as usize].push(e.cpus.as_ref());
        if boards.len() < hosts.len() {
            boards.push((
                e.pid,
                e.board.filter(|_| e.pid != 0).unwrap_or(-1),
                e.machine,
            ));
        }
        let scope = match e.addr {
            SocketAddr::V6(a) => a.scope_id(),
            SocketAddr::V4(_) => 0,
        };
        let ip = index_of(&mut ips, (e.addr.ip(), scope));
        ranks.extend_from_slice(&host.to_le_bytes());
        ranks.extend_from_slice(&ip.to_le_bytes());
        ranks.extend_from_slice(&e.addr.port().to_le_bytes());
        ranks.push(u8::from(e.offers_nccl));
    }
    let mut out = Vec::with_capacity(ranks.len() + 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(hosts.len() as u32).to_le_bytes());
    for ((h, (pid, board, machine)), sets) in hosts.iter().zip(&boards).zip(&cpus) {
        // Host ids are short: a hostname and two numbers, or an option's
        // id of at most 1024 bytes (options.rs); the cut never happens.
        let h = &h.as_bytes()[..h.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(h.len() as u16).to_le_bytes());
        out.extend_from_slice(h);
        out.extend_from_slice(&pid.to_le_bytes());
        out.extend_from_slice(&board.to_le_bytes());
        out.extend_from_slice(&machine.to_bytes());
        let cpus = Cpus::together(sets).unwrap_or(HostCpus { cpus: 0, ranks: 0 });
        out.extend_from_slice(&cpus.cpus.to_le_bytes());
        out.extend_from_slice(&cpus.ranks.to_le_bytes());
    }
    out.extend_from_slice(&(ips.len() as u32).to_le_bytes());
    for (ip, scope) in &ips {
        match ip {
            IpAddr::V4(a) => {
                out.push(V4);
                out.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out.push(V6);
                out.extend_from_slice(&a.octets());
                out.extend_from_slice(&scope.to_le_bytes());
            }
        }
    }
    out.extend_from_slice(&ranks);
    out
}

/// Where `item` is in `list` (added at the end when new). The lists stay
/// short (hosts, and their addresses), so a scan beats a map.
fn index_of<T: PartialEq>(list: &mut Vec<T>, item: T) -> u32 {
    match list.iter().position(|x| *x == item) {
        Some(i) => i as u32,
        None => {
            list.push(item);
            (list.len() - 1) as u32
        }
    }
}

/// The roster from its value; None when the value is not one.
pub(crate) fn decode(bytes: &[u8]) -> Option<Listing> {
    let mut r = Reader::new(bytes);
    if r.take(2)? != MAGIC {
        return None;
    }
    let size = r.u32()? as usize;
    let host_count = r.u32()? as usize;
    let mut hosts = Vec::with_capacity(host_count.min(bytes.len()));
    let mut boards = Vec::with_capacity(host_count.min(bytes.len()));
    let mut machines = Vec::with_capacity(host_count.min(bytes.len()));
    let mut cpus = Vec::with_capacity(host_count.min(bytes.len()));
    for _ in 0..host_count {
        let len = r.u16()? as usize;
        let host = HostId::from(String::from_utf8_lossy(r.take(len)?));
        let (pid, fd) = (r.u32()?, r.u32()? as i32);
        let machine = Machine::from_bytes(r.take(machine::BYTES)?.try_into().ok()?);
        let (count, ranks) = (r.u32()?, r.u32()?);
        cpus.push((
            host.clone(),
            (count > 0 && ranks > 0).then_some(HostCpus { cpus: count, ranks }),
        ));
        boards.push((host.clone(), (fd >= 0).then_some(BoardAt { pid, fd })));
        machines.push((host.clone(), machine));
        hosts.push(host);
    }
    let ip_count = r.u32()? as usize;
    let mut ips = Vec::with_capacity(ip_count.min(bytes.len()));
    for _ in 0..ip_count {
        ips.push(match r.take(1)?[0] {
            V4 => (
                IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(r.take(4)?).ok()?)),
                0,
            ),
            V6 => {
                let octets = <[u8; 16]>::try_from(r.take(16)?).ok()?;
                (IpAddr::V6(Ipv6Addr::from(octets)), r.u32()?)
            }
            _ => return None,
        });
    }
    if r.rest().len() != size.checked_mul(11)? {
        return None;
    }
    let records = r.rest().chunks_exact(11);
    let index = |rank: &[u8], at: usize| {
        u32::from_le_bytes([rank[at], rank[at + 1], rank[at + 2], rank[at + 3]]) as usize
    };
    // Checked first, then read into the shared lists in one allocation
    // each (every rank of a wide job does this after the roster comes).
    if !(records.clone()).all(|rank| index(rank, 0) < hosts.len() && index(rank, 4) < ips.len()) {
        return None;
    }
    let addrs: Arc<[SocketAddr]> = (records.clone())
        .map(|rank| {
            let port = u16::from_le_bytes([rank[8], rank[9]]);
            match ips[index(rank, 4)] {
                (IpAddr::V6(a), scope) => SocketAddr::V6(SocketAddrV6::new(a, port, 0, scope)),
                (ip, _) => SocketAddr::new(ip, port),
            }
        })
        .collect();
    let listing = Listing {
        addrs,
        hosts: (records.clone())
            .map(|rank| hosts[index(rank, 0)].clone())
            .collect(),
        some_offer_nccl: records.clone().any(|rank| rank[10] != 0),
        boards,
        machines,
        cpus,
    };
    Some(listing)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MACHINE: Machine = Machine {
        cores: 16,
        copy_one_mbs: 6300,
        copy_all_mbs: 40_000,
        handoff_ns: 80,
        tcp_latency_ns: 9000,
        tcp_mbs: 3000,
        cache_kib: 32768,
        pass_mbs: 9000,
        cma_mbs: 21000,
        cma_call_ns: 310,
        swap_1m_permille: 1260,
        swap_4m_permille: 1110,
        swap_16m_permille: 900,
    };

    fn published_key(size: usize, addr: &str, host: &str, nccl: &str) -> Vec<u8> {
        format!("{size} {addr} {host} 4242 {nccl} 7").into_bytes()
    }

    #[test]
    fn each_hosts_machine_is_its_first_ranks() {
        let addr: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let other = Machine {
            cores: 2,
            ..MACHINE
        };
        let lines = [
            published(3, addr, "a", 1, false, None, &MACHINE, None),
            published(3, addr, "b", 2, false, None, &UNKNOWN, None),
            published(3, addr, "a", 3, false, None, &other, None),
        ];
        let values: Vec<Vec<u8>> = lines.iter().map(|l| l.clone().into_bytes()).collect();
        let listing = decode(&gather(&values, 0, 3).unwrap()).unwrap();
        assert_eq!(
            listing.machines,
            vec![("a".into(), MACHINE), ("b".into(), UNKNOWN)]
        );
    }

    #[test]
    fn a_published_line_reads_back_and_gathers_only_one_world_size() {
        let addr: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let line = published(2, addr, "h/0a1b2c3d/1", 77, true, None, &MACHINE, None);
        let e = entry(0, line.as_bytes()).unwrap();
        assert_eq!(
            (e.addr, e.pid, e.offers_nccl, e.board, e.machine),
            (addr, 77, true, None, MACHINE)
        );
        let other = published(3, addr, "h", 78, false, Some(4), &UNKNOWN, None);
        let values = vec![line.clone().into_bytes(), line.into_bytes()];
        assert_eq!(
            decode(&gather(&values, 0, 2).unwrap()).unwrap().addrs.len(),
            2
        );
        let e = gather(&[values[0].clone(), other.into_bytes()], 0, 2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch);
        assert!(
            e.message()
                .contains("rank 1 was started with world size 3 but rank 0 with 2"),
            "{e}"
        );
    }

    #[test]
    fn what_ranks_published_reads_back_rank_by_rank() {
        let keys = [
            published_key(4, "10.0.0.1:5000", "a/0a1b2c3d/4026531840", "0"),
            published_key(4, "10.0.0.2:5001", "b/0a1b2c3d/4026531841", "0"),
            published_key(4, "10.0.0.1:5002", "a/0a1b2c3d/4026531840", "0"),
            published_key(4, "[fe80::1%7]:5003", "c", "0"),
        ];
        let entries: Vec<Entry> = keys
            .iter()
            .enumerate()
            .map(|(r, k)| entry(r, k).unwrap())
            .collect();
        assert_eq!(entries[3].addr.to_string(), "[fe80::1%7]:5003");
        let bytes = encode(&entries);
        // Hosts and addresses once each: 3 hosts, 3 addresses, 4 ranks.
        assert!(
            bytes.len() < 2 + 4 + 4 + 3 * (24 + 8 + machine::BYTES + 8) + 4 + 5 + 5 + 21 + 4 * 11,
            "{}",
            bytes.len()
        );
        let listing = decode(&bytes).unwrap();
        assert_eq!(
            listing.addrs,
            entries.iter().map(|e| e.addr).collect::<Arc<[_]>>()
        );
        let hosts: Vec<&str> = listing.hosts.iter().map(|h| &**h).collect();
        assert_eq!(
            hosts,
            entries.iter().map(|e| e.host.as_str()).collect::<Vec<_>>()
        );
        assert!(!listing.some_offer_nccl);
        // Each host's board is its first rank's.
        let board = Some(BoardAt { pid: 4242, fd: 7 });
        assert_eq!(listing.boards.len(), 3);
        assert!(listing.boards.iter().all(|(_, b)| *b == board));
        assert_eq!(&*listing.boards[1].0, "b/0a1b2c3d/4026531841");
    }

    #[test]
    fn each_hosts_cpus_are_its_ranks_together() {
        let addr: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        let cpus = |t: &str| Cpus::from_token(t);
        let lines = [
            published(4, addr, "a", 1, false, None, &UNKNOWN, cpus("0").as_ref()),
            published(4, addr, "b", 2, false, None, &UNKNOWN, cpus("0-7").as_ref()),
            published(4, addr, "a", 3, false, None, &UNKNOWN, cpus("1").as_ref()),
            published(4, addr, "c", 4, false, None, &UNKNOWN, None),
        ];
        let e = entry(2, lines[2].as_bytes()).unwrap();
        assert_eq!(e.cpus, cpus("1"));
        let values: Vec<Vec<u8>> = lines.iter().map(|l| l.clone().into_bytes()).collect();
        let listing = decode(&gather(&values, 0, 4).unwrap()).unwrap();
        assert_eq!(
            listing.cpus,
            vec![
                ("a".into(), Some(HostCpus { cpus: 2, ranks: 2 })),
                ("b".into(), Some(HostCpus { cpus: 8, ranks: 1 })),
                ("c".into(), None),
            ]
        );
    }

    #[test]
    fn a_host_whose_first_rank_made_no_board_has_none() {
        let keys = [
            b"2 10.0.0.1:5000 a 11 0 -1".to_vec(),
            b"2 10.0.0.1:5001 a 12 0 9".to_vec(),
        ];
        let entries: Vec<Entry> = (keys.iter().enumerate())
            .map(|(r, k)| entry(r, k).unwrap())
            .collect();
        assert_eq!(entries[1].board, Some(9));
        let listing = decode(&encode(&entries)).unwrap();
        assert_eq!(listing.boards, vec![("a".into(), None)]);
    }

    #[test]
    fn an_offer_of_nccl_or_a_key_without_the_field_counts() {
        for (nccl, offered) in [("1", true), ("0", false)] {
            let e = entry(0, &published_key(1, "127.0.0.1:1", "h", nccl)).unwrap();
            assert_eq!(decode(&encode(&[e])).unwrap().some_offer_nccl, offered);
        }
        let old = entry(0, b"1 127.0.0.1:1 h").unwrap();
        assert!(old.offers_nccl);
        assert_eq!(old.board, None);
    }

    #[test]
    fn a_bad_address_names_the_rank() {
        let e = entry(3, b"2 nowhere h 1 0").unwrap_err();
        assert!(
            e.message().contains("rank 3 published a bad address"),
            "{e}"
        );
    }

    #[test]
    fn anything_cut_or_foreign_is_refused() {
        let e = entry(0, &published_key(2, "127.0.0.1:9", "h", "0")).unwrap();
        let bytes = encode(&[e.clone(), e]);
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
        assert_eq!(decode(b"12 127.0.0.1:9 h 1 0"), None);
        let mut bad_index = bytes;
        let last = bad_index.len() - 11;
        bad_index[last] = 9;
        assert_eq!(decode(&bad_index), None);
    }
}
