//! Keel on an etcd that requires TLS and client certificates
//! (`scripts/start-etcd --tls`, certificates from Keel's own cluster CA):
//! the store works over TLS with the client certificate, etcd refuses a
//! client without one or with one of another CA (and Keel refuses an etcd
//! whose certificate its CA did not sign), `keel serve --store etcds://`
//! serves a VM, and plain `etcd://` is refused without `--insecure-store`.
//!
//! The TLS etcd listens on `KEEL_ETCD_TLS_ENDPOINT` (default
//! `https://127.0.0.1:2389`); this test starts it (idempotent) unless
//! `KEEL_SKIP_ETCD_TESTS=1`.

mod procs;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keel_store::conformance::{self, Fixture};
use keel_store::etcd::{EtcdOptions, EtcdStore, EtcdTls};
use keel_store::{Precondition, Store, StoreError};
use procs::{
    cli, etcd_tls_certs, etcd_tls_dir, serving_url, spawn_agent, spawn_control_plane, wait_running,
};

fn endpoint() -> String {
    std::env::var("KEEL_ETCD_TLS_ENDPOINT").unwrap_or_else(|_| "https://127.0.0.1:2389".into())
}

fn skipped() -> bool {
    std::env::var("KEEL_SKIP_ETCD_TESTS").as_deref() == Ok("1")
}

/// Starts the TLS etcd of `scripts/start-etcd --tls` (once per binary;
/// the script does nothing if it already runs).
fn tls_etcd() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/start-etcd");
        let out = Command::new(script)
            .arg("--tls")
            .arg(etcd_tls_dir())
            .env("KEEL_BIN", env!("CARGO_BIN_EXE_keel"))
            .env("KEEL_CONFIG", "")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/start-etcd --tls failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(etcd_tls_certs().join(name)).unwrap()
}

fn keel_tls() -> EtcdTls {
    EtcdTls {
        ca_pem: read("ca-cert.pem"),
        identity: Some((read("keel-cert.pem"), read("keel-key.pem"))),
    }
}

fn namespace(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("/keel-test/tls-{what}-{}-{nanos}", std::process::id())
}

async fn connect(what: &str, tls: EtcdTls) -> Result<EtcdStore, StoreError> {
    let options = EtcdOptions {
        request_timeout: Duration::from_secs(3),
        tls: Some(tls),
        ..EtcdOptions::default()
    };
    EtcdStore::connect_with(&[endpoint()], &namespace(what), options).await
}

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_CONFIG", "")
        .env_remove("KEEL_STORE")
        .env_remove("KEEL_DATA_DIR")
        .output()
        .unwrap()
}

