//! The recovery words at the terminal: showing them once, asking a few of
//! them back, reading them for `recover`, and the commands that use them
//! (`recovery create`, `recover`); and `device rotate`, the other command
//! that replaces keys on a home with its daemon stopped. The words never touch the disk and never
//! reach the daemon: only the recovery key's public half leaves this
//! process (`POST /v1/did/recovery-key`).
//!
//! What the words are and how they make a key is `nuwa_agent::identity::recovery`;
//! the DID updates they sign are `crate::lifecycle`.

use std::io::{BufRead as _, IsTerminal as _, Read as _, Write as _};
use std::path::Path;

use anyhow::{Context, Result, bail};
use nuwa_agent::identity::recovery::{
    CONFIRM_WORDS, RecoveryPhrase, WORD_COUNT, check_confirmation, random_confirmation_positions,
};
use serde::Serialize;
use zeroize::Zeroizing;

use crate::client::{self, print_json};
use crate::home;

/// Longest input accepted as recovery words (12 words of at most 8
/// letters, with room for stray spaces and numbering).
const MAX_WORDS_INPUT: usize = 4096;

/// How many times the words may be typed back wrong before giving up.
const CONFIRM_TRIES: usize = 3;

/// Refuses early, before anything is generated, when the words could not
/// be confirmed: no terminal to ask on, and no `--i-have-written-it-down`.
pub fn check_can_confirm(written_down: bool, json: bool) -> Result<()> {
    if json && !written_down {
        // With --json the words are not printed for people: they are in
        // `recovery_words`, which only a script that keeps them may ask for.
        bail!(
            "with --json the new recovery words are printed only in the JSON (`recovery_words`), \
             for scripts that keep them: pass --i-have-written-it-down too, or drop --json to see \
             them and type a few back"
        );
    }
    if written_down || std::io::stdin().is_terminal() {
        return Ok(());
    }
    bail!(
        "this shows the agent's recovery words, which must be written down and a few typed \
         back, but stdin is not a terminal. Run it on a terminal, or (scripts) pass \
         --i-have-written-it-down and keep the words it prints"
    )
}

/// Prints the words, numbered, with whose they are and what they are for.
pub fn show(phrase: &RecoveryPhrase, whose: &str) {
    let words = phrase.words();
    let mut out = String::new();
    out.push_str(&format!(
        "\nRECOVERY WORDS of {whose}\n\
         Write them down on paper, in order, and keep them offline. They are shown only \
         now and stored nowhere. With them, `nuwa-node recover` makes a device the agent's \
         admin again when every admin device is lost; whoever has them can take the agent \
         over.\n\n"
    ));
    for (i, w) in words.split_whitespace().enumerate() {
        out.push_str(&format!("  {:>2}. {w:<10}", i + 1));
        if i % 4 == 3 {
            out.push('\n');
        }
    }
    out.push('\n');
    // Not through `println!`: a closed stdout must not panic here.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    let _ = std::io::stdout().flush();
}

/// `recover` on a fresh home: this device's name, `given` or asked on a
/// terminal; empty (then `pair` names it after the host) when nobody is
/// there to ask, and then it says so.
pub fn ask_name(given: Option<String>, json: bool) -> Result<String> {
    let name = match given {
        Some(n) => n,
        None if !json && std::io::stdin().is_terminal() => {
            prompt("a name for this device (Enter: the host name): ")?
                .trim()
                .to_owned()
        }
        None => {
            eprintln!("no --name and no terminal: this device takes the host name as its name");
            return Ok(String::new());
        }
    };
    if !name.is_empty() {
        nuwa_agent::devices::check_rename(&[], "", &name)?;
    }
    Ok(name)
}

/// Asks for a few of the words back on the terminal, unless the user said
/// they are written down. Nothing has been written when this fails.
pub fn confirm(phrase: &RecoveryPhrase, written_down: bool) -> Result<()> {
    if written_down {
        return Ok(());
    }
    check_can_confirm(false, false)?;
    let mut attempt = 1;
    loop {
        let positions = random_confirmation_positions(WORD_COUNT, CONFIRM_WORDS)
            .context("cannot choose the words to confirm")?;
        let mut answers = Vec::new();
        for p in positions {
            let line = prompt(&format!("type word #{p}: "))?;
            answers.push((p, line.trim().to_owned()));
        }
        match check_confirmation(phrase, &answers) {
            Ok(()) => return Ok(()),
            Err(e) if attempt < CONFIRM_TRIES => {
                eprintln!("{e}; try again ({} tries left)", CONFIRM_TRIES - attempt);
                attempt += 1;
            }
            Err(e) => bail!("{e}; nothing was changed. Run the command again"),
        }
    }
}

