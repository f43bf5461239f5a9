//! The agent's recovery key, written down by the user as BIP-39 English words.
//!
//! `init` makes a second `capabilityDelegation` key besides the master key:
//! the recovery key. It is shown once as a list of words, the user writes them
//! down and types a few back ([`confirmation_positions`],
//! [`check_confirmation`]), and then it exists only on paper. `recover` takes
//! the words ([`RecoveryPhrase::parse`]), rebuilds the key
//! ([`RecoveryPhrase::key`]) and checks it is a recovery key of the agent being
//! recovered ([`check_belongs`]). Every refusal is a typed [`RecoveryError`]
//! that says what to do next, and none of these functions changes anything.
//!
//! This module does not show or ask for words, write anything anywhere, or
//! sign the document update that recovery makes: the node crate talks to the
//! user, and [`crate::log`] checks that the update is signed by a key holding
//! `capabilityDelegation`. A recovery key holds `capabilityDelegation` only,
//! never `authentication` ([`add_recovery_key`]): it can replace the agent's
//! keys but cannot act as a device.
//!
//! # Why 12 words
//!
//! Twelve words carry 128 bits of entropy (plus a 4-bit checksum), which
//! matches the security of the key they make: breaking an Ed25519 key costs
//! about 2^126 operations, so more entropy would not make the agent harder to
//! take over. Guessing words is also no shortcut: every guess costs an HKDF
//! and an Ed25519 scalar multiplication, and even against a million agents at
//! once (the salt is fixed, so one guess is tried against every agent's
//! published key) 2^108 guesses remain. What 24 words would add is a burden
//! on the user, twice the words to write, keep legible for years, type back
//! and get wrong, for no gain the curve lets through. A quantum computer
//! would break Ed25519 itself, so 24 words would not help there either. The
//! length lives in [`WORD_COUNT`] and `ENTROPY_BYTES`; changing it breaks
//! every written phrase, so it would need a new salt version.
//!
//! # Why the entropy and not the BIP-39 seed
//!
//! BIP-39 turns words into a wallet seed with 2048 rounds of PBKDF2 over the
//! words and a passphrase. Neither part earns its cost here: there is no
//! passphrase (one more secret to lose would defeat a recovery key), and the
//! stretching protects low-entropy passphrases, while the words already carry
//! the full 128 bits. So the Ed25519 seed is HKDF-SHA256 of the words' entropy
//! with a salt and info of our own ([`RECOVERY_KDF_SALT`],
//! [`RECOVERY_KDF_INFO`]): deterministic (the same words always make the same
//! key), domain-separated from any wallet that might read the same words, and
//! versioned by the salt.
//!
//! # Secrets in memory
//!
//! [`RecoveryPhrase`] keeps its entropy in a zeroizing buffer, its `Debug`
//! prints no words, and [`RecoveryPhrase::words`] returns a zeroizing string.
//! The `bip39` crate's parsing and encoding copy words and entropy into stack
//! buffers it does not wipe; that is beyond this module's reach.

use std::fmt;

use bip39::{Language, Mnemonic};
use hkdf::Hkdf;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::document::{DidDocument, DidError, Relationship, shorten};
use crate::keys::DeviceKey;

/// Number of words in a recovery phrase (128 bits of entropy, see the module docs).
pub const WORD_COUNT: usize = 12;
/// Bytes of BIP-39 entropy behind [`WORD_COUNT`] words.
const ENTROPY_BYTES: usize = 16;
/// How many words the user is asked to type back after writing them down.
pub const CONFIRM_WORDS: usize = 3;
/// The fragment prefix of recovery keys in the DID document (`recovery-1`, ...).
pub const RECOVERY_FRAGMENT_PREFIX: &str = "recovery";
/// HKDF salt of the recovery key derivation; a new version means new keys for the same words.
pub const RECOVERY_KDF_SALT: &[u8] = b"nuwa-recovery-v1";
/// HKDF info of the recovery key derivation.
pub const RECOVERY_KDF_INFO: &[u8] = b"ed25519 recovery key";
/// Typed words longer than this get no suggestion: BIP-39 English words have at
/// most 8 letters, so a longer word is more than two edits from all of them.
const SUGGEST_MAX_LEN: usize = 10;
/// Most edits (insert, delete, replace, swap of neighbours) between a typed
/// word and the word suggested for it.
const SUGGEST_MAX_EDITS: usize = 2;

