//! A VM's TPM (`spec.tpm`): an emulated TPM 2.0 whose state is the VM's
//! data, like its disks. Windows 11 needs one, and a measured boot or a
//! disk key sealed to it (BitLocker, systemd-cryptenroll) needs the same
//! state at every boot: once an instance has run with it
//! (`VmStatus::tpm_used_since`), no start anywhere may make a blank one in
//! its place.

use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// `spec.tpm`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub struct TpmSpec {
    #[serde(default)]
    pub version: TpmVersion,
}

/// The TPM's specification version. Only 2.0: TPM 1.2 is what no guest
/// that asks for a TPM today accepts.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub enum TpmVersion {
    #[default]
    #[serde(rename = "2.0")]
    V2_0,
}

impl std::fmt::Display for TpmVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TpmVersion::V2_0 => f.write_str("2.0"),
        }
    }
}

impl std::str::FromStr for TpmVersion {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "2.0" | "2" => Ok(TpmVersion::V2_0),
            _ => Err(ValidationError::new(
                "spec.tpm.version",
                format!("{s:?} is not a TPM version Keel offers (2.0)"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tpm_2_0_is_offered_and_named_as_such() {
        let spec: TpmSpec = serde_json::from_str(r#"{"version":"2.0"}"#).unwrap();
        assert_eq!(spec.version, TpmVersion::V2_0);
        assert_eq!(serde_json::from_str::<TpmSpec>("{}").unwrap(), spec);
        assert!(serde_json::from_str::<TpmSpec>(r#"{"version":"1.2"}"#).is_err());
        assert_eq!(
            serde_json::to_string(&spec).unwrap(),
            r#"{"version":"2.0"}"#
        );
        let err = "1.2".parse::<TpmVersion>().unwrap_err();
        assert_eq!(err.field, "spec.tpm.version");
        assert_eq!("2.0".parse::<TpmVersion>().unwrap().to_string(), "2.0");
    }
}
