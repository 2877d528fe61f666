//! `keel agent --console-listen ADDR`: the agent serves the consoles of its node's
//! VMs (`/api/v1/vms/{name}/console` and `/console/log`, the very handlers
//! of `keel serve`) and nothing else, guarded by the cluster's API tokens
//! (the hashed records in the store the control planes check, followed
//! by this agent's own `token_book`: a control plane passes the user's
//! token on, and the agent checks it, its role and its limits itself).
//! Its URL goes on its node record (`status.agent_url`), where the control
//! planes find it to pass a user's console request on
//! (`api::console_proxy`).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context};
use axum::routing::get;
use axum::{middleware, Router};
use keel_api::{Clock, Node};
use keel_ctrl::keys::node_key;
use keel_hv::images::ImageStore;
use keel_hv::Hypervisor;
use keel_store::{StoreError, TypedStore};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::token_limits::TokenLimits;
use crate::api::{self, AppState, NodeAccess};
use crate::metrics::Metrics;
use crate::token_book::TokenBook;

/// The console server of a running agent.
pub struct ConsoleServer {
    pub url: String,
    stop: watch::Sender<bool>,
    task: JoinHandle<std::io::Result<()>>,
}

impl ConsoleServer {
    /// Binds `listen` and serves the consoles of `node`'s VMs.
    pub async fn start(
        listen: SocketAddr,
        node: &str,
        store: TypedStore,
        hv: Arc<dyn Hypervisor>,
        clock: Arc<dyn Clock>,
        images: Arc<ImageStore>,
        tokens: Arc<TokenBook>,
    ) -> anyhow::Result<Self> {
        if listen.ip().is_unspecified() {
            bail!(
                "--console-listen {listen}: give the address the control planes reach this agent at \
                 (it goes on the node record), not an unspecified one"
            );
        }
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("--console-listen {listen}"))?;
        let addr = listener.local_addr()?;
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, "serving consoles beyond loopback: plain HTTP guarded only by the bearer token");
        }
        let (stop, stop_rx) = watch::channel(false);
        tokens.spawn_reflector(stop_rx.clone());
        let door = api::Door::new(tokens, store.clone(), TokenLimits::default());
        let state = AppState {
            store,
            clock,
            metrics: Arc::new(Metrics::new()),
            shutdown: stop_rx.clone(),
            images,
            node: Some(NodeAccess {
                node: node.to_string(),
                hv,
            }),
            limits: Default::default(),
            follows: Default::default(),
            image_imports: Default::default(),
        };
        let app = router(state, door);
        let task = tokio::spawn(crate::http_listener::serve_until(
            listener, app, None, stop_rx,
        ));
        let url = format!("http://{addr}");
        tracing::info!(%url, node, "serving this node's consoles");
        Ok(Self { url, stop, task })
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }

    pub fn abort(self) {
        self.task.abort();
    }
}

fn router(state: AppState, door: api::Door) -> Router {
    Router::new()
        .route("/api/v1/vms/{name}/console", get(api::console::attach))
        .route("/api/v1/vms/{name}/console/log", get(api::console::log))
        .layer(middleware::from_fn_with_state(
            door,
            crate::api::require_token::require_token,
        ))
        .with_state(state)
}

/// Records where this node's agent serves its consoles (`None`: nowhere,
/// so a URL left by an earlier run with `--console-listen` does not linger).
pub async fn publish_url(store: &TypedStore, node: &str, url: Option<&str>) -> anyhow::Result<()> {
    let key = node_key(node);
    loop {
        let Some(entry) = store.get::<Node>(&key).await? else {
            bail!("node {node} has no record to publish its console URL on");
        };
        let mut record = entry.value;
        if record.status.agent_url.as_deref() == url {
            return Ok(());
        }
        record.status.agent_url = url.map(str::to_string);
        match store.update(&key, &record, entry.revision).await {
            Ok(_) => return Ok(()),
            // The heartbeat wrote in between: read again.
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("publishing node {node}'s console URL"))
            }
        }
    }
}
