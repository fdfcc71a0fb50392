//! A per-ID async lock: one [`tokio::sync::Mutex`] per key, created on first use and removed when
//! its last user leaves.
//!
//! The controller and the agent lock each volume for the length of an operation, and the node
//! plugin refuses a call on a volume in progress ([`LockById::try_lock`]). A map of one
//! mutex per volume ever seen grows without bound on a node that creates and deletes volumes for
//! months; this map holds an entry only while someone holds or waits for it.
//!
//! Invariants:
//! - At most one entry, and so one mutex, exists per key at any time: an entry is removed only
//!   when its user count is zero, and the count changes only under the map's lock. Two holders of
//!   one key therefore always contend on the same mutex (no lost exclusion, no lost wake-up).
//! - A user is counted from the moment it asks for the lock until its guard is dropped, including
//!   while it waits; a waiter that is cancelled (its future dropped) is uncounted by its drop.
//! - Guards own everything they need (`'static`), so a guard can move into a spawned task and
//!   keep the key locked for as long as that task runs.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedMutexGuard;

struct Entry {
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Holders plus waiters.
    users: usize,
}

type Entries<K> = Mutex<HashMap<K, Entry>>;

/// See the crate documentation. Cloning shares the same locks.
pub struct LockById<K> {
    entries: Arc<Entries<K>>,
}

impl<K> Clone for LockById<K> {
    fn clone(&self) -> Self {
        Self {
            entries: Arc::clone(&self.entries),
        }
    }
}

impl<K> Default for LockById<K> {
    fn default() -> Self {
        Self {
            entries: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

impl<K> fmt::Debug for LockById<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockById")
            .field("entries", &lock_entries(&self.entries).len())
            .finish()
    }
}

fn lock_entries<K>(entries: &Entries<K>) -> std::sync::MutexGuard<'_, HashMap<K, Entry>> {
    // The map is consistent after every statement that touches it (no user code runs under its
    // lock), so a panic elsewhere never leaves it half-changed.
    entries.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One counted user of a key; uncounts itself when dropped.
struct User<K: Eq + Hash> {
    entries: Arc<Entries<K>>,
    key: K,
}

impl<K: Eq + Hash> Drop for User<K> {
    fn drop(&mut self) {
        let mut entries = lock_entries(&self.entries);
        let last = match entries.get_mut(&self.key) {
            Some(entry) => {
                entry.users -= 1;
                entry.users == 0
            }
            None => false,
        };
        if last {
            entries.remove(&self.key);
        }
    }
}

/// Holds one key locked until dropped.
#[must_use = "the key is unlocked when the guard is dropped"]
pub struct IdGuard<K: Eq + Hash> {
    // Declaration order is drop order: the mutex is released before the user is uncounted, so
    // an entry is never removed while its mutex is still held.
    _held: OwnedMutexGuard<()>,
    user: User<K>,
}

impl<K: Eq + Hash + fmt::Debug> fmt::Debug for IdGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdGuard")
            .field("key", &self.user.key)
            .finish()
    }
}

impl<K: Eq + Hash> IdGuard<K> {
    /// The key this guard holds.
    pub fn key(&self) -> &K {
        &self.user.key
    }
}

impl<K: Eq + Hash + Clone> LockById<K> {
    /// An empty set of locks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts a new user of `key` and returns its mutex.
    fn enter(&self, key: &K) -> (Arc<tokio::sync::Mutex<()>>, User<K>) {
        let mut entries = lock_entries(&self.entries);
        let entry = entries.entry(key.clone()).or_insert_with(|| Entry {
            lock: Arc::new(tokio::sync::Mutex::new(())),
            users: 0,
        });
        entry.users += 1;
        let lock = Arc::clone(&entry.lock);
        drop(entries);
        let user = User {
            entries: Arc::clone(&self.entries),
            key: key.clone(),
        };
        (lock, user)
    }

    /// Waits for `key` and locks it. Cancel-safe: dropping the future while it waits leaves no
    /// trace.
    pub async fn lock(&self, key: K) -> IdGuard<K> {
        let (lock, user) = self.enter(&key);
        let held = lock.lock_owned().await;
        IdGuard { _held: held, user }
    }

    /// Locks `key` if nobody holds it, without waiting.
    pub fn try_lock(&self, key: K) -> Option<IdGuard<K>> {
        let (lock, user) = self.enter(&key);
        let held = lock.try_lock_owned().ok()?;
        Some(IdGuard { _held: held, user })
    }

