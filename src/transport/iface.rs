//! Which local address a rank listens on: the one that routes to the master,
//! or the first address of an interface picked by `ifname` (NCCL's syntax:
//! `eth0,eth1` prefixes, `^docker,lo` exclusions, `=eth0` exact names).

use crate::error::{Error, ErrorKind, Result};
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// An interface name filter in NCCL_SOCKET_IFNAME syntax.
#[derive(Debug, PartialEq)]
pub struct IfFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfFilter {
    pub fn parse(spec: &str) -> IfFilter {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        IfFilter {
            exclude,
            exact,
            names,
        }
    }

    pub fn accepts(&self, ifname: &str) -> bool {
        let hit = self.names.iter().any(|n| {
            if self.exact {
                ifname == n
            } else {
                ifname.starts_with(n.as_str())
            }
        });
        hit != self.exclude
    }
}

/// The (interface name, address) pairs of the interfaces that are up.
pub fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free with freeifaddrs below; each
    // node is read only while the list is alive.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
                continue;
            }
            let name = CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    let ip = Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
                    out.push((name, IpAddr::V4(ip)));
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    let ip = Ipv6Addr::from(sa.sin6_addr.s6_addr);
                    // Link-local addresses need a scope id we don't carry.
                    if ip.segments()[0] & 0xffc0 != 0xfe80 {
                        out.push((name, IpAddr::V6(ip)));
                    }
                }
                _ => {}
            }
        }
        libc::freeifaddrs(head);
    }
    out
}

/// Resolves "host:port" (also "[v6]:port") to one socket address.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("cannot resolve host '{host}': {e}"),
            )
        })?
        .next()
        .ok_or_else(|| Error::invalid_argument(format!("host '{host}' has no address")))
}

/// The local address this rank should listen on and advertise.
pub fn listen_address(ifname: Option<&str>, master: SocketAddr) -> Result<IpAddr> {
    if let Some(spec) = ifname {
        let filter = IfFilter::parse(spec);
        let all = interfaces();
        // Prefer the master's address family, then any.
        let pick = all
            .iter()
            .find(|(n, ip)| filter.accepts(n) && ip.is_ipv4() == master.is_ipv4())
            .or_else(|| all.iter().find(|(n, _)| filter.accepts(n)));
        return match pick {
            Some((_, ip)) => Ok(*ip),
            None => {
                let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
                Err(Error::invalid_argument(format!(
                    "ifname '{spec}' matches no interface that is up (have: {})",
                    names.join(", ")
                )))
            }
        };
    }
    route_to(master.ip()).map_err(|e| {
        Error::system(
            format!("finding the local address that routes to {master}"),
            &e,
        )
    })
}

/// The local address the kernel would use to reach `dest` (no packet sent).
pub fn route_to(dest: IpAddr) -> std::io::Result<IpAddr> {
    if dest.is_loopback() {
        return Ok(dest);
    }
    let bind: SocketAddr = match dest {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let probe = UdpSocket::bind(bind)?;
    probe.connect((dest, 9))?;
    Ok(probe.local_addr()?.ip())
}

/// An address other hosts can reach this one at (for a unique id's store):
/// the first match of `ifname`, else the first non-loopback IPv4 address,
/// else loopback.
pub fn public_address(ifname: Option<&str>) -> IpAddr {
    let all = interfaces();
    let filter = ifname.map(IfFilter::parse);
    let ok = |n: &str, ip: &IpAddr| match &filter {
        Some(f) => f.accepts(n),
        None => !ip.is_loopback() && ip.is_ipv4() && !n.starts_with("docker"),
    };
    all.iter()
        .find(|(n, ip)| ok(n, ip))
        .map(|(_, ip)| *ip)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_interface_syntax() {
        let f = IfFilter::parse("eth,ib");
        assert!(f.accepts("eth0") && f.accepts("ib1") && !f.accepts("lo"));
        let f = IfFilter::parse("^docker,lo");
        assert!(f.accepts("eth0") && !f.accepts("lo") && !f.accepts("docker0"));
        let f = IfFilter::parse("=eth0");
        assert!(f.accepts("eth0") && !f.accepts("eth01"));
        let f = IfFilter::parse("^=lo");
        assert!(!f.accepts("lo") && f.accepts("lo2"));
    }

    #[test]
    fn loopback_routes_to_itself_and_lo_is_found() {
        let master: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(listen_address(None, master).unwrap(), master.ip());
        assert_eq!(
            listen_address(Some("lo"), master).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        let e = listen_address(Some("=nosuchif0"), master).unwrap_err();
        assert!(e.message().contains("nosuchif0"), "{e}");
    }
}
