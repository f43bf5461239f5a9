//! What the actor does with the owner's commands: dials, frames, relay
//! reservations, DHT, rendezvous and gossip requests, one handler per
//! family.

use std::collections::BTreeSet;

use libp2p::swarm::DialError;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::{Multiaddr, PeerId, gossipsub, kad, rendezvous};
use tracing::{debug, trace, warn};

use super::{Actor, MAX_PENDING_PUBLISHES};
use crate::handle::{Command, GossipCommand, KadCommand, RelayCommand, RendezvousCommand};
use crate::{NetCount, NetEvent, Protocol, path_of, peer_in, reach};

impl Actor {
    pub(super) fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Dial {
                peer,
                addrs,
                reuse_port,
            } => self.dial(peer, addrs, reuse_port),
            Command::Send { peer, frame } => self.queue_frame(peer, frame),
            Command::Disconnect { peer } => {
                self.queues.remove(&peer);
                let _ = self.swarm.disconnect_peer_id(peer);
            }
            Command::AddAddress { peer, addr } => {
                self.swarm.add_peer_address(peer, addr.clone());
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    k.add_address(&peer, addr);
                }
            }
            Command::Relay(cmd) => self.on_relay_command(cmd),
            Command::Kad(cmd) => self.on_kad_command(cmd),
            Command::Rendezvous(cmd) => self.on_rendezvous_command(cmd),
            Command::Gossip(cmd) => self.on_gossip_command(cmd),
        }
    }

    fn dial(&mut self, peer: Option<PeerId>, addrs: Vec<Multiaddr>, reuse_port: bool) {
        let me = *self.swarm.local_peer_id();
        if peer == Some(me) {
            self.counters.inc(NetCount::SelfDialsSkipped);
            return;
        }
        // Never our own listeners: a peer advertising a loopback address
        // would make us dial ourselves.
        let before = addrs.len();
        let addrs: Vec<Multiaddr> = addrs
            .into_iter()
            .filter(|a| {
                reach::socket_of(a).is_none_or(|s| !self.own_sockets.contains(&s))
                    && !reach::is_unspecified(a)
                    && peer_in(a) != Some(me)
            })
            .collect();
        if addrs.len() < before {
            self.counters.inc(NetCount::SelfDialsSkipped);
        }
        if addrs.is_empty() {
            return;
        }
        if let Some(p) = peer.filter(|_| reuse_port)
            && self.reuse_port_peers.len() < 1024
        {
            self.reuse_port_peers.insert(p);
        }
        let opts = match peer {
            Some(peer) if reuse_port => match self.infra_dial(peer, addrs) {
                Some(opts) => opts,
                None => return,
            },
            // Devices: a fresh source port. Reusing the listening port lets
            // two devices that dial each other at the same instant (both
            // found by mDNS) end up in one TCP connection (simultaneous
            // open) where both are the Noise initiator and both handshakes
            // fail. Hole punching (DCUtR) dials from the listening port by
            // itself.
            Some(peer) => DialOpts::peer_id(peer)
                .addresses(addrs)
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .allocate_new_port()
                .build(),
            None => match addrs.into_iter().next() {
                Some(addr) => DialOpts::unknown_peer_id()
                    .address(addr)
                    .allocate_new_port()
                    .build(),
                None => return,
            },
        };
        if let Err(e) = self.swarm.dial(opts) {
            if let DialError::Denied { cause } = &e {
                self.count_refused(cause);
            }
            // "already connected/dialing" is expected and harmless.
            trace!(?peer, error = %e, "dial not started");
        }
    }

    /// How to dial an infrastructure node: from the listening port, and
    /// over any transport we have no connection on yet; `None` when there
    /// is none left.
    fn infra_dial(&self, peer: PeerId, addrs: Vec<Multiaddr>) -> Option<DialOpts> {
        let have: BTreeSet<&'static str> = self
            .conns
            .get(&peer)
            .map(|cs| {
                cs.iter()
                    .filter(|c| !c.relayed)
                    .map(|c| path_of(&c.remote).transport)
                    .collect()
            })
            .unwrap_or_default();
        let addrs: Vec<Multiaddr> = addrs
            .into_iter()
            .filter(|a| !have.contains(path_of(a).transport))
            .collect();
        if addrs.is_empty() {
            return None;
        }
        let condition = if have.is_empty() {
            PeerCondition::DisconnectedAndNotDialing
        } else {
            PeerCondition::NotDialing
        };
        Some(
            DialOpts::peer_id(peer)
                .addresses(addrs)
                .condition(condition)
                .build(),
        )
    }

    /// Queues `frame` behind the others to `peer`, or drops and reports it
    /// when the peer's queue is full.
    fn queue_frame(&mut self, peer: PeerId, frame: Vec<u8>) {
        let max = self.config.max_queue_per_peer;
        let q = self.queues.entry(peer).or_default();
        if q.queue.len() >= max {
            // Counted; per frame this would flood the log.
            debug!(%peer, max, "send queue full; frame dropped");
            self.counters.inc(NetCount::OutboundFramesDropped);
            self.emit(NetEvent::SendFailed {
                peer,
                reason: format!("send queue full ({max} frames)"),
            });
            return;
        }
        q.queue.push_back(frame);
        self.pump(peer);
    }

    fn on_relay_command(&mut self, cmd: RelayCommand) {
        match cmd {
            RelayCommand::Reserve { relay, addr } => {
                if self.relay_listeners.contains_key(&relay) {
                    return;
                }
                let mut circuit = addr;
                if peer_in(&circuit).is_none() {
                    circuit.push(Protocol::P2p(relay));
                }
                circuit.push(Protocol::P2pCircuit);
                match self.swarm.listen_on(circuit.clone()) {
                    Ok(id) => {
                        debug!(%relay, %circuit, "reserving a relay circuit");
                        self.relay_listeners.insert(relay, id);
                        self.listener_relays.insert(id, relay);
                    }
                    Err(e) => {
                        self.counters.inc(NetCount::RelayReservationsLost);
                        self.emit(NetEvent::RelayClosed {
                            relay,
                            reason: e.to_string(),
                        });
                    }
                }
            }
            RelayCommand::Release { relay } => {
                if let Some(id) = self.relay_listeners.remove(&relay) {
                    self.listener_relays.remove(&id);
                    self.swarm.remove_listener(id);
                }
            }
        }
    }

    fn on_kad_command(&mut self, cmd: KadCommand) {
        // Without the DHT there is nothing to do (nor to report).
        let Some(k) = self.swarm.behaviour_mut().kad.as_mut() else {
            return;
        };
        match cmd {
            KadCommand::Bootstrap => {
                if let Err(e) = k.bootstrap() {
                    self.emit(NetEvent::KadBootstrapped {
                        ok: false,
                        reason: e.to_string(),
                    });
                }
            }
            KadCommand::Put { key, value } => {
                let record = kad::Record::new(key, value);
                if let Err(e) = k.put_record(record, kad::Quorum::One) {
                    debug!(error = %e, "dht put failed");
                }
            }
            KadCommand::Store { key, value } => {
                use kad::store::RecordStore;
                if let Err(e) = k.store_mut().put(kad::Record::new(key, value)) {
                    debug!(error = %e, "dht store refused a record");
                }
            }
            KadCommand::Get { key } => {
                let id = k.get_record(kad::RecordKey::new(&key));
                self.get_queries.insert(id, key);
            }
            KadCommand::Provide { key } => {
                if let Err(e) = k.start_providing(kad::RecordKey::new(&key)) {
                    debug!(error = %e, "dht start_providing failed");
                }
            }
            KadCommand::GetProviders { key } => {
                let id = k.get_providers(kad::RecordKey::new(&key));
                self.get_queries.insert(id, key);
            }
        }
    }

    fn on_rendezvous_command(&mut self, cmd: RendezvousCommand) {
        match cmd {
            RendezvousCommand::Register {
                server,
                namespace,
                ttl_secs,
            } => {
                let Ok(ns) = rendezvous::Namespace::new(namespace) else {
                    return;
                };
                if let Some(r) = self.swarm.behaviour_mut().rendezvous.as_mut()
                    && let Err(e) = r.register(ns, server, Some(ttl_secs))
                {
                    self.emit(NetEvent::RendezvousFailed {
                        server,
                        reason: e.to_string(),
                    });
                }
            }
            RendezvousCommand::Discover { server, namespace } => {
                let Ok(ns) = rendezvous::Namespace::new(namespace) else {
                    return;
                };
                if let Some(r) = self.swarm.behaviour_mut().rendezvous.as_mut() {
                    r.discover(Some(ns), None, Some(256), server);
                }
            }
        }
    }

    fn on_gossip_command(&mut self, cmd: GossipCommand) {
        match cmd {
            GossipCommand::Subscribe { topic } => {
                if let Some(g) = self.swarm.behaviour_mut().gossip.as_mut()
                    && let Err(e) = g.subscribe(&gossipsub::IdentTopic::new(topic))
                {
                    warn!(error = %e, "cannot subscribe");
                }
            }
            GossipCommand::Publish { topic, data } => {
                trace!(target: "nuwa_path", "publish");
                self.publish(topic, data);
                trace!(target: "nuwa_path", "published");
                self.probe_idle_peers();
            }
            GossipCommand::Report { id, accept } => {
                if let Some(g) = self.swarm.behaviour_mut().gossip.as_mut() {
                    let verdict = if accept {
                        gossipsub::MessageAcceptance::Accept
                    } else {
                        gossipsub::MessageAcceptance::Reject
                    };
                    g.report_message_validation_result(&id.id, &id.propagation_source, verdict);
                }
            }
        }
    }

    /// Publishes on `topic`, or holds the message (bounded) until a peer
    /// subscribes.
    pub(super) fn publish(&mut self, topic: String, data: Vec<u8>) {
        let Some(g) = self.swarm.behaviour_mut().gossip.as_mut() else {
            return;
        };
        match g.publish(gossipsub::IdentTopic::new(topic.clone()), data.clone()) {
            Ok(_) => {}
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {
                // Not lost: held until a peer subscribes (and anti-entropy
                // covers the rest).
                if self.pending_publishes.len() >= MAX_PENDING_PUBLISHES {
                    self.pending_publishes.pop_front();
                    self.counters.inc(NetCount::GossipPublishDropped);
                }
                self.pending_publishes.push_back((topic, data));
            }
            Err(gossipsub::PublishError::Duplicate) => {}
            Err(e) => {
                self.counters.inc(NetCount::GossipPublishDropped);
                debug!(error = %e, "gossip publish failed");
            }
        }
    }
}
