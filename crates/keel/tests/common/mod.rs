//! A real `keel serve` (SQLite store, controller, heartbeat, HTTPS API) on
//! 127.0.0.1:0 with a temp data dir and the sim hypervisor on the system
//! clock, driven over a real socket. Waits poll with a deadline. The
//! server makes its self-signed certificate in the data dir, and the
//! test's client trusts it from there, as a local CLI does.

#![allow(dead_code)]

pub mod cli;

use std::path::Path;
use std::time::{Duration, Instant};

use keel::api_tls::ApiTls;
use keel::args::HypervisorKind;
use keel::cli::server_trust::ServerTrust;
use keel::serve::{self, RunningServer, ServeConfig};
use keel_ctrl::LifecycleConfig;
use keel_hv::sim::SimConfig;
use keel_store::Entry;
use serde_json::{json, Value};
use tempfile::TempDir;

pub const DEADLINE: Duration = Duration::from_secs(30);

/// Small timings, so phases change within a fraction of a second.
pub fn fast_config(dir: &Path) -> ServeConfig {
    let mut cfg = ServeConfig::new(
        dir.to_path_buf(),
        "127.0.0.1:0".parse().unwrap(),
        HypervisorKind::Sim,
        "test-node".into(),
    );
    cfg.sim = SimConfig {
        boot_ms: 50,
        graceful_shutdown_ms: 50,
        ..SimConfig::default()
    };
    cfg.lifecycle = LifecycleConfig {
        stop_backoff_initial_ms: 50,
        stop_backoff_max_ms: 200,
        kill_recheck_ms: 100,
        retry_ms: 100,
        start_backoff_initial_ms: 100,
        start_backoff_max_ms: 400,
        boot_settle_ms: 200,
        poll_ms: 100,
        ..LifecycleConfig::default()
    };
    cfg
}

pub struct Resp {
    pub status: u16,
    pub text: String,
    pub headers: Vec<(String, String)>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.text))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub struct TestServer {
    pub rt: tokio::runtime::Runtime,
    server: Option<RunningServer>,
    pub dir: TempDir,
    pub base: String,
    pub token: String,
    /// How the test's clients verify the server (its data dir's certificate).
    pub trust: ServerTrust,
    agent: ureq::Agent,
}

impl TestServer {
    pub fn start() -> Self {
        Self::start_in(tempfile::tempdir().unwrap())
    }

    /// A server on [`fast_config`] changed by `adjust`.
    pub fn start_with(adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = fast_config(dir.path());
        adjust(&mut cfg);
        Self::start_cfg(dir, cfg)
    }

    /// A server on [`fast_config`] speaking plain HTTP (`--insecure-http`),
    /// for the tests that write raw requests to its socket.
    pub fn start_plain_with(adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        Self::start_with(|cfg| {
            cfg.tls = ApiTls::InsecureHttp;
            adjust(cfg)
        })
    }

    /// The `ws(s)://` URL of `path` and the connector that verifies it.
    pub fn ws_url(&self, path: &str) -> (String, Option<tokio_tungstenite::Connector>) {
        let url = format!(
            "{}{path}",
            self.base
                .replacen("https://", "wss://", 1)
                .replacen("http://", "ws://", 1)
        );
        (
            url,
            self.trust
                .client_config()
                .map(tokio_tungstenite::Connector::Rustls),
        )
    }

    pub fn start_in(dir: TempDir) -> Self {
        let cfg = fast_config(dir.path());
        Self::start_cfg(dir, cfg)
    }

    fn start_cfg(dir: TempDir, cfg: ServeConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let plain = cfg.tls == ApiTls::InsecureHttp;
        let data_dir = cfg.data_dir.clone();
        let server = rt.block_on(serve::start(cfg)).expect("server starts");
        let trust = if plain {
            ServerTrust::PlainHttp
        } else {
            ServerTrust::of_data_dir(&data_dir).expect("the server's certificate")
        };
        let agent = trust.agent(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .proxy(None)
                .timeout_global(Some(Duration::from_secs(30)))
                .build(),
        );
        let scheme = if plain { "http" } else { "https" };
        Self {
            base: format!("{scheme}://{}", server.addr()),
            trust,
            token: server.token().to_string(),
            server: Some(server),
            rt,
            dir,
            agent,
        }
    }

