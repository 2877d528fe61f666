//! cloud-init (NoCloud) settings of a VM: SSH keys for the image's default
//! user and/or the user's own user-data. Keel writes the seed drive from
//! these at every start (`keel-hv`'s `qemu::cloud_init`); the hostname is
//! the VM's name.

use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// The largest user-data Keel accepts. cloud-init itself has no hard limit,
/// but the seed is rebuilt at every start and the spec is stored in every
/// record write: a user-data file is configuration, not a payload.
pub const MAX_USER_DATA_BYTES: usize = 64 * 1024;
pub const MAX_SSH_KEYS: usize = 32;
/// An RSA 16384-bit key is about 2.8 KiB; this leaves room for comments.
pub const MAX_SSH_KEY_BYTES: usize = 8 * 1024;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CloudInitSpec {
    /// Public keys (one `authorized_keys` line each) for the image's
    /// default user.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_authorized_keys: Vec<String>,
    /// The user's own user-data (`#cloud-config`, a script, …). With keys
    /// as well, both go to the guest as one MIME multipart whose key part
    /// appends to whatever keys the user's cloud-config lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// cloud-init's `instance-id`: assigned once (the API fills it in), kept
    /// for the VM's life, so cloud-init runs its once-per-instance modules
    /// (user creation, keys, host keys) on the first boot only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
}

impl CloudInitSpec {
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.ssh_authorized_keys.is_empty() && self.user_data.is_none() {
            return Err(ValidationError::new(
                "spec.cloud_init",
                "give SSH keys, user-data or both (or leave cloud_init out)",
            ));
        }
        if self.ssh_authorized_keys.len() > MAX_SSH_KEYS {
            return Err(ValidationError::new(
                "spec.cloud_init.ssh_authorized_keys",
                format!(
                    "{} keys; at most {MAX_SSH_KEYS}",
                    self.ssh_authorized_keys.len()
                ),
            ));
        }
        for (i, key) in self.ssh_authorized_keys.iter().enumerate() {
            validate_ssh_key(&format!("spec.cloud_init.ssh_authorized_keys[{i}]"), key)?;
        }
        if let Some(data) = &self.user_data {
            if data.len() > MAX_USER_DATA_BYTES {
                return Err(ValidationError::new(
                    "spec.cloud_init.user_data",
                    format!(
                        "{} bytes; at most {MAX_USER_DATA_BYTES} (64 KiB)",
                        data.len()
                    ),
                ));
            }
            if data.contains('\0') {
                return Err(ValidationError::new(
                    "spec.cloud_init.user_data",
                    "must be text (contains NUL)",
                ));
            }
        }
        if let Some(id) = &self.instance_id {
            let ok = !id.is_empty()
                && id.len() <= 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !ok {
                return Err(ValidationError::new(
                    "spec.cloud_init.instance_id",
                    "1..=64 of a-z, A-Z, 0-9, '-', '_', '.'",
                ));
            }
        }
        Ok(())
    }
}

/// One `authorized_keys` line of a public key: `<type> <base64> [comment]`.
/// Options before the type (`from=…`) are not taken: the line goes to the
/// default user as cloud-init's `ssh_authorized_keys`, where they would be
/// honoured silently.
fn validate_ssh_key(field: &str, key: &str) -> Result<(), ValidationError> {
    let bad = |why: &str| Err(ValidationError::new(field, why.to_string()));
    if key.len() > MAX_SSH_KEY_BYTES {
        return bad("longer than 8 KiB: not a public key");
    }
    if key.contains(['\n', '\r', '\0']) {
        return bad("must be one line (one key per entry)");
    }
    let mut words = key.split_ascii_whitespace();
    let (Some(kind), Some(body)) = (words.next(), words.next()) else {
        return bad("not a public key: expected \"<type> <base64> [comment]\"");
    };
    let known = kind.starts_with("ssh-")
        || kind.starts_with("ecdsa-sha2-")
        || kind.starts_with("sk-ssh-")
        || kind.starts_with("sk-ecdsa-sha2-");
    if !known {
        return bad(
            "not a public key: type must be ssh-*, ecdsa-sha2-* or sk-* (is this a private key?)",
        );
    }
    if body.len() < 16
        || !body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
    {
        return bad("not a public key: the second word must be the base64 key");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvQ4m8y8kJqkVv6Zl9m8oQb2F2k9eW4k2q0o1v2w3x4 me@host";

    #[test]
    fn validation_names_the_field() {
        let field = |c: CloudInitSpec| c.validate().unwrap_err().field;
        assert_eq!(field(CloudInitSpec::default()), "spec.cloud_init");
        assert_eq!(
            field(CloudInitSpec {
                user_data: Some("x".repeat(MAX_USER_DATA_BYTES + 1)),
                ..Default::default()
            }),
            "spec.cloud_init.user_data"
        );
        for bad in [
            "-----BEGIN OPENSSH PRIVATE KEY-----",
            "ssh-ed25519",
            "ssh-ed25519 not*base64!",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA\nssh-rsa AAAAB3NzaC1yc2EAAAADAQAB",
        ] {
            assert_eq!(
                field(CloudInitSpec {
                    ssh_authorized_keys: vec![KEY.into(), bad.into()],
                    ..Default::default()
                }),
                "spec.cloud_init.ssh_authorized_keys[1]",
                "{bad}"
            );
        }
        assert_eq!(
            field(CloudInitSpec {
                ssh_authorized_keys: vec![KEY.into()],
                instance_id: Some("a b".into()),
                ..Default::default()
            }),
            "spec.cloud_init.instance_id"
        );
        CloudInitSpec {
            ssh_authorized_keys: vec![KEY.into()],
            user_data: Some("x".repeat(MAX_USER_DATA_BYTES)),
            instance_id: Some("i-0123abcd".into()),
        }
        .validate()
        .unwrap();
    }
}