/// Errors from reading, checking and confirming recovery words.
///
/// [`RecoveryError::UnknownWord`] carries one typed word and a guess at the
/// word meant, which is probably a word of the phrase: show it to the user,
/// but do not log it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// No random bytes could be had (see [`nuwa_entropy::fill`]).
    #[error("cannot read random bytes for a recovery phrase or the words to ask back")]
    Random(#[source] nuwa_entropy::Error),
    /// The phrase does not have [`WORD_COUNT`] words.
    #[error(
        "expected {expected} recovery words, found {found}: enter all {expected} words in order, separated by spaces"
    )]
    WordCount {
        /// Number of words entered.
        found: usize,
        /// Number of words a recovery phrase has.
        expected: usize,
    },
    /// A word is not in the BIP-39 English word list.
    #[error(
        "word {position} `{word}` is not a recovery word{}: check it against your written copy",
        suggestion_hint(.suggestion)
    )]
    UnknownWord {
        /// 1-based position of the word in the phrase.
        position: usize,
        /// The word as entered (lowercased, shortened if long).
        word: String,
        /// The closest word of the list, when one is clearly closest.
        suggestion: Option<String>,
    },
    /// Every word is in the list, but the last word's checksum does not fit the others.
    #[error(
        "the recovery words do not fit together (their checksum fails): a word is wrong or two are swapped; compare each word and its position with your written copy"
    )]
    Checksum,
    /// The document lists no recovery key made from these words.
    #[error(
        "these words are not a recovery key of {did}: check you are recovering the right agent, and that these words were not replaced by newer ones"
    )]
    NotThisAgent {
        /// The DID of the document that was searched (shortened if long).
        did: String,
    },
    /// The key is listed as a recovery key but no longer holds `capabilityDelegation`.
    #[error(
        "the recovery key {key_id} of these words may no longer change the agent's keys: use a newer recovery phrase or an authorised device"
    )]
    Retired {
        /// The recovery key's id in the document.
        key_id: String,
    },
    /// The key is listed as a recovery key but its `expires` has passed.
    #[error(
        "the recovery key {key_id} of these words expired at {expires}: use a newer recovery phrase or an authorised device"
    )]
    Expired {
        /// The recovery key's id in the document.
        key_id: String,
        /// Its `expires` value.
        expires: String,
    },
    /// The document entry of the recovery key cannot be read.
    #[error(
        "the did document's entry for this recovery key is invalid: fetch the agent's document again"
    )]
    Document(#[source] DidError),
    /// A word typed back does not match the phrase.
    #[error(
        "word {position} does not match: look at word {position} of the list you wrote down and correct your copy if needed"
    )]
    Mismatch {
        /// 1-based position of the word that differs.
        position: usize,
    },
    /// A confirmation answer names a position the phrase does not have.
    #[error("there is no word {position}: positions run from 1 to {n_words}")]
    PositionOutOfRange {
        /// The 1-based position given.
        position: usize,
        /// Number of words in the phrase.
        n_words: usize,
    },
    /// No confirmation answers were given, so nothing shows the words were written down.
    #[error("no words were typed back: type back the words at the positions asked")]
    NothingConfirmed,
}

fn suggestion_hint(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(word) => format!(" (did you mean `{word}`?)"),
        None => String::new(),
    }
}

/// A recovery phrase: [`WORD_COUNT`] BIP-39 English words encoding 128 bits
/// of entropy, from which [`RecoveryPhrase::key`] derives the recovery key.
///
/// The entropy is wiped on drop, and `Debug` prints `RecoveryPhrase(..)`. It
/// is deliberately not `Clone`, like [`DeviceKey`].
pub struct RecoveryPhrase {
    entropy: Zeroizing<[u8; ENTROPY_BYTES]>,
}