    /// Stops the server (as on SIGTERM) and hands back its data dir.
    pub fn stop(mut self) -> TempDir {
        let server = self.server.take().unwrap();
        self.rt.block_on(server.shutdown()).expect("clean shutdown");
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.dir, dir)
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = ureq::http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = body.map(|b| b.to_vec()).unwrap_or_default();
        if !body.is_empty() {
            req = req.header("Content-Type", "application/json");
        }
        let mut resp = self
            .agent
            .run(req.body(body).unwrap())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        Resp {
            status: resp.status().as_u16(),
            text: resp.body_mut().read_to_string().unwrap(),
            headers,
        }
    }

    pub fn get(&self, path: &str) -> Resp {
        self.request("GET", path, Some(&self.token), None, &[])
    }

    pub fn send(&self, method: &str, path: &str, body: &str) -> Resp {
        let body = (!body.is_empty()).then_some(body.as_bytes());
        self.request(method, path, Some(&self.token), body, &[])
    }

    pub fn create_vm(&self, name: &str, spec: Value) -> Value {
        let r = self.send(
            "POST",
            "/api/v1/vms",
            &json!({"name": name, "spec": spec}).to_string(),
        );
        assert_eq!(r.status, 201, "{}", r.text);
        r.json()
    }

    pub fn vm(&self, name: &str) -> Option<Value> {
        let r = self.get(&format!("/api/v1/vms/{name}"));
        match r.status {
            200 => Some(r.json()),
            404 => None,
            s => panic!("GET {name}: {s} {}", r.text),
        }
    }

    /// Polls until `pred` holds for the VM's response, or panics at the deadline.
    pub fn wait_vm(&self, name: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let current = self.vm(name);
            if let Some(v) = &current {
                if pred(v) {
                    return v.clone();
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "VM {name} did not {what} within {DEADLINE:?}; last: {current:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls a snapshot until `pred` holds for its response.
    pub fn wait_snapshot(
        &self,
        vm: &str,
        name: &str,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let r = self.get(&format!("/api/v1/vms/{vm}/snapshots/{name}"));
            let current = (r.status == 200).then(|| r.json());
            if let Some(v) = &current {
                if pred(v) {
                    return v.clone();
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "snapshot {vm}/{name} did not {what} within {DEADLINE:?}; last: {} {}",
                r.status,
                r.text
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until the VM has no snapshot left. A deleted snapshot may
    /// still be listed a moment, with its deletion requested, until the
    /// snapshot controller removes it; anything else listed fails at once.
    pub fn wait_no_snapshots(&self, vm: &str) {
        let start = Instant::now();
        loop {
            let snaps: Value = self.get(&format!("/api/v1/vms/{vm}/snapshots")).json();
            let items = snaps["items"].as_array().cloned().unwrap_or_default();
            if items.is_empty() {
                return;
            }
            assert!(
                items
                    .iter()
                    .all(|s| s["snapshot"]["deletion_requested_at"].is_u64()),
                "VM {vm} has snapshots not being deleted: {snaps}"
            );
            assert!(
                start.elapsed() < DEADLINE,
                "VM {vm}'s snapshots were not deleted within {DEADLINE:?}: {snaps}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls the node until `pred` holds for its response.
    pub fn wait_node(&self, name: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let r = self.get(&format!("/api/v1/nodes/{name}"));
            assert_eq!(r.status, 200, "{}", r.text);
            let v = r.json();
            if pred(&v) {
                return v;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "node {name} did not {what} within {DEADLINE:?}; last: {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn wait_gone(&self, name: &str) {
        let start = Instant::now();
        while self.vm(name).is_some() {
            assert!(start.elapsed() < DEADLINE, "VM {name} was not deleted");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Phase Stopped, no instance, and the controller caught up with the
    /// spec: after this the controller writes nothing more for the VM.
    pub fn wait_settled_stopped(&self, name: &str) -> Value {
        self.wait_vm(name, "settle Stopped", |v| {
            let vm = &v["vm"];
            vm["status"]["phase"] == "Stopped"
                && vm["status"].get("instance").is_none()
                && vm["status"]["observed_generation"] == vm["generation"]
        })
    }

    /// Everything a request could change: the raw entries of VMs, events,
    /// snapshots and migrations, and each node's record without what its
    /// heartbeat rewrites every few seconds (so without revisions).
    pub fn store_state(&self) -> (Vec<Entry>, Vec<Value>) {
        let store = self.server.as_ref().unwrap().store().raw().clone();
        let mut entries = self.snapshot();
        let nodes = self.rt.block_on(async {
            for prefix in ["/snapshots/", "/migrations/"] {
                let (more, _) = store.list(prefix).await.unwrap();
                entries.extend(more);
            }
            let (nodes, _) = store.list("/nodes/").await.unwrap();
            nodes
        });
        let nodes = nodes
            .iter()
            .map(|e| {
                let mut v: Value = serde_json::from_slice(&e.value).unwrap();
                v.as_object_mut().unwrap().remove("status");
                v
            })
            .collect();
        (entries, nodes)
    }

    /// Writes a record straight into the store (it must not exist yet), as
    /// a controller would.
    pub fn put_raw(&self, key: &str, value: &Value) {
        let store = self.server.as_ref().unwrap().store().raw().clone();
        self.rt
            .block_on(store.put(
                key,
                serde_json::to_vec(value).unwrap(),
                keel_store::Precondition::Absent,
            ))
            .unwrap();
    }

    /// Deletes a record straight from the store, at its current revision
    /// (as a Keel without today's checks could have).
    pub fn delete_raw(&self, key: &str) {
        let store = self.server.as_ref().unwrap().store().raw().clone();
        self.rt.block_on(async {
            let entry = store.get(key).await.unwrap().expect("the record exists");
            store.delete(key, entry.mod_revision).await.unwrap();
        });
    }

    /// [`TestServer::store_state`] once two reads a moment apart agree:
    /// the controllers have nothing left to write.
    pub fn settled_state(&self) -> (Vec<Entry>, Vec<Value>) {
        let start = Instant::now();
        let mut last = self.store_state();
        loop {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.store_state();
            if now == last {
                return now;
            }
            assert!(start.elapsed() < DEADLINE, "the store never settled");
            last = now;
        }
    }

    /// Every raw store entry under `prefix`.
    pub fn raw_entries(&self, prefix: &str) -> Vec<Entry> {
        let store = self.server.as_ref().unwrap().store().raw().clone();
        self.rt
            .block_on(async { store.list(prefix).await.unwrap().0 })
    }

    /// The raw store entries of VMs and events: keys, value bytes, revisions.
    /// The VMs and their events: what a refused request must leave as it
    /// was. The audit trail is left out, since it records refusals too.
    pub fn snapshot(&self) -> Vec<Entry> {
        let store = self.server.as_ref().unwrap().store().raw().clone();
        self.rt.block_on(async {
            let (mut vms, _) = store.list("/vms/").await.unwrap();
            let (events, _) = store.list("/events/").await.unwrap();
            vms.extend(
                events
                    .into_iter()
                    .filter(|e| !e.key.starts_with("/events/_audit/")),
            );
            vms
        })
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            let _ = self.rt.block_on(server.shutdown());
        }
    }
}

pub fn phase(v: &Value) -> &str {
    v["vm"]["status"]["phase"].as_str().unwrap_or("?")
}

pub fn instance(v: &Value) -> Option<String> {
    v["vm"]["status"]["instance"]["id"]
        .as_str()
        .map(String::from)
}

pub fn small_spec() -> Value {
    json!({"cpus": 1, "memory_mib": 64})
}
