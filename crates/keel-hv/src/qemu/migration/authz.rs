//! Which source a target admits: one node, by its certificate's subject.
//!
//! `verify-peer` alone admits any certificate the cluster CA signed, so any
//! node could push a guest state into any other node's incoming QEMU. The
//! target therefore also sets the migration's `tls-authz` to an
//! `authz-simple` object whose identity is the distinguished name of the
//! source node the migration record names. QEMU 7.2 compares it with the
//! client certificate's DN as gnutls prints it (`gnutls_x509_crt_get_dn`,
//! RFC 4514) once the certificate has verified (`crypto/tlssession.c`),
//! and refuses the handshake of anyone else. Node certificates carry
//! exactly one attribute in their subject, `CN=<node>` ([`super::super::tls`]),
//! so that string is the whole DN.

use keel_api::validate_name;
use serde_json::json;

use super::super::qmp::{QmpClient, QmpError};

/// The id of the `authz-simple` object Keel adds to a target QEMU.
pub const AUTHZ_ID: &str = "keel-migration-authz";

/// The DN of `node`'s certificate, as QEMU matches it. Refused for a name
/// that is not a node name: a `,` or `=` in it would spell another DN.
pub fn source_identity(node: &str) -> Result<String, String> {
    validate_name("source node", node).map_err(|e| e.to_string())?;
    Ok(format!("CN={node}"))
}

/// Adds the object admitting only `node`'s certificate to a target QEMU;
/// returns its id, for `tls-authz`.
pub async fn admit_only(client: &QmpClient, node: &str) -> Result<&'static str, String> {
    let identity = source_identity(node)?;
    // A fresh QEMU per incoming instance has none; an earlier attempt's
    // would make object-add fail.
    let _ = client
        .execute("object-del", Some(json!({ "id": AUTHZ_ID })))
        .await;
    client
        .execute(
            "object-add",
            Some(json!({
                "qom-type": "authz-simple",
                "id": AUTHZ_ID,
                "identity": identity,
            })),
        )
        .await
        .map_err(|e: QmpError| format!("object-add authz-simple {identity}: {e}"))?;
    Ok(AUTHZ_ID)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_is_the_nodes_common_name_and_nothing_else() {
        assert_eq!(source_identity("node-a").unwrap(), "CN=node-a");
        for spoof in ["a,O=x", "CN=a", "", "A"] {
            assert!(source_identity(spoof).is_err(), "{spoof:?}");
        }
    }
}
