//! The node's one call into the credentials delivery: a stage's secrets completed with this
//! node's DH-HMAC-CHAP pair from the controller (W10). Here, not in the delivery's client, so
//! that the client knows nothing of the node's errors and the node imports the client, never
//! the other way.

use std::collections::HashMap;

use pillar_nvmet::{HostNqn, VolumeId};

use super::NodeError;
use crate::context;
use crate::credentials_delivery::client::CredentialsClient;

/// NodeStageVolume's `secrets`, completed with this node's pair from the controller where the
/// publish context requires DH-HMAC-CHAP and kubelet passed no node secret, and `client` is
/// configured; unchanged otherwise (the stage's own checks then decide). The one call the node
/// service makes into this module.
pub async fn stage_secrets(
    client: Option<&CredentialsClient>,
    node: &str,
    host_nqn: &HostNqn,
    volume: &VolumeId,
    publish_context: &HashMap<String, String>,
    mut secrets: HashMap<String, String>,
) -> Result<HashMap<String, String>, NodeError> {
    let wanted = publish_context.get(context::AUTH).map(String::as_str) == Some("dhchap")
        && secrets
            .get(context::SECRET_DHCHAP)
            .is_none_or(String::is_empty);
    let Some(client) = client.filter(|_| wanted) else {
        return Ok(secrets);
    };
    let delivered = client
        .fetch(node, host_nqn, volume)
        .await
        .map_err(|source| NodeError::CredentialsNotDelivered {
            volume: volume.to_string(),
            key: context::SECRET_DHCHAP,
            source: Box::new(source),
        })?;
    tracing::info!(endpoint = %client.endpoint, "this node's DH-HMAC-CHAP pair was delivered by the controller");
    secrets.insert(context::SECRET_DHCHAP.to_owned(), delivered.secret);
    match delivered.ctrl_secret {
        Some(ctrl) => secrets.insert(context::SECRET_DHCHAP_CTRL.to_owned(), ctrl),
        None => secrets.remove(context::SECRET_DHCHAP_CTRL),
    };
    Ok(secrets)
}
