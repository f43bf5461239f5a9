//! The effects executor: the only place where the daemon persists,
//! acknowledges, seals and sends. Whatever order the session and the local
//! API produced work in, one call of [`Daemon::execute`] performs it as:
//!
//! 1. **persist**: local changes staged this turn and peers' changes, one
//!    group commit per (container, origin); then the DID log and key ring;
//! 2. **acknowledge**: API replies waiting on that durability;
//! 3. **seal and send**: queued local changes are flushed to peers only now,
//!    live deltas go by gossip when they fit (else over the direct stream),
//!    everything else is sealed per peer;
//! 4. **the rest**: disconnects and bookkeeping (verified peers, rejections,
//!    counters, reloading a poisoned container).
//!
//! So nothing reaches a peer, and nothing is acknowledged, before it is
//! durable here. A storage error fails every waiting reply and stops the
//! daemon (`fatal`), so nothing unacknowledged is ever reported durable.

use crate::metrics::Event;
use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result};
use nuwa_net::PeerId;
use nuwa_proto::{Frame, SyncPayload};
use nuwa_sync::{Door, Effect, Origin};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{COMPACT_AFTER_CHANGES, Daemon, load_container};
use crate::api::{self, ApiError, ErrorCode, PutReply, RevokeReply};
use crate::home;

/// A reply that waits for the durability of what its request wrote.
pub(super) enum Ack {
    Put {
        reply: oneshot::Sender<Result<PutReply, ApiError>>,
        container: String,
        key: String,
    },
    Value(
        oneshot::Sender<Result<serde_json::Value, ApiError>>,
        serde_json::Value,
    ),
    Revoke(oneshot::Sender<Result<RevokeReply, ApiError>>, RevokeReply),
    Batch(
        oneshot::Sender<Result<crate::api::BatchReply, ApiError>>,
        crate::api::BatchReply,
    ),
}

impl Ack {
    fn fail(self, e: ApiError) {
        match self {
            Ack::Put { reply, .. } => drop(reply.send(Err(e))),
            Ack::Value(reply, _) => drop(reply.send(Err(e))),
            Ack::Revoke(reply, _) => drop(reply.send(Err(e))),
            Ack::Batch(reply, _) => drop(reply.send(Err(e))),
        }
    }
}

impl Daemon {
    /// Stages a local change: it is persisted (origin `local`) by the next
    /// [`Daemon::execute`], before any reply or send.
    pub(super) fn stage(&mut self, container: &str, change: Option<Vec<u8>>) {
        if let Some(change) = change {
            self.staged.push((container.to_owned(), change));
        }
    }

