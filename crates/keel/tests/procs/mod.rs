//! Helpers for tests that run Keel as separate processes (`keel serve`,
//! `keel agent`) with real QEMU guests. Each test file compiles its own
//! copy and uses part of it.
#![allow(dead_code)]

pub mod faketime;
pub mod member;
pub mod stall_fs;
pub mod tcp_proxy;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// A `keel` process; SIGKILLed on drop. Its stderr is collected.
pub struct Keel {
    pub name: String,
    pub child: Child,
    pub log: Arc<Mutex<String>>,
}

impl Keel {
    pub fn spawn(name: &str, args: &[&str]) -> Keel {
        Self::spawn_with(name, Command::new(env!("CARGO_BIN_EXE_keel")).args(args))
    }

    /// `command` (a `keel`, or something that execs one), with the test's
    /// environment: no host config file, no inherited data dir, and no
    /// compaction of etcd's history (the shared test etcd keeps all of it
    /// for the store's conformance suite; a test of compaction gives the
    /// flag, which wins).
    pub fn spawn_with(name: &str, command: &mut Command) -> Keel {
        let mut child = command
            .env("KEEL_CONFIG", "")
            .env("KEEL_ETCD_COMPACTION_INTERVAL", "0s")
            .env(
                "RUST_LOG",
                std::env::var("KEEL_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("KEEL_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        Keel {
            name: name.into(),
            child,
            log,
        }
    }

    pub fn log(&self) -> String {
        format!("--- {} ---\n{}", self.name, self.log.lock().unwrap())
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Keel {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Where a process test runs: a private directory whose processes are all
/// SIGKILLed when it ends (before the directory goes), a store namespace
/// of its own and the test guest. `None` when such tests are skipped.
pub struct Workdir {
    pub root: std::path::PathBuf,
    pub store: String,
    /// The test guest's directory, for `--guest-dir`.
    pub guest_dir: String,
    // Dropped in this order: the processes, then their directory.
    _kill_all: KillAll,
    _tmp: tempfile::TempDir,
}

impl Workdir {
    pub fn start(test: &str) -> Option<Self> {
        if skipped() {
            return None;
        }
        let guest_dir = test_guest().to_string_lossy().into_owned();
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        Some(Self {
            _kill_all: KillAll(root.clone()),
            root,
            store: store_spec(test),
            guest_dir,
            _tmp: tmp,
        })
    }

    /// `name` under the root, as a flag value.
    pub fn dir(&self, name: &str) -> String {
        self.root.join(name).to_string_lossy().into_owned()
    }
}

/// SIGKILLs everything whose command line names `root` (QEMUs, keepers).
pub struct KillAll(pub std::path::PathBuf);

impl Drop for KillAll {
    fn drop(&mut self) {
        for (pid, _) in processes_naming(&self.0.to_string_lossy()) {
            // SAFETY: a process whose command line names this test's dir.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

pub fn processes_naming(needle: &str) -> Vec<(i32, String)> {
    keel_testkit::procs::all()
        .into_iter()
        .filter(|p| p.cmdline.contains(needle))
        .map(|p| (p.pid, p.cmdline))
        .collect()
}

/// QEMU processes of VM `vm` under `root`, by instance.
pub fn qemus_of(root: &Path, vm: &str) -> Vec<String> {
    processes_naming(&root.to_string_lossy())
        .into_iter()
        .filter(|(_, c)| c.starts_with("qemu-system"))
        .filter_map(|(_, c)| {
            let name = c.split("guest=").nth(1)?.split_whitespace().next()?;
            name.starts_with(&format!("{vm}-"))
                .then(|| name.to_string())
        })
        .collect()
}

pub fn cli(root: &Path, server: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_SERVER", server)
        .env("KEEL_DATA_DIR", root.join("cp"))
        .env("KEEL_CONFIG", "")
        .env_remove("KEEL_TOKEN")
        .output()
        .unwrap()
}

pub fn vm_json(root: &Path, server: &str, name: &str) -> Option<Value> {
    let out = cli(root, server, &["vm", "get", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice::<Value>(&out.stdout).unwrap()["vm"].clone())
}

pub fn skipped() -> bool {
    ["KEEL_SKIP_ETCD_TESTS", "KEEL_SKIP_QEMU_TESTS"]
        .iter()
        .any(|v| std::env::var(v).as_deref() == Ok("1"))
}

/// An etcd store spec with a namespace of its own, on the etcd of
/// `scripts/start-etcd` (`KEEL_ETCD_ENDPOINT`).
pub fn store_spec(test: &str) -> String {
    let endpoint =
        std::env::var("KEEL_ETCD_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:2379".into());
    let host = endpoint.trim_start_matches("http://").to_string();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "etcd://{host}/keel-test/{test}-{}-{nanos}",
        std::process::id()
    )
}

/// `--store STORE` and the flags its scheme needs: the one place the
/// process tests say how they reach etcd. The shared test etcd
/// (`scripts/start-etcd`) is plain, on loopback only, so `etcd://` gets
/// `--insecure-store`; `etcds://` gets the client certificate of the TLS
/// etcd (`scripts/start-etcd --tls`, [`etcd_tls_certs`]).
pub fn store_flags(store: &str) -> Vec<String> {
    let mut flags = vec!["--store".to_string(), store.to_string()];
    if store.starts_with("etcds://") {
        let certs = etcd_tls_certs();
        for (flag, file) in [
            ("--etcd-ca", "ca-cert.pem"),
            ("--etcd-cert", "keel-cert.pem"),
            ("--etcd-key", "keel-key.pem"),
        ] {
            flags.push(flag.to_string());
            flags.push(certs.join(file).to_string_lossy().into_owned());
        }
    } else if store.starts_with("etcd://") {
        flags.push("--insecure-store".to_string());
    }
    flags
}

/// Where `scripts/start-etcd --tls` keeps the certificates Keel's CA
/// issued for the TLS test etcd (`KEEL_ETCD_TLS_DIR`, default
/// target/etcd-tls-data), under `certs/`.
pub fn etcd_tls_certs() -> std::path::PathBuf {
    etcd_tls_dir().join("certs")
}

pub fn etcd_tls_dir() -> std::path::PathBuf {
    std::env::var_os("KEEL_ETCD_TLS_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/etcd-tls-data"),
        std::path::PathBuf::from,
    )
}

/// The command channel of `instance`'s guest on the agent with data dir
/// `agent_dir`, once the guest is ready. The socket dir is where the
/// instance's launch record says.
pub async fn guest_channel(agent_dir: &Path, instance: &str) -> keel_hv::guest::GuestChannel {
    use keel_hv::guest::GuestChannel;
    use std::time::Duration;
    let instance_dir = agent_dir.join("node/instances").join(instance);
    let spec: Value =
        serde_json::from_slice(&std::fs::read(instance_dir.join("spec.json")).unwrap()).unwrap();
    let sockets = std::path::PathBuf::from(spec["socket_dir"].as_str().unwrap());
    GuestChannel::wait_ready(&instance_dir.join("console.log"), Duration::from_secs(90))
        .await
        .unwrap();
    let mut ch = GuestChannel::connect(sockets.join("cmd.sock"))
        .await
        .unwrap();
    ch.sync(Duration::from_secs(30)).await.unwrap();
    ch
}

/// The test guest built by `scripts/build-test-guest`.
pub fn test_guest() -> std::path::PathBuf {
    keel_testkit::guest::required_dir()
}

/// A control plane (`keel serve`, node name `cp`) on `store` with data dir
/// `data_dir`, on an ephemeral loopback port (see [`serving_url`]), with
/// `extra` flags after.
pub fn spawn_control_plane(store: &str, data_dir: &str, extra: &[&str]) -> Keel {
    let args: Vec<String> = std::iter::once("serve".to_string())
        .chain(store_flags(store))
        .chain(
            [
                "--listen",
                "127.0.0.1:0",
                "--node",
                "cp",
                "--data-dir",
                data_dir,
            ]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
        )
        .collect();
    Keel::spawn_with(
        "control plane",
        Command::new(env!("CARGO_BIN_EXE_keel")).args(&args),
    )
}

/// A node agent `node` on `store` with data dir `data_dir`, with `extra`
/// flags after.
pub fn spawn_agent(store: &str, node: &str, data_dir: &str, extra: &[&str]) -> Keel {
    let args = agent_args(store, node, data_dir, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Keel::spawn(node, &args)
}

/// The command line of a node agent `node` on `store` with data dir
/// `data_dir`, with `extra` flags after.
pub fn agent_args(store: &str, node: &str, data_dir: &str, extra: &[&str]) -> Vec<String> {
    std::iter::once("agent".to_string())
        .chain(store_flags(store))
        .chain(
            ["--node", node, "--data-dir", data_dir]
                .iter()
                .chain(extra)
                .map(|s| s.to_string()),
        )
        .collect()
}

/// [`agent_args`] of an agent that runs its guests under TCG from
/// `guest_dir` on the disk dir `disks` its peers share.
pub fn shared_disk_agent_args(
    store: &str,
    node: &str,
    data_dir: &str,
    disks: &str,
    guest_dir: &str,
) -> Vec<String> {
    let extra = [
        "--disk-dir",
        disks,
        "--accel",
        "tcg",
        "--guest-dir",
        guest_dir,
    ];
    agent_args(store, node, data_dir, &extra)
}

/// Every process's log, for a failure message.
pub fn all_logs(cp: &Keel, agents: &[Keel]) -> String {
    std::iter::once(cp.log())
        .chain(agents.iter().map(Keel::log))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The API's URL, once the control plane's log says it serves (it
/// listens on port 0).
pub async fn serving_url(cp: &Keel) -> String {
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = cp.log.lock().unwrap().clone();
        if let Some(addr) = log.split("serving addr=").nth(1) {
            return format!("https://{}", addr.split_whitespace().next().unwrap());
        }
        assert!(Instant::now() < deadline, "no control plane:\n{}", cp.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (60 s at most) until `count` nodes are registered.
pub async fn wait_nodes(root: &Path, server: &str, count: usize, logs: impl Fn() -> String) {
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = cli(root, server, &["node", "list", "-o", "json"]);
        let nodes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if nodes["items"].as_array().is_some_and(|a| a.len() == count) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "agents did not register:\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls `keel vm get NAME` until `done` holds for the VM (its JSON) or
/// `within` has passed. An operation's CLI may return before every field
/// it does not wait for has settled (the target's first look after a
/// drain, say), so a test asserting such a field waits for it, bounded.
/// Fails saying `what` it waited for, with the VM as last seen.
pub async fn wait_vm(
    root: &Path,
    server: &str,
    name: &str,
    what: &str,
    within: std::time::Duration,
    done: impl Fn(&Value) -> bool,
    logs: impl Fn() -> String,
) -> Value {
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + within;
    loop {
        let vm = vm_json(root, server, name);
        if let Some(vm) = vm.as_ref().filter(|vm| done(vm)) {
            return vm.clone();
        }
        assert!(
            Instant::now() < deadline,
            "VM {name} did not {what} within {within:?}; last seen: {}\n{}",
            vm.map_or("no such VM".to_string(), |vm| vm.to_string()),
            logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (90 s at most) until VM `name` is Running; its (node, instance).
pub async fn wait_running(
    root: &Path,
    server: &str,
    name: &str,
    logs: impl Fn() -> String,
) -> (String, String) {
    let vm = wait_vm(
        root,
        server,
        name,
        "run",
        std::time::Duration::from_secs(90),
        |vm| vm["status"]["phase"] == "Running",
        logs,
    )
    .await;
    let inst = &vm["status"]["instance"];
    (
        inst["node"].as_str().unwrap().to_string(),
        inst["id"].as_str().unwrap().to_string(),
    )
}
