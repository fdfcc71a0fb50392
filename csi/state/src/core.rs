//! The API server's compare-and-swap rules, written once, and [`Memory`], the in-memory tables
//! they run on.
//!
//! Every store that keeps records itself applies these functions: the
//! [`MemoryStore`](crate::memory::MemoryStore) (the simulation and tests) and the API server test
//! double on [`Memory`], the [`EmbeddedStore`](crate::embedded::EmbeddedStore) on its directory.
//! Nothing here does I/O of its own or awaits; where the records live is a [`Backing`], and what
//! a record is (a typed object, or the JSON the double serves) is a [`Record`].
//!
//! The rules (read from the Kubernetes API server: the generic registry's store and the custom
//! resources' strategies):
//! 1. One resourceVersion counter for every kind, as etcd's revision: each create, effective
//!    update and delete takes the next value, so no value is handed out twice.
//! 2. Create: a taken name is [`Why::AlreadyExists`]; the status is dropped; the record gets its
//!    UID (one lifecycle of the name), the next resourceVersion and `metadata.generation` 1.
//! 3. A write names what it expects and is checked in the server's order: absent
//!    ([`Why::NotFound`]), another lifecycle ([`Why::UidMismatch`]), no resourceVersion
//!    ([`Why::VersionRequired`]: custom resources allow no unconditional update), one the store
//!    never hands out ([`Why::VersionInvalid`]), a stale one ([`Why::Conflict`]). A delete may
//!    leave either precondition out.
//! 4. A status write takes only the status from what the writer sends; a spec write takes
//!    everything but the status and the fields the server owns (uid, creationTimestamp,
//!    generation). Neither can change the other half.
//! 5. A write that changes nothing is not written and keeps the resourceVersion; a spec write
//!    that changes the spec bumps `metadata.generation`.

use std::collections::BTreeMap;
use std::convert::Infallible;

use serde_json::{Map, Value, json};

use crate::object::{Kind, PillarObject};
use crate::store::{Revision, StoreError};

/// What the rules read and set on a record.
pub trait Record: Clone + PartialEq {
    /// `metadata.uid`.
    fn uid(&self) -> Option<&str>;
    /// `metadata.resourceVersion`.
    fn resource_version(&self) -> Option<&str>;
    /// Sets `metadata.resourceVersion`.
    fn set_resource_version(&mut self, rv: String);
    /// A new record's server fields: `uid`, `resourceVersion`, `generation` 1.
    fn stamp_created(&mut self, uid: String, rv: String);
    /// Drops the status.
    fn clear_status(&mut self);
    /// `self` (the stored record) after a spec write of `candidate`: the candidate with this
    /// record's status and server-owned fields.
    fn spec_write(&self, candidate: Self) -> Self;
    /// `self` after a status write of `candidate`: this record with the candidate's status.
    fn status_write(&self, candidate: Self) -> Self;
    /// Whether a spec write from `self` to `next` changes the spec (and so the generation).
    fn spec_differs(&self, next: &Self) -> bool;
    /// Sets `next`'s generation to one more than this record's.
    fn bump_generation(&self, next: &mut Self);
}

/// Where one store keeps its records and its resourceVersion counter.
pub trait Backing<O> {
    /// Why reaching a record failed.
    type Error;
    /// The record `name` of `kind`, if any.
    fn read(&self, kind: Kind, name: &str) -> Result<Option<O>, Self::Error>;
    /// Every record of `kind`, ordered by name.
    fn list(&self, kind: Kind) -> Result<Vec<O>, Self::Error>;
    /// Stores `obj` as `name`.
    fn write(&mut self, kind: Kind, name: &str, obj: &O) -> Result<(), Self::Error>;
    /// Removes `name`.
    fn remove(&mut self, kind: Kind, name: &str) -> Result<(), Self::Error>;
    /// Takes the next resourceVersion.
    fn next_version(&mut self) -> Result<u64, Self::Error>;
}

/// What a write expects of the stored record; `None` checks nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Precondition<'a> {
    /// The lifecycle (`metadata.uid`).
    pub uid: Option<&'a str>,
    /// The resourceVersion.
    pub resource_version: Option<&'a str>,
}

