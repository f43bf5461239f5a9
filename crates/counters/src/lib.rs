//! One declaration per counter: each crate lists its counters once, in a
//! [`table!`], which produces the enum, every counter's stable name and its
//! help text. IO-free crates only declare tables and report counts as
//! values; the runtime that holds them keeps a [`Counters`] per table and
//! registers every table, once, into the one metrics registry it owns.
//!
//! Nothing here knows a metrics library, a clock or IO.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A table of counters declared with [`table!`].
pub trait Table: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Every counter, in declaration order.
    const ALL: &'static [Self];
    /// The counter's stable name (its metric name and its key in `status`).
    fn name(self) -> &'static str;
    /// One line saying what it counts.
    fn help(self) -> &'static str;
    /// Its position in [`Table::ALL`].
    fn index(self) -> usize;
}

/// Declares a counter table: `table! { pub enum Count { Variant => "name", "help"; ... } }`.
#[macro_export]
macro_rules! table {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($variant:ident => $counter:literal, $help:literal;)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        $vis enum $name { $($variant),* }

        impl $crate::Table for $name {
            const ALL: &'static [Self] = &[$($name::$variant),*];
            fn name(self) -> &'static str {
                match self { $($name::$variant => $counter),* }
            }
            fn help(self) -> &'static str {
                match self { $($name::$variant => $help),* }
            }
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}

/// The values of one table's counters: one atomic per counter. Clones
/// share the values, so the thread that counts and the one that reads
/// (metrics, `status`) hold the same set.
pub struct Counters<T: Table> {
    cells: Arc<[AtomicU64]>,
    _table: PhantomData<T>,
}

impl<T: Table> Clone for Counters<T> {
    fn clone(&self) -> Self {
        Counters {
            cells: self.cells.clone(),
            _table: PhantomData,
        }
    }
}

impl<T: Table> Default for Counters<T> {
    fn default() -> Self {
        Counters {
            cells: T::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            _table: PhantomData,
        }
    }
}

impl<T: Table> std::fmt::Debug for Counters<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.values()).finish()
    }
}

impl<T: Table> Counters<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn inc(&self, counter: T) {
        self.add(counter, 1);
    }

    pub fn add(&self, counter: T, n: u64) {
        self.cells[counter.index()].fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self, counter: T) -> u64 {
        self.cells[counter.index()].load(Ordering::Relaxed)
    }

    /// Every counter with its name and value, in declaration order.
    pub fn values(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        T::ALL.iter().map(|c| (c.name(), self.get(*c)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    table! {
        /// Counters of a test.
        pub enum Demo {
            First => "first", "The first";
            Second => "second", "The second";
        }
    }

    // Goal: a table gives each counter one name, help and slot, and clones
    // of a counter set share their values.
    #[test]
    fn a_table_declares_names_help_and_slots_once() {
        assert_eq!(Demo::ALL, &[Demo::First, Demo::Second]);
        assert_eq!(Demo::Second.name(), "second");
        assert_eq!(Demo::First.help(), "The first");
        let c = Counters::<Demo>::new();
        let shared = c.clone();
        c.inc(Demo::Second);
        shared.add(Demo::Second, 2);
        assert_eq!(c.get(Demo::Second), 3);
        assert_eq!(
            c.values().collect::<Vec<_>>(),
            vec![("first", 0), ("second", 3)]
        );
    }
}