    /// Performs `effects` plus every staged local change, in the order the
    /// module docs give, then answers `acks`.
    pub(super) async fn execute(&mut self, effects: Vec<Effect>, acks: Vec<Ack>) {
        if acks.is_empty() {
            if let Some(deferred) = self.deferred.as_mut() {
                // Inside a run of network events: executed, in order, at its
                // end (nothing waits on these effects but the peer).
                deferred.extend(effects);
                return;
            }
        }
        // 1. Persist. Group commits per (container, origin), in first-seen
        // order of containers.
        let mut persist: BTreeMap<(String, Origin), Vec<Vec<u8>>> = BTreeMap::new();
        for (container, change) in std::mem::take(&mut self.staged) {
            persist
                .entry((container, Origin::Local))
                .or_default()
                .push(change);
        }
        let mut rest = Vec::with_capacity(effects.len());
        let mut persist_log = false;
        let mut sealed_at: Vec<u64> = Vec::new();
        let mut persist_keys: Option<Option<Vec<u8>>> = None;
        for e in effects {
            match e {
                Effect::Persist {
                    container,
                    changes,
                    origin,
                    sealed_at_ms,
                } => {
                    if let Some(t) = sealed_at_ms {
                        sealed_at.push(t);
                    }
                    persist
                        .entry((container, origin))
                        .or_default()
                        .extend(changes)
                }
                Effect::PersistLog => persist_log = true,
                Effect::PersistKeys { grant } => {
                    // A later grant replaces an earlier one of this turn.
                    let keep = grant.or_else(|| persist_keys.take().flatten());
                    persist_keys = Some(keep);
                }
                other => rest.push(other),
            }
        }
        let registry_changed = persist
            .keys()
            .any(|(c, _)| c == super::asm::REGISTRY_CONTAINER);
        if let Err(e) = self.persist(persist).await {
            let msg = format!("{e:#}");
            for a in acks {
                a.fail(ApiError::new(ErrorCode::StorageFailed, msg.clone()));
            }
            self.fatal = Some(e);
            return;
        }
        if registry_changed {
            // Schemas replicate through the registry container: rebuild the
            // registry (and the reader's) as soon as it is durable.
            self.refresh_registry();
        }
        let durable_at = home::now_ms();
        for t in sealed_at {
            self.metrics
                .observe_propagation_apply(std::time::Duration::from_millis(
                    durable_at.saturating_sub(t),
                ));
        }
        if let Some(grant) = persist_keys {
            // Keys before the grant: a grant whose key is lost would be
            // forwarded to peers by a device that cannot use it.
            if let Err(e) = home::save_keys(&self.home_dir, self.session.secure().keys()) {
                warn!(error = %e, "cannot persist the key ring");
            }
            if let Some(grant) = grant {
                if let Err(e) = home::save_grant(&self.home_dir, &grant) {
                    warn!(error = %e, "cannot persist the epoch grant");
                }
            }
        }
        if persist_log {
            rest.extend(self.rebase_after_fork());
            if let Err(e) = home::save_log(&self.home_dir, self.session.log()) {
                warn!(error = %e, "cannot persist the newer DID log");
            }
        }

        // 2. Acknowledge.
        for a in acks {
            match a {
                Ack::Put {
                    reply,
                    container,
                    key,
                } => {
                    let heads = self.heads_hex(&container);
                    let _ = reply.send(Ok(PutReply {
                        container,
                        key,
                        heads,
                        durable: true,
                    }));
                }
                Ack::Value(reply, v) => drop(reply.send(Ok(v))),
                Ack::Revoke(reply, r) => drop(reply.send(Ok(r))),
                Ack::Batch(reply, mut r) => {
                    // Heads as they are now that everything is durable.
                    for c in &mut r.containers {
                        c.heads = self.heads_hex(&c.container);
                    }
                    drop(reply.send(Ok(r)))
                }
            }
        }

        // 3. Seal and send: local changes leave only now that they are
        // durable.
        rest.extend(self.session.flush());
        let now = home::now_ms();
        let mut published: BTreeSet<String> = BTreeSet::new();
        let mut later = Vec::new();
        for e in rest {
            match e {
                Effect::Send { peer, payload } => {
                    self.send_payload(peer, payload, now, &mut published).await;
                }
                Effect::SendHello { peer, hello } => {
                    if let Ok(p) = peer.parse::<PeerId>() {
                        let _ = self.net.send(p, Frame::Hello(*hello).encode()).await;
                    }
                }
                Effect::SendFrame { peer, frame } => {
                    if let Ok(p) = peer.parse::<PeerId>() {
                        let _ = self.net.send(p, frame.encode()).await;
                    }
                }
                other => later.push(other),
            }
        }

        // 4. The rest.
        for e in later {
            self.bookkeep(e).await;
        }
    }

    /// Seals one payload. A live delta goes once per container through
    /// gossip when it fits (one publish reaches every device), else over
    /// the direct stream.
    async fn send_payload(
        &mut self,
        peer: String,
        payload: SyncPayload,
        now: u64,
        published: &mut BTreeSet<String>,
    ) {
        let Ok(peer_id) = peer.parse::<PeerId>() else {
            return;
        };
        // A live delta is published once, whatever the number of peers;
        // packs partition containers, so their first one names them.
        let delta = match &payload {
            SyncPayload::Delta { container, .. } => Some(container.clone()),
            SyncPayload::Deltas(list) => list.first().map(|(c, _)| format!("\0pack:{c}")),
            _ => None,
        };
        if let Some(c) = &delta {
            if published.contains(c) {
                return;
            }
        }
        let bytes = match self.session.seal(&payload, now) {
            Ok(env) => Frame::Envelope(env).encode(),
            Err(e) => {
                warn!(error = %e, "cannot seal a payload");
                return;
            }
        };
        if let Some(c) = delta {
            if bytes.len() <= nuwa_net::MAX_GOSSIP_BYTES {
                self.count(Event::GossipDeltasPublished);
                // Sealed bytes handed to gossip (each mesh peer gets a copy).
                self.add(Event::BytesSent, bytes.len() as u64);
                let _ = self
                    .net
                    .gossip_publish(self.wide.topic.clone(), bytes)
                    .await;
                published.insert(c);
                return;
            }
            self.count(Event::DeltasOverStream);
        }
        if bytes.len() > nuwa_proto::MAX_FRAME_BYTES {
            self.count(Event::FrameTooLarge);
            warn!(%peer_id, len = bytes.len(), "payload exceeds the frame cap; relying on the sync protocol");
            return;
        }
        self.count(Event::FramesSent);
        self.add(Event::BytesSent, bytes.len() as u64);
        let _ = self.net.send(peer_id, bytes).await;
    }

