//! The one source of randomness for nuwa-sync's IO-free crates (`identity`, `crypto`,
//! `sync`): device keys, sync keys, recovery words, DID entry and signature nonces, envelope
//! and at-rest nonces, sealing ephemerals, pairing codes and `Hello` nonces all come from
//! [`fill`].
//!
//! In normal operation [`fill`] is the operating system's generator (`getrandom`) and nothing
//! else. A seeded simulator of whole agents needs the opposite: a failing seed must replay
//! exactly, and it cannot while DID entries carry OS-random nonces (their hashes decide the
//! fork rule) and fresh keys change PeerIds (and with them the order of everything). So with
//! the `sim` cargo feature this crate also offers [`deterministic_for_simulation`]: while the
//! guard it returns lives, [`fill`] on *that thread* draws from a generator keyed by a `u64`
//! seed (SHA-256 in counter mode); dropping the guard gives the thread back to the operating
//! system. Other threads never see the seed.
//!
//! **The deterministic mode makes every secret predictable.** It exists only for simulations
//! and tests. The `sim` feature must be enabled only from `[dev-dependencies]`, so that a
//! normal build of the daemon does not even contain [`deterministic_for_simulation`]; and
//! even in a build that has it (a `cargo test` of the workspace unifies dev-dependency
//! features), nothing happens unless code calls it by that name.
//!
//! Left to others: time (always a parameter of the core), the node's own randomness (API
//! tokens and client nonces, which no core decision depends on) and the generators tests use
//! to pick seeds or mutate inputs.

/// Why no random bytes could be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The operating system's random number generator failed.
    #[error("the operating system's random number generator could not fill {len} bytes")]
    Os {
        /// How many bytes were asked for.
        len: usize,
        /// What `getrandom` reported.
        #[source]
        source: getrandom::Error,
    },
}

/// Fills `buf` with random bytes: from the operating system, unless this thread holds a
/// [`DeterministicGuard`] (only possible with the `sim` feature), in which case from that
/// guard's seeded stream.
///
/// # Errors
/// [`Error::Os`] if the operating system's generator fails. The deterministic stream never
/// fails.
pub fn fill(buf: &mut [u8]) -> Result<(), Error> {
    #[cfg(any(test, feature = "sim"))]
    if deterministic::fill(buf) {
        return Ok(());
    }
    getrandom::fill(buf).map_err(|source| Error::Os {
        len: buf.len(),
        source,
    })
}

/// Whether [`fill`] on this thread is drawing from a seeded stream right now. Always `false`
/// without the `sim` feature; a daemon may assert it.
#[must_use]
pub fn is_deterministic() -> bool {
    #[cfg(any(test, feature = "sim"))]
    {
        deterministic::is_active()
    }
    #[cfg(not(any(test, feature = "sim")))]
    {
        false
    }
}

/// **Simulations and tests only: every key and nonce drawn on this thread becomes
/// predictable from `seed`.** While the returned guard lives, [`fill`] on the calling thread
/// draws from a deterministic stream keyed by `seed`; other threads keep the operating
/// system's generator. Dropping the guard ends it.
///
/// Guards nest: the newest guard alive on a thread decides, and when it is dropped the one
/// before it continues where it stopped. An inner guard with the same seed as an outer one
/// repeats the outer stream from its start, so give each simulated device its own seed. The
/// stream is a function of the seed and of the number of bytes drawn before, not of how the
/// draws were cut up; it may change between releases, so a seed replays on the same build.
///
/// The generator's state is not wiped on drop: nothing it produces is secret.
///
/// # Panics
/// If more than [`MAX_NESTED_GUARDS`] guards are alive on this thread (a leak: guards are
/// meant to be scoped).
#[cfg(any(test, feature = "sim"))]
pub fn deterministic_for_simulation(seed: u64) -> DeterministicGuard {
    DeterministicGuard {
        id: deterministic::push(seed),
        not_send: std::marker::PhantomData,
    }
}

/// Runs `f` with [`fill`] deterministic on this thread (see [`deterministic_for_simulation`],
/// with the same warning), then restores what was before.
#[cfg(any(test, feature = "sim"))]
pub fn with_deterministic_for_simulation<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    let _guard = deterministic_for_simulation(seed);
    f()
}

/// How many [`DeterministicGuard`]s may be alive on one thread at once. Real nesting is one or
/// two deep (a simulator, then a test inside it); more is a leak.
#[cfg(any(test, feature = "sim"))]
pub const MAX_NESTED_GUARDS: usize = 16;

