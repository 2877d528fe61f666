//! API tokens: who may call the API and with which role. The store keeps
//! a hash of each token's secret, never the secret: a reader of the store
//! learns no credential.

use serde::{Deserialize, Serialize};

use crate::{validate_name, Millis, ValidationError};

/// What a token may do. Each role includes the ones below it: an admin
/// may do all an operator may, an operator all a viewer may.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads: VMs, snapshots, images, nodes, events, migrations, metrics.
    Viewer,
    /// Powers VMs (start, stop, restart, reboot), takes snapshots, live
    /// migrates and attaches to consoles.
    Operator,
    /// Everything: creating, changing and deleting VMs, restoring and
    /// deleting snapshots, images, nodes (cordon, drain, freeze), tokens.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    /// Whether this role may do what `needed` may.
    pub fn includes(self, needed: Role) -> bool {
        self >= needed
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("{s:?}: expected admin, operator or viewer"))
    }
}

/// One token, stored under `/tokens/<id>`. The secret handed out is
/// `keel_<id>_<secret>`; `hash` is the hex SHA-256 of `<secret>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiToken {
    pub id: String,
    /// Who holds it: the actor of audit events.
    pub name: String,
    pub role: Role,
    pub created: Millis,
    /// Refused from this moment on ("token expired").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<Millis>,
    /// Hex SHA-256 of the secret.
    pub hash: String,
    /// When it was revoked; refused from then on ("token revoked"). The
    /// record stays, so the audit trail's actor keeps its meaning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked: Option<Millis>,
}

impl ApiToken {
    /// Why the token is refused at `now`, if it is.
    pub fn refusal(&self, now: Millis) -> Option<&'static str> {
        if self.revoked.is_some() {
            return Some("token revoked");
        }
        match self.expires {
            Some(at) if now >= at => Some("token expired"),
            _ => None,
        }
    }

    /// Neither revoked nor expired at `now`.
    pub fn is_live(&self, now: Millis) -> bool {
        self.refusal(now).is_none()
    }
}

/// The body of `POST /api/v1/tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTokenRequest {
    pub name: String,
    pub role: Role,
    /// Seconds from now until the token expires; none: it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_s: Option<u64>,
}

/// The longest lifetime a token may be given: ten years.
pub const MAX_TOKEN_LIFETIME_S: u64 = 10 * 366 * 24 * 3600;

impl CreateTokenRequest {
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_name("name", &self.name)?;
        match self.expires_in_s {
            Some(0) => Err(ValidationError::new(
                "expires_in_s",
                "must be at least 1 (omit it for a token that does not expire)",
            )),
            Some(s) if s > MAX_TOKEN_LIFETIME_S => Err(ValidationError::new(
                "expires_in_s",
                format!("at most {MAX_TOKEN_LIFETIME_S} (ten years)"),
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> ApiToken {
        ApiToken {
            id: "abc".into(),
            name: "ci".into(),
            role: Role::Operator,
            created: 10,
            expires: Some(100),
            hash: "00".into(),
            revoked: None,
        }
    }

    #[test]
    fn roles_nest() {
        assert!(Role::Admin.includes(Role::Operator));
        assert!(Role::Operator.includes(Role::Viewer));
        assert!(!Role::Viewer.includes(Role::Operator));
        assert!(!Role::Operator.includes(Role::Admin));
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
        assert!("root".parse::<Role>().is_err());
    }

    #[test]
    fn expiry_and_revocation_refuse() {
        let mut t = token();
        assert_eq!(t.refusal(99), None);
        assert_eq!(t.refusal(100), Some("token expired"));
        t.revoked = Some(50);
        assert_eq!(t.refusal(60), Some("token revoked"));
    }

    #[test]
    fn requests_are_checked() {
        let mut r = CreateTokenRequest {
            name: "ci".into(),
            role: Role::Viewer,
            expires_in_s: Some(0),
        };
        assert_eq!(r.validate().unwrap_err().field, "expires_in_s");
        r.expires_in_s = None;
        r.validate().unwrap();
        r.name = "Bad_Name".into();
        assert_eq!(r.validate().unwrap_err().field, "name");
    }
}