impl RecoveryPhrase {
    /// A fresh phrase from the operating system's random number generator (through
    /// [`nuwa_entropy::fill`]).
    pub fn generate() -> Result<RecoveryPhrase, RecoveryError> {
        let mut entropy = Zeroizing::new([0u8; ENTROPY_BYTES]);
        nuwa_entropy::fill(entropy.as_mut_slice()).map_err(RecoveryError::Random)?;
        Ok(RecoveryPhrase { entropy })
    }

    /// Reads a phrase typed by the user.
    ///
    /// Words may be separated by any whitespace and written in any case.
    /// Checks, in order: the number of words ([`RecoveryError::WordCount`]),
    /// that each word is in the list ([`RecoveryError::UnknownWord`], the
    /// first unknown one, with a suggestion when one word is clearly closest),
    /// and the checksum ([`RecoveryError::Checksum`]).
    pub fn parse(input: &str) -> Result<RecoveryPhrase, RecoveryError> {
        let found = input.split_whitespace().count();
        if found != WORD_COUNT {
            return Err(RecoveryError::WordCount {
                found,
                expected: WORD_COUNT,
            });
        }
        // One space between lowercase words is bip39's normalized form for
        // English. Tokens plus single spaces never outgrow the input, so the
        // buffer never reallocates and leaves no unwiped copy behind.
        let mut normalized = Zeroizing::new(String::with_capacity(input.len()));
        for word in input.split_whitespace() {
            if !normalized.is_empty() {
                normalized.push(' ');
            }
            normalized.extend(word.chars().map(|c| c.to_ascii_lowercase()));
        }
        let mnemonic =
            Mnemonic::parse_in_normalized(Language::English, &normalized).map_err(|error| {
                match error {
                    bip39::Error::UnknownWord(index) => {
                        let word = normalized.split(' ').nth(index).unwrap_or_default();
                        RecoveryError::UnknownWord {
                            position: index + 1,
                            word: shorten(word),
                            suggestion: suggest_word(word).map(str::to_owned),
                        }
                    }
                    bip39::Error::InvalidChecksum => RecoveryError::Checksum,
                    // The count was checked above; bip39 returns the other two
                    // only when making words from entropy or guessing a language.
                    bip39::Error::BadWordCount(_)
                    | bip39::Error::BadEntropyBitCount(_)
                    | bip39::Error::AmbiguousLanguages(_) => RecoveryError::WordCount {
                        found,
                        expected: WORD_COUNT,
                    },
                }
            })?;
        let (entropy_and_spare, _len) = mnemonic.to_entropy_array();
        let entropy_and_spare = Zeroizing::new(entropy_and_spare);
        let mut entropy = Zeroizing::new([0u8; ENTROPY_BYTES]);
        entropy.copy_from_slice(&entropy_and_spare[..ENTROPY_BYTES]);
        Ok(RecoveryPhrase { entropy })
    }

    /// The words separated by single spaces, to show the user once.
    pub fn words(&self) -> Zeroizing<String> {
        let mnemonic = self.mnemonic();
        // Room for the longest words (8 letters) so the string never
        // reallocates and leaves an unwiped copy behind.
        let mut out = Zeroizing::new(String::with_capacity(WORD_COUNT * 9));
        for word in mnemonic.words() {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(word);
        }
        out
    }

    /// The word at a 1-based position, if there is one.
    fn word_at(&self, position: usize) -> Option<&'static str> {
        let index = position.checked_sub(1)?;
        self.mnemonic().words().nth(index)
    }

    /// The recovery key: Ed25519 seed = HKDF-SHA256(ikm = entropy, salt =
    /// [`RECOVERY_KDF_SALT`], info = [`RECOVERY_KDF_INFO`]). The same words
    /// always give the same key.
    pub fn key(&self) -> DeviceKey {
        let mut seed = Zeroizing::new([0u8; 32]);
        Hkdf::<Sha256>::new(Some(RECOVERY_KDF_SALT), self.entropy.as_slice())
            .expand(RECOVERY_KDF_INFO, seed.as_mut_slice())
            // HKDF-SHA256 refuses only outputs over 255 × 32 bytes; this one is 32.
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        DeviceKey::from_seed(&seed)
    }

    fn mnemonic(&self) -> Mnemonic {
        // bip39 refuses entropy only when its length is not 16, 20, 24, 28 or
        // 32 bytes; ours is always ENTROPY_BYTES = 16.
        Mnemonic::from_entropy_in(Language::English, self.entropy.as_slice())
            .expect("16 bytes is a valid bip-39 entropy length")
    }
}