/// Keeps [`fill`] deterministic on the thread that created it until dropped. Not `Send`:
/// the stream belongs to one thread, so the guard stays there too.
#[cfg(any(test, feature = "sim"))]
#[must_use = "fill is deterministic only while the guard lives; bind it to a named variable, not `_`"]
#[derive(Debug)]
pub struct DeterministicGuard {
    id: u64,
    // A raw pointer makes the guard neither `Send` nor `Sync`.
    not_send: std::marker::PhantomData<*const ()>,
}

#[cfg(any(test, feature = "sim"))]
impl Drop for DeterministicGuard {
    fn drop(&mut self) {
        deterministic::pop(self.id);
    }
}

#[cfg(any(test, feature = "sim"))]
mod deterministic {
    //! The per-thread stack of seeded streams behind [`crate::deterministic_for_simulation`].

    use std::cell::{Cell, RefCell};

    use sha2::{Digest, Sha256};

    use crate::MAX_NESTED_GUARDS;

    /// Domain separator of the generator's blocks; the version changes with the construction.
    const DOMAIN: &[u8] = b"nuwa-entropy/deterministic-for-simulation/v1";
    const BLOCK_BYTES: usize = 32;

    /// SHA-256 in counter mode: block `i` is `SHA-256(DOMAIN ‖ seed_le ‖ i_be)`. Simple and
    /// built from a hash the workspace already has; speed does not matter for keys and nonces.
    struct Stream {
        seed: u64,
        counter: u64,
        block: [u8; BLOCK_BYTES],
        used: usize,
    }

    impl Stream {
        fn new(seed: u64) -> Self {
            Self {
                seed,
                counter: 0,
                block: [0; BLOCK_BYTES],
                used: BLOCK_BYTES,
            }
        }

        fn fill(&mut self, dst: &mut [u8]) {
            let mut filled = 0;
            while filled < dst.len() {
                if self.used == BLOCK_BYTES {
                    self.refill();
                }
                let n = (dst.len() - filled).min(BLOCK_BYTES - self.used);
                dst[filled..filled + n].copy_from_slice(&self.block[self.used..self.used + n]);
                self.used += n;
                filled += n;
            }
        }

        fn refill(&mut self) {
            let mut h = Sha256::new();
            h.update(DOMAIN);
            h.update(self.seed.to_le_bytes());
            h.update(self.counter.to_be_bytes());
            self.block.copy_from_slice(&h.finalize());
            // 2^64 blocks are far beyond any simulation; wrapping keeps this panic-free.
            self.counter = self.counter.wrapping_add(1);
            self.used = 0;
        }
    }

    struct Active {
        id: u64,
        stream: Stream,
    }

    thread_local! {
        /// The guards alive on this thread, oldest first; the last one decides.
        static STACK: RefCell<Vec<Active>> = const { RefCell::new(Vec::new()) };
        /// Tells this thread's guards apart, so a guard dropped out of order removes its own
        /// stream and no other.
        static NEXT_ID: Cell<u64> = const { Cell::new(0) };
    }

    pub(crate) fn push(seed: u64) -> u64 {
        let id = NEXT_ID.with(|next| {
            let id = next.get();
            next.set(id.wrapping_add(1));
            id
        });
        STACK.with(|stack| {
            let mut stack = stack.borrow_mut();
            assert!(
                stack.len() < MAX_NESTED_GUARDS,
                "more than {MAX_NESTED_GUARDS} deterministic entropy guards alive on one thread; \
                 a guard is leaked"
            );
            stack.push(Active {
                id,
                stream: Stream::new(seed),
            });
        });
        id
    }

    pub(crate) fn pop(id: u64) {
        // `try_with`: a guard dropped while the thread's locals are torn down has nothing left
        // to restore.
        let _ = STACK.try_with(|stack| stack.borrow_mut().retain(|active| active.id != id));
    }

    /// Fills `buf` from this thread's newest stream; `false` if the thread has none.
    pub(crate) fn fill(buf: &mut [u8]) -> bool {
        STACK
            .try_with(|stack| match stack.borrow_mut().last_mut() {
                Some(active) => {
                    active.stream.fill(buf);
                    true
                }
                None => false,
            })
            .unwrap_or(false)
    }

    pub(crate) fn is_active() -> bool {
        STACK
            .try_with(|stack| !stack.borrow().is_empty())
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests;
