//! Device lifecycle on top of the DID chain and the key ring: the signed
//! DID updates that add (pairing, provisioning), remove (revocation),
//! promote, demote and rotate devices, recovery with the recovery words,
//! and the epoch grants that revocation, recovery and rotation issue.
//! (Checking a grant that arrives from a peer is `nuwa_sync::grant`.)
//!
//! Pure functions: no IO, no clock (time is a parameter). The agent and
//! the shell's offline commands persist what they return.

use crate::constants::*;
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{EpochGrant, KeyRing};
use nuwa_identity::chain::{ChainError, DidChain};
use nuwa_identity::document::{DidDocument, DidError, KeyStatus, Relationship, shorten};
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_identity::recovery::{RECOVERY_FRAGMENT_PREFIX, add_recovery_key, check_belongs};

/// Fragment suffix of a device's X25519 `keyAgreement` key.
pub const X25519_SUFFIX: &str = "-x25519";

/// Relationships every device key gets. `authentication` is what sync
/// membership checks; the others let a device sign state and invoke
/// services. Key management (`capabilityDelegation`) stays with admins.
pub const DEVICE_RELATIONSHIPS: &[Relationship] = &[
    Relationship::Authentication,
    Relationship::AssertionMethod,
    Relationship::CapabilityInvocation,
];

/// Why a lifecycle change was not made. Nothing changed in any case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LifecycleError {
    /// The change does not apply; the message says why and what to do.
    #[error("{0}")]
    Refused(String),
    /// Editing the DID document failed.
    #[error("cannot {what}")]
    Document {
        what: String,
        #[source]
        source: DidError,
    },
    /// Signing the update onto the chain failed.
    #[error("cannot sign the {what}")]
    Sign {
        what: &'static str,
        #[source]
        source: Box<ChainError>,
    },
    /// A key or grant could not be made.
    #[error("cannot {what}")]
    Crypto {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The recovery words do not belong to this agent.
    #[error(transparent)]
    Recovery(#[from] nuwa_identity::recovery::RecoveryError),
}

fn refused(message: impl Into<String>) -> LifecycleError {
    LifecycleError::Refused(message.into())
}

fn doc_err(what: impl Into<String>) -> impl FnOnce(DidError) -> LifecycleError {
    let what = what.into();
    move |source| LifecycleError::Document { what, source }
}

fn sign_err(what: &'static str) -> impl FnOnce(ChainError) -> LifecycleError {
    move |source| LifecycleError::Sign {
        what,
        source: Box::new(source),
    }
}

fn crypto_err<E: std::error::Error + Send + Sync + 'static>(
    what: &'static str,
) -> impl FnOnce(E) -> LifecycleError {
    move |source| LifecycleError::Crypto {
        what,
        source: Box::new(source),
    }
}

type Result<T> = std::result::Result<T, LifecycleError>;

/// Returns a [`LifecycleError::Refused`] with a formatted message.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(refused(format!($($arg)*)))
    };
}

/// A key this home holds that may change the DID document: it is listed
/// with `capabilityDelegation` in the current version. The master key of
/// `init` (`HOME/master.key`), or this device's own key once an admin
/// promoted it (`device promote`) or it recovered the agent (`recover`).
pub struct Admin {
    pub key: DeviceKey,
    /// Absolute key id of `key` in the DID document.
    pub key_id: String,
}

impl Admin {
    /// The grant issuer's context id: the fragment of the signing key.
    pub fn fragment(&self) -> &str {
        DidDocument::fragment(&self.key_id)
    }
}

/// The key of this home that may change the DID document: the master key
/// of `init` (`master`, when the home holds it) if it is still listed with
/// `capabilityDelegation`, else this device's key if it holds that
/// relationship. Explains what to do when neither does.
pub fn admin_of(
    log: &DidChain,
    device: &DeviceKey,
    master: Option<&DeviceKey>,
    now_secs: i64,
) -> Result<Admin> {
    let doc = log.current();
    let mut master_note = "";
    if let Some(master) = master {
        match doc.method_for_public(
            &master.public(),
            Relationship::CapabilityDelegation,
            now_secs,
        ) {
            Ok(m) => {
                return Ok(Admin {
                    key_id: m.id.clone(),
                    key: DeviceKey::from_seed(&master.seed()),
                });
            }
            Err(_) => {
                master_note = " (this home's master.key is no longer an admin key of the agent: it was \
                               rotated out)";
            }
        }
    }
    if let Ok(m) = doc.method_for_public(
        &device.public(),
        Relationship::CapabilityDelegation,
        now_secs,
    ) {
        return Ok(Admin {
            key_id: m.id.clone(),
            key: DeviceKey::from_seed(&device.seed()),
        });
    }
    Err(refused(format!(
        "this device is not an admin of the agent: it holds no key with capabilityDelegation, \
         the only keys that may approve, provision, promote or revoke devices{master_note}. Run \
         this on an admin device (`nuwa-node device list` shows them), make this one an admin \
         there with `nuwa-node device promote CONTEXT_ID`, or, if every admin device is lost, \
         recover with the recovery words: `nuwa-node recover`"
    )))
}

/// Whether `key_id` (or fragment) names a recovery key.
pub fn is_recovery_key(key_id: &str) -> bool {
    nuwa_identity::recovery::is_recovery_fragment(key_id)
}

/// The recovery keys the document lists.
pub fn recovery_keys(doc: &DidDocument) -> Vec<String> {
    doc.verification_method
        .iter()
        .filter(|m| is_recovery_key(&m.id))
        .map(|m| m.id.clone())
        .collect()
}

/// The generation the next recovery key gets: one above every listed
/// one's, or above the log's count of updates so a removed generation is
/// never reused.
fn next_recovery_generation(log: &DidChain) -> u32 {
    log.documents()
        .flat_map(|d| recovery_keys(&d))
        .filter_map(|id| {
            DidDocument::fragment(&id)
                .strip_prefix(RECOVERY_FRAGMENT_PREFIX)
                .and_then(|rest| rest.strip_prefix('-'))
                .and_then(|n| n.parse::<u32>().ok())
        })
        .max()
        .unwrap_or(0)
        .saturating_add(1)
}

/// Replaces every recovery key of `doc` with `public`; returns its key id.
fn rotate_recovery_key(log: &DidChain, doc: &mut DidDocument, public: &[u8; 32]) -> Result<String> {
    for id in recovery_keys(doc) {
        doc.remove_key(&id)
            .map_err(doc_err(format!("remove the old recovery key {id}")))?;
    }
    add_recovery_key(doc, next_recovery_generation(log), public)
        .map_err(doc_err("add the recovery key to the DID document"))
}

/// `recovery create`: the signed update that makes `public` the agent's
/// recovery key (replacing any other). Returns the new log and the key id.
pub fn set_recovery_key(
    log: &DidChain,
    admin: &Admin,
    public: &[u8; 32],
    now_secs: i64,
) -> Result<(DidChain, String)> {
    let mut doc = log.current().clone();
    let key_id = rotate_recovery_key(log, &mut doc, public)?;
    let mut log = log.clone();
    log.append_document(&doc, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("DID document update"))?;
    proof_fits(&log)?;
    Ok((log, key_id))
}

