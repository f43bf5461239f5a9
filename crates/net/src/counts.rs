//! What the network counts, declared once: each counter's variant, its
//! stable name (the metric name and its key in `status`) and its help text.
//! The actor and the codec count into one shared
//! [`Counters<NetCount>`](nuwa_counters::Counters); the daemon registers
//! the whole table in its metrics registry by these names, so a new counter
//! is one line here and its uses.

nuwa_counters::table! {
    /// A counter of the network actor.
    pub enum NetCount {
        // libp2p drops a failed inbound read without an event, so the codec
        // counts these itself.
        OversizedFramesRefused => "oversized_frames_refused", "Inbound frames over the frame cap, refused before they were read";
        // libp2p-kad 0.49 drops these itself, without an event, before the
        // actor sees them; the name stays for dashboards that read it.
        KadForgedProviders => "kad_forged_providers", "DHT provider records refused because the provider was not the sender";
        // The held queue overflowed, gossipsub refused them, or the command
        // queue was behind.
        GossipPublishDropped => "gossip_publish_dropped", "Gossip publishes that did not go out";
        // Dropped because the owner was not reading events; each one's
        // stream was closed without a receipt.
        FramesDropped => "frames_dropped", "Inbound frames the network dropped rather than wait on the daemon (healed by anti-entropy)";
        // Reported to gossipsub as ignored, so not forwarded.
        GossipDropped => "gossip_dropped", "Inbound gossip the network dropped rather than wait on the daemon";
        // Droppable events (send failures, DHT and rendezvous results) when
        // the event channel was full, and must-deliver ones when even the
        // backlog was.
        EventsDropped => "events_dropped", "Other network events dropped rather than wait on the daemon";
        // The command queue was behind or the peer's send queue was full.
        OutboundFramesDropped => "outbound_frames_dropped", "Outbound frames dropped because the network was behind";
        // By `ConnectionLimits`, inbound and outbound.
        ConnectionsRefused => "connections_refused", "Connections refused by the connection limits";
        RelayReservationsAccepted => "relay_reservations_accepted", "Relay reservations granted (infrastructure node)";
        RelayReservationsDenied => "relay_reservations_denied", "Relay reservations refused by limits or rates (infrastructure node)";
        RelayCircuitsAccepted => "relay_circuits_accepted", "Relay circuits opened (infrastructure node)";
        RelayCircuitsDenied => "relay_circuits_denied", "Relay circuits refused by limits or rates (infrastructure node)";
        // A limit reached, or a side went away mid-stream.
        RelayCircuitsCut => "relay_circuits_cut", "Relay circuits cut by a limit or an error (infrastructure node)";
        RelayReservationsLost => "relay_reservations_lost", "Relay reservations of this device that ended or were refused";
        HolePunchesOk => "hole_punches_ok", "Relayed connections made direct by hole punching (DCUtR)";
        HolePunchesFailed => "hole_punches_failed", "Hole punches that failed (the relay carries the link)";
        AutonatReachable => "autonat_reachable", "AutoNAT tests that found an address of this device reachable";
        AutonatUnreachable => "autonat_unreachable", "AutoNAT tests that found an address of this device unreachable";
        BytesSentRelayed => "bytes_sent_relayed", "Frame bytes sent over relayed connections";
        BytesSentDirect => "bytes_sent_direct", "Frame bytes sent over direct connections";
        FramesDeferredForDirect => "frames_deferred_for_direct", "Frames too big for the relay held for a direct connection";
        ProbesSent => "probes_sent", "Empty frames sent after a gossip message to peers with nothing in flight (gossip has no receipts)";
        PathsRefreshed => "paths_refreshed", "Times a stalled frame made this device dial every connected peer again (a network change)";
        // The address was one of our own listeners, or the peer was
        // ourselves.
        SelfDialsSkipped => "self_dials_skipped", "Dials not made because they pointed at this device itself";
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nuwa_counters::Table;

    // Goal: every counter has its own name (two equal names would merge two
    // metrics in the daemon's registry), in the metric-name alphabet, and
    // help text.
    #[test]
    fn names_are_unique_metric_names_with_help() {
        let names: std::collections::BTreeSet<&str> =
            NetCount::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), NetCount::ALL.len());
        for c in NetCount::ALL {
            assert!(
                c.name()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{c:?}"
            );
            assert!(!c.help().is_empty(), "{c:?}");
        }
    }
}
