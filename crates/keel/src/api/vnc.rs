//! `/api/v1/vms/{name}/vnc`: the graphical console (`spec.boot.graphics`)
//! as a WebSocket carrying the raw RFB stream of the instance's VNC server
//! in binary messages both ways, as websockify does for noVNC (which asks
//! for the `binary` subprotocol; it is granted when asked). The same door
//! as the serial console: an operator's token, and a console session of
//! that token for as long as the socket lasts. QEMU's VNC server listens
//! only on a unix socket of the instance, never on a TCP port, so this
//! route is the only way to it.
//!
//! Served for the node this server runs; for a VM on another node it is
//! passed on to that node's agent like the serial console
//! (`console_proxy`), and a 501 naming the node only when that agent
//! serves no consoles.

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use keel_api::VirtualMachine;
use keel_ctrl::keys::vm_key;

use super::console::{self, Console};
use super::console_proxy;
use super::extract::{NameParam, QueryParams};
use super::require_token::ConsoleHold;
use super::{ApiError, AppState};
use crate::token_book::Caller;

/// The WebSocket subprotocol noVNC asks for: binary messages only.
const SUBPROTOCOL: &str = "binary";

/// `GET /api/v1/vms/{name}/vnc` with a WebSocket upgrade.
pub async fn attach(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    caller: Option<Extension<Caller>>,
    query: QueryParams,
    hold: Option<Extension<ConsoleHold>>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    query.finish()?;
    // The token's console session (`--max-consoles-per-token`), kept
    // until the socket closes.
    let session = hold.and_then(|Extension(h)| h.take());
    let vm = state
        .store
        .get::<VirtualMachine>(&vm_key(&name))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("VM {name} not found")))?
        .value;
    if vm.spec.boot.graphics.is_none() {
        return Err(ApiError::conflict(
            "spec.boot.graphics",
            format!(
                "VM {name} has no graphical console: set spec.boot.graphics to vnc \
                 (keel vm create --graphics vnc) and restart it"
            ),
        ));
    }
    let located = console::locate(&state, &name, &console::actor(caller)).await?;
    let Ok(ws) = ws else {
        return Err(ApiError::bad_request(
            "upgrade",
            "the graphical console is a WebSocket carrying VNC (RFB): connect a WebSocket \
             VNC client such as noVNC, sending GET with `Connection: Upgrade` and \
             `Upgrade: websocket`",
        ));
    };
    let ws = ws.protocols([SUBPROTOCOL]);
    let (hv, instance) = match located {
        Console::Here(hv, instance) => (hv, instance),
        Console::Agent(remote) => {
            return console_proxy::attach_vnc(remote, &name, ws, state.shutdown.clone(), session)
                .await
        }
    };
    // Connected before the upgrade, so an instance without a display gets
    // its answer rather than a socket that closes at once.
    let stream = hv.open_vnc(&instance).await.map_err(console::hv_error)?;
    tracing::info!(vm = %name, %instance, "graphical console attached");
    let shutdown = state.shutdown.clone();
    Ok(ws.on_upgrade(move |socket| async move {
        let _session = session;
        console::pump(socket, stream, shutdown).await;
        tracing::info!(vm = %name, %instance, "graphical console detached");
    }))
}
