//! Keeps `device list` useful without a daemon: the peers this device is
//! connected to are recorded as seen (names and times, in the encrypted
//! store's metadata; see `crate::devices`) at most once a minute, and once
//! more at shutdown.

use super::Daemon;

impl Daemon {
    /// Records this device and every verified peer as seen at `now_ms`,
    /// if a minute passed since the last time (always when `force`).
    pub(super) fn remember_seen(&mut self, now_ms: u64, force: bool) {
        if !self.seen.refresh_due(now_ms) && !force {
            return;
        }
        let me = self.session.membership().context_id().to_owned();
        let peers: Vec<String> = self
            .session
            .verified()
            .map(|(_, ctx)| ctx.to_owned())
            .collect();
        self.seen.saw(&me, &self.name, now_ms);
        for ctx in &peers {
            self.seen.saw(ctx, "", now_ms);
        }
        self.save_seen();
    }
}
