//! Scenario 9's control: the same force-detach with the agent's test-only ACL-only revoke.

use crate::harness::gate::{Scenario, in_lane};
use crate::s9_force_detach::force_detach;

/// The force-detach of scenario 9 with `--unsafe-revoke-acl-only`: the revoke only removes node
/// A's host from `allowed_hosts` (no drain, no cut). A's live controller keeps working, so its
/// writes land over the marker written after ControllerUnpublish returned: (a) fails, which is
/// what this control asserts. It proves that scenario 9 can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real kernel: runs inside the kernel-lane VM (tests/kernel-lane/run.sh)"]
async fn s9_control_acl_only_revoke() {
    if !in_lane() {
        return;
    }
    force_detach(Scenario::start("s9_control_acl_only_revoke"), false).await;
}
