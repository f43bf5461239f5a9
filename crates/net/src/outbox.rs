//! How the network actor and its owner (the daemon) hand work to each other
//! without either ever waiting on the other.
//!
//! Two bounded queues connect them: commands flow in, events flow out. If
//! the actor awaited room in the event queue while the owner awaited room in
//! the command queue, a burst in both directions would leave each waiting
//! on the other for ever. So the rule is one-sided on purpose:
//!
//! - **The actor never awaits the owner.** Events go out with `try_send`
//!   through an [`Outbox`]. Events that nothing re-sends (a connection
//!   opened or closed, a listen address, identify's report) *must be
//!   delivered*: when the channel is full they wait, in order, in a bounded
//!   backlog that the actor moves into the channel as room appears, polled
//!   in its `select!` next to the swarm and never instead of it. Everything
//!   else is *droppable* and is dropped and counted when the channel is full
//!   or the backlog is not empty (it may not overtake older events):
//!   inbound sync frames (the owner's anti-entropy re-sends heads every few
//!   seconds, and a dropped frame's stream is closed without a receipt so
//!   its sender sees the failure and moves on), gossip (reported `Ignore`,
//!   so it is not forwarded, and the sync stream covers it) and DHT or
//!   rendezvous results (the owner repeats its lookups and registrations).
//!   If even the backlog is full the event is dropped and counted: a bound
//!   that a working owner never reaches.
//! - **The owner never waits on the network for data.** `NetHandle::send`
//!   and `gossip_publish` use `try_send` and give up (counted) once the
//!   command queue holds [`DATA_SHARE`] commands; anti-entropy heals what
//!   they drop. Control commands (dial, disconnect, DHT and rendezvous
//!   requests, gossip verdicts) must not be lost, so they go through the
//!   *same* queue, keeping their order relative to frames (a frame sent
//!   before a disconnect is not sent after a later reconnect), with an
//!   awaiting `send`. Data can fill at most [`DATA_SHARE`] of the
//!   [`COMMAND_QUEUE`] slots, so a control command finds room at once
//!   unless thousands of control commands are already queued; and even
//!   then the wait ends, because the actor, which never waits on the owner,
//!   keeps draining the queue. No unbounded queue is involved anywhere.

use std::collections::VecDeque;

use tokio::sync::mpsc::{self, error::TrySendError};

/// Slots of the command queue (owner to actor).
pub(crate) const COMMAND_QUEUE: usize = 8192;
/// The most commands the queue may hold before data (frames, publishes) is
/// dropped instead of queued; the rest is kept for control commands.
pub(crate) const DATA_SHARE: usize = COMMAND_QUEUE / 2;
/// Slots of the event channel (actor to owner).
pub(crate) const EVENT_QUEUE: usize = 1024;
/// Must-deliver events held while the event channel is full.
pub(crate) const MAX_BACKLOG: usize = 16 * 1024;

/// Whether an event may be dropped when its receiver is behind.
pub(crate) trait Delivery {
    /// True for events that nothing repeats, so losing one would leave the
    /// receiver with a wrong picture (a peer it thinks is connected, say).
    fn must_deliver(&self) -> bool;
}

/// The receiver has gone away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Closed;

/// The sending end of the event channel, with its ordered backlog of
/// must-deliver events. Nothing here awaits except [`Outbox::drain`], which
/// the actor polls next to its other work.
pub(crate) struct Outbox<T> {
    tx: mpsc::Sender<T>,
    backlog: VecDeque<T>,
    max_backlog: usize,
}

impl<T: Delivery> Outbox<T> {
    pub(crate) fn new(tx: mpsc::Sender<T>, max_backlog: usize) -> Self {
        Outbox {
            tx,
            backlog: VecDeque::new(),
            max_backlog,
        }
    }

    /// Hands `item` over without waiting. Returns it back when it was
    /// dropped (the caller counts it and releases what it stands for);
    /// `None` when it was sent, held in the backlog, or the receiver is gone
    /// (see [`Outbox::is_closed`]).
    pub(crate) fn push(&mut self, item: T) -> Option<T> {
        self.flush();
        let item = if self.backlog.is_empty() {
            match self.tx.try_send(item) {
                Ok(()) | Err(TrySendError::Closed(_)) => return None,
                Err(TrySendError::Full(item)) => item,
            }
        } else {
            item
        };
        // A droppable event may not overtake held ones, and a full backlog
        // takes nothing more.
        if !item.must_deliver() || self.backlog.len() >= self.max_backlog {
            return Some(item);
        }
        self.backlog.push_back(item);
        None
    }

    /// Whether must-deliver events are waiting for room.
    pub(crate) fn has_backlog(&self) -> bool {
        !self.backlog.is_empty()
    }

    pub(crate) fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Waits for room in the channel, then moves held events into it,
    /// oldest first, as far as room allows. Pending for ever when nothing is
    /// held, so poll it only when [`Outbox::has_backlog`].
    ///
    /// Cancel safe: until room is reserved nothing has moved, and after that
    /// nothing awaits.
    pub(crate) async fn drain(&mut self) -> Result<(), Closed> {
        if self.backlog.is_empty() {
            return std::future::pending().await;
        }
        let permit = self.tx.reserve().await.map_err(|_| Closed)?;
        match self.backlog.pop_front() {
            Some(item) => permit.send(item),
            None => drop(permit),
        }
        self.flush();
        Ok(())
    }

