//! Strong removal: a device removed on any branch stays removed when the
//! branches meet, whichever branch wins the fork rule.
//!
//! The fork rule ([`super::compare_branches`]) picks one branch, and the
//! entries of the others are gone. For most entries that is right (the
//! admin who signed them signs them again on the winner, see
//! [`super::rebase_ops`]), but a removal must not depend on who signs
//! next: a branch that forked before a revocation (a revoked device's
//! stale chain handed to a recovering home, an admin that never heard of
//! it) would otherwise bring the device back. So a chain keeps the
//! branches it saw lose ([`DidChain::lost_branches`]) while they remove
//! a device it still lists, and its [`DidChain::current`] document leaves
//! those devices out. A removal stands until this chain itself removes the
//! same key after the fork (an admin signed it again, or signed its own
//! removal); a key listed again after that was re-added by an admin that
//! had seen a removal, which is the one way back.
//!
//! Keys are compared by their public key material, so a device removed on
//! one branch under one id is removed under any id. Recovery keys are not
//! subject to this rule: a recovery key is replaced by the recovery words,
//! and the recovery branch is the one that wins.

use super::{ChainError, DidChain, DidDocument, DidEntry, Ordering, compare_branches};
use std::collections::BTreeSet;

/// Most lost branches a chain keeps. Each is kept only while it removes a
/// device the chain lists, so more than a few means several admins (or
/// recovery flows) raced; beyond this the oldest evidence is kept.
pub const MAX_LOST_BRANCHES: usize = 8;

/// Most entries of lost branches carried in one Hello.
pub const MAX_EVIDENCE_ENTRIES: usize = 64;

/// Public keys (multibase) of the methods `before` lists and `after` does
/// not, recovery keys left out.
fn removed_keys(before: &DidDocument, after: &DidDocument) -> Vec<String> {
    let kept: BTreeSet<&str> = after
        .verification_method
        .iter()
        .map(|m| m.public_key_multibase.as_str())
        .collect();
    before
        .verification_method
        .iter()
        .filter(|m| !super::is_recovery_id(&m.id))
        .filter(|m| !kept.contains(m.public_key_multibase.as_str()))
        .map(|m| m.public_key_multibase.clone())
        .collect()
}

/// Keys removed by the entries of `chain` at positions `from..`.
fn removed_from(chain: &DidChain, from: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut before: Option<DidDocument> = None;
    for (index, doc) in chain.documents().enumerate() {
        if index >= from
            && let Some(b) = &before
        {
            out.extend(removed_keys(b, &doc));
        }
        before = Some(doc);
    }
    out
}

impl DidChain {
    /// The document after the latest entry, as the entries say, before
    /// [strong removal](self) takes out what lost branches removed. What
    /// proofs carry and what new entries are diffed against; authorise
    /// with [`DidChain::current`].
    pub fn chain_document(&self) -> &DidDocument {
        &self.current
    }

    /// Branches that lost the fork rule against this chain and remove a
    /// device it lists (see the [module docs](self)).
    pub fn lost_branches(&self) -> &[DidChain] {
        &self.lost
    }

    /// Ids (absolute) of the methods this chain lists that a lost branch
    /// removed: what [`DidChain::current`] leaves out, and what an admin
    /// signs the removal of ([`DidChain::append_document`] with
    /// [`DidChain::current`] does).
    pub fn standing_removals(&self) -> Vec<String> {
        let Some(effective) = &self.effective else {
            return Vec::new();
        };
        let kept: BTreeSet<&str> = effective
            .verification_method
            .iter()
            .map(|m| m.id.as_str())
            .collect();
        self.current
            .verification_method
            .iter()
            .filter(|m| !kept.contains(m.id.as_str()))
            .map(|m| m.id.clone())
            .collect()
    }

    /// Keys that `branch` removed after it forked from this chain and that
    /// this chain did not remove after the same point.
    fn standing_in(&self, branch: &DidChain) -> BTreeSet<String> {
        let Some(fork) = self.fork_point(branch) else {
            return BTreeSet::new();
        };
        let theirs = removed_from(branch, fork);
        if theirs.is_empty() {
            return theirs;
        }
        let ours = removed_from(self, fork);
        theirs.difference(&ours).cloned().collect()
    }

