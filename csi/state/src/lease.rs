//! Leader election on a `coordination.k8s.io/v1` Lease, for the controller's own background
//! loops (the resync loop): one replica runs them, the others stand by and take over when the
//! holder stops renewing. The rules are client-go's `leaderelection`:
//!
//! - The holder renews every `retry_period`. It counts as leader only while its last
//!   successful renewal *started* less than `renew_deadline` ago ([`Leadership::is_leader`],
//!   monotonic clock), so a holder that was paused, partitioned or slowed stops acting by
//!   itself, before anyone else may take over.
//! - A standby takes over only after the Lease record has not changed for a whole
//!   `lease_duration` measured on its own clock from when it saw the record change (other
//!   nodes' clocks are never compared), and only with a compare-and-swap on the record's
//!   resourceVersion: of two standbys one wins. It saw the change when the answer *arrived*,
//!   as client-go stamps it: an API server may hold a GET and answer it with a renewal made
//!   long after it was sent, and dating that renewal from the send would let the standby start
//!   while the holder still acts.
//! - `renew_deadline < lease_duration`: a holder stops acting before a standby may start.
//! - On shutdown the holder releases the Lease (empty holder), so a standby takes over at once.
//!
//! Safety never depends on this: every change a loop makes is fenced (two replicas acting at
//! once is safe, W8); the Lease only saves duplicate work and conflicting retries.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::time::Instant;

/// Where the Lease is and how it is held.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub namespace: String,
    pub name: String,
    /// This replica's name in `holderIdentity` (the pod name).
    pub identity: String,
    /// How long a standby waits, from the last change it saw, before taking over.
    pub lease_duration: Duration,
    /// How long the holder acts after the start of its last successful renewal.
    pub renew_deadline: Duration,
    /// How often the holder renews and a standby retries.
    pub retry_period: Duration,
}