// The temporary `Mnemonic`s built from the entropy hold the words' indices;
// this breaks the build if bip39's `zeroize` feature, which wipes them, is lost.
const _: () = {
    const fn assert_zeroize_on_drop<T: zeroize::ZeroizeOnDrop>() {}
    assert_zeroize_on_drop::<Mnemonic>();
};

impl zeroize::ZeroizeOnDrop for RecoveryPhrase {}

impl fmt::Debug for RecoveryPhrase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The words are the key: they must never reach logs.
        f.write_str("RecoveryPhrase(..)")
    }
}

/// The closest word of the list to a word that is not in it, if one is clearly closest.
///
/// BIP-39 English words are unique in their first four letters, so a word
/// starting with a list word's four letters is taken to be that word.
/// Otherwise the suggestion is the only word at the smallest number of edits,
/// if that is at most [`SUGGEST_MAX_EDITS`]; on a tie there is no suggestion,
/// since guessing between two words would mislead.
fn suggest_word(typed: &str) -> Option<&'static str> {
    let english = Language::English;
    if let Some(prefix) = typed.get(..4) {
        let mut matches = english.words_by_prefix_iter(prefix);
        if let (Some(only), None) = (matches.next(), matches.next()) {
            return Some(only);
        }
    }
    if typed.chars().count() > SUGGEST_MAX_LEN {
        return None;
    }
    let typed: Vec<char> = typed.chars().collect();
    let mut best: Option<&'static str> = None;
    let mut best_edits = SUGGEST_MAX_EDITS + 1;
    let mut tied = false;
    for &word in english.word_list() {
        let edits = edit_distance(&typed, word);
        if edits < best_edits {
            best = Some(word);
            best_edits = edits;
            tied = false;
        } else if edits == best_edits {
            tied = true;
        }
    }
    if tied { None } else { best }
}

/// Edits (insert, delete, replace, swap of neighbours) to turn `a` into `b`
/// (optimal string alignment distance).
fn edit_distance(a: &[char], b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    // rows[i][j]: edits between a[..i] and b[..j]; words are at most
    // SUGGEST_MAX_LEN long, so the table stays tiny.
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let replace = usize::from(a[i - 1] != b[j - 1]);
            let mut edits = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + replace);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                edits = edits.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = edits;
        }
    }
    rows[a.len()][b.len()]
}

/// The id fragment of the `generation`-th recovery key: `recovery-1`,
/// `recovery-2`, ... (a new phrase replaces the old one under the next number).
pub fn recovery_fragment(generation: u32) -> String {
    format!("{RECOVERY_FRAGMENT_PREFIX}-{generation}")
}

/// Whether a key id or fragment names a recovery key (`recovery-<anything>`).
pub fn is_recovery_fragment(key_id: &str) -> bool {
    DidDocument::fragment(key_id)
        .strip_prefix(RECOVERY_FRAGMENT_PREFIX)
        .is_some_and(|rest| rest.starts_with('-'))
}

/// Lists `public` in `doc` as the `generation`-th recovery key, with
/// `capabilityDelegation` only, and returns its key id.
///
/// Fails as [`DidDocument::add_key`] does (for instance when that fragment or
/// key is already listed), leaving the document unchanged, and with
/// [`DidError::Malformed`] for bytes that are no usable Ed25519 public key
/// (not a curve point, or of small order): words can never sign for such a
/// key, nor open what is sealed to it, so it would only lock recovery out.
pub fn add_recovery_key(
    doc: &mut DidDocument,
    generation: u32,
    public: &[u8; 32],
) -> Result<String, DidError> {
    let usable = ed25519_dalek::VerifyingKey::from_bytes(public).is_ok_and(|k| !k.is_weak());
    if !usable {
        return Err(DidError::Malformed {
            reason: format!(
                "the recovery key {} is not a usable Ed25519 public key",
                hex::encode(public)
            ),
        });
    }
    let fragment = recovery_fragment(generation);
    doc.add_key(
        &fragment,
        public,
        &[Relationship::CapabilityDelegation],
        None,
    )?;
    Ok(doc.key_id(&fragment))
}

