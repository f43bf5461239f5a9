//! Which of our addresses are true for whom.
//!
//! An address is worth advertising (to identify, rendezvous and the DHT)
//! only if a peer that learns it there can use it. Three scopes decide:
//! - **loopback** addresses reach only this host;
//! - **private** addresses (RFC 1918, CGNAT, link-local, unique-local)
//!   reach only the same network;
//! - **public** addresses reach anyone not filtered on the way.
//!
//! A listen address is advertised at once only when its scope is one the
//! caller vouches for ([`NetConfig::advertise_listen`](crate::NetConfig)),
//! which the daemon derives from where its infrastructure nodes are: an
//! infrastructure node on loopback means every peer that meets us there is
//! on this host, one on a private network means they share that network.
//! Everything else waits for evidence: an address AutoNAT v2 confirmed (a
//! server dialed it back), or a relay circuit we hold a reservation on.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;

/// How far an address reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Loopback,
    Private,
    Public,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Loopback => "loopback",
            Scope::Private => "private",
            Scope::Public => "public",
        }
    }
}

fn v4_scope(ip: Ipv4Addr) -> Scope {
    let o = ip.octets();
    if ip.is_loopback() {
        Scope::Loopback
    } else if ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        // 100.64.0.0/10: carrier-grade NAT, shared by a carrier's customers.
        || (o[0] == 100 && (o[1] & 0xc0) == 64)
    {
        Scope::Private
    } else {
        Scope::Public
    }
}

fn v6_scope(ip: Ipv6Addr) -> Scope {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return v4_scope(v4);
    }
    let first = ip.segments()[0];
    if ip.is_loopback() {
        Scope::Loopback
    } else if ip.is_unspecified()
        // fc00::/7 unique-local, fe80::/10 link-local.
        || (first & 0xfe00) == 0xfc00
        || (first & 0xffc0) == 0xfe80
    {
        Scope::Private
    } else {
        Scope::Public
    }
}

/// The scope of an IP address.
pub fn ip_scope(ip: IpAddr) -> Scope {
    match ip {
        IpAddr::V4(v4) => v4_scope(v4),
        IpAddr::V6(v6) => v6_scope(v6),
    }
}

/// The scope of an address, by its first component: a relay circuit is as
/// far-reaching as the relay's own address. DNS names count as public.
pub fn scope_of(addr: &Multiaddr) -> Option<Scope> {
    match addr.iter().next()? {
        Protocol::Ip4(ip) => Some(v4_scope(ip)),
        Protocol::Ip6(ip) => Some(v6_scope(ip)),
        Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_) | Protocol::Dnsaddr(_) => {
            Some(Scope::Public)
        }
        _ => None,
    }
}

/// Whether `addr` goes through a relay circuit.
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

/// Whether the address is an unspecified (wildcard) one, which nobody can
/// dial.
pub fn is_unspecified(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_unspecified(),
        Protocol::Ip6(ip) => ip.is_unspecified(),
        _ => false,
    })
}

/// The scopes of listen addresses to advertise at once, given the scope of
/// the infrastructure nodes a device uses (the nearest, when they differ)
/// and its listen addresses.
///
/// - Infrastructure on loopback: loopback and private (every peer that
///   meets us there is on this host).
/// - Infrastructure on a private network: private only.
/// - Public infrastructure: none; confirmed and relayed addresses only.
/// - No infrastructure (LAN or static peers): private, plus loopback when
///   we listen on nothing else (then every peer is on this host).
pub fn listen_scopes(infra: Option<Scope>, listen: &[Multiaddr]) -> Vec<Scope> {
    match infra {
        Some(Scope::Loopback) => vec![Scope::Loopback, Scope::Private],
        Some(Scope::Private) => vec![Scope::Private],
        Some(Scope::Public) => vec![],
        None => {
            let only_loopback =
                !listen.is_empty() && listen.iter().all(|a| scope_of(a) == Some(Scope::Loopback));
            if only_loopback {
                vec![Scope::Loopback, Scope::Private]
            } else {
                vec![Scope::Private]
            }
        }
    }
}