/// The id of the key that signed the genesis: the master key of `init`.
pub fn master_key_id(log: &DidChain) -> Result<String> {
    let genesis = &log
        .documents()
        .next()
        .ok_or_else(|| refused("the DID log is empty"))?;
    genesis
        .capability_delegation
        .first()
        .cloned()
        .ok_or_else(|| refused("the DID log's genesis has no capabilityDelegation key"))
}

/// The first update of a new agent: this device's keys and the recovery
/// key, signed by the master key of the genesis.
pub fn first_update(
    log: &mut DidChain,
    master: &DeviceKey,
    device: &DeviceKey,
    recovery_public: &[u8; 32],
    now_secs: i64,
) -> Result<String> {
    let mut doc = log.current().clone();
    let context_id = list_device(&mut doc, device, &[])?;
    add_recovery_key(&mut doc, 1, recovery_public)
        .map_err(doc_err("add the recovery key to the DID document"))?;
    log.append_document(&doc, master, &master_key_id(log)?, now_secs)
        .map_err(sign_err("DID document update"))?;
    Ok(context_id)
}

/// Lists a device's Ed25519 key (device relationships plus `extra`) and
/// its X25519 key in `doc`.
fn list_device(
    doc: &mut DidDocument,
    device: &DeviceKey,
    extra: &[Relationship],
) -> Result<String> {
    let public = device.public();
    let x25519 = nuwa_identity::did_key::x25519_public_from_ed25519(&public)
        .map_err(doc_err("derive the device's key-agreement key"))?;
    let context_id = context_id_for(&public);
    let rels: Vec<Relationship> = DEVICE_RELATIONSHIPS.iter().chain(extra).copied().collect();
    doc.add_key(&context_id, &public, &rels, None)
        .map_err(doc_err("add the device key to the DID document"))?;
    doc.add_key_agreement_key(&format!("{context_id}{X25519_SUFFIX}"), &x25519, None)
        .map_err(doc_err(
            "add the device's key-agreement key to the DID document",
        ))?;
    Ok(context_id)
}

/// Appends the signed update that adds a device: its Ed25519 key with the
/// device relationships and its X25519 key under `keyAgreement`. Returns the
/// device's context id.
pub fn add_device(
    log: &mut DidChain,
    admin: &Admin,
    ed25519: &[u8; 32],
    x25519: &[u8; 32],
    now_secs: i64,
) -> Result<String> {
    add_device_until(log, admin, (ed25519, x25519), None, now_secs)
}

/// [`add_device`] for a device that expires at `expires` (RFC 3339, see
/// [`crate::expiry`]): both its keys carry the instant, after which (and
/// [`nuwa_identity::document::EXPIRY_GRACE_SECS`]) every peer refuses it.
/// Refused when the document would outgrow what Hellos and DHT pointers
/// carry: `log` is unchanged then.
pub fn add_device_until(
    log: &mut DidChain,
    admin: &Admin,
    (ed25519, x25519): (&[u8; 32], &[u8; 32]),
    expires: Option<String>,
    now_secs: i64,
) -> Result<String> {
    let context_id = context_id_for(ed25519);
    let mut doc: DidDocument = log.current().clone();
    doc.add_key(&context_id, ed25519, DEVICE_RELATIONSHIPS, expires.clone())
        .map_err(doc_err("add the device key to the DID document"))?;
    doc.add_key_agreement_key(&format!("{context_id}{X25519_SUFFIX}"), x25519, expires)
        .map_err(doc_err(
            "add the device's key-agreement key to the DID document",
        ))?;
    let mut next = log.clone();
    next.append_document(&doc, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("DID document update"))?;
    let bytes = next.proof().encode().map(|b| b.len()).unwrap_or(usize::MAX);
    if bytes > MAX_PROOF_AFTER_CHANGE {
        return Err(refused(format!(
            "refused: with one more device the proof of the agent's DID document would be \
             {bytes} bytes, over the {MAX_PROOF_AFTER_CHANGE} that DHT pointers and Hellos carry. \
             Revoke devices no longer used (`nuwa-node device list`, `nuwa-node device revoke`); \
             expired devices are pruned by an admin's running daemon"
        )));
    }
    *log = next;
    Ok(context_id)
}

/// Applies to `onto` the change that turned `base` into `mine`: methods
/// added or removed, and ids added to or removed from each relationship.
/// What no longer applies (a method already there, one already gone, an
/// id whose method is missing) is skipped. Used to sign again, on top of
/// the winning branch, what this device signed on a branch that lost a
/// fork.
pub fn rebase_change(base: &DidDocument, mine: &DidDocument, onto: &DidDocument) -> DidDocument {
    let mut out = onto.clone();
    let ids = |d: &DidDocument| -> Vec<String> {
        d.verification_method.iter().map(|m| m.id.clone()).collect()
    };
    let (base_ids, mine_ids) = (ids(base), ids(mine));
    for id in base_ids.iter().filter(|id| !mine_ids.contains(id)) {
        if out.find_method(id).is_some() {
            let _ = out.remove_key(id);
        }
    }
    for m in mine
        .verification_method
        .iter()
        .filter(|m| !base_ids.contains(&m.id))
    {
        let clash = out
            .verification_method
            .iter()
            .any(|o| o.id == m.id || o.public_key_multibase == m.public_key_multibase);
        if !clash {
            out.verification_method.push(m.clone());
        }
    }
    for rel in Relationship::ALL {
        let (b, n) = (base.relationship(rel), mine.relationship(rel));
        for id in b.iter().filter(|id| !n.contains(id)) {
            out.revoke(id, rel);
        }
        for id in n.iter().filter(|id| !b.contains(id)) {
            if out.find_method(id).is_some() && !out.has_relationship(id, rel) {
                let _ = out.grant(id, rel);
            }
        }
    }
    out
}

/// After the DID log moved from `old` to `new` (a peer's branch won a
/// fork), the updates of `old` that are gone and were signed by one of
/// `own` (public keys this home holds), re-applied on top of `new`'s
/// current document. None when nothing of ours was dropped or it is all in
/// the winner already.
pub fn rebased_document(
    old: &DidChain,
    new: &DidChain,
    own: &[[u8; 32]],
) -> Option<(DidDocument, usize)> {
    let kept: std::collections::HashSet<&str> =
        (0..new.len()).filter_map(|i| new.hash_at(i)).collect();
    if kept.contains(old.head_hash()) {
        return None;
    }
    let docs: Vec<DidDocument> = old.documents().collect();
    let mut doc = new.chain_document().clone();
    let mut n = 0;
    for (i, entry) in old.entries().iter().enumerate().skip(1) {
        if old.hash_at(i).is_some_and(|h| kept.contains(h)) {
            continue;
        }
        let (Some(prev), Some(next)) = (docs.get(i - 1), docs.get(i)) else {
            break;
        };
        let signer = prev
            .find_method(&prev.key_id(entry.key_id()))
            .and_then(|m| m.ed25519_public().ok());
        if signer.is_some_and(|p| own.contains(&p)) {
            doc = rebase_change(prev, next, &doc);
            n += 1;
        }
    }
    // A device we added that the old branch itself removed later (another
    // admin revoked it, or pruned it once it expired) stays out: signing
    // our addition again would bring it back, and the removal, on a
    // branch that no longer lists anything it removed, is no evidence
    // any more (seed 3439 of the agent simulator).
    let head = old.current();
    let removed_later: Vec<String> = doc
        .verification_method
        .iter()
        .filter(|m| new.chain_document().find_method(&m.id).is_none())
        .filter(|m| {
            !head
                .verification_method
                .iter()
                .any(|h| h.public_key_multibase == m.public_key_multibase)
        })
        .map(|m| m.id.clone())
        .collect();
    for id in removed_later {
        let _ = doc.remove_key(&id);
    }
    (n > 0 && &doc != new.chain_document() && doc.validate().is_ok()).then_some((doc, n))
}