impl<'a> From<&'a Revision> for Precondition<'a> {
    fn from(r: &'a Revision) -> Self {
        Self {
            uid: Some(&r.uid),
            resource_version: Some(&r.resource_version),
        }
    }
}

/// Which half of a record a write replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    /// Everything but the status (the main resource).
    Spec,
    /// The status subresource.
    Status,
}

/// Why the rules refused a write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// No record of that name.
    NotFound,
    /// Create found a record of that name.
    AlreadyExists,
    /// The name belongs to another lifecycle.
    UidMismatch {
        /// The UID the writer expected.
        expected: String,
        /// The record's UID.
        current: String,
    },
    /// An update named no resourceVersion.
    VersionRequired,
    /// An update named a resourceVersion the store never hands out.
    VersionInvalid {
        /// What it named.
        given: String,
    },
    /// The record changed since the resourceVersion the writer expected.
    Conflict {
        /// The resourceVersion the writer expected.
        expected: String,
        /// The record's.
        current: String,
    },
}

/// A write the rules refused: which record, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The record's kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// Why.
    pub why: Why,
}

impl From<Refusal> for StoreError {
    fn from(r: Refusal) -> Self {
        let (kind, name) = (r.kind.kind, r.name);
        match r.why {
            Why::NotFound => Self::NotFound { kind, name },
            Why::AlreadyExists => Self::AlreadyExists { kind, name },
            Why::UidMismatch { expected, current } => Self::UidMismatch {
                kind,
                name,
                expected,
                message: format!("the object's UID is {current}"),
            },
            // A typed writer always names a resourceVersion; an empty or foreign one can only be
            // stale.
            Why::VersionRequired => Self::Conflict {
                kind,
                name,
                expected: String::new(),
                message: "no resourceVersion was given".into(),
            },
            Why::VersionInvalid { given } => Self::Conflict {
                kind,
                name,
                expected: given.clone(),
                message: format!("{given:?} is not a resourceVersion of this store"),
            },
            Why::Conflict { expected, current } => Self::Conflict {
                kind,
                name,
                expected,
                message: format!("the object is at resourceVersion {current}"),
            },
        }
    }
}

fn refusal(kind: Kind, name: &str, why: Why) -> Refusal {
    Refusal {
        kind,
        name: name.to_owned(),
        why,
    }
}

/// Reads `name` and checks it against `pre` (rule 3). `update`: an update, which must name a
/// resourceVersion.
fn expect<O, B, E>(
    b: &B,
    kind: Kind,
    name: &str,
    pre: Precondition<'_>,
    update: bool,
) -> Result<O, E>
where
    O: Record,
    B: Backing<O>,
    E: From<Refusal> + From<B::Error>,
{
    let refuse = |why| E::from(refusal(kind, name, why));
    let current = b.read(kind, name)?.ok_or_else(|| refuse(Why::NotFound))?;
    let current_uid = current.uid().unwrap_or_default();
    if let Some(uid) = pre.uid
        && uid != current_uid
    {
        return Err(refuse(Why::UidMismatch {
            expected: uid.to_owned(),
            current: current_uid.to_owned(),
        }));
    }
    let current_rv = current.resource_version().unwrap_or_default();
    match pre.resource_version {
        None if update => return Err(refuse(Why::VersionRequired)),
        None => {}
        Some(rv) => {
            if update && rv.parse::<u64>().is_err() {
                return Err(refuse(Why::VersionInvalid {
                    given: rv.to_owned(),
                }));
            }
            if rv != current_rv {
                return Err(refuse(Why::Conflict {
                    expected: rv.to_owned(),
                    current: current_rv.to_owned(),
                }));
            }
        }
    }
    Ok(current)
}

/// Creates `name` from `obj` (rule 2). `admit` sees the record before it is stamped and may
/// refuse it or fill in what the caller's server adds (defaults, a creation time).
pub fn create<O, B, E>(
    b: &mut B,
    kind: Kind,
    name: &str,
    mut obj: O,
    uid: String,
    admit: impl FnOnce(&mut O) -> Result<(), E>,
) -> Result<O, E>
where
    O: Record,
    B: Backing<O>,
    E: From<Refusal> + From<B::Error>,
{
    if b.read(kind, name)?.is_some() {
        return Err(refusal(kind, name, Why::AlreadyExists).into());
    }
    obj.clear_status();
    admit(&mut obj)?;
    let rv = b.next_version()?;
    obj.stamp_created(uid, rv.to_string());
    b.write(kind, name, &obj)?;
    Ok(obj)
}

