//! Which accelerator the operator asked for (a configuration value, kept
//! apart from the probe in `accel` so the configuration needs no probe code).

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AccelChoice {
    /// Probe KVM once, fall back to TCG.
    #[default]
    Auto,
    Kvm,
    Tcg,
}

pub const ACCEL_ENV: &str = "KEEL_ACCEL";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid accelerator {value:?}: use auto, kvm or tcg")]
pub struct AccelParseError {
    pub value: String,
}

impl FromStr for AccelChoice {
    type Err = AccelParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Kvm),
            "tcg" => Ok(AccelChoice::Tcg),
            _ => Err(AccelParseError {
                value: s.to_string(),
            }),
        }
    }
}

impl fmt::Display for AccelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccelChoice::Auto => "auto",
            AccelChoice::Kvm => "kvm",
            AccelChoice::Tcg => "tcg",
        })
    }
}

impl AccelChoice {
    /// `KEEL_ACCEL=tcg|kvm|auto`; unset means `Auto`. An unknown value is an
    /// error rather than a silent `Auto`, so a typo does not change the
    /// accelerator behind the operator's back.
    pub fn from_env() -> Result<AccelChoice, AccelParseError> {
        match std::env::var(ACCEL_ENV) {
            Ok(v) => v.parse(),
            Err(std::env::VarError::NotPresent) => Ok(AccelChoice::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(AccelParseError {
                value: v.to_string_lossy().into_owned(),
            }),
        }
    }
}
