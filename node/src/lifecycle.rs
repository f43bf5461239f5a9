//! Device lifecycle on top of the DID log and the key ring: the signed DID
//! updates that add (pairing) or remove (revocation) a device, and the epoch
//! grant a revocation issues. (Checking a grant that arrives from a peer is
//! `nuwa_sync::grant`.)
//!
//! No IO here: the daemon and the offline CLI paths persist the results.

use anyhow::{Context, Result, bail};
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{EpochGrant, KeyRing};
use nuwa_identity::document::{DidDocument, KeyStatus, Relationship};
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_identity::log::DidLog;

use crate::home::DEVICE_RELATIONSHIPS;

/// Fragment suffix of a device's X25519 `keyAgreement` key.
pub const X25519_SUFFIX: &str = "-x25519";

/// Reads the key that may change the DID document (`capabilityDelegation`)
/// from `HOME/master.key`, or explains where key management happens.
pub fn load_master(home: &std::path::Path, log: &DidLog, now_secs: i64) -> Result<DeviceKey> {
    let path = home.join(crate::home::MASTER_KEY);
    let bytes = std::fs::read(&path).map_err(|_| {
        anyhow::anyhow!(
            "this device holds no key with capabilityDelegation ({} is missing), so it cannot \
             change the agent's DID document; run this on the device where `nuwa-node init` ran",
            path.display()
        )
    })?;
    let master = DeviceKey::from_seed_file_bytes(&bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let key_id = master_key_id(log)?;
    let listed = log
        .current()
        .key_for(&key_id, Relationship::CapabilityDelegation, now_secs)
        .with_context(|| format!("the master key {key_id} may no longer delegate"))?;
    if listed != master.public() {
        bail!(
            "{} does not hold the agent's capabilityDelegation key {key_id}",
            path.display()
        );
    }
    Ok(master)
}

/// The id of the key that signs DID updates: the genesis document's
/// `capabilityDelegation` key (the master key of `init`).
pub fn master_key_id(log: &DidLog) -> Result<String> {
    let genesis = &log.updates().first().context("DID log is empty")?.document;
    genesis
        .capability_delegation
        .first()
        .cloned()
        .context("DID log genesis has no capabilityDelegation key")
}

/// Appends the signed update that adds a device: its Ed25519 key with the
/// device relationships and its X25519 key under `keyAgreement`. Returns the
/// device's context id.
pub fn add_device(
    log: &mut DidLog,
    master: &DeviceKey,
    ed25519: &[u8; 32],
    x25519: &[u8; 32],
    now_secs: i64,
) -> Result<String> {
    let context_id = context_id_for(ed25519);
    let mut doc: DidDocument = log.current().clone();
    doc.add_key(&context_id, ed25519, DEVICE_RELATIONSHIPS, None)
        .context("cannot add the device key to the DID document")?;
    doc.add_key_agreement_key(&format!("{context_id}{X25519_SUFFIX}"), x25519, None)
        .context("cannot add the device's key-agreement key to the DID document")?;
    log.append(doc, master, &master_key_id(log)?, now_secs)
        .context("cannot sign the DID document update")?;
    Ok(context_id)
}

/// The result of revoking a device: the extended log, the new epoch's key
/// (already in `keys`) and the encoded grant that hands it to the rest.
pub struct Revocation {
    pub log: DidLog,
    pub keys: KeyRing,
    pub grant: Vec<u8>,
    pub epoch: u64,
    pub remaining: Vec<String>,
}

/// Signs the DID update removing `target` (its Ed25519 and X25519 keys) and
/// opens a new key epoch sealed to every remaining device's X25519 key.
pub fn revoke(
    log: &DidLog,
    keys: &KeyRing,
    master: &DeviceKey,
    target: &str,
    self_context: &str,
    now_secs: i64,
) -> Result<Revocation> {
    if target == self_context {
        bail!(
            "{target} is this device; a device cannot revoke itself (revoke it from another \
             device that holds the master key, or stop using this home)"
        );
    }
    let did = log.did().to_owned();
    let doc = log.current();
    let key_id = format!("{did}#{target}");
    if doc.key_status(&key_id, now_secs) == KeyStatus::NotListed {
        let ever = log
            .updates()
            .iter()
            .any(|u| u.document.key_status(&key_id, i64::MIN / 2) != KeyStatus::NotListed);
        if ever {
            bail!("device {target} is already revoked");
        }
        bail!("no device {target} in the agent's DID document; see `nuwa-node device list`");
    }
    let master_id = master_key_id(log)?;
    if DidDocument::fragment(&master_id) == target {
        bail!("{target} is the agent's master key, not a device");
    }
    let mut next = doc.clone();
    next.remove_key(target)
        .with_context(|| format!("cannot remove {target}"))?;
    let x = format!("{target}{X25519_SUFFIX}");
    if next.key_status(&format!("{did}#{x}"), now_secs) != KeyStatus::NotListed {
        next.remove_key(&x)
            .with_context(|| format!("cannot remove {x}"))?;
    }
    let mut log = log.clone();
    log.append(next, master, &master_id, now_secs)
        .context("cannot sign the DID document update")?;

    let recipients = recipients(log.current(), now_secs)?;
    if recipients.is_empty() {
        bail!("no device would remain after revoking {target}");
    }
    let epoch = keys.current().epoch() + 1;
    let key = SyncKey::generate(epoch).context("cannot generate the new sync key")?;
    let grant = EpochGrant::create(
        &key,
        &recipients,
        &[target.to_owned()],
        DidDocument::fragment(&master_id),
        master.signing_key(),
        &did,
        now_secs.max(0) as u64,
    )
    .context("cannot create the epoch grant")?
    .encode()
    .context("cannot encode the epoch grant")?;
    let mut keys = keys.clone();
    keys.insert(key).context("cannot add the new key epoch")?;
    Ok(Revocation {
        log,
        keys,
        grant,
        epoch,
        remaining: recipients.into_iter().map(|(c, _)| c).collect(),
    })
}

/// Every active device with an X25519 key: (context id, X25519 public key).
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
        log: DidLog,
        master: DeviceKey,
        devices: Vec<DeviceKey>,
        keys: KeyRing,
    }

    fn agent(n: usize) -> Agent {
        let master = DeviceKey::generate().unwrap();
        let mut log = DidLog::genesis(&master, 1_000).unwrap();
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
        let e = revoke(&a.log, &a.keys, &a.devices[0], &ctx[1], &ctx[0], 1_010)
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
}