/// Checks that `key` (from [`RecoveryPhrase::key`]) is a recovery key of the
/// agent `doc` describes, able to change its keys at `now_unix_secs`, and
/// returns its key id.
///
/// The key must be listed as an Ed25519 method under a `recovery-` fragment
/// ([`RecoveryError::NotThisAgent`] otherwise), hold `capabilityDelegation`
/// ([`RecoveryError::Retired`]) and not be expired ([`RecoveryError::Expired`]).
/// From one document it cannot tell a retired phrase that was removed from
/// words that never belonged to this agent; both are `NotThisAgent`.
pub fn check_belongs(
    doc: &DidDocument,
    key: &DeviceKey,
    now_unix_secs: i64,
) -> Result<String, RecoveryError> {
    let public = key.public();
    let method = doc
        .verification_method
        .iter()
        .find(|method| {
            is_recovery_fragment(&method.id) && method.ed25519_public().ok() == Some(public)
        })
        .ok_or_else(|| RecoveryError::NotThisAgent {
            did: shorten(&doc.id),
        })?;
    if !doc.has_relationship(&method.id, Relationship::CapabilityDelegation) {
        return Err(RecoveryError::Retired {
            key_id: method.id.clone(),
        });
    }
    method
        .check_not_expired(now_unix_secs)
        .map_err(|error| match error {
            DidError::Expired { key_id, expires } => RecoveryError::Expired { key_id, expires },
            other => RecoveryError::Document(other),
        })?;
    Ok(method.id.clone())
}

/// `k` distinct 1-based positions out of `n_words`, in ascending order, to ask
/// the user to type back; `k` is capped at `n_words`.
///
/// The positions come from `seed` alone, so tests can fix them; pass a random
/// seed in real use ([`random_confirmation_positions`]).
pub fn confirmation_positions(n_words: usize, k: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64(seed);
    let mut positions: Vec<usize> = (1..=n_words).collect();
    let k = k.min(n_words);
    // The first k steps of a Fisher-Yates shuffle pick k distinct positions.
    for i in 0..k {
        let j = i + rng.below(n_words - i);
        positions.swap(i, j);
    }
    positions.truncate(k);
    positions.sort_unstable();
    positions
}

/// [`confirmation_positions`] with a seed from the operating system's random
/// number generator, so the user cannot know in advance which words are asked.
pub fn random_confirmation_positions(
    n_words: usize,
    k: usize,
) -> Result<Vec<usize>, RecoveryError> {
    let mut seed = [0u8; 8];
    nuwa_entropy::fill(&mut seed).map_err(RecoveryError::Random)?;
    Ok(confirmation_positions(n_words, k, u64::from_le_bytes(seed)))
}

/// Checks words typed back by the user: each `(position, word)` must name the
/// word at that 1-based position (any case, surrounding spaces ignored).
///
/// Fails on the first wrong answer with [`RecoveryError::Mismatch`], on a
/// position the phrase lacks with [`RecoveryError::PositionOutOfRange`], and
/// on no answers at all with [`RecoveryError::NothingConfirmed`].
pub fn check_confirmation(
    phrase: &RecoveryPhrase,
    answers: &[(usize, String)],
) -> Result<(), RecoveryError> {
    if answers.is_empty() {
        return Err(RecoveryError::NothingConfirmed);
    }
    for (position, answer) in answers {
        let expected = phrase
            .word_at(*position)
            .ok_or(RecoveryError::PositionOutOfRange {
                position: *position,
                n_words: WORD_COUNT,
            })?;
        if !answer.trim().eq_ignore_ascii_case(expected) {
            return Err(RecoveryError::Mismatch {
                position: *position,
            });
        }
    }
    Ok(())
}

/// SplitMix64 (Steele, Lea and Flood 2014): a tiny seeded generator, enough to
/// pick which words to ask; it guards nothing secret.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0); the bias of the multiply-shift is below
    /// n / 2^64, far too small to matter here.
    fn below(&mut self, n: usize) -> usize {
        let wide = u128::from(self.next()) * n as u128;
        (wide >> 64) as usize
    }
}

#[cfg(test)]
mod tests;