/// Replaces one half of `name` (rules 3-5) with that half of `candidate(current)`. `admit` sees
/// the next record before it is compared and may refuse it (a schema) or adjust it.
pub fn replace<O, B, E>(
    b: &mut B,
    kind: Kind,
    name: &str,
    pre: Precondition<'_>,
    half: Half,
    candidate: impl FnOnce(&O) -> O,
    admit: impl FnOnce(&mut O) -> Result<(), E>,
) -> Result<O, E>
where
    O: Record,
    B: Backing<O>,
    E: From<Refusal> + From<B::Error>,
{
    let current: O = expect::<O, B, E>(b, kind, name, pre, true)?;
    let proposed = candidate(&current);
    let mut next = match half {
        Half::Spec => current.spec_write(proposed),
        Half::Status => current.status_write(proposed),
    };
    admit(&mut next)?;
    let current_rv = current.resource_version().unwrap_or_default().to_owned();
    next.set_resource_version(current_rv);
    if next == current {
        return Ok(current);
    }
    if half == Half::Spec && current.spec_differs(&next) {
        current.bump_generation(&mut next);
    }
    let rv = b.next_version()?;
    next.set_resource_version(rv.to_string());
    b.write(kind, name, &next)?;
    Ok(next)
}

/// Deletes `name` if it matches `pre` (rule 3); returns what was deleted.
pub fn delete<O, B, E>(b: &mut B, kind: Kind, name: &str, pre: Precondition<'_>) -> Result<O, E>
where
    O: Record,
    B: Backing<O>,
    E: From<Refusal> + From<B::Error>,
{
    let current: O = expect::<O, B, E>(b, kind, name, pre, false)?;
    b.remove(kind, name)?;
    b.next_version()?;
    Ok(current)
}

/// A record as the Kubernetes API serves it: a JSON object.
pub type Object = Map<String, Value>;

fn meta_str<'a>(obj: &'a Object, key: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(key)?.as_str()
}