    /// Recomputes [`DidChain::current`] from the lost branches, and drops
    /// the branches that no longer remove anything this chain lists.
    pub(super) fn apply_removals(&mut self) {
        self.effective = None;
        if self.lost.is_empty() {
            return;
        }
        let mut gone = BTreeSet::new();
        let lost = std::mem::take(&mut self.lost);
        for branch in lost {
            let standing = self.standing_in(&branch);
            let listed = self
                .current
                .verification_method
                .iter()
                .any(|m| standing.contains(&m.public_key_multibase));
            if listed {
                gone.extend(standing);
                self.lost.push(branch);
            }
        }
        if gone.is_empty() {
            return;
        }
        let mut doc = self.current.clone();
        let ids: Vec<String> = doc
            .verification_method
            .iter()
            .filter(|m| gone.contains(&m.public_key_multibase))
            .map(|m| m.id.clone())
            .collect();
        for id in ids {
            // Listed a moment ago, so this cannot fail.
            let _ = doc.remove_key(&id);
        }
        self.effective = Some(doc);
    }

    /// Keeps `branch` (a verified chain of this DID) as evidence if it
    /// forks from this chain, loses the fork rule and removes a device this
    /// chain lists; a prefix of a branch kept already is replaced by it.
    pub(super) fn keep_lost(&mut self, branch: &DidChain) {
        if self.fork_point(branch).is_none()
            || compare_branches(self, branch).ok() != Some(Ordering::Greater)
            || self.lost.iter().any(|b| b.holds(branch))
        {
            return;
        }
        let mut branch = branch.clone();
        branch.lost.clear();
        branch.effective = None;
        self.lost.retain(|b| !branch.holds(b));
        if self.lost.len() >= MAX_LOST_BRANCHES {
            return;
        }
        self.lost.push(branch);
        self.apply_removals();
    }

    /// Keeps the lost branches `others` holds that are evidence against
    /// this chain (used when a chain replaces another: its evidence
    /// carries over).
    pub(super) fn keep_lost_of(&mut self, others: &[DidChain]) {
        for branch in others {
            self.keep_lost(branch);
        }
    }

    /// Head hashes of the lost branches kept, to tell whether a merge
    /// added evidence.
    pub(super) fn lost_heads(&self) -> Vec<String> {
        self.lost.iter().map(|b| b.head_hash().to_owned()).collect()
    }

    /// Whether `other`'s entries are a prefix of (or equal to) ours.
    fn holds(&self, other: &DidChain) -> bool {
        other.len() <= self.len()
            && self
                .hash_at(other.len() - 1)
                .is_some_and(|h| h == other.head_hash())
    }

    /// For a Hello: per lost branch that removes a device this chain lists,
    /// its entries from the fork with this chain up to the last one that
    /// removes such a device. A receiver that holds our prefix splices each
    /// and merges it with the fork rule ([`DidChain::splice`],
    /// [`DidChain::merge`]), so it learns the removal even when it never
    /// met a device of that branch. At most [`MAX_EVIDENCE_ENTRIES`]
    /// entries in all.
    pub fn removal_evidence(&self) -> Vec<Vec<DidEntry>> {
        let mut out = Vec::new();
        let mut budget = MAX_EVIDENCE_ENTRIES;
        for branch in &self.lost {
            let Some(fork) = self.fork_point(branch) else {
                continue;
            };
            let standing = self.standing_in(branch);
            let mut last = None;
            let mut before: Option<DidDocument> = None;
            for (index, doc) in branch.documents().enumerate() {
                if index >= fork
                    && let Some(b) = &before
                    && removed_keys(b, &doc).iter().any(|k| standing.contains(k))
                {
                    last = Some(index);
                }
                before = Some(doc);
            }
            let Some(last) = last else { continue };
            let n = last + 1 - fork;
            if n > budget {
                break;
            }
            budget -= n;
            out.push(branch.entries[fork..=last].to_vec());
        }
        out
    }

    /// Verifies the lost branches a stored chain carries.
    pub(super) fn verify_lost(&self, now_unix_secs: i64) -> Result<(), ChainError> {
        for branch in &self.lost {
            branch.verify(Some(self.did()), now_unix_secs)?;
        }
        Ok(())
    }
}
