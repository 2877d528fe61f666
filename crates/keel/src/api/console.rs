//! `/api/v1/vms/{name}/console` (a WebSocket to the serial console) and
//! `/api/v1/vms/{name}/console/log` (what the console printed).
//!
//! Both need the VM's node: its hypervisor holds the console. This server
//! serves them for the node it runs (`keel serve` on one host, a control
//! plane with `--agent` for its own node, a `keel agent --console-listen` for its
//! node); for a VM on another node it passes the request on to that
//! node's agent (`console_proxy`), and answers 501, naming the node, only
//! when that agent serves no consoles.
//!
//! The WebSocket carries raw console bytes both ways in binary messages
//! (text messages from the client are taken as their UTF-8 bytes). One
//! session per instance: a second attach is refused with 409 while the
//! first lasts. The session ends when either side closes, the instance
//! goes away, or the server shuts down.

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::{SinkExt, StreamExt};
use keel_api::{Node, VirtualMachine};
use keel_ctrl::keys::{node_key, vm_key};
use keel_hv::{ConsoleStream, HvError, Hypervisor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::console_proxy::{self, Remote};
use super::extract::{NameParam, QueryParams};
use super::require_token::ConsoleHold;
use super::{ApiError, AppState};
use crate::cli::server_trust::ServerTrust;
use crate::token_book::Caller;

// The wire contract of the log endpoint, shared with the proxy that
// passes it on (kept there, so the proxy needs nothing of this file).
pub use super::console_proxy::{INSTANCE_HEADER, MAX_LOG_BYTES};

/// Where a VM's console is.
pub(super) enum Console {
    /// In this process: the hypervisor and the instance.
    Here(Arc<dyn Hypervisor>, String),
    /// With the agent of another node.
    Agent(Remote),
}

/// The VM's current instance and who holds its console; `actor` is who
/// asks, named to another node's agent.
pub(super) async fn locate(state: &AppState, name: &str, actor: &str) -> Result<Console, ApiError> {
    let vm = state
        .store
        .get::<VirtualMachine>(&vm_key(name))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("VM {name} not found")))?
        .value;
    let Some(inst) = vm.status.instance else {
        return Err(ApiError::conflict(
            "status.instance",
            format!(
                "VM {name} has no instance ({:?}): a console exists only while one does",
                vm.status.phase
            ),
        ));
    };
    match &state.node {
        Some(access) if access.node == inst.node => {
            return Ok(Console::Here(access.hv.clone(), inst.id))
        }
        _ => {}
    }
    let url = state
        .store
        .get::<Node>(&node_key(&inst.node))
        .await?
        .and_then(|n| n.value.status.agent_url);
    match url {
        Some(url) => {
            let trust = agent_trust(state, &inst.node, &url)?;
            Ok(Console::Agent(Remote {
                node: inst.node,
                instance: inst.id,
                url,
                trust,
                actor: actor.to_string(),
            }))
        }
        None => Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!(
                "the console of VM {name} (instance {}) is on node {}, whose agent serves no \
                 consoles: start it with `keel agent --console-listen ADDR` (or run that node as \
                 `keel serve` / a control plane with --agent)",
                inst.id, inst.node
            ),
        )
        .with_field("status.instance.node")),
    }
}

/// How this server reaches `node`'s agent at `url`: mutual TLS with its
/// own cluster certificate, or not at all.
fn agent_trust(state: &AppState, node: &str, url: &str) -> Result<ServerTrust, ApiError> {
    if !url.starts_with("https://") {
        return Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "node {node}'s record gives its console URL as {url}: consoles are passed on \
                 only over mutual TLS (https), so nothing was sent there; restart that agent \
                 with its cluster certificate (`keel cluster issue-cert {node}`)"
            ),
        )
        .with_field("status.agent_url"));
    }
    let Some(creds) = &state.cluster_creds else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("this server serves only its own node's consoles; node {node}'s are served by the control planes"),
        )
        .with_field("status.instance.node"));
    };
    crate::agent_link::client_trust(creds, node).map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the console is on node {node}, whose agent this control plane reaches only with \
                 its own cluster certificate in {} (`keel cluster issue-cert NAME --control-plane \
                 --data-dir DATA_DIR`): {e:#}",
                creds.display()
            ),
        )
    })
}

pub(super) fn hv_error(err: HvError) -> ApiError {
    match err {
        HvError::NotFound { instance } => {
            ApiError::conflict("status.instance", format!("instance {instance} is gone"))
        }
        HvError::Unavailable { .. } => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            keel_ctrl::error_chain(&err),
        ),
        other => ApiError::conflict("status.instance", keel_ctrl::error_chain(&other)),
    }
}

