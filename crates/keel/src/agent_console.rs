//! `keel agent --console-listen ADDR`: the agent serves the consoles of its node's
//! VMs (`/api/v1/vms/{name}/console`, `/console/log` and `/vnc`, the very handlers
//! of `keel serve`) and its VMs' figures (`/api/v1/vm-stats`, for the
//! control plane's `/metrics`: `api::agent_figures`), nothing else, to the
//! cluster's control planes only:
//! mutual TLS on the cluster CA (`agent_link`), no user token.
//! Its URL goes on its node record (`status.agent_url`), where the control
//! planes find it to pass a user's console request on
//! (`api::console_proxy`).

use std::net::SocketAddr;
use std::path::Path;
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

use crate::api::{self, AppState, NodeAccess};
use crate::metrics::Metrics;

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
        creds: &Path,
    ) -> anyhow::Result<Self> {
        if listen.ip().is_unspecified() {
            bail!(
                "--console-listen {listen}: give the address the control planes reach this agent at \
                 (it goes on the node record), not an unspecified one"
            );
        }
        // Before binding: without its certificate the node serves no
        // consoles rather than serving them unauthenticated.
        let tls = crate::agent_link::server_config(creds).with_context(|| {
            format!(
                "--console-listen needs this node's cluster certificate in {} \
                 (`keel cluster issue-cert {node} --data-dir DATA_DIR`)",
                creds.display()
            )
        })?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("--console-listen {listen}"))?;
        let addr = listener.local_addr()?;

        let (stop, stop_rx) = watch::channel(false);
        let metrics = Arc::new(Metrics::new());
        metrics.report_vms_of(
            node,
            Arc::new(keel_hv::stats_cache::StatsCache::new(
                hv.clone(),
                clock.clone(),
            )),
            clock.clone(),
        );
        let state = AppState {
            store,
            clock,
            metrics,
            shutdown: stop_rx.clone(),
            images,
            node: Some(NodeAccess {
                node: node.to_string(),
                hv,
            }),
            limits: Default::default(),
            follows: Default::default(),
            // Serves no creates: its count is never consulted.
            vm_count: Default::default(),
            // An agent passes no console on: it serves its own node's.
            cluster_creds: None,
            image_imports: Default::default(),
        };
        let app = router(state);
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let task = tokio::spawn(crate::http_listener::serve_until(
            listener,
            app,
            Some(acceptor),
            stop_rx,
        ));
        let url = format!("https://{addr}");
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

fn router(state: AppState) -> Router {
    Router::new()
        .route("/api/v1/vms/{name}/console", get(api::console::attach))
        .route("/api/v1/vms/{name}/console/log", get(api::console::log))
        .route("/api/v1/vms/{name}/vnc", get(api::vnc::attach))
        // This node's VMs' figures, for the control plane's /metrics
        // (`api::agent_figures`).
        .route("/api/v1/vm-stats", get(api::vm_stats::list))
        .layer(middleware::from_fn(
            crate::agent_link::require_control_plane,
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