/// The result of revoking a device: the extended log, the new epoch's key
/// (already in `keys`) and the encoded grant that hands it to the rest.
pub struct Revocation {
    pub log: DidChain,
    pub keys: KeyRing,
    pub grant: Vec<u8>,
    pub epoch: u64,
    pub remaining: Vec<String>,
}

/// Signs the DID update removing `target` (its Ed25519 and X25519 keys) and
/// opens a new key epoch sealed to every remaining device's X25519 key.
pub fn revoke(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    target: &str,
    self_context: &str,
    now_secs: i64,
) -> Result<Revocation> {
    if target == self_context {
        bail!(
            "{target} is this device; a device cannot revoke itself (revoke it from another \
             admin device, or stop using this home)"
        );
    }
    let did = log.did().to_owned();
    let doc = log.current();
    let key_id = format!("{did}#{target}");
    if doc.key_status(&key_id, now_secs) == KeyStatus::NotListed {
        return Err(not_listed(log, &key_id, target));
    }
    let master_id = master_key_id(log)?;
    if DidDocument::fragment(&master_id) == target {
        bail!("{target} is the agent's master key, not a device");
    }
    if is_recovery_key(target) {
        bail!(
            "{target} is the agent's recovery key, not a device; replace it with \
             `nuwa-node recovery create`"
        );
    }
    let mut next = doc.clone();
    next.remove_key(target)
        .map_err(doc_err(format!("remove {target}")))?;
    let x = format!("{target}{X25519_SUFFIX}");
    if next.key_status(&format!("{did}#{x}"), now_secs) != KeyStatus::NotListed {
        next.remove_key(&x)
            .map_err(doc_err(format!("remove {x}")))?;
    }
    if no_admin_device(&next) {
        bail!(
            "{target} is the last admin device: revoking it leaves only the recovery words able \
             to change the agent. Promote another device first (`nuwa-node device promote ID`)"
        );
    }
    sign_removal(log, keys, admin, &next, &[target.to_owned()], 0, now_secs)
}

/// `next` (a document without `revoked`) signed onto `log` by `admin`,
/// and a new key epoch (at least `min_epoch`) sealed to the devices it
/// leaves: what revoking, pruning and re-signing a lost removal share.
pub(crate) fn sign_removal(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    next: &DidDocument,
    revoked: &[String],
    min_epoch: u64,
    now_secs: i64,
) -> Result<Revocation> {
    let mut log = log.clone();
    log.append_document(next, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("DID document update"))?;
    let (keys, grant, epoch, remaining) = new_epoch(
        &log,
        keys,
        &admin.key,
        admin.fragment(),
        revoked,
        min_epoch,
        now_secs,
    )?;
    Ok(Revocation {
        log,
        keys,
        grant,
        epoch,
        remaining,
    })
}

/// Signs the removals that branches which lost the fork rule made and
/// this chain does not hold yet (strong removal, see
/// [`DidChain::standing_removals`]), and opens a new key epoch for the
/// rest, as [`revoke`] does: the devices they removed never receive it.
/// `None` when nothing stands.
pub fn sign_standing_removals(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    now_secs: i64,
) -> Result<Option<Revocation>> {
    if log.standing_removals().is_empty() {
        return Ok(None);
    }
    sign_with_epoch(log, keys, admin, log.current(), now_secs).map(Some)
}

/// Signs the update that turns `log`'s chain document into `next` and
/// opens a new key epoch sealed to the devices `next` lists: for changes
/// made while branches met (removals a lost branch made, or this admin's
/// own pairings and revocations signed again on the winner), whose
/// devices must end on one key that exactly the listed devices hold.
pub fn sign_with_epoch(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    next: &DidDocument,
    now_secs: i64,
) -> Result<Revocation> {
    if no_admin_device(next) {
        bail!(
            "the update leaves only the recovery words able to change the agent; recover with \
             them (`nuwa-node recover`)"
        );
    }
    let listed = |d: &DidDocument| -> Vec<String> {
        d.verification_method
            .iter()
            .map(|m| DidDocument::fragment(&m.id).to_owned())
            .filter(|f| !f.ends_with(X25519_SUFFIX))
            .collect()
    };
    let after = listed(next);
    let revoked: Vec<String> = listed(log.chain_document())
        .into_iter()
        .filter(|f| !after.contains(f))
        .collect();
    // Each branch opened its epochs with entries of its own, so numbering
    // this one past every branch's length keeps it from reusing a number a
    // device of another branch holds under a different key. Several admins
    // may hear of the same branches at once and each sign: the next 16
    // bits, from the signer's key, keep their epochs apart, so every
    // device ends on the highest one instead of two under one number.
    let longest = log
        .lost_branches()
        .iter()
        .map(DidChain::len)
        .chain([log.len() + 1])
        .max()
        .unwrap_or(0) as u64;
    // And past the epoch this device holds, by a whole step of the high
    // bits: were it only `current + 1`, two admins that adopted the same
    // epoch would each open that same next number under their own key
    // (seed 5953 of the agent simulator), and the low bits below, drawn
    // here, are what keeps concurrent signers apart.
    let longest = longest.max((keys.current().epoch() >> 32) + 1);
    // 16 random bits below those: an admin that signs twice at one length
    // (its home restored from a copy taken before the first time, so it
    // no longer holds that key) opens another number, not a second key
    // under the one its peers hold (seed 2348 of the agent simulator).
    let public = admin.key.public();
    let mut fresh = [0u8; 2];
    nuwa_entropy::fill(&mut fresh).map_err(crypto_err("draw the epoch number"))?;
    let min_epoch = (longest << 32)
        | (u64::from(u16::from_be_bytes([public[0], public[1]])) << 16)
        | u64::from(u16::from_be_bytes(fresh));
    sign_removal(log, keys, admin, next, &revoked, min_epoch, now_secs)
}

