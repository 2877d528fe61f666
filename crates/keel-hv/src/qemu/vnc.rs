//! A VM's graphical console (`spec.boot.graphics`): a standard VGA device
//! and QEMU's VNC server listening on a unix socket in the instance's
//! socket dir, never on a TCP port. The API passes the socket's RFB stream
//! over a WebSocket to whoever holds a token allowed to; QEMU's VNC server
//! itself asks for no password (security type None), so the socket's
//! directory (root's, 0700) is what keeps everyone else out.

use std::path::Path;

use keel_api::Graphics;

use super::opts::opt_escape;
use super::QemuDriver;
use crate::{ConsoleStream, HvError};

/// The arguments of the display device and its VNC server.
pub fn args(graphics: Graphics, socket: &Path) -> Vec<String> {
    match graphics {
        // VGA rather than a framebuffer-only device: SeaBIOS, OVMF and an
        // installer's text mode all draw on it.
        Graphics::Vnc => vec![
            "-vnc".into(),
            format!("unix:{}", opt_escape(socket)),
            "-device".into(),
            "VGA".into(),
        ],
    }
}

impl QemuDriver {
    /// A connection to the instance's VNC server. Several may be open at
    /// once (QEMU shares the display among its clients).
    pub(super) async fn attach_vnc(&self, instance: &str) -> Result<ConsoleStream, HvError> {
        let op = "attach graphical console";
        let domain = self.live_domain(instance, op)?;
        let failed = |reason: String| HvError::Failed {
            instance: instance.to_string(),
            op,
            reason,
            source: None,
        };
        let socket = &domain.paths.vnc_sock;
        if !socket.exists() {
            return Err(failed(
                "the instance has no graphical console (started without spec.boot.graphics; \
                 set it and restart the VM)"
                    .into(),
            ));
        }
        let timeout = self.inner.config.qmp_timeout;
        let stream = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(socket))
            .await
            .map_err(|_| failed(format!("VNC socket: no answer within {timeout:?}")))?
            .map_err(|e| HvError::failed_by(instance, op, socket.display().to_string(), e))?;
        Ok(ConsoleStream::new(Box::new(stream), None))
    }
}