    async fn bookkeep(&mut self, e: Effect) {
        let now = home::now_ms();
        match e {
            Effect::Disconnect { peer } => {
                if let Ok(p) = peer.parse::<PeerId>() {
                    let _ = self.net.disconnect(p).await;
                }
            }
            Effect::PeerVerified {
                peer,
                context_id,
                name,
            } => {
                info!(%peer, context_id = %context_id, "peer verified");
                self.seen.saw(&context_id, &name, now);
                self.save_seen();
                if let Ok(p) = peer.parse::<PeerId>() {
                    self.on_verified(p).await;
                }
            }
            Effect::PeerGone { peer, context_id } => {
                info!(%peer, context_id = %context_id, "peer disconnected");
                self.seen.saw(&context_id, "", now);
                self.save_seen();
            }
            Effect::Rejected {
                peer,
                door,
                rejection,
            } => {
                // The first rejection of a peer for a reason is logged; the
                // rest are counted (`status`, metrics), or a revoked device
                // that redials would fill the log.
                let repeat = self
                    .rejections
                    .get(&(door.as_str().to_owned(), peer.clone()))
                    .is_some_and(|r| r.label == rejection.label());
                match door {
                    Door::Connection if repeat => {
                        debug!(%peer, reason = %rejection, "peer rejected again")
                    }
                    Door::Connection => info!(
                        %peer,
                        reason = %rejection,
                        "peer rejected (repeats are counted in `nuwa-node status`, not logged)"
                    ),
                    Door::Gossip => debug!(%peer, reason = %rejection, "gossip rejected"),
                    Door::Keeper => {
                        debug!(%peer, reason = %rejection, "envelope from the keeper rejected")
                    }
                }
                self.reject(door.as_str(), peer, &rejection);
            }
            Effect::EnvelopeRejected {
                peer,
                label,
                reason,
            } => {
                self.metrics.envelope_rejected(label);
                debug!(%peer, %reason, "envelope rejected");
            }
            Effect::LogExtended => {
                info!(len = self.session.log().len(), "adopted a newer DID log");
                self.check_revoked();
                if self.revoked {
                    // check_revoked said what it means.
                } else if let Err(r) = self.session.self_authorised(now) {
                    warn!(
                        reason = %r,
                        "this device is no longer an active device of the agent (revoked?); \
                         its peers will refuse it and it receives nothing new"
                    );
                }
                self.retry_unknown_announcements().await;
                // The pointer carries the proof of the current document:
                // publish the new one at the next tick.
                self.wide.next_pointer_ms = 0;
            }
            Effect::EpochAdopted { peer, epoch } => {
                info!(%peer, epoch, "adopted a new key epoch");
            }
            Effect::GrantRejected { peer, reason } => {
                if self.revoked {
                    // Expected: a revoked device gets no grant (said once).
                    debug!(%peer, %reason, "epoch grant rejected");
                } else {
                    warn!(%peer, %reason, "epoch grant rejected");
                }
            }
            Effect::Converged { peer, container } => {
                let ctx = self.session.context_of(&peer).unwrap_or_default();
                info!(container = %container, peer_context = %ctx, "container converged with peer");
            }
            Effect::Poisoned { container, error } => {
                self.reload_poisoned(container, error).await;
            }
            Effect::ClockSkew { peer, offset_ms } => {
                self.count(Event::ClockSkewDetected);
                // Redials repeat this every few seconds: warn when the
                // offset first appears or moves, not on every Hello.
                let last = self.skew_warned.insert(peer.clone(), offset_ms);
                if last.is_none_or(|l| (l - offset_ms).abs() > 10_000) {
                    warn!(
                        %peer,
                        offset_ms,
                        window_ms = nuwa_sync::secure::REPLAY_WINDOW_SECS * 1000,
                        "clock_skew: a device of this agent has a clock beyond the replay window; \
                         nothing syncs with it until the wrong clock is fixed (enable NTP)"
                    );
                }
            }
            Effect::Count(c) => self.count(c.into()),
            Effect::Persist { .. }
            | Effect::PersistLog
            | Effect::PersistKeys { .. }
            | Effect::Send { .. }
            | Effect::SendFrame { .. }
            | Effect::SendHello { .. } => {
                // Performed in the earlier phases of `execute`.
            }
        }
    }

