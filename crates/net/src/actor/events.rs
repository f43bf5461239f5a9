//! What the actor does with the swarm's own events: listen addresses (and
//! which of them are advertised), connections opened and closed, and
//! connections the limits refused. Behaviours' events go on to
//! `behaviours`.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use libp2p::core::ConnectedPoint;
use libp2p::core::transport::ListenerId;
use libp2p::swarm::{ConnectionDenied, ConnectionId, DialError, ListenError, SwarmEvent};
use libp2p::{Multiaddr, PeerId, connection_limits, kad};
use tracing::{debug, info};

use super::{Actor, Conn};
use crate::swarm::BehaviourEvent;
use crate::{NetCount, NetEvent, public_of, reach};

impl Actor {
    pub(super) fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) -> Vec<NetEvent> {
        match ev {
            SwarmEvent::NewListenAddr {
                address,
                listener_id,
            } => self.on_new_listen_addr(address, listener_id),
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.swarm.remove_external_address(&address);
                vec![]
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                addresses,
                reason,
            } => self.on_listener_closed(listener_id, &addresses, reason),
            SwarmEvent::ExternalAddrConfirmed { address } => {
                if reach::confirmed_is_advertisable(&address, &self.vouched) {
                    info!(%address, "external address confirmed");
                } else {
                    debug!(%address, "confirmed address not advertised (loopback)");
                    self.swarm.remove_external_address(&address);
                }
                vec![]
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => self.on_connection_established(peer_id, connection_id, endpoint, num_established),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => self.on_connection_closed(peer_id, connection_id, num_established),
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                if let DialError::Denied { cause } = &error {
                    self.count_refused(cause);
                }
                vec![NetEvent::DialFailed {
                    peer: peer_id,
                    reason: error.to_string(),
                }]
            }
            SwarmEvent::IncomingConnectionError {
                error: ListenError::Denied { cause },
                send_back_addr,
                ..
            } => {
                if self.count_refused(&cause) {
                    debug!(remote = %send_back_addr, %cause, "inbound connection refused");
                }
                vec![]
            }
            SwarmEvent::Behaviour(ev) => self.on_behaviour_event(ev),
            _ => vec![],
        }
    }

    fn on_new_listen_addr(&mut self, address: Multiaddr, listener_id: ListenerId) -> Vec<NetEvent> {
        info!(%address, "listening");
        if let Some(s) = reach::socket_of(&address) {
            self.own_sockets.insert(s);
        }
        // Advertise only what a peer elsewhere can use (`reach`): a relay
        // circuit we hold, every address of an infrastructure node, and
        // listen addresses of a scope the owner vouched for. The rest waits
        // for AutoNAT. A circuit is as far-reaching as its relay's address
        // (the relay hands us all of its own, loopback included).
        let relayed = reach::is_relayed(&address);
        let advertise = !reach::is_unspecified(&address)
            && ((relayed && reach::confirmed_is_advertisable(&address, &self.vouched))
                || reach::scope_of(&address).is_some_and(|s| self.vouched.contains(&s)));
        if advertise {
            self.swarm.add_external_address(address.clone());
        }
        if relayed && let Some(relay) = self.listener_relays.get(&listener_id) {
            info!(%relay, %address, "reachable through a relay");
        }
        vec![NetEvent::Listening(address)]
    }

    /// A listener closed; if it was a relay circuit, our reservation there
    /// ended.
    fn on_listener_closed(
        &mut self,
        listener_id: ListenerId,
        addresses: &[Multiaddr],
        reason: Result<(), std::io::Error>,
    ) -> Vec<NetEvent> {
        for a in addresses {
            self.swarm.remove_external_address(a);
        }
        let Some(relay) = self.listener_relays.remove(&listener_id) else {
            return vec![];
        };
        self.relay_listeners.remove(&relay);
        self.counters.inc(NetCount::RelayReservationsLost);
        let reason = match reason {
            Ok(()) => "closed".to_owned(),
            Err(e) => e.to_string(),
        };
        info!(%relay, %reason, "relay reservation ended");
        vec![NetEvent::RelayClosed { relay, reason }]
    }

    fn on_connection_established(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        endpoint: ConnectedPoint,
        num_established: NonZeroU32,
    ) -> Vec<NetEvent> {
        let relayed = endpoint.is_relayed();
        let remote = match endpoint {
            ConnectedPoint::Dialer { address, .. } => address,
            // An inbound circuit's send-back address is only the peer's
            // id; our circuit address names the relay and its transport.
            ConnectedPoint::Listener { local_addr, .. } if relayed => local_addr,
            ConnectedPoint::Listener { send_back_addr, .. } => send_back_addr,
        };
        self.conns.entry(peer_id).or_default().push(Conn {
            id: connection_id,
            remote: remote.clone(),
            relayed,
            since: tokio::time::Instant::now(),
        });
        if !relayed {
            self.punch_failed.remove(&peer_id);
            self.repunch.remove(&peer_id);
        }
        self.replace_suspect(peer_id, connection_id);
        if num_established.get() != 1 {
            let out = self.on_paths_changed(peer_id);
            self.pump(peer_id);
            return out;
        }
        self.reported_path.insert(peer_id, remote.clone());
        self.pump(peer_id);
        vec![NetEvent::Connected {
            peer: peer_id,
            public: public_of(&peer_id),
            remote,
        }]
    }

    fn on_connection_closed(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        num_established: u32,
    ) -> Vec<NetEvent> {
        if let Some(cs) = self.conns.get_mut(&peer_id) {
            cs.retain(|c| c.id != connection_id);
        }
        if num_established != 0 {
            return self.on_paths_changed(peer_id);
        }
        self.conns.remove(&peer_id);
        self.reported_path.remove(&peer_id);
        self.relayed_to_close.remove(&peer_id);
        self.suspect.remove(&peer_id);
        self.repunch.remove(&peer_id);
        self.probed.remove(&peer_id);
        self.identified.remove(&peer_id);
        self.queues.remove(&peer_id);
        vec![NetEvent::Disconnected { peer: peer_id }]
    }

    /// Counts a connection refused by
    /// [`ConnectionLimits`](crate::ConnectionLimits); whether it was.
    pub(super) fn count_refused(&self, cause: &ConnectionDenied) -> bool {
        let refused = cause
            .downcast_ref::<connection_limits::Exceeded>()
            .is_some();
        if refused {
            self.counters.inc(NetCount::ConnectionsRefused);
        }
        refused
    }

    /// Re-derives what we advertise after any swarm event: reports a
    /// changed set, and keeps Kademlia a server only while we advertise a
    /// direct address.
    pub(super) fn on_external_change(&mut self) {
        let now: BTreeSet<Multiaddr> = self.swarm.external_addresses().cloned().collect();
        if now == self.reported_external {
            return;
        }
        info!(
            addrs = ?now.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "advertised addresses changed"
        );
        if !self.infrastructure {
            let direct = now.iter().any(|a| !reach::is_relayed(a));
            if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                k.set_mode(Some(if direct {
                    kad::Mode::Server
                } else {
                    kad::Mode::Client
                }));
            }
        }
        self.reported_external = now.clone();
        self.emit(NetEvent::ExternalAddrs(now.into_iter().collect()));
    }
}
