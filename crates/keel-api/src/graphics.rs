//! A VM's graphical console (`spec.boot.graphics`): a display device and a
//! VNC server on a unix socket of the instance, which the API passes over
//! a WebSocket (`/api/v1/vms/{name}/vnc`). Never a TCP port.
//!
//! Opt-in rather than on every VM: the display device takes guest memory
//! and a PCI slot, and a VM's device set must not change under it (live
//! migration needs the same devices on both sides; guests name NICs by
//! slot). A change takes effect at the next instance, as any boot field.

use serde::{Deserialize, Serialize};

use crate::ValidationError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Graphics {
    /// A standard VGA device, its screen served by QEMU's VNC server.
    Vnc,
}

impl Graphics {
    pub fn as_str(self) -> &'static str {
        match self {
            Graphics::Vnc => "vnc",
        }
    }
}

impl std::fmt::Display for Graphics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Graphics {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vnc" => Ok(Graphics::Vnc),
            _ => Err(ValidationError::new(
                "spec.boot.graphics",
                format!("{s:?} is not one of vnc"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_its_names_and_names_the_field() {
        assert_eq!("vnc".parse::<Graphics>().unwrap(), Graphics::Vnc);
        assert_eq!(
            "spice".parse::<Graphics>().unwrap_err().field,
            "spec.boot.graphics"
        );
        assert_eq!(serde_json::to_string(&Graphics::Vnc).unwrap(), "\"vnc\"");
    }
}