    pub(super) fn heads_hex(&self, container: &str) -> Vec<String> {
        self.session
            .engine()
            .heads_of(container)
            .map(|h| h.iter().map(hex::encode).collect())
            .unwrap_or_default()
    }

    /// Makes every batch durable: one group commit (one flush) for all the
    /// containers of this turn, then reports each as a change event.
    async fn persist(&mut self, batches: BTreeMap<(String, Origin), Vec<Vec<u8>>>) -> Result<()> {
        let mut logged: Vec<(String, Origin, Vec<Vec<u8>>)> = Vec::with_capacity(batches.len());
        for ((container, origin), changes) in batches {
            let n = changes.len() as u64;
            let big = n >= COMPACT_AFTER_CHANGES || self.catch_ups.has_snapshot(&container);
            if big && self.session.engine().container(&container).is_some() {
                // A batch this large (a cold sync, a long partition healing)
                // would be compacted right after being logged. The document
                // already holds every one of these changes, so one snapshot
                // makes them durable at a fraction of the cost of logging
                // each (a 100,000-change cold sync: one ~0.5 MB write
                // instead of ~90 MB of log). Nothing is acknowledged before
                // it returns.
                drop(changes);
                self.compact(&container).await?;
                // The reader reloads it from the snapshot when next asked.
                self.reader.reset(&container);
                self.emit_change_event(&container, n as usize, origin);
            } else {
                logged.push((container, origin, changes));
            }
        }
        if logged.is_empty() {
            return Ok(());
        }
        let records = self.heads_records(&logged);
        let store = self.store.clone();
        let (seqs, logged) = tokio::task::spawn_blocking(move || {
            let batches: Vec<(&str, &[Vec<u8>])> = logged
                .iter()
                .map(|(c, _, changes)| (c.as_str(), changes.as_slice()))
                .collect();
            let seqs = store.append_many_with_meta(&batches, &records);
            seqs.map(|s| (s, logged))
        })
        .await
        .context("store task panicked")?
        .context("cannot persist changes")?;
        for ((container, origin, changes), seq) in logged.into_iter().zip(seqs) {
            let n = changes.len() as u64;
            // Durable: readers may see it now (before any acknowledgement).
            self.reader.changes(&container, &changes);
            self.last_seq.insert(container.clone(), seq);
            self.emit_change_event(&container, n as usize, origin);
            let count = self.logged.entry(container.clone()).or_default();
            *count += n;
            if *count >= COMPACT_AFTER_CHANGES {
                self.compact(&container).await?;
            }
        }
        Ok(())
    }

    /// The heads records of the containers about to be logged, as they will
    /// be once the append is done (see `heads_record.rs`).
    fn heads_records(&self, logged: &[(String, Origin, Vec<Vec<u8>>)]) -> Vec<(String, Vec<u8>)> {
        let mut after: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for (c, _, changes) in logged {
            let n = changes.len() as u64;
            let e = after.entry(c.as_str()).or_insert_with(|| {
                (
                    self.last_seq.get(c).copied().unwrap_or(0),
                    self.logged.get(c).copied().unwrap_or(0),
                )
            });
            e.0 += n;
            e.1 += n;
        }
        let engine = self.session.engine();
        after
            .into_iter()
            .filter_map(|(c, (last_seq, logged))| {
                let record = super::heads_record::HeadsRecord {
                    heads: engine.heads_of(c)?,
                    changes: engine.change_count_of(c)? as u64,
                    last_seq,
                    logged,
                };
                Some((super::heads_record::key(c), record.encode()?))
            })
            .collect()
    }

