//! Consoles of VMs on other nodes: this server passes `console`,
//! `console/log` and `vnc` on to the agent of the VM's node, at the URL that agent
//! published on its node record (`keel agent --console-listen`,
//! `crate::agent_console`), over mutual TLS on the cluster CA
//! (`crate::agent_link`): the agent's certificate must name that node, and
//! this server presents its own. The user's token stays here (this server
//! has checked it); only its holder's name goes along, for the agent's
//! log. The agent's answer (a 409 for a console in use, a 404, the log
//! itself) comes back as it gave it.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Error as WsError};

use super::token_limits::ConsoleSession;
use super::ApiError;
use crate::agent_link::ACTOR_HEADER;
use crate::cli::server_trust::ServerTrust;

/// The most of a console log one request returns.
pub const MAX_LOG_BYTES: u64 = 1 << 20;

/// Sent as the header of every log response.
pub const INSTANCE_HEADER: &str = "x-keel-instance";

/// The agent that holds a VM's console.
#[derive(Debug, Clone)]
pub struct Remote {
    pub node: String,
    pub instance: String,
    /// `https://HOST:PORT`, from the node record.
    pub url: String,
    /// How to reach it: this server's certificate, and the agent's
    /// verified to name `node`.
    pub trust: ServerTrust,
    /// Who asked (the token's holder), for the agent's log.
    pub actor: String,
}

/// How long a proxied log request may take, the agent included.
const LOG_TIMEOUT_S: u64 = 30;

impl Remote {
    fn unreachable(&self, why: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the console of instance {} is on node {}, whose agent at {} did not answer: {why}",
                self.instance, self.node, self.url
            ),
        )
        .with_field("status.instance.node")
    }

    fn path(&self, vm: &str, tail: &str) -> String {
        format!("/api/v1/vms/{vm}/console{tail}")
    }
}

/// `GET …/console/log` from the agent, its answer passed back.
pub async fn log(remote: Remote, vm: &str, tail: Option<u64>) -> Result<Response, ApiError> {
    let query = tail.map(|n| format!("?tail={n}")).unwrap_or_default();
    let url = format!("{}{}", remote.url, remote.path(vm, &format!("/log{query}")));
    let (trust, actor) = (remote.trust.clone(), remote.actor.clone());
    let fetched = tokio::task::spawn_blocking(move || fetch(&trust, &url, &actor))
        .await
        .map_err(|e| remote.unreachable(e))?;
    let (status, content_type, instance, body) = fetched.map_err(|e| remote.unreachable(e))?;
    let mut resp = (status, body).into_response();
    let h = resp.headers_mut();
    if let Some(v) = content_type {
        h.insert(header::CONTENT_TYPE, v);
    }
    if let Some(v) = instance {
        h.insert(INSTANCE_HEADER, v);
    }
    Ok(resp)
}

type Fetched = (
    StatusCode,
    Option<HeaderValue>,
    Option<HeaderValue>,
    Vec<u8>,
);

/// One GET, any status taken as an answer (not an error), bounded.
fn fetch(trust: &ServerTrust, url: &str, actor: &str) -> Result<Fetched, String> {
    let agent = trust.agent(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            // Straight to the agent, never through an HTTP_PROXY.
            .proxy(None)
            .timeout_global(Some(std::time::Duration::from_secs(LOG_TIMEOUT_S)))
            .build(),
    );
    let mut resp = agent
        .get(url)
        .header(ACTOR_HEADER, actor)
        .call()
        .map_err(|e| e.to_string())?;
    let status = StatusCode::from_u16(resp.status().as_u16()).map_err(|e| e.to_string())?;
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
    };
    let content_type = header("content-type");
    let instance = header(INSTANCE_HEADER);
    let body = resp
        .body_mut()
        .with_config()
        .limit(2 * MAX_LOG_BYTES)
        .read_to_vec()
        .map_err(|e| e.to_string())?;
    Ok((status, content_type, instance, body))
}

type AgentSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens the agent's console session first, so its refusal (409 while
/// another session lasts, 404, 401) is this request's answer; then
/// upgrades the client and relays messages both ways until either ends.
pub async fn attach(
    remote: Remote,
    vm: &str,
    ws: WebSocketUpgrade,
    shutdown: tokio::sync::watch::Receiver<bool>,
    session: Option<ConsoleSession>,
) -> Result<Response, ApiError> {
    let path = remote.path(vm, "");
    attach_at(remote, vm, &path, ws, shutdown, session).await
}

/// The graphical console (`/vms/{vm}/vnc`), passed on the same way: its
/// RFB stream rides in the same binary messages.
pub async fn attach_vnc(
    remote: Remote,
    vm: &str,
    ws: WebSocketUpgrade,
    shutdown: tokio::sync::watch::Receiver<bool>,
    session: Option<ConsoleSession>,
) -> Result<Response, ApiError> {
    let path = format!("/api/v1/vms/{vm}/vnc");
    attach_at(remote, vm, &path, ws, shutdown, session).await
}

async fn attach_at(
    remote: Remote,
    vm: &str,
    path: &str,
    ws: WebSocketUpgrade,
    shutdown: tokio::sync::watch::Receiver<bool>,
    session: Option<ConsoleSession>,
) -> Result<Response, ApiError> {
    let url = format!("{}{path}", remote.url.replacen("https://", "wss://", 1));
    let mut req = url
        .as_str()
        .into_client_request()
        .map_err(|e| remote.unreachable(e))?;
    if let Ok(v) = tungstenite::http::HeaderValue::from_str(&remote.actor) {
        req.headers_mut().insert(ACTOR_HEADER, v);
    }
    let connector = remote
        .trust
        .client_config()
        .map(tokio_tungstenite::Connector::Rustls);
    let connect = tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector);
    let agent =
        match tokio::time::timeout(std::time::Duration::from_secs(LOG_TIMEOUT_S), connect).await {
            Err(_) => return Err(remote.unreachable("no answer in time")),
            Ok(Ok((socket, _))) => socket,
            // The agent's own refusal, passed back as it gave it.
            Ok(Err(WsError::Http(resp))) => {
                let status =
                    StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
                let body = resp.body().clone().unwrap_or_default();
                let mut out = (status, body).into_response();
                out.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                return Ok(out);
            }
            Ok(Err(e)) => return Err(remote.unreachable(e)),
        };
    tracing::info!(vm, path, instance = %remote.instance, node = %remote.node, "console attached through the node's agent");
    let vm = vm.to_string();
    Ok(ws.on_upgrade(move |client| async move {
        let _session = session;
        relay(client, agent, shutdown).await;
        tracing::info!(vm = %vm, instance = %remote.instance, "proxied console detached");
    }))
}

async fn relay(
    client: WebSocket,
    agent: AgentSocket,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let (mut to_client, mut from_client) = client.split();
    let (mut to_agent, mut from_agent) = agent.split();
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            msg = from_agent.next() => {
                let bytes = match msg {
                    Some(Ok(tungstenite::Message::Binary(b))) => b.to_vec(),
                    Some(Ok(tungstenite::Message::Text(t))) => t.as_bytes().to_vec(),
                    Some(Ok(tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_)
                        | tungstenite::Message::Frame(_))) => continue,
                    Some(Ok(tungstenite::Message::Close(_))) | Some(Err(_)) | None => break,
                };
                if to_client.send(Message::Binary(bytes.into())).await.is_err() {
                    break;
                }
            }
            msg = from_client.next() => {
                let bytes = match msg {
                    Some(Ok(Message::Binary(b))) => b.to_vec(),
                    Some(Ok(Message::Text(t))) => t.as_bytes().to_vec(),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                };
                if to_agent.send(tungstenite::Message::binary(bytes)).await.is_err() {
                    break;
                }
            }
            _ = &mut stop => break,
        }
    }
    let _ = to_agent.send(tungstenite::Message::Close(None)).await;
    let _ = to_client.send(Message::Close(None)).await;
}