fn prompt(text: &str) -> Result<Zeroizing<String>> {
    let mut err = std::io::stderr().lock();
    write!(err, "{text}")?;
    err.flush()?;
    drop(err);
    let mut line = Zeroizing::new(String::new());
    let n = std::io::stdin()
        .lock()
        .take(MAX_WORDS_INPUT as u64)
        .read_line(&mut line)
        .context("cannot read from the terminal")?;
    if n == 0 {
        bail!("no answer (end of input); nothing was changed");
    }
    Ok(line)
}

/// All of `r` as text, refused beyond [`MAX_WORDS_INPUT`].
fn bounded(r: impl std::io::Read, what: &str) -> Result<Zeroizing<String>> {
    let mut s = Zeroizing::new(String::new());
    r.take(MAX_WORDS_INPUT as u64 + 1)
        .read_to_string(&mut s)
        .with_context(|| format!("cannot read the recovery words from {what}"))?;
    if s.len() > MAX_WORDS_INPUT {
        bail!("{what} is too large to hold recovery words");
    }
    Ok(s)
}

/// Reads recovery words: from `file` when given, else asked on the
/// terminal, else all of stdin (scripts). Bounded; parsed with a typed
/// error that names the wrong word.
pub fn read_words(file: Option<&Path>) -> Result<RecoveryPhrase> {
    let text: Zeroizing<String> = match file {
        Some(path) => bounded(
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?,
            &path.display().to_string(),
        )?,
        None if std::io::stdin().is_terminal() => {
            prompt(&format!("the {WORD_COUNT} recovery words, in order: "))?
        }
        None => bounded(std::io::stdin().lock(), "stdin")?,
    };
    // Numbering as `show` prints it ("1. word") is accepted.
    let cleaned: Zeroizing<String> = Zeroizing::new(
        text.split_whitespace()
            .filter(|w| !w.trim_end_matches('.').chars().all(|c| c.is_ascii_digit()))
            .collect::<Vec<_>>()
            .join(" "),
    );
    RecoveryPhrase::parse(&cleaned)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("the recovery words were not accepted; nothing was changed")
}

#[derive(Serialize)]
struct RecoveryCreated {
    did: String,
    recovery_key_id: String,
    did_log_len: usize,
    /// Only with --i-have-written-it-down: scripts must keep them.
    #[serde(skip_serializing_if = "Option::is_none")]
    recovery_words: Option<String>,
}

/// `recovery create`: new words, and the DID update (signed by this
/// home's admin key) that makes their key the agent's recovery key,
/// replacing any earlier one. Through the daemon when it runs.
pub fn create(home_dir: &Path, written_down: bool, json: bool) -> Result<()> {
    check_can_confirm(written_down, json)?;
    let lock = home::try_lock(home_dir)?;
    let h = home::load(home_dir)?;
    let now = home::now_unix_secs();
    if lock.is_some() {
        // Refuse before showing words that could not be used.
        crate::home::load_admin(home_dir, &h.log, &h.device, now)?;
    }
    let phrase = RecoveryPhrase::generate().context("cannot generate recovery words")?;
    if !json {
        show(&phrase, &format!("agent {}", h.log.did()));
    }
    confirm(&phrase, written_down)?;
    let public = phrase.key().public();
    let (key_id, len) = match lock {
        Some(lock) => home::change_offline(home_dir, lock, |h, admin, now| {
            let (log, key_id) =
                nuwa_agent::lifecycle::set_recovery_key(&h.log, admin, &public, now)?;
            home::save_log(home_dir, &log)?;
            Ok((key_id, log.len()))
        })?,
        None => {
            let r: crate::api::AdminReply = client::post_json(
                home_dir,
                "/v1/did/recovery-key",
                &crate::api::RecoveryKeyBody {
                    public_key_hex: hex::encode(public),
                },
            )?;
            (r.subject, r.did_log_len)
        }
    };
    if json {
        return print_json(&RecoveryCreated {
            did: h.log.did().to_owned(),
            recovery_key_id: key_id,
            did_log_len: len,
            recovery_words: written_down.then(|| phrase.words().to_string()),
        });
    }
    println!(
        "recovery key {key_id} is the agent's recovery key now; any earlier recovery words no \
         longer work"
    );
    Ok(())
}

#[derive(Serialize)]
struct Recovered {
    did: String,
    admin: String,
    removed: Vec<String>,
    epoch: u64,
    remaining: Vec<String>,
    recovery_key_id: String,
    did_log_len: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    recovery_words: Option<String>,
}

