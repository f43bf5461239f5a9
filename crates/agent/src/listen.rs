//! Start-up's listeners, as the shell waits for them: when the configured
//! listen addresses count as up, and which TCP port the mDNS announcement
//! names.
//!
//! The network reports each listener once per interface it binds, and in
//! no fixed order: a QUIC listener on `0.0.0.0` may report loopback and
//! every LAN interface before TCP reports once. So "as many reports as
//! addresses" is not "every listener is up". Here a configured address is
//! up once one reported address of the same IP family and transport stack
//! (and the same IP and port where it names them) has come. The shell
//! keeps the clock: it asks [`ready`] after each report and gives up at
//! its own deadline, then takes what came.

use std::net::IpAddr;

use crate::peer::{Multiaddr, Protocol};

/// Why mDNS cannot announce this device: the announcement names the TCP
/// port that peers dial, and there is none.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoTcpPort {
    /// No configured listen address is plain TCP.
    #[error(
        "no listen address is TCP (--listen {configured}), and mDNS announces the TCP port \
         peers dial; add one such as /ip4/0.0.0.0/tcp/0 (the default has it)"
    )]
    NotConfigured {
        /// The configured addresses, comma-separated.
        configured: String,
    },
    /// TCP was configured but no TCP listener reported an address in time.
    #[error(
        "no TCP listener came up (--listen {configured}; up: {reported}); check that each \
         address is this host's and its port is free"
    )]
    NotUp {
        /// The configured addresses, comma-separated.
        configured: String,
        /// The addresses that did come up, comma-separated (`none`).
        reported: String,
    },
}

/// Whether start-up may go on: something is up, and every configured
/// address is covered by a reported one (see the module's rule). An empty
/// `configured` asks only for one report.
pub fn ready(configured: &[Multiaddr], reported: &[Multiaddr]) -> bool {
    !reported.is_empty() && pending(configured, reported).is_empty()
}

/// The configured addresses no reported address covers yet, in the order
/// configured (what the shell names when its deadline passes).
pub fn pending<'a>(configured: &'a [Multiaddr], reported: &[Multiaddr]) -> Vec<&'a Multiaddr> {
    configured
        .iter()
        .filter(|c| !reported.iter().any(|r| covers(c, r)))
        .collect()
}

/// The TCP port mDNS announces: the lowest port among the reported
/// addresses of the configured plain-TCP listeners, whatever order the
/// reports came in (one listener reports one port on every interface; the
/// agent's own announcements take it from its boot addresses the same way,
/// `mdns_port(addrs, addrs)`, so the SRV and TXT ports agree).
pub fn mdns_port(configured: &[Multiaddr], reported: &[Multiaddr]) -> Result<u16, NoTcpPort> {
    let tcp: Vec<&Multiaddr> = configured
        .iter()
        .filter(|c| shape(c).stack == ["tcp"])
        .collect();
    if tcp.is_empty() {
        return Err(NoTcpPort::NotConfigured {
            configured: joined(configured.iter()),
        });
    }
    reported
        .iter()
        .filter(|r| tcp.iter().any(|c| covers(c, r)))
        .map(|r| shape(r).port)
        .filter(|&port| port != 0)
        .min()
        .ok_or_else(|| NoTcpPort::NotUp {
            configured: joined(configured.iter()),
            reported: joined(reported.iter()),
        })
}

/// An address as a listener reads it.
struct Shape {
    ip: Option<IpAddr>,
    /// The port of its TCP or UDP part (0: any).
    port: u16,
    /// Its protocols after the IP, by name (`["udp", "quic-v1"]`), without
    /// a trailing `/p2p/…`.
    stack: Vec<&'static str>,
}

fn shape(a: &Multiaddr) -> Shape {
    let mut s = Shape {
        ip: None,
        port: 0,
        stack: Vec::new(),
    };
    for p in a.iter() {
        match p {
            Protocol::Ip4(ip) => s.ip = Some(IpAddr::V4(ip)),
            Protocol::Ip6(ip) => s.ip = Some(IpAddr::V6(ip)),
            Protocol::P2p(_) => {}
            Protocol::Tcp(port) | Protocol::Udp(port) => {
                s.port = port;
                s.stack.push(p.tag());
            }
            other => s.stack.push(other.tag()),
        }
    }
    s
}

/// Whether `reported` is one of the addresses the listener on `configured`
/// binds: same family and stack, the same IP unless `configured`'s is
/// unspecified, the same port unless `configured`'s is 0.
fn covers(configured: &Multiaddr, reported: &Multiaddr) -> bool {
    let (c, r) = (shape(configured), shape(reported));
    let ip = match (c.ip, r.ip) {
        (Some(c), Some(r)) => c.is_ipv4() == r.is_ipv4() && (c.is_unspecified() || c == r),
        (None, None) => true,
        _ => false,
    };
    ip && c.stack == r.stack && (c.port == 0 || c.port == r.port)
}

fn joined<'a>(addrs: impl Iterator<Item = &'a Multiaddr>) -> String {
    let all: Vec<String> = addrs.map(|a| a.to_string()).collect();
    if all.is_empty() {
        "none".to_owned()
    } else {
        all.join(",")
    }
}

#[cfg(test)]
mod tests {
    //! Goal: start-up goes on exactly when every configured listener has
    //! reported, and mDNS gets the same TCP port, whatever order and how
    //! many per-interface reports come. Method: data-driven cases, each
    //! run over every rotation and the reversal of its reports.

    use super::*;

    const DEFAULT: &[&str] = &["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"];

    fn addrs(list: &[&str]) -> Vec<Multiaddr> {
        list.iter().map(|a| a.parse().expect(a)).collect()
    }

