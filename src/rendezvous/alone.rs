//! A world of one: `env://` in a process no launcher started runs as rank 0
//! of 1, as an MPI program started without mpirun does, hosting no store.

use super::store::Store;
use super::Joined;
use crate::error::{Error, ErrorKind, Result};
use crate::log;
use crate::options::{LogLevel, Options};
use crate::transport::membership::cpus::Cpus;
use crate::transport::membership::{host_id, hosts, Roster};
use std::collections::HashMap;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Joins a world of one: no store to meet at, no port but a loopback
/// listener the mesh code expects (it never accepts anything).
pub(super) fn join(opts: &Options) -> Result<Joined> {
    log::emit(
        LogLevel::Info,
        Some(0),
        "env:// with none of RANK, WORLD_SIZE (nor Slurm's, Open MPI's or PMI's rank and size variables) set: \
         running as a world of one (rank 0 of 1), as an MPI program started without a launcher does; \
         no MASTER_ADDR or MASTER_PORT needed, no store hosted (start it with rdistrun for more ranks)",
    );
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::system("binding a loopback listener", &e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::system("local_addr", &e))?;
    let mut job = [0u8; 16];
    crate::random::fill(&mut job);
    let host: crate::transport::membership::HostId =
        opts.host_id.clone().unwrap_or_else(host_id).into();
    Ok(Joined {
        size: 1,
        local_rank: opts.local_rank.map_or(0, |l| l as usize),
        roster: Roster {
            job,
            comm_id: 0,
            addrs: vec![addr].into(),
            hosts: vec![host.clone()].into(),
            machines: vec![(
                host.clone(),
                crate::transport::machine::this_machine(hosts::machine_of(&host)),
            )]
            .into(),
            cpus: (Cpus::own().and_then(|c| Cpus::together(&[Some(&c)])))
                .map(|c| (host.clone(), c))
                .into_iter()
                .collect(),
        },
        // A world of one asks nobody else: establishing NCCL just looks
        // at this process.
        some_rank_offers_nccl: true,
        listener,
        store: Arc::new(OwnStore::default()),
        server: None,
        file_store: None,
        rank: 0,
        // Its own store's default `arrive` (in memory).
        answers_wait_get: true,
        place: "a world of one".into(),
        board: super::Board::None,
        deadline: std::time::Instant::now() + opts.timeout,
        timeout: opts.timeout,
    })
}

/// The store of a world of one, in memory: no other rank can add a key, so
/// waiting for a missing one fails at once.
#[derive(Default)]
struct OwnStore(Mutex<HashMap<String, Vec<u8>>>);

impl OwnStore {
    fn data(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        crate::sync::lock(&self.0)
    }
}

fn missing(key: &str) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!("key '{key}' is not in the store of a world of one, and no other rank can add it"),
    )
}

impl Store for OwnStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.data().insert(key.to_string(), value.to_vec());
        Ok(())
    }

    fn get(&self, key: &str, _timeout: Duration) -> Result<Vec<u8>> {
        self.data().get(key).cloned().ok_or_else(|| missing(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut data = self.data();
        let current = match data.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    Error::invalid_argument(format!("key '{key}' is not a decimal integer"))
                })?,
        };
        let sum = current.checked_add(delta).ok_or_else(|| {
            Error::invalid_argument(format!("adding {delta} to '{key}' overflows"))
        })?;
        data.insert(key.to_string(), sum.to_string().into_bytes());
        Ok(sum)
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let data = self.data();
        Ok(keys.iter().all(|k| data.contains_key(*k)))
    }

    fn wait(&self, keys: &[&str], _timeout: Duration) -> Result<()> {
        let data = self.data();
        match keys.iter().find(|k| !data.contains_key(**k)) {
            Some(key) => Err(missing(key)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_store_keeps_keys_and_counts() {
        let store = OwnStore::default();
        store.set("a", b"x").unwrap();
        assert_eq!(store.get("a", Duration::ZERO).unwrap(), b"x");
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", 3).unwrap(), 5);
        assert!(store.check(&["a", "n"]).unwrap());
        assert!(!store.check(&["a", "b"]).unwrap());
        assert_eq!(
            store.wait(&["b"], Duration::ZERO).unwrap_err().kind(),
            ErrorKind::Timeout
        );
        assert!(store.add("a", 1).is_err());
    }
}
