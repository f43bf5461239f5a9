//! Names people cannot confuse: the rules a new container name and a key
//! must meet at the local API (issue 25 finding 4: `notes`, `nоtes` with a
//! Cyrillic о and `notes` + U+200B were three containers that looked the
//! same; a name could start with U+202E; keys took NUL and newline).
//!
//! - **NFC.** A name or key must be in Unicode Normalization Form C. It is
//!   refused otherwise, with its NFC form in the message, rather than
//!   rewritten: a client then sees exactly the name it sent in every reply
//!   and event, and two spellings never name one container by surprise.
//! - **Nothing invisible or reordering.** Control characters (Cc), line and
//!   paragraph separators, and every Default_Ignorable_Code_Point of
//!   Unicode (zero-width characters, the bidi controls U+202A–U+202E and
//!   U+2066–U+2069, variation selectors, tags, U+FEFF ...) are refused.
//! - **No mixed-script word** (container names only). Each word (a run of
//!   letters and digits) is checked with UTS #39 restriction-level
//!   detection (the `unicode-security` crate): Latin mixed with Cyrillic or
//!   Greek in one word, the classic homograph, is refused; Latin with Han,
//!   Kana or Hangul (highly restrictive) and Latin with one other
//!   recommended script (moderately restrictive) pass. Keys are data an app
//!   chooses (a URL, a sentence), so this rule is not applied to them.
//!
//! The rules hold at the local API only. A container that a peer (or an
//! older version) already made under such a name still syncs, and the
//! reading routes still reach it, so nothing already stored is stranded.

use unicode_normalization::{IsNormalized, is_nfc_quick};
use unicode_security::{RestrictionLevel, RestrictionLevelDetection as _};

/// Default_Ignorable_Code_Point (Unicode 15.1 DerivedCoreProperties.txt),
/// as inclusive ranges. It holds the zero-width characters and the bidi
/// controls.
const DEFAULT_IGNORABLE: &[(u32, u32)] = &[
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
];

/// Why a name or key breaks the rules above.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameRuleError {
    #[error("it is not in Unicode NFC; send it as {nfc:?}")]
    NotNfc { nfc: String },
    #[error("it holds the invisible or control character U+{0:04X}; remove it")]
    Invisible(u32),
    #[error(
        "its word {word:?} mixes scripts that look alike (e.g. Latin and Cyrillic); \
         write each word in one script"
    )]
    MixedScript { word: String },
}

/// Whether `c` is refused in a name or key.
fn invisible(c: char) -> bool {
    let u = c as u32;
    c.is_control()
        || matches!(u, 0x2028 | 0x2029)
        || DEFAULT_IGNORABLE
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&u))
}

fn check_nfc_and_visible(s: &str) -> Result<(), NameRuleError> {
    if let Some(c) = s.chars().find(|&c| invisible(c)) {
        return Err(NameRuleError::Invisible(c as u32));
    }
    let nfc = match is_nfc_quick(s.chars()) {
        IsNormalized::Yes => true,
        IsNormalized::No => false,
        IsNormalized::Maybe => unicode_normalization::is_nfc(s),
    };
    if !nfc {
        use unicode_normalization::UnicodeNormalization as _;
        return Err(NameRuleError::NotNfc {
            nfc: s.nfc().collect(),
        });
    }
    Ok(())
}

/// The rules for a key written through the local API.
pub fn check_key_rules(key: &str) -> Result<(), NameRuleError> {
    check_nfc_and_visible(key)
}

/// The rules for a container name written through the local API.
pub fn check_name_rules(name: &str) -> Result<(), NameRuleError> {
    check_nfc_and_visible(name)?;
    for word in name.split(|c: char| !c.is_alphanumeric()) {
        if word.is_ascii() {
            continue;
        }
        if word.detect_restriction_level() == RestrictionLevel::MinimallyRestrictive {
            return Err(NameRuleError::MixedScript {
                word: word.to_owned(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the three look-alike names of finding 4 are told apart: only
    // the plain one passes; the bidi override, NUL and newline are
    // refused; NFD is refused with its NFC form; names in one script, or
    // Latin with Han or with words in another script, pass.
    #[test]
    fn look_alike_and_invisible_names_are_refused() {
        let ok = [
            "notes",
            "did:nuwa:cap:weather:state:Forecast#v1",
            "заметки",
            "notes-日本語",
            "café",
            "notes для работы",
            "Ωμέγα 2",
        ];
        for name in ok {
            assert_eq!(check_name_rules(name), Ok(()), "{name}");
        }
        let mixed = "n\u{043E}tes"; // Cyrillic о
        assert!(matches!(
            check_name_rules(mixed),
            Err(NameRuleError::MixedScript { .. })
        ));
        for (name, cp) in [
            ("notes\u{200B}", 0x200B),
            ("\u{202E}setoN", 0x202E),
            ("a\u{2066}b", 0x2066),
            ("a\0b", 0),
            ("a\nb", 0x0A),
            ("\u{FEFF}notes", 0xFEFF),
            ("a\u{2028}b", 0x2028),
            ("tag\u{E0041}", 0xE0041),
        ] {
            assert_eq!(
                check_name_rules(name),
                Err(NameRuleError::Invisible(cp)),
                "{name:?}"
            );
            assert_eq!(
                check_key_rules(name),
                Err(NameRuleError::Invisible(cp)),
                "{name:?}"
            );
        }
        let nfd = "cafe\u{301}";
        assert_eq!(
            check_name_rules(nfd),
            Err(NameRuleError::NotNfc {
                nfc: "café".to_owned()
            })
        );
        assert!(check_key_rules(nfd).is_err());
        // A Greek letter inside a Latin word is the same trick.
        assert!(check_name_rules("Ωmega").is_err());
        // Keys may mix scripts (they are data).
        assert_eq!(check_key_rules(mixed), Ok(()));
    }
}
