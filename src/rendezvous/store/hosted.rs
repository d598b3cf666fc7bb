//! The stores rank 0 hosts for `tcp://` and `env://`, one per address per
//! process: a communicator leases the store on its address, and the next
//! communicator on that address (made again and again, or beside it)
//! leases the same one, so ranks that come back to the address before
//! rank 0 never meet a store that is about to close. Unleased, a store
//! serves on until no client has asked anything for [`LINGER`] (late
//! ranks can still learn who was missing), then closes and frees the port.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::server::{Limits, StoreLease, TcpStoreServer};
use crate::auth::Token;
use crate::error::{Error, Result};
use crate::sync::lock;

/// How long an unleased store keeps serving after its last query.
pub const LINGER: Duration = Duration::from_secs(5);

static HOSTED: Mutex<Vec<Arc<TcpStoreServer>>> = Mutex::new(Vec::new());

/// A lease on this process's store at `addr`, binding it if there is none.
/// Communicators with different tokens cannot share one.
pub fn host(addr: SocketAddr, token: Option<Token>) -> Result<StoreLease> {
    let mut hosted = lock(&HOSTED);
    let mut found = None;
    hosted.retain(|server| {
        let lease = server.lease();
        let serving = lease.is_some();
        if server.local_addr() == addr && found.is_none() {
            found = lease;
        }
        serving
    });
    if let Some(lease) = found {
        if lease.token() != token.as_ref() {
            return Err(Error::invalid_usage(format!(
                "this process hosts the rendezvous store at {addr} for a communicator with \
                 another auth token; communicators on one address must share one token"
            )));
        }
        return Ok(lease);
    }
    let limits = Limits {
        linger: Some(LINGER),
        token,
        ..Limits::default()
    };
    let server = Arc::new(TcpStoreServer::bind_with(addr, limits)?);
    let lease = server
        .lease()
        .expect("a server that was just bound is serving");
    hosted.push(server);
    Ok(lease)
}