    /// Each case: configured, reported, whether ready, the mDNS port (or
    /// the reason's variant name).
    fn check(
        configured: &[&str],
        reported: &[&str],
        ready_want: bool,
        port_want: Result<u16, &str>,
    ) {
        let c = addrs(configured);
        let r = addrs(reported);
        let mut orders = Vec::new();
        for k in 0..r.len().max(1) {
            let mut o = r.clone();
            o.rotate_left(k);
            orders.push(o.clone());
            o.reverse();
            orders.push(o);
        }
        for order in orders {
            assert_eq!(
                ready(&c, &order),
                ready_want,
                "ready {configured:?} after {order:?}"
            );
            let port = mdns_port(&c, &order).map_err(|e| match e {
                NoTcpPort::NotConfigured { .. } => "NotConfigured",
                NoTcpPort::NotUp { .. } => "NotUp",
            });
            assert_eq!(port, port_want, "mdns port {configured:?} after {order:?}");
        }
    }

    #[test]
    fn listeners_count_as_up_by_transport_not_by_number() {
        let quic3 = [
            "/ip4/127.0.0.1/udp/40001/quic-v1",
            "/ip4/10.201.0.1/udp/40001/quic-v1",
            "/ip4/192.168.7.2/udp/40001/quic-v1",
        ];
        // QUIC reports on 3 interfaces before TCP reports: not up yet, no port.
        check(DEFAULT, &quic3, false, Err("NotUp"));
        check(DEFAULT, &quic3[..2], false, Err("NotUp"));
        // Then TCP reports once (on any interface): up, its port.
        let mut all = quic3.to_vec();
        all.push("/ip4/10.201.0.1/tcp/4242");
        check(DEFAULT, &all, true, Ok(4242));
        all.push("/ip4/127.0.0.1/tcp/4242");
        check(DEFAULT, &all, true, Ok(4242));
        // TCP alone is not enough while QUIC is configured.
        check(DEFAULT, &["/ip4/127.0.0.1/tcp/4242"], false, Ok(4242));
        check(
            DEFAULT,
            &["/ip4/127.0.0.1/tcp/4242", "/ip4/10.201.0.1/tcp/4242"],
            false,
            Ok(4242),
        );
        // Nothing reported yet.
        check(DEFAULT, &[], false, Err("NotUp"));
        check(&[], &[], false, Err("NotConfigured"));
        check(&[], &["/ip4/127.0.0.1/tcp/1"], true, Err("NotConfigured"));
        // The tests' loopback-only TCP.
        check(
            &["/ip4/127.0.0.1/tcp/0"],
            &["/ip4/127.0.0.1/tcp/5000"],
            true,
            Ok(5000),
        );
        // A reported address with our PeerId still counts.
        check(
            &["/ip4/127.0.0.1/tcp/0"],
            &["/ip4/127.0.0.1/tcp/5000/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"],
            true,
            Ok(5000),
        );
        // QUIC only: up, but mDNS has no port to announce.
        check(
            &["/ip4/0.0.0.0/udp/0/quic-v1"],
            &["/ip4/10.201.0.1/udp/9/quic-v1"],
            true,
            Err("NotConfigured"),
        );
        // A fixed port must come up as that port; a fixed IP as that IP.
        check(
            &["/ip4/0.0.0.0/tcp/4001"],
            &["/ip4/10.0.0.1/tcp/4002"],
            false,
            Err("NotUp"),
        );
        check(
            &["/ip4/0.0.0.0/tcp/4001"],
            &["/ip4/10.0.0.1/tcp/4001"],
            true,
            Ok(4001),
        );
        check(
            &["/ip4/10.0.0.1/tcp/0"],
            &["/ip4/10.0.0.2/tcp/7"],
            false,
            Err("NotUp"),
        );
        // IPv6 is not IPv4; websocket over TCP is not plain TCP.
        check(
            &["/ip6/::/tcp/0"],
            &["/ip4/10.0.0.1/tcp/7"],
            false,
            Err("NotUp"),
        );
        check(&["/ip6/::/tcp/0"], &["/ip6/fd00::1/tcp/7"], true, Ok(7));
        check(
            &["/ip4/0.0.0.0/tcp/0/ws"],
            &["/ip4/10.0.0.1/tcp/7"],
            false,
            Err("NotConfigured"),
        );
        // Two TCP listeners on different ports: the lower port, whichever
        // reports first, and the same when the reports are all the agent
        // knows (its boot addresses).
        check(
            &["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"],
            &["/ip6/::1/tcp/6000", "/ip4/127.0.0.1/tcp/5000"],
            true,
            Ok(5000),
        );
        let both = [
            "/ip6/::1/tcp/4000",
            "/ip4/10.0.0.1/udp/3000/quic-v1",
            "/ip4/127.0.0.1/tcp/5000",
        ];
        check(&both, &both, true, Ok(4000));
        check(
            &["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"],
            &["/ip6/::1/tcp/6000"],
            false,
            Ok(6000),
        );
    }

    #[test]
    fn the_reasons_name_what_to_do() {
        let quic = addrs(&["/ip4/0.0.0.0/udp/0/quic-v1"]);
        let e = mdns_port(&quic, &[]).unwrap_err().to_string();
        assert!(
            e.contains("/ip4/0.0.0.0/tcp/0") && e.contains("--listen"),
            "{e}"
        );
        let e = mdns_port(&addrs(DEFAULT), &[]).unwrap_err().to_string();
        assert!(e.contains("up: none") && e.contains("port is free"), "{e}");
    }
}