/// The name of the token's holder (none on an agent's console port,
/// where the control plane names the user itself).
pub(super) fn actor(caller: Option<Extension<Caller>>) -> String {
    caller.map(|Extension(c)| c.name).unwrap_or_default()
}

/// `GET /api/v1/vms/{name}/console/log[?tail=LINES]`: `text/plain`, the
/// end of the console log of the current instance (at most 1 MiB), the
/// instance in `X-Keel-Instance`.
pub async fn log(
    State(state): State<AppState>,
    NameParam(name): NameParam,
    caller: Option<Extension<Caller>>,
    mut query: QueryParams,
) -> Result<Response, ApiError> {
    let tail = query.take_u64("tail")?;
    query.finish()?;
    let (hv, instance) = match locate(&state, &name, &actor(caller)).await? {
        Console::Here(hv, instance) => (hv, instance),
        Console::Agent(remote) => return console_proxy::log(remote, &name, tail).await,
    };
    let (bytes, _len) = hv
        .console_tail(&instance, MAX_LOG_BYTES)
        .await
        .map_err(hv_error)?;
    let bytes = match tail {
        Some(lines) => last_lines(&bytes, lines).to_vec(),
        None => bytes,
    };
    let mut resp = (StatusCode::OK, bytes).into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Ok(v) = HeaderValue::from_str(&instance) {
        headers.insert(INSTANCE_HEADER, v);
    }
    Ok(resp)
}

/// The last `n` lines of `bytes` (a final line without a newline counts).
pub fn last_lines(bytes: &[u8], n: u64) -> &[u8] {
    if n == 0 {
        return &[];
    }
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == n {
                return &bytes[i + 1..];
            }
        }
    }
    bytes
}

/// `GET /api/v1/vms/{name}/console` with a WebSocket upgrade.
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
    let located = locate(&state, &name, &actor(caller)).await?;
    let Ok(ws) = ws else {
        return Err(ApiError::bad_request(
            "upgrade",
            "the console is a WebSocket: send GET with `Connection: Upgrade` and \
             `Upgrade: websocket` (or use `keel vm console`)",
        ));
    };
    // A browser that sent its token as a subprotocol must get one back,
    // or it drops the connection; the token's own entry is never chosen.
    let ws = ws.protocols([super::ws_auth::CONSOLE_PROTOCOL]);
    let (hv, instance) = match located {
        Console::Here(hv, instance) => (hv, instance),
        Console::Agent(remote) => {
            return console_proxy::attach(remote, &name, ws, state.shutdown.clone(), session).await
        }
    };
    // Claimed before the upgrade, so a second session gets its 409 here
    // rather than a socket that closes at once.
    let console = hv.open_console(&instance).await.map_err(hv_error)?;
    tracing::info!(vm = %name, %instance, "console attached");
    let shutdown = state.shutdown.clone();
    Ok(ws.on_upgrade(move |socket| async move {
        let _session = session;
        pump(socket, console, shutdown).await;
        tracing::info!(vm = %name, %instance, "console detached");
    }))
}

pub(super) async fn pump(
    socket: WebSocket,
    console: ConsoleStream,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let (mut to_client, mut from_client) = socket.split();
    let (mut guest_out, mut guest_in) = tokio::io::split(console.io);
    let mut buf = vec![0u8; 4096];
    // The guard `wait_for` returns must not live across the loop's awaits.
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            read = guest_out.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_client.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        break;
                    }
                }
            },
            msg = from_client.next() => {
                let bytes = match msg {
                    Some(Ok(Message::Binary(b))) => b.to_vec(),
                    Some(Ok(Message::Text(t))) => t.as_bytes().to_vec(),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                };
                if guest_in.write_all(&bytes).await.is_err() {
                    break;
                }
            }
            _ = &mut stop => break,
        }
    }
    let _ = to_client.send(Message::Close(None)).await;
}

#[cfg(test)]
mod tests {
    use super::last_lines;

    #[test]
    fn tail_counts_lines_from_the_end() {
        let log = b"a\nb\nc\n";
        assert_eq!(last_lines(log, 1), b"c\n");
        assert_eq!(last_lines(log, 2), b"b\nc\n");
        assert_eq!(last_lines(log, 9), log);
        assert_eq!(last_lines(b"a\nb", 1), b"b");
        assert_eq!(last_lines(log, 0), b"");
    }
}