/// Opens the next key epoch, sealed to every active device of `log`'s
/// current document, and signs its grant with `issuer` (a key listed with
/// `capabilityDelegation` under the fragment `issuer_fragment`).
pub(crate) fn new_epoch(
    log: &DidChain,
    keys: &KeyRing,
    issuer: &DeviceKey,
    issuer_fragment: &str,
    revoked: &[String],
    min_epoch: u64,
    now_secs: i64,
) -> Result<(KeyRing, Vec<u8>, u64, Vec<String>)> {
    let recipients = recipients(log.current(), now_secs)?;
    if recipients.is_empty() {
        bail!("no device would remain to receive the new key epoch");
    }
    let epoch = (keys.current().epoch() + 1).max(min_epoch);
    let key = SyncKey::generate(epoch).map_err(crypto_err("generate the new sync key"))?;
    let grant = EpochGrant::create(
        &key,
        &recipients,
        revoked,
        issuer_fragment,
        issuer.signing_key(),
        log.did(),
        now_secs.max(0) as u64,
    )
    .map_err(crypto_err("create the epoch grant"))?
    .encode()
    .map_err(crypto_err("encode the epoch grant"))?;
    let mut keys = keys.clone();
    keys.insert(key)
        .map_err(crypto_err("add the new key epoch"))?;
    Ok((
        keys,
        grant,
        epoch,
        recipients.into_iter().map(|(c, _)| c).collect(),
    ))
}

/// The active device `target` (a context id) of `doc`, or why it is not one.
fn active_device(log: &DidChain, target: &str, now_secs: i64) -> Result<String> {
    let doc = log.current();
    let key_id = format!("{}#{target}", doc.id);
    match doc.key_status(&key_id, now_secs) {
        KeyStatus::Active if doc.has_relationship(&key_id, Relationship::Authentication) => {
            Ok(key_id)
        }
        KeyStatus::NotListed => Err(not_listed(log, &key_id, target)),
        _ => bail!(
            "{} is not an active device of the agent; see `nuwa-node device list`",
            shorten(target)
        ),
    }
}

/// Why `target` (whose key id `key_id` the current document does not list)
/// cannot be acted on: revoked earlier, or never a device of the agent.
/// Echoes at most a short prefix of what the caller typed.
fn not_listed(log: &DidChain, key_id: &str, target: &str) -> LifecycleError {
    let ever = log
        .documents()
        .any(|d| d.key_status(key_id, i64::MIN / 2) != KeyStatus::NotListed);
    if ever {
        refused(format!("device {target} is already revoked"))
    } else {
        refused(format!(
            "no device {} in the agent's DID document; see `nuwa-node device list`",
            shorten(target)
        ))
    }
}

/// Refuses an update that would make the document's proof too big to
/// travel: every authority change (promote, demote, a recovery key or an
/// admin key rotation) adds its entry, about 1.3 KB, to every proof.
fn proof_fits(log: &DidChain) -> Result<()> {
    let bytes = log.proof().encode().map(|b| b.len()).unwrap_or(usize::MAX);
    if bytes > MAX_PROOF_AFTER_CHANGE {
        return Err(refused(format!(
            "refused: after this change the proof of the agent's DID document would be {bytes} \
             bytes, over the {MAX_PROOF_AFTER_CHANGE} that DHT pointers and Hellos carry; each \
             promote, demote and key rotation of an admin adds about 1.3 KB for good. Keep the \
             admins you have (`nuwa-node device list`)"
        )));
    }
    Ok(())
}

/// `device promote`: gives device `target` `capabilityDelegation`, so it
/// can approve, provision, promote and revoke devices too.
pub fn promote(log: &DidChain, admin: &Admin, target: &str, now_secs: i64) -> Result<DidChain> {
    let target = target.trim();
    let key_id = active_device(log, target, now_secs)?;
    let mut doc = log.current().clone();
    if doc.has_relationship(&key_id, Relationship::CapabilityDelegation) {
        bail!("device {target} is already an admin");
    }
    doc.grant(&key_id, Relationship::CapabilityDelegation)
        .map_err(doc_err(format!("make {target} an admin")))?;
    let mut log = log.clone();
    log.append_document(&doc, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("DID document update"))?;
    proof_fits(&log)?;
    Ok(log)
}

/// `device demote`: takes `capabilityDelegation` from device `target`. The
/// last admin device cannot be demoted (only the recovery words would be
/// left to change the agent).
pub fn demote(log: &DidChain, admin: &Admin, target: &str, now_secs: i64) -> Result<DidChain> {
    let target = target.trim();
    let key_id = active_device(log, target, now_secs)?;
    let mut doc = log.current().clone();
    if !doc.has_relationship(&key_id, Relationship::CapabilityDelegation) {
        bail!("device {target} is not an admin");
    }
    doc.revoke(&key_id, Relationship::CapabilityDelegation);
    if no_admin_device(&doc) {
        bail!(
            "{target} is the last admin: demoting it leaves only the recovery words able to \
             change the agent. Promote another device first"
        );
    }
    let mut log = log.clone();
    log.append_document(&doc, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("DID document update"))?;
    proof_fits(&log)?;
    Ok(log)
}

/// What `device rotate` did: the extended log and the new key epoch.
pub struct Rotation {
    pub log: DidChain,
    pub keys: KeyRing,
    pub grant: Vec<u8>,
    pub epoch: u64,
    pub old_context: String,
    pub new_context: String,
}

/// `device rotate`: replaces this device's key `old` with `new`, with the
/// same relationships, in one update signed by `admin` (this device's own
/// key when it is an admin, or the master key of this home), and opens a
/// new key epoch sealed to the devices of the new document, so the old
/// key reads nothing written after.
pub fn rotate(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    old: &DeviceKey,
    new: &DeviceKey,
    now_secs: i64,
) -> Result<Rotation> {
    let doc = log.current();
    let old_context = context_id_for(&old.public());
    let old_id = active_device(log, &old_context, now_secs)?;
    let extra: Vec<Relationship> = Relationship::ALL
        .into_iter()
        .filter(|r| !DEVICE_RELATIONSHIPS.contains(r) && *r != Relationship::KeyAgreement)
        .filter(|r| doc.has_relationship(&old_id, *r))
        .collect();
    let mut next = doc.clone();
    next.remove_key(&old_id)
        .map_err(doc_err("remove the old device key"))?;
    let x = format!("{old_context}{X25519_SUFFIX}");
    if next.find_method(&x).is_some() {
        next.remove_key(&x)
            .map_err(doc_err("remove the old key-agreement key"))?;
    }
    let new_context = list_device(&mut next, new, &extra)?;
    let mut log = log.clone();
    log.append_document(&next, &admin.key, &admin.key_id, now_secs)
        .map_err(sign_err("rotation"))?;
    proof_fits(&log)?;
    // The grant's issuer must hold capabilityDelegation in the new
    // document: the master key, or the device's new key.
    let (issuer, fragment): (&DeviceKey, String) = if admin.key.public() == old.public() {
        (new, new_context.clone())
    } else {
        (&admin.key, admin.fragment().to_owned())
    };
    let min_epoch = log.len() as u64;
    let (keys, grant, epoch, _) = new_epoch(
        &log,
        keys,
        issuer,
        &fragment,
        std::slice::from_ref(&old_context),
        min_epoch,
        now_secs,
    )?;
    Ok(Rotation {
        log,
        keys,
        grant,
        epoch,
        old_context,
        new_context,
    })
}