impl LeaseSettings {
    /// client-go's defaults: 15 s, 10 s, 2 s.
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Why a Lease operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("the lease settings are inconsistent: {0}")]
    Settings(&'static str),
    #[error("reading Lease {0}")]
    Get(String, #[source] kube::Error),
    #[error("creating Lease {0}")]
    Create(String, #[source] kube::Error),
    #[error("updating Lease {0}")]
    Update(String, #[source] kube::Error),
    #[error("Lease {0}: the API server did not answer within the renew deadline")]
    Timeout(String),
}

/// Whether this replica may run its loops now. Cheap to clone and check.
#[derive(Clone, Debug)]
pub struct Leadership {
    inner: Arc<LeadershipInner>,
}

#[derive(Debug)]
struct LeadershipInner {
    /// `None`: always leader (a single process, no Kubernetes).
    renew_deadline: Option<Duration>,
    /// When the last successful acquisition or renewal was sent.
    renewed: Mutex<Option<Instant>>,
}

impl Leadership {
    /// Leadership of a process that is the only one (the embedded store): always held.
    pub fn sole() -> Self {
        Self {
            inner: Arc::new(LeadershipInner {
                renew_deadline: None,
                renewed: Mutex::new(None),
            }),
        }
    }

    fn elected(renew_deadline: Duration) -> Self {
        Self {
            inner: Arc::new(LeadershipInner {
                renew_deadline: Some(renew_deadline),
                renewed: Mutex::new(None),
            }),
        }
    }

    /// Held, and renewed (the renewal that succeeded started) within the renew deadline.
    pub fn is_leader(&self) -> bool {
        let Some(deadline) = self.inner.renew_deadline else {
            return true;
        };
        self.renewed().is_some_and(|at| at.elapsed() < deadline)
    }

    fn renewed(&self) -> Option<Instant> {
        *self
            .inner
            .renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_renewed(&self, at: Option<Instant>) {
        *self
            .inner
            .renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = at;
    }
}

/// Acquires and renews the Lease; see the module docs.
#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    settings: LeaseSettings,
    leadership: Leadership,
    /// The record's resourceVersion when this replica last saw it change, and when (the
    /// arrival of the answer that showed it).
    observed: Option<(String, Instant)>,
    /// Whether this replica led when it last looked, so every loss is logged once, including
    /// a renew deadline that passes between two attempts.
    leading: bool,
}

impl Elector {
    /// An elector for `settings` and the [`Leadership`] it maintains.
    pub fn new(
        client: kube::Client,
        settings: LeaseSettings,
    ) -> Result<(Self, Leadership), LeaseError> {
        if settings.identity.is_empty() {
            // Every replica without a name would read an empty holder as its own Lease.
            return Err(LeaseError::Settings(
                "the identity (the Lease's holderIdentity) must not be empty",
            ));
        }
        if settings.renew_deadline >= settings.lease_duration {
            return Err(LeaseError::Settings(
                "renew_deadline must be shorter than lease_duration",
            ));
        }
        if settings.retry_period >= settings.renew_deadline || settings.retry_period.is_zero() {
            return Err(LeaseError::Settings(
                "retry_period must be positive and shorter than renew_deadline",
            ));
        }
        let leadership = Leadership::elected(settings.renew_deadline);
        let api = Api::namespaced(client, &settings.namespace);
        Ok((
            Self {
                api,
                settings,
                leadership: leadership.clone(),
                observed: None,
                leading: false,
            },
            leadership,
        ))
    }

    /// Acquires or renews every retry period until `shutdown` completes, then releases the
    /// Lease if this replica holds it.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            // The renew deadline may have passed while this replica slept after a failed
            // attempt: that is a loss too, seen here.
            self.note_leadership();
            if let Err(e) = self.try_acquire_or_renew().await {
                tracing::warn!(lease = %self.settings.name, error = %crate::error_chain(&e), "lease acquire or renew failed");
            }
            self.note_leadership();
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(self.settings.retry_period) => {}
            }
        }
        if let Err(e) = self.release().await {
            tracing::warn!(lease = %self.settings.name, error = %crate::error_chain(&e), "lease release failed");
        }
    }

    /// Logs a change of leadership since the last look: a loss as a warning (the background
    /// loops stop), a gain as information.
    fn note_leadership(&mut self) {
        let now = self.leadership.is_leader();
        if self.leading && !now {
            tracing::warn!(lease = %self.settings.name, identity = %self.settings.identity, "lost the lease (not renewed within the renew deadline); background loops stop");
        } else if !self.leading && now {
            tracing::info!(lease = %self.settings.name, identity = %self.settings.identity, "became the leader");
        }
        self.leading = now;
    }

    /// One round: create the Lease, renew it, or take it over when it expired. `Ok(true)`
    /// when this replica holds it afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaseError> {
        let sent = Instant::now();
        let name = self.settings.name.clone();
        let current = self.call(self.api.get_opt(&name)).await?;
        let current = current.map_err(|e| LeaseError::Get(name.clone(), e))?;
        // What the answer shows was true when it arrived, not when it was asked for.
        let received = Instant::now();
        let now = MicroTime(Timestamp::now());
        let Some(lease) = current else {
            return self.create_lease(name, now, sent).await;
        };
        if self.held_by_another(&lease, received) {
            self.leadership.set_renewed(None);
            return Ok(false);
        }
        self.renew_or_take_over(name, lease, now, sent).await
    }

    /// The lease duration written in the record: whole seconds, rounded up, so a standby
    /// reading it never waits less than this replica's renew deadline.
    fn record_duration_secs(&self) -> i32 {
        i32::try_from(self.settings.lease_duration.as_millis().div_ceil(1000))
            .unwrap_or(i32::MAX)
            .max(1)
    }

    /// No Lease yet: create it held by this replica. `Ok(false)` when another replica created
    /// it first.
    async fn create_lease(
        &mut self,
        name: String,
        now: MicroTime,
        sent: Instant,
    ) -> Result<bool, LeaseError> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(self.settings.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.settings.identity.clone()),
                lease_duration_seconds: Some(self.record_duration_secs()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        match self
            .call(self.api.create(&PostParams::default(), &lease))
            .await?
        {
            Ok(_) => {
                self.leadership.set_renewed(Some(sent));
                Ok(true)
            }
            // Another replica created it first: not ours this round.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(LeaseError::Create(name, e)),
        }
    }

    /// Whether another replica holds `lease` and it has not expired. Expiry is measured on
    /// this replica's clock from when it first received the record's current version, over the
    /// holder's lease duration: never from the times written in the record.
    fn held_by_another(&mut self, lease: &Lease, received: Instant) -> bool {
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != rv) {
            self.observed = Some((rv, received));
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let mine = holder == self.settings.identity;
        let their_duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.settings.lease_duration, Duration::from_secs);
        let expired = self
            .observed
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() >= their_duration);
        !mine && !holder.is_empty() && !expired
    }

    /// Renews `lease` (this replica's), or takes it over (free or expired): a conditional
    /// replace, so `Ok(false)` when someone else wrote the record since it was read.
    async fn renew_or_take_over(
        &mut self,
        name: String,
        mut next: Lease,
        now: MicroTime,
        sent: Instant,
    ) -> Result<bool, LeaseError> {
        let mut spec = next.spec.clone().unwrap_or_default();
        let mine = spec.holder_identity.clone().unwrap_or_default() == self.settings.identity;
        if !mine {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
            spec.holder_identity = Some(self.settings.identity.clone());
        }
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(self.record_duration_secs());
        next.spec = Some(spec);
        match self
            .call(self.api.replace(&name, &PostParams::default(), &next))
            .await?
        {
            Ok(_) => {
                self.leadership.set_renewed(Some(sent));
                Ok(true)
            }
            // Someone else wrote the record since this replica read it: not ours this round
            // (a holder keeps acting until its deadline and retries).
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(LeaseError::Update(name, e)),
        }
    }

    /// Gives the Lease up if this replica holds it: empty holder, so a standby takes over at
    /// its next retry instead of waiting out the lease duration.
    pub async fn release(&mut self) -> Result<(), LeaseError> {
        let held = self.leadership.is_leader();
        self.leadership.set_renewed(None);
        if !held {
            return Ok(());
        }
        let name = self.settings.name.clone();
        let Some(mut lease) = self
            .call(self.api.get_opt(&name))
            .await?
            .map_err(|e| LeaseError::Get(name.clone(), e))?
        else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.settings.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        match self
            .call(self.api.replace(&name, &PostParams::default(), &lease))
            .await?
        {
            Ok(_) => {
                tracing::info!(lease = %name, identity = %self.settings.identity, "released the lease");
                Ok(())
            }
            Err(e) => Err(LeaseError::Update(name, e)),
        }
    }

    /// An API call bounded by the renew deadline: a hung request must not outlive the time
    /// this replica may act.
    async fn call<T>(&self, f: impl Future<Output = T>) -> Result<T, LeaseError> {
        tokio::time::timeout(self.settings.renew_deadline, f)
            .await
            .map_err(|_| LeaseError::Timeout(self.settings.name.clone()))
    }
}

/// Runs `round` every `interval` while `leadership` holds, and skips the rounds while it does
/// not: the shape of every background loop of the controller.
pub async fn every_round_while_leader<F, Fut>(
    leadership: Leadership,
    interval: Duration,
    mut round: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        if leadership.is_leader() {
            round().await;
        }
        tokio::time::sleep(interval).await;
    }
}