    fn emit_change_event(&self, container: &str, n: usize, origin: Origin) {
        if self.events.receiver_count() > 0 {
            let _ = self.events.send(api::ChangeEvent {
                container: container.to_owned(),
                changes: n,
                heads: self.heads_hex(container),
                origin: origin.as_str(),
                at_unix_ms: home::now_ms(),
            });
        }
    }

    pub(super) async fn compact(&mut self, container: &str) -> Result<()> {
        self.session
            .ensure_loaded(container)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let Some(doc) = self.session.engine().container(container) else {
            return Ok(());
        };
        // Every logged change up to `covers` is already in the document.
        // A catch-up's worker may have saved exactly this document already.
        let heads = doc.heads();
        let (mut snapshot, final_form) = match self.catch_ups.take_snapshot(container, &heads) {
            // Already compressed as the container asks.
            Some(ready) => {
                debug!(
                    container,
                    bytes = ready.len(),
                    "snapshot saved off the loop"
                );
                (ready, true)
            }
            None => (doc.save(), false),
        };
        if let (false, Some(c)) = (
            final_form,
            self.asm.registry.get(container).and_then(|s| s.compression),
        ) {
            let plain = snapshot.len();
            snapshot = crate::snapshot::compress(&snapshot, c)?;
            debug!(
                container,
                plain,
                stored = snapshot.len(),
                "compressed snapshot"
            );
        }
        let covers = self.last_seq.get(container).copied().unwrap_or(0);
        let store = self.store.clone();
        let name = container.to_owned();
        tokio::task::spawn_blocking(move || store.save_snapshot(&name, &snapshot, covers))
            .await
            .context("store task panicked")?
            .with_context(|| format!("cannot compact container {container:?}"))?;
        self.logged.insert(container.to_owned(), 0);
        debug!(container, "compacted");
        Ok(())
    }

    /// Automerge panicked on a peer's bytes: the engine dropped the
    /// half-updated container, and it is rebuilt from the store, which holds
    /// everything the container held before (every change is persisted
    /// before the next input is handled). The daemon keeps running.
    async fn reload_poisoned(&mut self, name: String, error: String) {
        self.count(Event::ContainersPoisoned);
        warn!(container = %name, %error, "peer input left the container untrustworthy; reloading it from the store");
        let store = self.store.clone();
        let actor = self.session.membership().device().public().to_vec();
        let task_name = name.clone();
        let loaded =
            tokio::task::spawn_blocking(move || load_container(store.as_ref(), &actor, &task_name))
                .await
                .context("store task panicked");
        match loaded {
            Ok(Ok(Some(loaded))) => {
                self.session
                    .insert_container(name.clone(), loaded.container);
                self.last_seq.insert(name.clone(), loaded.last_seq);
                self.logged.insert(name, loaded.logged);
            }
            // Never persisted: the container was empty before this input.
            Ok(Ok(None)) => {}
            Ok(Err(err)) | Err(err) => {
                self.fatal = Some(err.context(format!("cannot reload container {name:?}")));
            }
        }
    }
}