/// A CA of its own (not the TLS etcd's) with a client certificate: what
/// an attacker who reaches etcd but holds no key of the cluster CA has.
fn foreign_ca(dir: &Path) -> EtcdTls {
    let ca = dir.join("other-ca");
    let out = dir.join("other-certs");
    let run = |args: &[&str]| {
        let o = keel(args);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run(&["cluster", "init-ca", "--ca-dir", ca.to_str().unwrap()]);
    run(&[
        "cluster",
        "issue-cert",
        "intruder",
        "--etcd-client",
        "--ca-dir",
        ca.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    EtcdTls {
        ca_pem: std::fs::read(out.join("ca-cert.pem")).unwrap(),
        identity: Some((
            std::fs::read(out.join("intruder-cert.pem")).unwrap(),
            std::fs::read(out.join("intruder-key.pem")).unwrap(),
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_works_over_tls_with_a_client_certificate() {
    if skipped() {
        return;
    }
    tls_etcd();
    let started = Instant::now();
    let store = connect("ops", keel_tls()).await.expect("connect over TLS");
    let rev = store
        .put("/vms/a", b"1".to_vec(), Precondition::Absent)
        .await
        .unwrap();
    let got = store.get("/vms/a").await.unwrap().unwrap();
    assert_eq!((got.value.as_slice(), got.mod_revision), (&b"1"[..], rev));

    // A few of the shared conformance checks, each on a namespace of its
    // own: transactions, watches and leases over the TLS channel.
    let fixture = |store: EtcdStore| Fixture::real_time(Arc::new(store), 2_000);
    conformance::get_put_roundtrip(fixture(connect("roundtrip", keel_tls()).await.unwrap())).await;
    conformance::put_stale_revision_conflicts(fixture(connect("cas", keel_tls()).await.unwrap()))
        .await;
    conformance::watch_filters_prefix(fixture(connect("watch", keel_tls()).await.unwrap())).await;
    conformance::lease_revoke_deletes_keys(fixture(connect("lease", keel_tls()).await.unwrap()))
        .await;
    eprintln!("store over TLS: {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_refuses_a_client_without_a_certificate_or_from_another_ca() {
    if skipped() {
        return;
    }
    tls_etcd();
    let dir = tempfile::tempdir().unwrap();
    let foreign = foreign_ca(dir.path());
    let no_certificate = EtcdTls {
        identity: None,
        ..keel_tls()
    };
    let other_ca_client = EtcdTls {
        identity: foreign.identity.clone(),
        ..keel_tls()
    };
    // Trusting only the other CA: etcd's certificate must not pass.
    let trusts_other_ca = EtcdTls {
        ca_pem: foreign.ca_pem.clone(),
        ..keel_tls()
    };
    for (what, tls, says) in [
        ("no client certificate", no_certificate, "presents none"),
        (
            "a client certificate of another CA",
            other_ca_client,
            "refused this client's certificate",
        ),
        (
            "a server certificate of a CA we do not trust",
            trusts_other_ca,
            "invalid peer certificate",
        ),
    ] {
        let began = Instant::now();
        let err = connect("refused", tls)
            .await
            .expect_err(&format!("{what}: connected"));
        let StoreError::Unavailable { key, reason } = &err else {
            panic!("{what}: expected Unavailable, got {err:?}");
        };
        assert!(
            key.contains("127.0.0.1:2389") || key.contains(&endpoint()),
            "{what}: {key}"
        );
        // Bounded: a refused handshake fails, it does not hang.
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{what}: took {:?}",
            began.elapsed()
        );
        eprintln!("{what}: {reason}");
        assert!(reason.contains(says), "{what}: {reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_serve_on_etcds_serves_a_vm() {
    if skipped() {
        return;
    }
    tls_etcd();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let host = endpoint().trim_start_matches("https://").to_string();
    let store = format!("etcds://{host}{}", namespace("serve"));
    let cp = spawn_control_plane(
        &store,
        root.join("cp").to_str().unwrap(),
        &["--hypervisor", "sim"],
    );
    let server = serving_url(&cp).await;
    let out = cli(&root, &server, &["vm", "create", "web", "--stopped"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cp.log()
    );
    let out = cli(&root, &server, &["vm", "get", "web", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The VM is in etcd, read back by another TLS client.
    let ns = store.split_once(&host).unwrap().1;
    let options = EtcdOptions {
        tls: Some(keel_tls()),
        ..EtcdOptions::default()
    };
    let direct = EtcdStore::connect_with(&[endpoint()], ns, options)
        .await
        .unwrap();
    let (vms, _) = direct.list("/vms/").await.unwrap();
    assert!(
        vms.iter().any(|e| e.key.ends_with("/web")),
        "no VM web in etcd: {:?}",
        vms.iter().map(|e| &e.key).collect::<Vec<_>>()
    );
    assert!(
        !cp.log().contains("--insecure-store"),
        "warned about a plain store on etcds://:\n{}",
        cp.log()
    );
    // A node agent on the same etcds:// registers and runs the VM the
    // control plane places on it: every process of the cluster talks to
    // an etcd that requires client certificates.
    let agent = spawn_agent(
        &store,
        "n1",
        root.join("n1").to_str().unwrap(),
        &["--hypervisor", "sim"],
    );
    let logs = || format!("{}\n{}", cp.log(), agent.log());
    let out = cli(&root, &server, &["vm", "start", "web"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs()
    );
    let (node, _) = wait_running(&root, &server, "web", logs).await;
    assert_eq!(node, "n1", "{}", logs());
    assert!(!agent.log().contains("--insecure-store"), "{}", agent.log());
}

#[test]
fn plain_etcd_needs_insecure_store_and_etcds_needs_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let stderr = |o: std::process::Output| {
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // Refused before anything connects: port 1 is no etcd.
    for command in ["serve", "agent"] {
        let err = stderr(keel(&[
            command,
            "--store",
            "etcd://127.0.0.1:1",
            "--hypervisor",
            "sim",
            "--data-dir",
            data,
        ]));
        // The refusal itself, not the start-up warning that names the
        // flag too.
        assert!(
            err.contains("or pass --insecure-store") && !err.contains("connecting to the store"),
            "{command}: {err}"
        );
    }
    let certs = etcd_tls_certs();
    let ca = certs.join("ca-cert.pem");
    let cert = certs.join("keel-cert.pem");
    let err = stderr(keel(&[
        "agent",
        "--store",
        "etcds://127.0.0.1:1",
        "--hypervisor",
        "sim",
        "--data-dir",
        data,
        "--etcd-ca",
        ca.to_str().unwrap(),
        "--etcd-cert",
        cert.to_str().unwrap(),
    ]));
    assert!(err.contains("--etcd-key"), "{err}");
    let err = stderr(keel(&[
        "serve",
        "--store",
        "etcds://127.0.0.1:1",
        "--hypervisor",
        "sim",
        "--data-dir",
        data,
        "--etcd-ca",
        "/nonexistent/ca.pem",
        "--etcd-cert",
        cert.to_str().unwrap(),
        "--etcd-key",
        cert.to_str().unwrap(),
    ]));
    assert!(
        err.contains("--etcd-ca") && err.contains("/nonexistent/ca.pem"),
        "{err}"
    );
}

#[test]
fn a_plain_store_is_warned_about_at_start() {
    if skipped() {
        return;
    }
    // The shared plain test etcd: accepted with --insecure-store, and
    // the start says what that means.
    let dir = tempfile::tempdir().unwrap();
    let store = procs::store_spec("etcd-tls-warn");
    let cp = spawn_control_plane(
        &store,
        dir.path().join("cp").to_str().unwrap(),
        &["--hypervisor", "sim"],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cp.log().contains("serving") {
        assert!(Instant::now() < deadline, "no start:\n{}", cp.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = cp.log();
    assert!(
        log.contains("no TLS and no authentication") && log.contains("--insecure-store"),
        "{log}"
    );
}