/// `recover` on a device's home, with the daemon stopped (a fresh home
/// pairs instead: `main` runs `pair` with a `RecoveryJoin`): sign with the
/// recovery words the update that makes this device an admin, removes the
/// master key of `init` and the `lost` devices, and replaces the words;
/// open a new key epoch for the devices that remain; show the new words.
pub fn recover(
    home_dir: &Path,
    lost: &[String],
    words_file: Option<&Path>,
    written_down: bool,
    json: bool,
) -> Result<()> {
    check_can_confirm(written_down, json)?;
    let Some(_lock) = home::try_lock(home_dir)? else {
        bail!(
            "the daemon of {} is running; stop it first (Ctrl-C, or `systemctl --user stop \
             nuwa-node`), run recover, then start it again: it hands the new DID log and key \
             epoch to every peer",
            home_dir.display()
        );
    };
    let h = home::load(home_dir)?;
    let now = home::now_unix_secs();
    let words = read_words(words_file)?;
    let old_key = words.key();
    drop(words);
    // Check the words before anything else is generated or shown.
    nuwa_agent::identity::recovery::check_belongs(h.log.current(), &old_key, now)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("the recovery words were not accepted; nothing was changed")?;
    let next = RecoveryPhrase::generate().context("cannot generate new recovery words")?;
    let r = nuwa_agent::lifecycle::recover(
        &h.log,
        &h.keys,
        &old_key,
        &h.device,
        lost,
        &next.key().public(),
        now,
    )?;
    drop(old_key);
    if !json {
        println!(
            "recovered: this device ({}) is an admin of {}",
            h.info.context_id,
            h.log.did()
        );
        show(&next, &format!("agent {}", h.log.did()));
    }
    // The old words already signed; until the new ones are confirmed the
    // update is not written, so a failed confirmation changes nothing.
    confirm(&next, written_down)?;
    home::save_epoch(home_dir, &r.log, &r.keys, &r.grant)?;
    if json {
        return print_json(&Recovered {
            did: h.log.did().to_owned(),
            admin: h.info.context_id.clone(),
            removed: r.removed,
            epoch: r.epoch,
            remaining: r.remaining,
            recovery_key_id: r.recovery_key_id,
            did_log_len: r.log.len(),
            recovery_words: written_down.then(|| next.words().to_string()),
        });
    }
    print!(
        "{}",
        nuwa_agent::text::recovered(&r, !lost.is_empty(), &home_dir.display().to_string())
    );
    Ok(())
}

#[derive(Serialize)]
struct Rotated {
    old_context_id: String,
    context_id: String,
    epoch: u64,
    did_log_len: usize,
}

/// `device rotate`: with the daemon stopped, replaces this device's key
/// (and so its PeerId and context id) in one DID update signed by this
/// home's admin key, opens a new key epoch, and writes the home. The
/// store, its at-rest key and every epoch key stay: nothing is lost and
/// nothing is paired again.
pub fn rotate(home_dir: &Path, json: bool) -> Result<()> {
    let Some(_lock) = home::try_lock(home_dir)? else {
        bail!(
            "the daemon of {} is running; stop it first, run `device rotate`, then start it \
             again (its new key is its new identity on the network)",
            home_dir.display()
        );
    };
    let h = home::load(home_dir)?;
    let now = home::now_unix_secs();
    let admin = crate::home::load_admin(home_dir, &h.log, &h.device, now).map_err(|_| {
        anyhow::anyhow!(
            "this device is not an admin, and a key change must be signed by one. Make it an \
             admin first (on an admin device: `nuwa-node device promote {}`), rotate, then take \
             it back if you like (`device demote`)",
            h.info.context_id
        )
    })?;
    let new =
        nuwa_agent::identity::keys::DeviceKey::generate().context("cannot generate the new key")?;
    let r = nuwa_agent::lifecycle::rotate(&h.log, &h.keys, &admin, &h.device, &new, now)?;
    drop(admin);
    home::rotate_device(home_dir, &new, &h.info.name, &r.log, &r.keys, &r.grant)?;
    if json {
        return print_json(&Rotated {
            old_context_id: r.old_context,
            context_id: r.new_context,
            epoch: r.epoch,
            did_log_len: r.log.len(),
        });
    }
    println!(
        "rotated: this device is {} now (was {}); new key epoch {}. Start the daemon: peers \
         accept the new key from the DID log it brings",
        r.new_context, r.old_context, r.epoch
    );
    Ok(())
}