impl Daemon {
    /// The session adopted a peer's DID log. If it was not an extension of
    /// the one on disk but another branch that won the fork rule, the DID
    /// updates this home signed on the losing branch are gone: sign their
    /// changes again, as one update on top of the winner, and hand it to
    /// the session (its effects send it to every peer). Returns those
    /// effects; nothing when no update of ours was dropped.
    fn rebase_after_fork(&mut self) -> Vec<Effect> {
        let Ok(old) = home::read_log(&self.home_dir) else {
            return Vec::new();
        };
        let new = self.session.log().clone();
        if new.hash_at(old.len() - 1) == Some(old.head_hash()) {
            return Vec::new(); // an extension: nothing dropped
        }
        self.count(Event::DidLogForksLost);
        let mut own = vec![self.session.membership().device().public()];
        if let Ok(bytes) = std::fs::read(self.home_dir.join(home::MASTER_KEY)) {
            if let Ok(k) = nuwa_identity::keys::DeviceKey::from_seed_file_bytes(&bytes) {
                own.push(k.public());
            }
        }
        let Some((doc, n)) = crate::lifecycle::rebased_document(&old, &new, &own) else {
            info!(
                "DID log fork: another branch won the fork rule; no update of this device was dropped"
            );
            return Vec::new();
        };
        let now_secs = home::now_unix_secs();
        let admin = match self.admin_key(now_secs) {
            Ok(a) => a,
            Err(_) => {
                warn!(
                    updates = n,
                    "DID log fork: another branch won and it took this device's admin rights, \
                     so its {n} dropped update(s) cannot be signed again; if that branch is not \
                     yours, recover with the recovery words (`nuwa-node recover`)"
                );
                return Vec::new();
            }
        };
        let mut log = new;
        if let Err(e) = log.append_document(&doc, &admin.key, &admin.key_id, now_secs) {
            warn!(error = %e, "DID log fork: cannot sign this device's dropped updates again");
            return Vec::new();
        }
        match self.session.adopt_own_update(log, None, home::now_ms()) {
            Ok(effects) => {
                for _ in 0..n {
                    self.count(Event::DidLogUpdatesRebased);
                }
                info!(
                    updates = n,
                    "DID log fork: another branch won the fork rule; this device's dropped \
                     updates were signed again on top of it"
                );
                effects
            }
            Err(e) => {
                warn!(error = %e, "DID log fork: the re-signed update was refused");
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Goal: the executor persists before it acknowledges or sends, for
    //! local and remote writes alike. Method: a real daemon core (session,
    //! executor, ASM) over a store that, at every persist, checks that no
    //! network command has been issued and no reply delivered since the
    //! batch began; a batch holds a `Put` then a writing `Tool`, the shape
    //! that used to push the put's delta before the put was durable.

    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use nuwa_store::{ContainerRecord, MemStore, Storage, StoreError};
    use tokio::sync::oneshot;

    use super::super::{Daemon, RunOptions, open_session};
    use crate::api::{ApiRequest, PutBody};
    use crate::home;

    type Check = Box<dyn Fn(&str) + Send + Sync>;

    /// A store that runs a check before every write it makes durable.
    struct CheckingStore {
        inner: MemStore,
        check: Mutex<Option<Check>>,
        persisted: Mutex<Vec<String>>,
    }

    impl CheckingStore {
        fn before_write(&self, what: &str) {
            if let Some(check) = self.check.lock().unwrap().as_ref() {
                check(what);
            }
            self.persisted.lock().unwrap().push(what.to_owned());
        }
    }

    impl Storage for CheckingStore {
        fn append_changes(&self, c: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
            self.before_write(c);
            self.inner.append_changes(c, changes)
        }
        fn save_snapshot(&self, c: &str, s: &[u8], covers: u64) -> Result<(), StoreError> {
            self.before_write(c);
            self.inner.save_snapshot(c, s, covers)
        }
        fn load_container(&self, c: &str) -> Result<Option<ContainerRecord>, StoreError> {
            self.inner.load_container(c)
        }
        fn list_containers(&self) -> Result<Vec<String>, StoreError> {
            self.inner.list_containers()
        }
        fn put_meta(&self, k: &str, v: &[u8]) -> Result<(), StoreError> {
            self.inner.put_meta(k, v)
        }
        fn get_meta(&self, k: &str) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.get_meta(k)
        }
        fn flush(&self) -> Result<(), StoreError> {
            self.inner.flush()
        }
    }

    fn options() -> RunOptions {
        RunOptions {
            listen: Vec::new(),
            peers: Vec::new(),
            known_peers: false,
            mdns: false,
            mdns_interfaces: Vec::new(),
            dht: false,
            bootstrap: Vec::new(),
            rendezvous: false,
            rendezvous_servers: Vec::new(),
            keepers: Vec::new(),
            api_listen: "127.0.0.1:0".parse().unwrap(),
            memory_budget_mb: 256,
            once: None,
            lifecycle_every: Duration::from_secs(3600),
        }
    }

    #[tokio::test]
    async fn a_batch_is_persisted_before_it_is_acknowledged_or_sent() {
        let dir = tempfile::tempdir().unwrap();
        let a_dir = dir.path().join("a");
        let b_dir = dir.path().join("b");
        home::init(
            &a_dir,
            "a",
            &nuwa_identity::keys::DeviceKey::generate().unwrap().public(),
        )
        .unwrap();
        home::provision(&a_dir, &b_dir, "b").unwrap();
        let a = home::load(&a_dir).unwrap();
        let b = home::load(&b_dir).unwrap();

        let store = Arc::new(CheckingStore {
            inner: MemStore::new(),
            check: Mutex::new(None),
            persisted: Mutex::new(Vec::new()),
        });
        let opened = open_session(&a, store.as_ref()).unwrap();
        let a_peer = nuwa_net::peer_id_from_public(&a.device.public()).unwrap();
        let net = nuwa_net::NetHandle::detached(a_peer);
        let (events, _) = tokio::sync::broadcast::channel(16);
        let mut d = Daemon::new(
            &a,
            opened,
            store.clone(),
            net.clone(),
            Vec::new(),
            String::new(),
            &options(),
            false,
            events,
            Arc::new(crate::metrics::Metrics::new()),
            super::super::reader::spawn(
                store.clone(),
                a.device.public().to_vec(),
                nuwa_asm::registry::Registry::with_core(),
                16,
            )
            .unwrap()
            .0,
        );
        d.asm_start().await;
        d.execute(Vec::new(), Vec::new()).await;

        // B connects and proves itself, so writes have somewhere to go.
        let b_peer = nuwa_net::peer_id_from_public(&b.device.public()).unwrap();
        let now = home::now_ms();
        let effects = d.session.connected(
            &b_peer.to_string(),
            Some(b.device.public()),
            "/ip4/127.0.0.1/tcp/1".into(),
            now,
        );
        d.execute(effects, Vec::new()).await;
        let b_membership = nuwa_sync::Membership::new(
            b.log.clone(),
            b.info.context_id.clone(),
            "b".into(),
            nuwa_identity::keys::DeviceKey::from_seed(&b.device.seed()),
        );
        let hello = b_membership.hello(now).unwrap();
        let effects = d.session.on_hello(&b_peer.to_string(), &hello, now);
        d.execute(effects, Vec::new()).await;
        assert_eq!(d.session.verified().count(), 1, "b must be verified");

        // The batch: a put, then a tool that writes (a schema registration).
        let (put_tx, put_rx) = oneshot::channel();
        let (tool_tx, tool_rx) = oneshot::channel();
        let replies = Arc::new(Mutex::new((put_rx, tool_rx)));
        let commands_before = net.commands_issued();
        {
            let net = net.clone();
            let replies = replies.clone();
            *store.check.lock().unwrap() = Some(Box::new(move |container: &str| {
                assert_eq!(
                    net.commands_issued(),
                    commands_before,
                    "something went to the network before {container:?} was durable"
                );
                let mut r = replies.lock().unwrap();
                assert!(
                    r.0.try_recv().is_err() && r.1.try_recv().is_err(),
                    "a reply was delivered before {container:?} was durable"
                );
            }));
        }
        store.persisted.lock().unwrap().clear();
        let schema: serde_json::Value = serde_json::from_str(include_str!(
            "../../../crates/asm/schemas/examples/note.json"
        ))
        .unwrap();
        d.on_api_batch(vec![
            ApiRequest::Put(
                PutBody {
                    container: "notes".into(),
                    key: "today".into(),
                    value: serde_json::json!("buy milk"),
                },
                put_tx,
            ),
            ApiRequest::Tool(crate::api::Tool::SchemaAdd(schema), tool_tx),
        ])
        .await;
        assert!(d.fatal.is_none());
        let persisted = store.persisted.lock().unwrap().clone();
        assert!(
            persisted.iter().any(|c| c == "notes")
                && persisted
                    .iter()
                    .any(|c| c == super::super::asm::REGISTRY_CONTAINER),
            "both writes persisted: {persisted:?}"
        );
        assert!(
            net.commands_issued() > commands_before,
            "the writes were pushed to the verified peer after persisting"
        );
        let mut r = replies.lock().unwrap();
        let put = r.0.try_recv().expect("put answered").expect("put accepted");
        assert!(put.durable);
        r.1.try_recv()
            .expect("tool answered")
            .expect("tool accepted");
    }
}