    /// Whether someone holds `key` right now (a waiter alone does not count): for assertions
    /// of code that must run under the key's lock. It cannot say who holds it.
    pub fn is_held(&self, key: &K) -> bool {
        lock_entries(&self.entries)
            .get(key)
            .is_some_and(|entry| entry.lock.try_lock().is_err())
    }

    /// Keys with a holder or a waiter right now.
    pub fn len(&self) -> usize {
        lock_entries(&self.entries).len()
    }

    /// Whether no key is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn the_entry_goes_with_its_last_holder() {
        let locks = LockById::new();
        let a = locks.lock("a").await;
        let b = locks.lock("b").await;
        assert_eq!(locks.len(), 2);
        drop(a);
        assert_eq!(locks.len(), 1);
        drop(b);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn is_held_says_whether_a_holder_has_the_key() {
        let locks = LockById::new();
        assert!(!locks.is_held(&"a"));
        let a = locks.lock("a").await;
        assert!(locks.is_held(&"a"));
        assert!(!locks.is_held(&"b"));
        // Asking does not take the lock from anyone: a second ask still sees it held.
        assert!(locks.is_held(&"a"));
        drop(a);
        assert!(!locks.is_held(&"a"));
        assert!(locks.try_lock("a").is_some());
    }

    #[tokio::test]
    async fn a_waiter_keeps_the_entry_and_gets_the_lock() {
        let locks = LockById::new();
        let first = locks.lock(1u32).await;
        let l = locks.clone();
        let waiter = tokio::spawn(async move { l.lock(1).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiter.is_finished(),
            "the key is held; the waiter must wait"
        );
        drop(first);
        // The holder left, but the waiter still counts: the entry (and its mutex) stays.
        let second = waiter.await.expect("waiter");
        assert_eq!(locks.len(), 1);
        drop(second);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_no_entry() {
        let locks = LockById::new();
        let held = locks.lock("v").await;
        let timed_out = tokio::time::timeout(Duration::from_millis(10), locks.lock("v")).await;
        assert!(timed_out.is_err());
        assert_eq!(locks.len(), 1, "only the holder counts now");
        drop(held);
        assert!(locks.is_empty());
    }

    #[tokio::test]
    async fn try_lock_refuses_a_held_key_and_leaves_no_entry() {
        let locks = LockById::new();
        let held = locks.try_lock("v").expect("free key");
        assert!(locks.try_lock("v").is_none());
        assert_eq!(locks.len(), 1);
        drop(held);
        assert!(locks.is_empty());
        assert!(locks.try_lock("v").is_some());
    }

    /// Many tasks on few keys, with holders yielding inside the lock and waiters cancelled at
    /// random: every holder is alone on its key, every task finishes (no lost wake-up), and the
    /// map is empty at the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn contention_with_cancellation_keeps_exclusion_and_loses_no_wakeup() {
        const KEYS: usize = 3;
        const TASKS: usize = 64;
        const ROUNDS: usize = 50;
        let locks = LockById::new();
        let inside: Arc<Vec<AtomicBool>> =
            Arc::new((0..KEYS).map(|_| AtomicBool::new(false)).collect());
        let counts: Arc<Vec<AtomicUsize>> =
            Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let locks = locks.clone();
            let inside = Arc::clone(&inside);
            let counts = Arc::clone(&counts);
            tasks.push(tokio::spawn(async move {
                let mut done = 0;
                for round in 0..ROUNDS {
                    let key = (t + round) % KEYS;
                    let attempt = locks.lock(key);
                    // Every third attempt gives up quickly: a cancelled waiter.
                    let guard = if (t + round) % 3 == 0 {
                        match tokio::time::timeout(Duration::from_micros(50), attempt).await {
                            Ok(g) => g,
                            Err(_) => continue,
                        }
                    } else {
                        attempt.await
                    };
                    assert!(
                        !inside[key].swap(true, Ordering::SeqCst),
                        "two holders of key {key}"
                    );
                    let before = counts[key].load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counts[key].store(before + 1, Ordering::SeqCst);
                    inside[key].store(false, Ordering::SeqCst);
                    drop(guard);
                    done += 1;
                }
                done
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("a task never finished: lost wake-up")
                .expect("task panicked");
        }
        let counted: usize = counts.iter().map(|c| c.load(Ordering::SeqCst)).sum();
        assert_eq!(counted, total, "an increment was lost: exclusion broken");
        assert!(
            total >= TASKS * ROUNDS * 2 / 3,
            "the uncancelled attempts all ran"
        );
        assert!(locks.is_empty(), "entries left behind: {locks:?}");
    }
}