/// The DID log a home stored, as the device starts from it: resolved with
/// the stored log as the first source (further resolvers chain here; at
/// run time peers extend it through their Hellos, settled by the fork
/// rule). Refused unless every entry verifies.
pub fn resolve_stored(log: DidChain, now_secs: i64) -> Result<DidChain> {
    use nuwa_identity::resolver::{ChainResolver, StaticLog};
    let did = log.did().to_owned();
    let resolved = ChainResolver::new()
        .with(Box::new(StaticLog::new("local cache", Some(log))))
        .resolve(&did, now_secs);
    match resolved {
        Ok(r) => match r.skipped.first() {
            None => Ok(r.log),
            Some(skipped) => Err(refused(skipped.to_string())),
        },
        Err(e) => Err(refused(format!("does not verify: {e}"))),
    }
}

/// Whether the current DID document lists the device key `public` (a
/// rotation became durable once the log names the new key).
pub fn lists(log: &DidChain, public: &[u8; 32]) -> bool {
    let id = format!("{}#{}", log.did(), context_id_for(public));
    log.current().find_method(&id).is_some()
}

/// How a key `recover` removed reads to a person: devices by context id,
/// the master key of `init` by name.
pub fn describe_removed(fragment: &str) -> String {
    if fragment.starts_with("device-") {
        fragment.to_owned()
    } else {
        format!("the master key of init (#{fragment})")
    }
}

/// What `recover` did: the extended log, the new epoch (already in `keys`)
/// and its grant, and which keys it removed.
pub struct Recovery {
    pub log: DidChain,
    pub keys: KeyRing,
    pub grant: Vec<u8>,
    pub epoch: u64,
    /// Key fragments removed from the document (the lost master key, lost devices).
    pub removed: Vec<String>,
    /// Devices the new epoch was sealed to.
    pub remaining: Vec<String>,
    /// The new recovery key's id.
    pub recovery_key_id: String,
}

/// `recover`: with the recovery key, makes `device` (this home's device,
/// listed or not) an admin, removes the master key of `init` and every
/// device in `lost`, replaces the recovery key with `new_recovery_public`,
/// and opens a new key epoch sealed to the devices that remain, issued by
/// `device`. Nothing changes on error.
pub fn recover(
    log: &DidChain,
    keys: &KeyRing,
    recovery: &DeviceKey,
    device: &DeviceKey,
    lost: &[String],
    new_recovery_public: &[u8; 32],
    now_secs: i64,
) -> Result<Recovery> {
    let did = log.did().to_owned();
    let doc = log.current();
    let recovery_id = check_belongs(doc, recovery, now_secs)?;
    let context_id = context_id_for(&device.public());
    let device_id = format!("{did}#{context_id}");
    let mut next = doc.clone();
    let mut removed = Vec::new();
    if next.key_status(&device_id, now_secs) == KeyStatus::NotListed {
        list_device(&mut next, device, &[Relationship::CapabilityDelegation])?;
    } else if !next.has_relationship(&device_id, Relationship::CapabilityDelegation) {
        next.grant(&device_id, Relationship::CapabilityDelegation)
            .map_err(doc_err("make this device an admin"))?;
    }
    let master_id = master_key_id(log)?;
    if next.find_method(&master_id).is_some() {
        next.remove_key(&master_id)
            .map_err(doc_err("remove the master key"))?;
        removed.push(DidDocument::fragment(&master_id).to_owned());
    }
    let mut revoked = Vec::new();
    for target in lost {
        let target = target.trim();
        if target == context_id {
            bail!("{target} is this device; it cannot be lost and recover the agent");
        }
        if is_recovery_key(target) || target == DidDocument::fragment(&master_id) {
            bail!("{target} is not a device; name lost devices by context id (`device list`)");
        }
        active_device(log, target, now_secs)?;
        next.remove_key(target)
            .map_err(doc_err(format!("remove {target}")))?;
        let x = format!("{target}{X25519_SUFFIX}");
        if next.find_method(&x).is_some() {
            next.remove_key(&x)
                .map_err(doc_err(format!("remove {x}")))?;
        }
        removed.push(target.to_owned());
        revoked.push(target.to_owned());
    }
    let recovery_key_id = rotate_recovery_key(log, &mut next, new_recovery_public)?;
    let mut log = log.clone();
    log.append_document(&next, recovery, &recovery_id, now_secs)
        .map_err(sign_err("recovery update"))?;
    // The device recovering may have missed epochs its peers opened (a
    // stolen admin revoked it): number this one after every update of the
    // log it signs on, so it cannot reuse an epoch another device holds.
    let min_epoch = log.len() as u64;
    let (keys, grant, epoch, remaining) = new_epoch(
        &log,
        keys,
        device,
        &context_id,
        &revoked,
        min_epoch,
        now_secs,
    )?;
    Ok(Recovery {
        log,
        keys,
        grant,
        epoch,
        removed,
        remaining,
        recovery_key_id,
    })
}

/// Every active device with an X25519 key: (context id, X25519 public key).
/// A grant of the current key epoch sealed to the one device `context_id`
/// (listed and active in `log`'s current document), signed by `admin`:
/// for a device that holds no grant of this epoch because it was paired
/// on a branch that met this epoch's only after it was opened (two
/// admins, one pairing while the other revoked). Nobody's access changes:
/// the device is a member, and the key is the one everyone uses.
pub fn grant_current_to(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    context_id: &str,
    now_secs: i64,
) -> Result<Vec<u8>> {
    let recipient: Vec<(String, [u8; 32])> = recipients(log.current(), now_secs)?
        .into_iter()
        .filter(|(c, _)| c == context_id)
        .collect();
    if recipient.is_empty() {
        bail!("{context_id} is not an active device of the agent");
    }
    EpochGrant::create(
        keys.current(),
        &recipient,
        &[],
        admin.fragment(),
        admin.key.signing_key(),
        log.did(),
        now_secs.max(0) as u64,
    )
    .map_err(crypto_err("create the epoch grant"))?
    .encode()
    .map_err(crypto_err("encode the epoch grant"))
}

/// Whether only the recovery key is left to administer `doc`.
pub(crate) fn no_admin_device(doc: &DidDocument) -> bool {
    doc.capability_delegation
        .iter()
        .all(|id| is_recovery_key(id))
}