/// Whether a confirmed (dialed-back) address may be advertised: never a
/// loopback one unless loopback is vouched for (AutoNAT has confirmed
/// loopback addresses before, libp2p PR #5526).
pub fn confirmed_is_advertisable(addr: &Multiaddr, vouched: &[Scope]) -> bool {
    match scope_of(addr) {
        Some(Scope::Loopback) => vouched.contains(&Scope::Loopback),
        Some(_) => !is_unspecified(addr),
        None => false,
    }
}

/// The IP and port an address ends up at (for TCP or QUIC), to spot our
/// own listeners among a peer's addresses.
pub fn socket_of(addr: &Multiaddr) -> Option<(IpAddr, u16, bool)> {
    if is_relayed(addr) {
        return None;
    }
    let mut ip = None;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(a) => ip = Some(IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(IpAddr::V6(a)),
            Protocol::Tcp(port) => return ip.map(|ip| (ip, port, false)),
            Protocol::Udp(port) => return ip.map(|ip| (ip, port, true)),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn scopes_of_addresses() {
        assert_eq!(scope_of(&a("/ip4/127.0.0.1/tcp/1")), Some(Scope::Loopback));
        assert_eq!(scope_of(&a("/ip6/::1/tcp/1")), Some(Scope::Loopback));
        for p in [
            "/ip4/10.1.2.3/tcp/1",
            "/ip4/172.16.0.1/tcp/1",
            "/ip4/192.168.1.10/udp/1/quic-v1",
            "/ip4/100.64.0.1/tcp/1",
            "/ip4/169.254.1.1/tcp/1",
            "/ip6/fd00::1/tcp/1",
            "/ip6/fe80::1/tcp/1",
        ] {
            assert_eq!(scope_of(&a(p)), Some(Scope::Private), "{p}");
        }
        for p in [
            "/ip4/198.51.100.2/tcp/1",
            "/ip4/100.128.0.1/tcp/1",
            "/ip4/8.8.8.8/tcp/1",
            "/ip6/2001:db8::1/tcp/1",
            "/dns4/relay.example/tcp/1",
        ] {
            assert_eq!(scope_of(&a(p)), Some(Scope::Public), "{p}");
        }
        // A circuit is as far-reaching as its relay.
        let circuit = a(
            "/ip4/198.51.100.2/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
        );
        assert_eq!(scope_of(&circuit), Some(Scope::Public));
        assert!(is_relayed(&circuit));
        assert!(!is_relayed(&a("/ip4/1.2.3.4/tcp/1")));
    }

    #[test]
    fn what_is_vouched_for_follows_the_infrastructure() {
        let lo = vec![a("/ip4/127.0.0.1/tcp/4001")];
        let lan = vec![a("/ip4/0.0.0.0/tcp/4001"), a("/ip4/192.168.1.2/tcp/4001")];
        assert_eq!(
            listen_scopes(Some(Scope::Loopback), &lan),
            vec![Scope::Loopback, Scope::Private]
        );
        assert_eq!(
            listen_scopes(Some(Scope::Private), &lan),
            vec![Scope::Private]
        );
        assert!(listen_scopes(Some(Scope::Public), &lo).is_empty());
        assert_eq!(listen_scopes(None, &lan), vec![Scope::Private]);
        assert_eq!(
            listen_scopes(None, &lo),
            vec![Scope::Loopback, Scope::Private]
        );
        // Confirmed loopback is refused unless vouched for.
        assert!(!confirmed_is_advertisable(&lo[0], &[Scope::Private]));
        assert!(confirmed_is_advertisable(&lo[0], &[Scope::Loopback]));
        assert!(confirmed_is_advertisable(
            &a("/ip4/198.51.100.11/tcp/4001"),
            &[]
        ));
    }

    #[test]
    fn sockets_of_addresses() {
        assert_eq!(
            socket_of(&a(
                "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
            )),
            Some(("127.0.0.1".parse().unwrap(), 4001, false))
        );
        assert_eq!(
            socket_of(&a("/ip4/127.0.0.1/udp/4001/quic-v1")),
            Some(("127.0.0.1".parse().unwrap(), 4001, true))
        );
        assert_eq!(
            socket_of(&a(
                "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit"
            )),
            None
        );
    }
}
