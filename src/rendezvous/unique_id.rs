//! NCCL-style bootstrap: `rdist_get_unique_id` starts a store in the calling
//! process and packs its address and a fresh job id into 128 bytes that the
//! engine ships to the ranks by its own means.

use super::store::{Limits, Store, TcpStoreClient, TcpStoreServer};
use crate::auth::Token;
use crate::error::{Error, Result};
use crate::transport::iface;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &[u8; 4] = b"RDID";
const VERSION: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId {
    pub addr: SocketAddr,
    pub job: [u8; 16],
}

impl UniqueId {
    pub fn to_bytes(self) -> [u8; UNIQUE_ID_BYTES] {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        let (family, ip) = match self.addr.ip() {
            IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6, v6.octets()),
        };
        b[5] = family;
        b[6..8].copy_from_slice(&self.addr.port().to_le_bytes());
        b[8..24].copy_from_slice(&ip);
        b[24..40].copy_from_slice(&self.job);
        b
    }

    pub fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> Result<UniqueId> {
        if &b[0..4] != MAGIC || b[4] != VERSION {
            return Err(Error::invalid_argument(
                "the unique id is not one rdist_get_unique_id made (bad magic or version; were its 128 bytes copied whole?)",
            ));
        }
        let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).expect("16 bytes"));
        let ip = match b[5] {
            4 => IpAddr::V4(v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::LOCALHOST)),
            6 => IpAddr::V6(v6),
            f => {
                return Err(Error::invalid_argument(format!(
                    "the unique id has unknown address family {f}"
                )))
            }
        };
        Ok(UniqueId {
            addr: SocketAddr::new(ip, u16::from_le_bytes([b[6], b[7]])),
            job: b[24..40].try_into().expect("16 bytes"),
        })
    }
}

/// Starts hosting a rendezvous store and returns its id. The store lives
/// in a background thread until every rank has connected, or `timeout`.
pub fn create(ifname: Option<&str>, timeout: Duration, token: Option<Token>) -> Result<UniqueId> {
    let ip = iface::public_address(ifname);
    let wildcard: IpAddr = match ip {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let limits = Limits {
        token: token.clone(),
        ..Limits::default()
    };
    let server = TcpStoreServer::bind_with(SocketAddr::new(wildcard, 0), limits)?;
    let port = server.local_addr().port();
    let mut job = [0u8; 16];
    crate::random::fill(&mut job);
    let local = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + timeout;
    std::thread::Builder::new()
        .name("rdist-uid-store".into())
        .spawn(move || host_until_joined(server, &local, deadline, token))
        .map_err(|e| Error::system("starting the unique id's store thread", &e))?;
    Ok(UniqueId {
        addr: SocketAddr::new(ip, port),
        job,
    })
}

/// Keeps `server` alive until all ranks are out of init (they count
/// themselves under `LEFT_KEY` once released), or the deadline: a rank
/// released later than the others still reads its release here.
fn host_until_joined(server: TcpStoreServer, local: &str, deadline: Instant, token: Option<Token>) {
    let Ok(client) = TcpStoreClient::connect_with(local, deadline, token.as_ref()) else {
        return;
    };
    while Instant::now() < deadline {
        let done = client.check(&["world_size"]).unwrap_or(false)
            && match (
                client.get("world_size", Duration::from_secs(1)),
                client.add(super::LEFT_KEY, 0),
            ) {
                (Ok(size), Ok(n)) => String::from_utf8_lossy(&size)
                    .parse::<i64>()
                    .map(|s| n >= s)
                    .unwrap_or(false),
                _ => false,
            };
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(client);
    drop(server);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_garbage_is_refused() {
        for addr in ["10.1.2.3:29500", "[fd00::1]:80"] {
            let id = UniqueId {
                addr: addr.parse().unwrap(),
                job: [7; 16],
            };
            assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
        }
        assert!(UniqueId::from_bytes(&[0; UNIQUE_ID_BYTES]).is_err());
    }
}