fn recipients(doc: &DidDocument, now_secs: i64) -> Result<Vec<(String, [u8; 32])>> {
    let mut out = Vec::new();
    for id in &doc.key_agreement {
        let frag = DidDocument::fragment(id);
        let Some(ctx) = frag.strip_suffix(X25519_SUFFIX) else {
            continue;
        };
        let device_id = format!("{}#{ctx}", doc.id);
        if doc.key_status(&device_id, now_secs) != KeyStatus::Active {
            continue;
        }
        if let Ok(public) = doc.key_for(id, Relationship::KeyAgreement, now_secs) {
            out.push((ctx.to_owned(), public));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    // Checking a forwarded grant is pure and lives in the IO-free session;
    // these tests exercise it against the grants this module issues.
    use nuwa_sync::grant::{GrantOutcome, open_grant};

    struct Agent {
        log: DidChain,
        master: Admin,
        devices: Vec<DeviceKey>,
        keys: KeyRing,
    }

    fn agent(n: usize) -> Agent {
        let key = DeviceKey::generate().unwrap();
        let mut log = DidChain::genesis(&key, 1_000).unwrap();
        let master = Admin {
            key_id: master_key_id(&log).unwrap(),
            key,
        };
        let mut devices = Vec::new();
        for _ in 0..n {
            let d = DeviceKey::generate().unwrap();
            let x = nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret());
            add_device(&mut log, &master, &d.public(), &x, 1_000).unwrap();
            devices.push(d);
        }
        Agent {
            log,
            master,
            devices,
            keys: KeyRing::new(SyncKey::generate(0).unwrap()),
        }
    }

    // Goal: a home's stored log is taken only if every entry verifies (an
    // entry edited on disk is refused, not skipped), and `lists` tells a
    // listed device key from any other.
    #[test]
    fn a_stored_log_is_taken_only_whole_and_verified() {
        let a = agent(1);
        let log = resolve_stored(a.log.clone(), 1_010).unwrap();
        assert_eq!(log.head_hash(), a.log.head_hash());
        assert!(lists(&log, &a.devices[0].public()));
        assert!(!lists(&log, &DeviceKey::generate().unwrap().public()));
        let mut v = serde_json::to_value(&a.log).unwrap();
        v["entries"][1]["timestamp"] = 1_001.into();
        let edited: DidChain = serde_json::from_value(v).unwrap();
        assert!(matches!(
            resolve_stored(edited, 1_010),
            Err(LifecycleError::Refused(_))
        ));
    }

    // Goal: revoking a device removes both its keys, opens epoch 1 that
    // every remaining device (and only those) can open, and refuses the
    // nonsensical cases. Method: a three-device agent.
    #[test]
    fn revoke_removes_keys_and_grants_the_rest() {
        let a = agent(3);
        let ctx: Vec<String> = a
            .devices
            .iter()
            .map(|d| context_id_for(&d.public()))
            .collect();
        let r = revoke(&a.log, &a.keys, &a.master, &ctx[2], &ctx[0], 1_010).unwrap();
        assert_eq!(r.epoch, 1);
        assert_eq!(r.keys.current().epoch(), 1);
        assert_eq!(r.log.len(), a.log.len() + 1);
        r.log.verify(None, 1_010).unwrap();
        let did = r.log.did().to_owned();
        let doc = r.log.current();
        assert_eq!(
            doc.key_status(&format!("{did}#{}", ctx[2]), 1_010),
            KeyStatus::NotListed
        );
        assert_eq!(
            doc.key_status(&format!("{did}#{}-x25519", ctx[2]), 1_010),
            KeyStatus::NotListed
        );
        let mut remaining = r.remaining.clone();
        remaining.sort();
        let mut want = vec![ctx[0].clone(), ctx[1].clone()];
        want.sort();
        assert_eq!(remaining, want);

        for (device, id) in a.devices.iter().zip(&ctx).take(2) {
            match open_grant(&r.grant, &a.keys, doc, device, id, 1_010).unwrap() {
                GrantOutcome::NewKey(k) => {
                    assert_eq!(k.expose_secret(), r.keys.current().expose_secret())
                }
                GrantOutcome::Known => panic!("device {id} should learn the new key"),
            }
        }
        let err = open_grant(&r.grant, &a.keys, doc, &a.devices[2], &ctx[2], 1_010)
            .err()
            .unwrap();
        assert!(
            err.contains("not a recipient") || err.contains("cannot open"),
            "{err}"
        );
        // Against the old document (revocation unknown) the grant is refused.
        let err = open_grant(
            &r.grant,
            &a.keys,
            a.log.current(),
            &a.devices[0],
            &ctx[0],
            1_010,
        )
        .err()
        .unwrap();
        assert!(err.contains("still lists"), "{err}");
        // A ring that already holds the epoch treats it as known.
        assert!(matches!(
            open_grant(&r.grant, &r.keys, doc, &a.devices[0], &ctx[0], 1_010).unwrap(),
            GrantOutcome::Known
        ));

        // Refusals.
        let e = revoke(&r.log, &r.keys, &a.master, &ctx[2], &ctx[0], 1_020)
            .err()
            .unwrap();
        assert!(e.to_string().contains("already revoked"), "{e}");
        let e = revoke(&r.log, &r.keys, &a.master, &ctx[0], &ctx[0], 1_020)
            .err()
            .unwrap();
        assert!(e.to_string().contains("cannot revoke itself"), "{e}");
        let e = revoke(
            &r.log,
            &r.keys,
            &a.master,
            "device-000000000000",
            &ctx[0],
            1_020,
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("no device"), "{e}");
        // A key without capabilityDelegation cannot sign the update.
        let not_admin = Admin {
            key_id: format!("{}#{}", a.log.did(), ctx[0]),
            key: DeviceKey::from_seed(&a.devices[0].seed()),
        };
        let e = revoke(&a.log, &a.keys, &not_admin, &ctx[1], &ctx[0], 1_010)
            .err()
            .unwrap();
        assert!(e.to_string().contains("cannot sign"), "{e:#}");
    }

    // Goal: a grant signed by an ordinary device (no capabilityDelegation)
    // or tampered with is refused.
    #[test]
    fn grants_need_the_delegation_key_and_a_valid_signature() {
        let a = agent(2);
        let ctx: Vec<String> = a
            .devices
            .iter()
            .map(|d| context_id_for(&d.public()))
            .collect();
        let x: Vec<[u8; 32]> = a
            .devices
            .iter()
            .map(|d| nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret()))
            .collect();
        let key = SyncKey::generate(1).unwrap();
        let forged = EpochGrant::create(
            &key,
            &[(ctx[0].clone(), x[0]), (ctx[1].clone(), x[1])],
            &[],
            &ctx[1],
            a.devices[1].signing_key(),
            a.log.did(),
            1_000,
        )
        .unwrap()
        .encode()
        .unwrap();
        let err = open_grant(
            &forged,
            &a.keys,
            a.log.current(),
            &a.devices[0],
            &ctx[0],
            1_000,
        )
        .err()
        .unwrap();
        assert!(err.contains("may not open epochs"), "{err}");

        let r = revoke(&a.log, &a.keys, &a.master, &ctx[1], &ctx[0], 1_010).unwrap();
        let mut tampered = r.grant.clone();
        let n = tampered.len();
        tampered[n - 70] ^= 1;
        let err = open_grant(
            &tampered,
            &a.keys,
            r.log.current(),
            &a.devices[0],
            &ctx[0],
            1_010,
        )
        .err()
        .unwrap();
        assert!(
            err.contains("does not verify") || err.contains("malformed"),
            "{err}"
        );
        let err = open_grant(
            b"junk",
            &a.keys,
            r.log.current(),
            &a.devices[0],
            &ctx[0],
            1_010,
        )
        .err()
        .unwrap();
        assert!(err.contains("malformed"), "{err}");
    }

    /// An agent made as `init` makes it (device 0 and the recovery key in
    /// the first update) plus `n - 1` more devices; returns the words' key.
    /// `a`'s device `i` promoted to admin: every device's context id, the
    /// log after the promotion, and the device as an admin.
    fn promoted(a: &Agent, i: usize) -> (Vec<String>, DidChain, Admin) {
        let ctx: Vec<String> = a
            .devices
            .iter()
            .map(|d| context_id_for(&d.public()))
            .collect();
        let log = promote(&a.log, &a.master, &ctx[i], 1_010).unwrap();
        let admin = Admin {
            key_id: format!("{}#{}", log.did(), ctx[i]),
            key: DeviceKey::from_seed(&a.devices[i].seed()),
        };
        (ctx, log, admin)
    }

    fn agent_with_recovery(n: usize) -> (Agent, DeviceKey) {
        let key = DeviceKey::generate().unwrap();
        let recovery = DeviceKey::generate().unwrap();
        let mut log = DidChain::genesis(&key, 1_000).unwrap();
        let first = DeviceKey::generate().unwrap();
        first_update(&mut log, &key, &first, &recovery.public(), 1_000).unwrap();
        let master = Admin {
            key_id: master_key_id(&log).unwrap(),
            key,
        };
        let mut devices = vec![first];
        for _ in 1..n {
            let d = DeviceKey::generate().unwrap();
            let x = nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret());
            add_device(&mut log, &master, &d.public(), &x, 1_000).unwrap();
            devices.push(d);
        }
        let agent = Agent {
            log,
            master,
            devices,
            keys: KeyRing::new(SyncKey::generate(0).unwrap()),
        };
        (agent, recovery)
    }

    // Goal: recovery with the words makes the recovering device an admin,
    // takes the master key and the lost device out, replaces the recovery
    // key, and seals a new epoch only to the devices that remain; the old
    // words and another agent's words are refused. Method: three devices,
    // device 0 (with the master key's home) lost, device 1 recovers.
    #[test]
    fn recover_makes_this_device_admin_and_locks_the_lost_one_out() {
        let (a, words) = agent_with_recovery(3);
        let ctx: Vec<String> = a
            .devices
            .iter()
            .map(|d| context_id_for(&d.public()))
            .collect();
        let new_words = DeviceKey::generate().unwrap();
        let r = recover(
            &a.log,
            &a.keys,
            &words,
            &a.devices[1],
            std::slice::from_ref(&ctx[0]),
            &new_words.public(),
            1_010,
        )
        .unwrap();
        r.log.verify(Some(a.log.did()), 1_010).unwrap();
        let doc = r.log.current();
        let did = doc.id.clone();
        assert!(doc.has_relationship(
            &format!("{did}#{}", ctx[1]),
            Relationship::CapabilityDelegation
        ));
        assert_eq!(
            doc.key_status(&master_key_id(&a.log).unwrap(), 1_010),
            KeyStatus::NotListed
        );
        assert_eq!(
            doc.key_status(&format!("{did}#{}", ctx[0]), 1_010),
            KeyStatus::NotListed
        );
        assert_eq!(recovery_keys(doc), vec![format!("{did}#recovery-2")]);
        assert_eq!(r.recovery_key_id, format!("{did}#recovery-2"));
        let mut removed = r.removed.clone();
        removed.sort();
        let mut want = vec![
            ctx[0].clone(),
            DidDocument::fragment(&master_key_id(&a.log).unwrap()).to_owned(),
        ];
        want.sort();
        assert_eq!(removed, want);
        // Numbered after the log it was opened on (4 updates: genesis,
        // first update, two devices, the recovery).
        assert_eq!(r.epoch, r.log.len() as u64);
        for i in [1, 2] {
            match open_grant(&r.grant, &a.keys, doc, &a.devices[i], &ctx[i], 1_010).unwrap() {
                GrantOutcome::NewKey(k) => {
                    assert_eq!(k.expose_secret(), r.keys.current().expose_secret())
                }
                GrantOutcome::Known => panic!("device {i} should learn the new key"),
            }
        }
        assert!(open_grant(&r.grant, &a.keys, doc, &a.devices[0], &ctx[0], 1_010).is_err());

        // The old words are retired; a stranger's words never belonged.
        let again = recover(
            &r.log,
            &r.keys,
            &words,
            &a.devices[1],
            &[],
            &new_words.public(),
            1_020,
        );
        let e = again.err().unwrap().to_string();
        assert!(e.contains("not a recovery key"), "{e}");
        let stranger = DeviceKey::generate().unwrap();
        let e = recover(
            &a.log,
            &a.keys,
            &stranger,
            &a.devices[1],
            &[],
            &new_words.public(),
            1_020,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("not a recovery key"), "{e}");
        // The new words work, from a device the log does not list yet.
        let fresh = DeviceKey::generate().unwrap();
        let newer = DeviceKey::generate().unwrap();
        let r2 = recover(
            &r.log,
            &r.keys,
            &new_words,
            &fresh,
            &[],
            &newer.public(),
            1_030,
        )
        .unwrap();
        let fresh_id = format!("{did}#{}", context_id_for(&fresh.public()));
        assert!(
            r2.log
                .current()
                .has_relationship(&fresh_id, Relationship::Authentication)
        );
        assert!(
            r2.log
                .current()
                .has_relationship(&fresh_id, Relationship::CapabilityDelegation)
        );
        assert_eq!(r2.epoch, r2.log.len() as u64);
        assert!(r2.epoch > r.epoch);
    }

    // Goal: admin changes stop, with a clear error and nothing changed,
    // before the proof of the document outgrows what DHT pointers and
    // Hellos carry; pairings never make it grow. Method: promote and demote
    // a device until refused; then add devices.
    #[test]
    fn admin_changes_stop_before_the_proof_outgrows_a_pointer() {
        let (a, _words) = agent_with_recovery(2);
        let ctx = context_id_for(&a.devices[1].public());
        let mut log = a.log.clone();
        let mut changes = 0;
        let err = loop {
            let r = if changes % 2 == 0 {
                promote(&log, &a.master, &ctx, 1_010)
            } else {
                demote(&log, &a.master, &ctx, 1_010)
            };
            match r {
                Ok(next) => log = next,
                Err(e) => break e,
            }
            changes += 1;
            assert!(changes < 200, "never refused");
        };
        let msg = format!("{err:#}");
        assert!(msg.contains("over the") && msg.contains("Hellos"), "{msg}");
        assert!(changes >= 30, "only {changes} admin changes fit");
        let bytes = log.proof().encode().unwrap().len();
        assert!(bytes <= MAX_PROOF_AFTER_CHANGE, "{bytes}");
        println!("{changes} admin changes fit; the proof is {bytes} bytes");
    }

    // Goal: a promoted device can sign DID updates itself (add a device),
    // a demoted one cannot, and neither revoke nor demote may leave the
    // agent without an admin device. Method: promote device 1, let it add
    // a device, demote it, then recover so device 1 is the only admin.
    #[test]
    fn promote_and_demote_move_admin_rights() {
        let (a, words) = agent_with_recovery(2);
        let ctx: Vec<String> = a
            .devices
            .iter()
            .map(|d| context_id_for(&d.public()))
            .collect();
        let log = promote(&a.log, &a.master, &ctx[1], 1_010).unwrap();
        let e = promote(&log, &a.master, &ctx[1], 1_010)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("already an admin"), "{e}");
        // A hostile id is echoed only as a short prefix.
        let e = promote(&log, &a.master, &"x".repeat(5_000), 1_010)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no device") && e.len() < 300,
            "{} bytes",
            e.len()
        );
        let did = log.did().to_owned();
        let phone = Admin {
            key_id: format!("{did}#{}", ctx[1]),
            key: DeviceKey::from_seed(&a.devices[1].seed()),
        };
        let mut by_phone = log.clone();
        let d = DeviceKey::generate().unwrap();
        let x = nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret());
        add_device(&mut by_phone, &phone, &d.public(), &x, 1_020).unwrap();
        by_phone.verify(None, 1_020).unwrap();

        let log = demote(&by_phone, &a.master, &ctx[1], 1_030).unwrap();
        let mut denied = log.clone();
        assert!(
            add_device(
                &mut denied,
                &phone,
                &DeviceKey::generate().unwrap().public(),
                &x,
                1_040
            )
            .is_err()
        );
        let e = demote(&log, &a.master, &ctx[1], 1_040)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not an admin"), "{e}");
        let e = promote(&log, &a.master, "recovery-1", 1_040)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("not an active device") || e.contains("no device"),
            "{e}"
        );

        // After recovery device 0 is the only admin device: it cannot be
        // demoted or revoked by itself.
        let r = recover(
            &log,
            &a.keys,
            &words,
            &a.devices[0],
            &[],
            &DeviceKey::generate().unwrap().public(),
            1_050,
        )
        .unwrap();
        let me = Admin {
            key_id: format!("{did}#{}", ctx[0]),
            key: DeviceKey::from_seed(&a.devices[0].seed()),
        };
        let e = demote(&r.log, &me, &ctx[0], 1_060)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("last admin"), "{e}");
    }

    // Goal: two admins who approved devices concurrently converge on one
    // log that lists both devices: the loser of the fork rule signs its
    // change again on top of the winner. Method: the master and a promoted
    // device each add a device to the same log; both merge the other's.
    #[test]
    fn a_lost_fork_is_rebased_onto_the_winner() {
        let (a, _words) = agent_with_recovery(2);
        let (_, base, phone) = promoted(&a, 1);
        let (x, y) = (
            DeviceKey::generate().unwrap(),
            DeviceKey::generate().unwrap(),
        );
        let xx = |d: &DeviceKey| nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret());
        let mut by_master = base.clone();
        let cx = add_device(&mut by_master, &a.master, &x.public(), &xx(&x), 1_020).unwrap();
        let mut by_phone = base.clone();
        let cy = add_device(&mut by_phone, &phone, &y.public(), &xx(&y), 1_020).unwrap();

        // Each side merges the other's log; exactly one branch wins.
        let mut m = by_master.clone();
        let mut p = by_phone.clone();
        let om = m.merge(&by_phone, 1_030).unwrap();
        let op = p.merge(&by_master, 1_030).unwrap();
        assert_eq!(m, p, "both sides pick the same branch");
        let (loser_old, loser_admin) = match (&om, &op) {
            (nuwa_identity::chain::MergeOutcome::SwitchedFork { .. }, _) => (&by_master, &a.master),
            (_, nuwa_identity::chain::MergeOutcome::SwitchedFork { .. }) => (&by_phone, &phone),
            other => panic!("no branch won: {other:?}"),
        };
        let own = [loser_admin.key.public()];
        let (doc, n) = rebased_document(loser_old, &m, &own).expect("something to rebase");
        assert_eq!(n, 1);
        let mut merged = m.clone();
        merged
            .append_document(&doc, &loser_admin.key, &loser_admin.key_id, 1_040)
            .unwrap();
        merged.verify(None, 1_040).unwrap();
        let did = merged.did().to_owned();
        for c in [&cx, &cy] {
            assert!(
                merged
                    .current()
                    .has_relationship(&format!("{did}#{c}"), Relationship::Authentication),
                "{c} missing after the rebase"
            );
        }
        // The winner's side has nothing of its own to rebase.
        let winner_admin = if std::ptr::eq(loser_admin, &a.master) {
            &phone
        } else {
            &a.master
        };
        assert!(rebased_document(&m, &merged, &[winner_admin.key.public()]).is_none());
        // Nor does a device whose log simply grew.
        assert!(rebased_document(&base, &merged, &own).is_none());
    }

    // Goal: two admins that hold the same key epoch and each sign a change
    // with a new epoch (both heard of the same lost branch) open two
    // different numbers, both past the one they held, even when that one
    // is already past every branch's length. Seed 5953 of the agent
    // simulator: both opened `current + 1`, two keys under one number,
    // and neither side could read the other's writes.
    #[test]
    fn two_admins_signing_at_once_open_different_epochs() {
        let a = agent(2);
        let (ctx, log, phone) = promoted(&a, 0);
        // Both hold an epoch whose high bits are already past the length.
        let held = (u64::from(u32::MAX) << 8) | 0x1234;
        let keys = KeyRing::new(SyncKey::generate(held).unwrap());
        // Both sign the removal of the other device.
        let mut next = log.current().clone();
        next.remove_key(&ctx[1]).unwrap();
        next.remove_key(&format!("{}{X25519_SUFFIX}", ctx[1]))
            .unwrap();
        for _ in 0..20 {
            let by_master = sign_with_epoch(&log, &keys, &a.master, &next, 1_020).unwrap();
            let by_phone = sign_with_epoch(&log, &keys, &phone, &next, 1_020).unwrap();
            assert!(by_master.epoch > held && by_phone.epoch > held);
            assert_ne!(by_master.epoch, by_phone.epoch);
            assert_ne!(by_master.epoch, held + 1);
        }
    }

    // Goal: what an admin signs again after its branch lost the fork rule
    // does not bring back a device the lost branch itself removed after
    // this admin added it (another admin revoked it, or pruned it once it
    // expired); an addition that still stood is signed again. Seed 3439
    // of the agent simulator: a recovered admin paired a short-lived
    // device, a second admin pruned it, a third branch won, and the first
    // admin's rebase listed the pruned device again.
    #[test]
    fn a_rebase_does_not_add_back_what_the_lost_branch_removed_later() {
        let (a, _words) = agent_with_recovery(2);
        let (ctx, base, phone) = promoted(&a, 1);
        let xx = |d: &DeviceKey| nuwa_crypto::epoch::x25519_public_key(&d.x25519_secret());
        let (x, y) = (
            DeviceKey::generate().unwrap(),
            DeviceKey::generate().unwrap(),
        );
        // The winner: the phone adds y on the base.
        let mut winner = base.clone();
        add_device(&mut winner, &phone, &y.public(), &xx(&y), 1_020).unwrap();
        // The lost branch: the master adds x; then the phone revokes it.
        let mut lost = base.clone();
        let cx = add_device(&mut lost, &a.master, &x.public(), &xx(&x), 1_020).unwrap();
        let own = [a.master.key.public()];
        let (doc, _) = rebased_document(&lost, &winner, &own).expect("x still stands");
        assert!(
            doc.find_method(&cx).is_some(),
            "an addition that stood is signed again"
        );
        let keys = KeyRing::new(SyncKey::generate(0).unwrap());
        let r = revoke(&lost, &keys, &phone, &cx, &ctx[1], 1_030).unwrap();
        assert!(
            rebased_document(&r.log, &winner, &own).is_none(),
            "nothing of the master's still stands on the lost branch"
        );
    }
}
