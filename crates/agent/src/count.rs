//! What the agent counts, declared once: each counter's name (its metric
//! name and its key in `status`) and help. The agent reports counts as
//! [`Effect::Count`](crate::Effect::Count); the shell keeps the values and
//! registers this table into its metrics registry.

nuwa_counters::table! {
    /// A counted event of the agent.
    pub enum Count {
        BytesSent => "bytes_sent", "Sealed bytes handed to the network (frames and gossip publishes)";
        FramesSent => "frames_sent", "Sealed frames sent over direct streams";
        FrameTooLarge => "frame_too_large", "Payloads over the frame cap, left to the sync protocol";
        GossipDeltasPublished => "gossip_deltas_published", "Live deltas published on the agent's gossip topic";
        DeltasOverStream => "deltas_over_stream", "Live deltas too large for gossip, sent over direct streams";
        SendFailed => "send_failed", "Frames the network could not deliver";
        InboundFrameError => "inbound_frame_error", "Unreadable inbound frames";
        MalformedFrame => "malformed_frame", "Frames that did not decode";
        DialFailed => "dial_failed", "Failed dials";
        ClockSkewDetected => "clock_skew_detected", "Genuine Hellos refused because the peer's clock is beyond the replay window";
        ContainersPoisoned => "containers_poisoned", "Containers reloaded from the store after Automerge panicked on peer input";
        ContainersEvicted => "containers_evicted", "Containers whose document left memory (idle, or over the memory budget); they load again on use";
        DevicesRevoked => "devices_revoked", "Devices revoked from this device";
        ExpiredDevicesPruned => "expired_devices_pruned", "Devices whose --expires ran out, removed from the DID chain by this device (one update and key epoch per prune)";
        PeersRefusedExpired => "peers_refused_expired", "Hellos, gossip and keeper envelopes refused because the sender's device expired (--expires)";
        EpochGrantsResealed => "epoch_grants_resealed", "Grants of the current key epoch sealed to one member device that lacked it (paired on a branch that met this epoch late)";
        DidLogForksLost => "did_log_forks_lost", "DID log forks (two admins' concurrent updates) this device resolved for the other branch (the fork rule)";
        DidLogUpdatesRebased => "did_log_updates_rebased", "This device's DID updates of a branch that lost a fork, signed again on top of the winner";
        DhtBootstrapFailed => "dht_bootstrap_failed", "Failed DHT bootstraps";
        DhtPointerTopicMismatch => "dht_pointer_topic_mismatch", "Verified DHT pointers naming another topic";
        DhtPointersVerified => "dht_pointers_verified", "DHT pointers of this agent that verified";
        DhtRecordsStored => "dht_records_stored", "Inbound DHT records stored after verification";
        DhtPeersFound => "dht_peers_found", "Devices of this agent found through the DHT";
        RendezvousPeersFound => "rendezvous_peers_found", "Devices of this agent found through rendezvous";
        RendezvousFailed => "rendezvous_failed", "Failed rendezvous requests";
        MdnsAnnouncementsVerified => "mdns_announcements_verified", "mDNS announcements of this agent that verified";
        LifecycleItemsRemoved => "lifecycle_items_removed", "Lifecycle passes that removed expired items";
        ContainersRepaired => "containers_repaired", "Typed containers whose broken layout state.reset put back";
        SchemasRefusedFromPeers => "schemas_refused_from_peers", "Replicated schemas that did not register";
        PairingAnnouncementsRejected => "pairing_announcements_rejected", "Pairing announcements refused";
        PairingApprovalsStarted => "pairing_approvals_started", "Approvals started";
        PairingApprovalsSucceeded => "pairing_approvals_succeeded", "Approvals that paired a device";
        PairingApprovalsFailed => "pairing_approvals_failed", "Approvals that failed";
        PairingFramesUnexpected => "pairing_frames_unexpected", "Pairing frames outside an approval";
        KeeperPushes => "keeper_pushes", "Pushes a keeper acknowledged (durable there)";
        KeeperEnvelopesApplied => "keeper_envelopes_applied", "Envelopes pulled from a keeper that verified and opened, applied with their page (or already held)";
        KeeperEnvelopesRefused => "keeper_envelopes_refused", "Envelopes pulled from a keeper that did not verify or open";
        KeeperRefusals => "keeper_refusals", "Requests a keeper refused";
        KeeperRollbacks => "keeper_rollbacks", "Times a keeper held less than it was seen to hold (a store rolled back)";
        KeeperCompactionsTooBig => "keeper_compactions_too_big", "Snapshots not pushed because the history exceeds one push";
        KeeperResponsesUnexpected => "keeper_responses_unexpected", "Keeper responses nobody asked for (dropped)";
    }
}