    /// Moves held events into the channel while it has room.
    fn flush(&mut self) {
        while let Some(item) = self.backlog.pop_front() {
            match self.tx.try_send(item) {
                Ok(()) => {}
                Err(TrySendError::Full(item) | TrySendError::Closed(item)) => {
                    self.backlog.push_front(item);
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    /// A test event: its number, and whether it must be delivered.
    #[derive(Debug)]
    struct Ev(u32, bool);

    impl Delivery for Ev {
        fn must_deliver(&self) -> bool {
            self.1
        }
    }

    /// Runs `script` against an outbox whose channel holds `capacity` and
    /// whose backlog holds `max_backlog`, then checks what the receiver got
    /// (in order), what was dropped, and what is still held. Script steps,
    /// space separated: `m7` pushes must-deliver event 7, `d7` droppable
    /// event 7, `r` receives one event, `w` polls `drain` once (it must be
    /// ready, since the script only drains when there is room).
    fn check(
        capacity: usize,
        max_backlog: usize,
        script: &str,
        received: &[u32],
        dropped: &[u32],
        held: usize,
    ) {
        let (tx, mut rx) = mpsc::channel(capacity);
        let mut outbox = Outbox::new(tx, max_backlog);
        let mut got = Vec::new();
        let mut lost = Vec::new();
        for step in script.split_whitespace() {
            let (op, n) = step.split_at(1);
            match op {
                "m" | "d" => {
                    if let Some(Ev(n, _)) = outbox.push(Ev(n.parse().unwrap(), op == "m")) {
                        lost.push(n);
                    }
                }
                "r" => got.push(rx.try_recv().expect("an event to receive").0),
                "w" => outbox
                    .drain()
                    .now_or_never()
                    .expect("drain ready when there is room")
                    .unwrap(),
                _ => panic!("unknown step {step}"),
            }
        }
        while let Ok(Ev(n, _)) = rx.try_recv() {
            got.push(n);
        }
        assert_eq!(got, received, "received, script {script:?}");
        assert_eq!(lost, dropped, "dropped, script {script:?}");
        assert_eq!(outbox.backlog_len(), held, "held, script {script:?}");
    }

    // Goal: the outbox never reorders, drops only what it may, and holds no
    // more than its bound. Method: scripted pushes, receives and drains
    // against a two-slot channel.
    #[test]
    fn order_drops_and_bound() {
        // Room in the channel: everything goes straight through.
        check(2, 4, "m1 d2 r r m3", &[1, 2, 3], &[], 0);
        // Channel full: droppable events are dropped, must-deliver ones held.
        check(2, 4, "m1 m2 d3 m4 d5", &[1, 2], &[3, 5], 1);
        // Held events leave first, oldest first, before any newer event,
        // and a droppable event may not overtake them while any is held.
        check(2, 4, "m1 m2 m3 m4 r m5 d6 r r w", &[1, 2, 3, 4, 5], &[6], 0);
        // Once the backlog has drained, droppable events flow again.
        check(2, 4, "m1 m2 m3 r r d4 r d5", &[1, 2, 3, 4, 5], &[], 0);
        // drain moves held events in as room appears, as many as fit.
        check(2, 4, "m1 m2 m3 m4 m5 r r w", &[1, 2, 3, 4], &[], 1);
        // The backlog is bounded: beyond it must-deliver events are dropped
        // too, and earlier held ones keep their place.
        check(1, 2, "m1 m2 m3 m4 m5", &[1], &[4, 5], 2);
        check(1, 2, "m1 m2 m3 m4 m5 r w r w", &[1, 2, 3], &[4, 5], 0);
    }

    // Goal: drain waits while the channel is full and wakes when the
    // receiver makes room, without losing its place. Method: poll it with
    // the channel full (pending), receive one, poll again (ready).
    #[tokio::test]
    async fn drain_waits_for_room() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut outbox = Outbox::new(tx, 8);
        assert!(outbox.push(Ev(1, true)).is_none());
        assert!(outbox.push(Ev(2, true)).is_none());
        assert!(outbox.has_backlog());
        assert!(outbox.drain().now_or_never().is_none(), "no room yet");
        assert_eq!(rx.recv().await.unwrap().0, 1);
        let drained = tokio::time::timeout(std::time::Duration::from_secs(5), outbox.drain())
            .await
            .expect("drain wakes once there is room");
        assert_eq!(drained, Ok(()));
        assert!(!outbox.has_backlog());
        assert_eq!(rx.recv().await.unwrap().0, 2);
        // Nothing held: drain never completes, so a select! arm guarded by
        // has_backlog is the only way it is polled.
        assert!(outbox.drain().now_or_never().is_none());
        drop(rx);
        assert!(outbox.push(Ev(3, true)).is_none(), "closed is not a drop");
        assert!(outbox.is_closed());
    }
}
