//! What the actor does with each behaviour's events: the sync protocol's
//! frames and receipts, identify, ping, the DHT, rendezvous, gossip, the
//! relay server and client, AutoNAT and hole punching. Each handler turns
//! an event into the [`NetEvent`]s the owner hears of, and counts.

use libp2p::{
    Multiaddr, PeerId, autonat, dcutr, gossipsub, identify, kad, ping, relay, rendezvous,
    request_response,
};
use tracing::{debug, info};

use super::Actor;

/// Peers remembered as failing hole punches (far above a device's peers).
const MAX_PUNCH_FAILED: usize = 1024;
use crate::swarm::BehaviourEvent;
use crate::{GossipId, KAD_PROTOCOL, NetCount, NetEvent, Registration};

impl Actor {
    pub(super) fn on_behaviour_event(&mut self, ev: BehaviourEvent) -> Vec<NetEvent> {
        match ev {
            BehaviourEvent::Sync(ev) => self.on_sync_event(ev).into_iter().collect(),
            BehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                vec![self.on_identified(peer_id, info)]
            }
            BehaviourEvent::Ping(ping::Event {
                peer,
                result: Ok(rtt),
                ..
            }) => vec![NetEvent::Rtt { peer, rtt }],
            BehaviourEvent::Ping(ping::Event {
                peer,
                connection,
                result: Err(e),
            }) => {
                // libp2p reports ping failures but leaves the connection
                // open; a dead link must close so that it can be redialed.
                debug!(%peer, error = %e, "ping failed; closing the connection");
                self.swarm.close_connection(connection);
                vec![]
            }
            BehaviourEvent::Kad(ev) => self.on_kad_event(ev),
            BehaviourEvent::Rendezvous(ev) => self.on_rendezvous_event(ev),
            BehaviourEvent::Gossip(ev) => self.on_gossip_event(ev),
            BehaviourEvent::RelayServer(ev) => {
                self.on_relay_server_event(ev);
                vec![]
            }
            BehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            }) => vec![NetEvent::RelayReserved {
                relay: relay_peer_id,
                renewal,
            }],
            BehaviourEvent::AutonatClient(ev) => vec![self.on_autonat_test(ev)],
            BehaviourEvent::Dcutr(ev) => vec![self.on_hole_punch(ev)],
            _ => vec![],
        }
    }

    /// identify told us `peer`'s listen addresses: the swarm and (if the
    /// peer speaks it) the DHT learn them.
    fn on_identified(&mut self, peer_id: PeerId, info: identify::Info) -> NetEvent {
        let listen_addrs: Vec<Multiaddr> = info.listen_addrs.into_iter().take(32).collect();
        let speaks_kad = info.protocols.iter().any(|p| p.as_ref() == KAD_PROTOCOL);
        if speaks_kad && let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
            for a in &listen_addrs {
                k.add_address(&peer_id, a.clone());
            }
        }
        for a in &listen_addrs {
            self.swarm.add_peer_address(peer_id, a.clone());
        }
        if self.identified.len() < 1024 || self.identified.contains_key(&peer_id) {
            self.identified.insert(peer_id, listen_addrs.clone());
        }
        NetEvent::Identified {
            peer: peer_id,
            listen_addrs,
        }
    }

    fn on_autonat_test(&self, ev: autonat::v2::client::Event) -> NetEvent {
        let autonat::v2::client::Event {
            tested_addr,
            server,
            result,
            ..
        } = ev;
        let reachable = result.is_ok();
        self.counters.inc(if reachable {
            NetCount::AutonatReachable
        } else {
            NetCount::AutonatUnreachable
        });
        debug!(%server, addr = %tested_addr, reachable, "AutoNAT test");
        NetEvent::AutonatTested {
            server,
            addr: tested_addr,
            reachable,
            reason: result.err().map(|e| e.to_string()).unwrap_or_default(),
        }
    }

    fn on_hole_punch(&mut self, ev: dcutr::Event) -> NetEvent {
        let dcutr::Event {
            remote_peer_id,
            result,
        } = ev;
        let ok = result.is_ok();
        if ok {
            self.punch_failed.remove(&remote_peer_id);
        } else if self.punch_failed.len() < MAX_PUNCH_FAILED {
            // No direct path is coming: what waits for one goes now.
            self.punch_failed.insert(remote_peer_id);
            self.pump(remote_peer_id);
        }
        self.counters.inc(if ok {
            NetCount::HolePunchesOk
        } else {
            NetCount::HolePunchesFailed
        });
        let reason = result.err().map(|e| e.to_string()).unwrap_or_default();
        info!(peer = %remote_peer_id, ok, %reason, "hole punch finished");
        NetEvent::HolePunch {
            peer: remote_peer_id,
            ok,
            reason,
        }
    }

    fn on_sync_event(&mut self, ev: request_response::Event<Vec<u8>, Vec<u8>>) -> Option<NetEvent> {
        match ev {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } if request.is_empty() => {
                    // A probe (see `liveness`): the receipt is all it asks.
                    let _ = self
                        .swarm
                        .behaviour_mut()
                        .sync
                        .send_response(channel, Vec::new());
                    None
                }
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    let dropped = self.emit(NetEvent::Frame {
                        peer,
                        frame: request,
                    });
                    if dropped.is_none() {
                        // The receipt is transport-level: the frame arrived
                        // whole and was handed on. An empty body encodes
                        // `Ack { code: OK }`.
                        let _ = self
                            .swarm
                            .behaviour_mut()
                            .sync
                            .send_response(channel, Vec::new());
                    }
                    // Else the channel drops here: the stream closes with no
                    // receipt, so the sender sees a failed send and moves on
                    // to its next frame instead of waiting for a timeout.
                    None
                }
                request_response::Message::Response { request_id, .. } => {
                    self.finish(peer, request_id);
                    None
                }
            },
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error: request_response::OutboundFailure::ConnectionClosed,
                ..
            } if self.retry_closed(peer, request_id) => None,
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                self.finish(peer, request_id);
                Some(NetEvent::SendFailed {
                    peer,
                    reason: error.to_string(),
                })
            }
            // Only a frame dropped above goes unanswered; it is counted.
            request_response::Event::InboundFailure {
                error: request_response::InboundFailure::ResponseOmission,
                ..
            } => None,
            request_response::Event::InboundFailure { peer, error, .. } => {
                Some(NetEvent::InboundError {
                    peer,
                    reason: error.to_string(),
                })
            }
            request_response::Event::ResponseSent { .. } => None,
        }
    }

    fn on_kad_event(&mut self, ev: kad::Event) -> Vec<NetEvent> {
        match ev {
            kad::Event::InboundRequest { request } => match request {
                kad::InboundRequest::PutRecord {
                    source,
                    record: Some(record),
                    ..
                } => vec![NetEvent::KadInboundRecord {
                    from: source,
                    key: record.key.to_vec(),
                    value: record.value,
                }],
                kad::InboundRequest::AddProvider {
                    record: Some(provider),
                } => {
                    // The provider record names who provides; accept it only
                    // from that peer itself, so nobody can enlist others.
                    // Membership in an agent is checked by whoever dials.
                    if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                        use kad::store::RecordStore;
                        if let Err(e) = k.store_mut().add_provider(provider) {
                            debug!(error = %e, "provider not stored");
                        }
                    }
                    vec![]
                }
                _ => vec![],
            },
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => {
                let key = if step.last {
                    self.get_queries.remove(&id)
                } else {
                    self.get_queries.get(&id).cloned()
                };
                match result {
                    kad::QueryResult::GetRecord(Ok(kad::GetRecordOk::FoundRecord(r))) => {
                        vec![NetEvent::KadRecord {
                            key: r.record.key.to_vec(),
                            value: r.record.value,
                        }]
                    }
                    kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders {
                        providers,
                        ..
                    })) => {
                        let key = key.unwrap_or_default();
                        let providers = providers
                            .into_iter()
                            .take(64)
                            .map(|p| {
                                let addrs = self.known_addrs(&p);
                                (p, addrs)
                            })
                            .collect();
                        vec![NetEvent::KadProviders { key, providers }]
                    }
                    kad::QueryResult::Bootstrap(r) => {
                        if step.last || r.is_err() {
                            vec![NetEvent::KadBootstrapped {
                                ok: r.is_ok(),
                                reason: r.err().map(|e| e.to_string()).unwrap_or_default(),
                            }]
                        } else {
                            vec![]
                        }
                    }
                    _ => vec![],
                }
            }
            _ => vec![],
        }
    }

    fn known_addrs(&mut self, peer: &PeerId) -> Vec<Multiaddr> {
        let Some(k) = self.swarm.behaviour_mut().kad.as_mut() else {
            return vec![];
        };
        let mut out = Vec::new();
        for bucket in k.kbuckets() {
            for entry in bucket.iter() {
                if entry.node.key.preimage() == peer {
                    out.extend(entry.node.value.iter().cloned());
                }
            }
        }
        out
    }

    fn on_rendezvous_event(&mut self, ev: rendezvous::client::Event) -> Vec<NetEvent> {
        match ev {
            rendezvous::client::Event::Discovered {
                rendezvous_node,
                registrations,
                ..
            } => vec![NetEvent::RendezvousDiscovered {
                server: rendezvous_node,
                registrations: registrations
                    .into_iter()
                    .take(256)
                    .map(|r| Registration {
                        peer: r.record.peer_id(),
                        addrs: r.record.addresses().iter().take(32).cloned().collect(),
                        namespace: r.namespace.to_string(),
                        ttl_secs: r.ttl,
                    })
                    .collect(),
            }],
            rendezvous::client::Event::Registered {
                rendezvous_node,
                ttl,
                namespace,
            } => vec![NetEvent::RendezvousRegistered {
                server: rendezvous_node,
                namespace: namespace.to_string(),
                ttl_secs: ttl,
            }],
            rendezvous::client::Event::RegisterFailed {
                rendezvous_node,
                error,
                ..
            }
            | rendezvous::client::Event::DiscoverFailed {
                rendezvous_node,
                error,
                ..
            } => vec![NetEvent::RendezvousFailed {
                server: rendezvous_node,
                reason: format!("{error:?}"),
            }],
            _ => vec![],
        }
    }

    fn on_gossip_event(&mut self, ev: gossipsub::Event) -> Vec<NetEvent> {
        match ev {
            gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            } => {
                tracing::trace!(target: "nuwa_path", "gossip in");
                let dropped = self.emit(NetEvent::GossipMessage {
                    id: GossipId {
                        id: message_id,
                        propagation_source,
                    },
                    author: message.source,
                    topic: message.topic.to_string(),
                    data: message.data,
                });
                // Nobody will judge it: release it unforwarded and
                // unpunished (the sync stream carries the same state).
                if let Some(NetEvent::GossipMessage { id, .. }) = dropped
                    && let Some(g) = self.swarm.behaviour_mut().gossip.as_mut()
                {
                    g.report_message_validation_result(
                        &id.id,
                        &id.propagation_source,
                        gossipsub::MessageAcceptance::Ignore,
                    );
                }
                vec![]
            }
            gossipsub::Event::Subscribed { peer_id, topic } => {
                // Retry what was published before anyone listened.
                let pending = std::mem::take(&mut self.pending_publishes);
                for (t, data) in pending {
                    self.publish(t, data);
                }
                vec![NetEvent::GossipSubscribed {
                    peer: peer_id,
                    topic: topic.to_string(),
                }]
            }
            _ => vec![],
        }
    }

    /// Counts what the relay server grants and refuses.
    fn on_relay_server_event(&mut self, ev: relay::Event) {
        let c = &self.counters;
        match ev {
            relay::Event::ReservationReqAccepted { .. } => {
                c.inc(NetCount::RelayReservationsAccepted)
            }
            relay::Event::ReservationReqDenied { src_peer_id, .. } => {
                debug!(peer = %src_peer_id, "relay reservation refused");
                c.inc(NetCount::RelayReservationsDenied)
            }
            relay::Event::CircuitReqAccepted { .. } => c.inc(NetCount::RelayCircuitsAccepted),
            relay::Event::CircuitReqDenied {
                src_peer_id,
                dst_peer_id,
                ..
            } => {
                debug!(src = %src_peer_id, dst = %dst_peer_id, "relay circuit refused");
                c.inc(NetCount::RelayCircuitsDenied)
            }
            relay::Event::CircuitClosed {
                src_peer_id,
                dst_peer_id,
                error: Some(e),
            } => {
                debug!(src = %src_peer_id, dst = %dst_peer_id, error = %e, "relay circuit cut");
                c.inc(NetCount::RelayCircuitsCut)
            }
            _ => {}
        }
    }
}