/// Runs `f` on the record's metadata, making it an empty object when absent or not one.
fn with_meta<T>(obj: &mut Object, f: impl FnOnce(&mut Object) -> T) -> T {
    let mut meta = match obj.remove("metadata") {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    let out = f(&mut meta);
    obj.insert("metadata".into(), Value::Object(meta));
    out
}

/// Copies `key` of `from` into `to`, or removes it from `to` when `from` lacks it.
fn copy_key(to: &mut Object, from: &Object, key: &str) {
    match from.get(key) {
        Some(v) => {
            to.insert(key.to_owned(), v.clone());
        }
        None => {
            to.remove(key);
        }
    }
}

fn without_metadata(obj: &Object) -> Object {
    obj.iter()
        .filter(|(k, _)| k.as_str() != "metadata")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The JSON record: what the API server test double keeps, and the [`Memory`] core under the
/// [`MemoryStore`](crate::memory::MemoryStore).
impl Record for Object {
    fn uid(&self) -> Option<&str> {
        meta_str(self, "uid")
    }
    fn resource_version(&self) -> Option<&str> {
        meta_str(self, "resourceVersion")
    }
    fn set_resource_version(&mut self, rv: String) {
        with_meta(self, |m| m.insert("resourceVersion".into(), json!(rv)));
    }
    fn stamp_created(&mut self, uid: String, rv: String) {
        with_meta(self, |meta| {
            meta.insert("uid".into(), json!(uid));
            meta.insert("resourceVersion".into(), json!(rv));
            meta.insert("generation".into(), json!(1));
        });
    }
    fn clear_status(&mut self) {
        self.remove("status");
    }
    fn spec_write(&self, candidate: Self) -> Self {
        let mut next = candidate;
        copy_key(&mut next, self, "status");
        let old_meta = self
            .get("metadata")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        with_meta(&mut next, |meta| {
            for key in ["uid", "creationTimestamp", "generation"] {
                copy_key(meta, &old_meta, key);
            }
        });
        next
    }
    fn status_write(&self, candidate: Self) -> Self {
        let mut next = self.clone();
        copy_key(&mut next, &candidate, "status");
        next
    }
    fn spec_differs(&self, next: &Self) -> bool {
        without_metadata(self) != without_metadata(next)
    }
    fn bump_generation(&self, next: &mut Self) {
        let generation = self
            .get("metadata")
            .and_then(|m| m.get("generation"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        with_meta(next, |m| {
            m.insert("generation".into(), json!(generation.saturating_add(1)))
        });
    }
}

/// A typed record: what the [`EmbeddedStore`](crate::embedded::EmbeddedStore) keeps. Its writers
/// say only a spec or a status, so a spec write takes the candidate's spec alone.
impl<K: PillarObject> Record for K {
    fn uid(&self) -> Option<&str> {
        self.meta().uid.as_deref()
    }
    fn resource_version(&self) -> Option<&str> {
        self.meta().resource_version.as_deref()
    }
    fn set_resource_version(&mut self, rv: String) {
        self.meta_mut().resource_version = Some(rv);
    }
    fn stamp_created(&mut self, uid: String, rv: String) {
        let meta = self.meta_mut();
        meta.uid = Some(uid);
        meta.resource_version = Some(rv);
        meta.generation = Some(1);
    }
    fn clear_status(&mut self) {
        self.set_status(None);
    }
    fn spec_write(&self, candidate: Self) -> Self {
        let mut next = self.clone();
        next.set_spec(candidate.spec().clone());
        next
    }
    fn status_write(&self, candidate: Self) -> Self {
        let mut next = self.clone();
        next.set_status(candidate.status().cloned());
        next
    }
    fn spec_differs(&self, next: &Self) -> bool {
        self.spec() != next.spec()
    }
    fn bump_generation(&self, next: &mut Self) {
        let generation = self.meta().generation.unwrap_or(1);
        next.meta_mut().generation = Some(generation.saturating_add(1));
    }
}

/// The in-memory tables: one resourceVersion counter and the JSON records of every kind.
#[derive(Debug, Default)]
pub struct Memory {
    last_rv: u64,
    /// plural -> name -> record.
    tables: BTreeMap<&'static str, BTreeMap<String, Object>>,
}

impl Memory {
    /// The last resourceVersion handed out.
    pub fn last_version(&self) -> u64 {
        self.last_rv
    }

    /// Takes the next resourceVersion (for what shares the counter without being a record here,
    /// as the double's Leases and Events).
    pub fn take_version(&mut self) -> u64 {
        self.last_rv = self.last_rv.saturating_add(1);
        self.last_rv
    }

    /// The record `name` of the kind `plural`.
    pub fn get(&self, plural: &str, name: &str) -> Option<&Object> {
        self.tables.get(plural)?.get(name)
    }

    /// Every record of the kind `plural`, ordered by name.
    pub fn records(&self, plural: &str) -> impl Iterator<Item = &Object> {
        self.tables.get(plural).into_iter().flat_map(|t| t.values())
    }
}

impl Backing<Object> for Memory {
    type Error = Infallible;
    fn read(&self, kind: Kind, name: &str) -> Result<Option<Object>, Infallible> {
        Ok(self.get(kind.plural, name).cloned())
    }
    fn list(&self, kind: Kind) -> Result<Vec<Object>, Infallible> {
        Ok(self.records(kind.plural).cloned().collect())
    }
    fn write(&mut self, kind: Kind, name: &str, obj: &Object) -> Result<(), Infallible> {
        self.tables
            .entry(kind.plural)
            .or_default()
            .insert(name.to_owned(), obj.clone());
        Ok(())
    }
    fn remove(&mut self, kind: Kind, name: &str) -> Result<(), Infallible> {
        if let Some(t) = self.tables.get_mut(kind.plural) {
            t.remove(name);
        }
        Ok(())
    }
    fn next_version(&mut self) -> Result<u64, Infallible> {
        Ok(self.take_version())
    }
}
