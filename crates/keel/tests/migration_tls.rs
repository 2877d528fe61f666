//! `keel cluster init-ca` / `issue-cert` and the agent's migration flags,
//! through the built binary.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_CONFIG", "")
        .env_remove("KEEL_MIGRATION_LISTEN")
        .output()
        .expect("run keel")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_ca_issues_private_node_credentials_and_agents_need_them_for_tcp() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = tmp.path().join("ca");
    let ca = ca.to_str().unwrap();
    let node_dir = tmp.path().join("node-a");
    let data_dir = node_dir.to_str().unwrap();

    ok(&keel(&["cluster", "init-ca", "--ca-dir", ca]));
    // Never replaced: every certificate it issued would stop working.
    let err = fails(&keel(&["cluster", "init-ca", "--ca-dir", ca]));
    assert!(err.contains("already exists"), "{err}");

    let out = ok(&keel(&[
        "cluster",
        "issue-cert",
        "node-a",
        "--ca-dir",
        ca,
        "--data-dir",
        data_dir,
    ]));
    assert!(out.contains("migration-tls"), "{out}");
    let creds = node_dir.join("migration-tls");
    for (file, mode) in [
        ("ca-cert.pem", 0o644),
        ("server-cert.pem", 0o644),
        ("client-cert.pem", 0o644),
        ("server-key.pem", 0o600),
        ("client-key.pem", 0o600),
    ] {
        let meta = std::fs::metadata(creds.join(file)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, mode, "{file}");
    }
    assert!(!creds.join("ca-key.pem").exists());
    let err = fails(&keel(&[
        "cluster",
        "issue-cert",
        "Bad_Name",
        "--ca-dir",
        ca,
        "--data-dir",
        data_dir,
    ]));
    assert!(err.contains("node"), "{err}");

    // A TCP listen address without credentials or --insecure-migration is
    // refused before the agent does anything; a malformed one names the flag.
    let empty = tmp.path().join("empty");
    let err = fails(&keel(&[
        "agent",
        "--store",
        "etcd://127.0.0.1:2379",
        "--insecure-store",
        "--hypervisor",
        "sim",
        "--node",
        "n1",
        "--data-dir",
        empty.to_str().unwrap(),
        "--migration-listen",
        "127.0.0.1:47400-47409",
    ]));
    assert!(err.contains("--insecure-migration"), "{err}");
    let err = fails(&keel(&[
        "agent",
        "--store",
        "etcd://127.0.0.1:2379",
        "--insecure-store",
        "--migration-listen",
        "127.0.0.1:9-2",
    ]));
    assert!(err.contains("--migration-listen"), "{err}");
}

/// `revoke-cert` puts a node's certificates on the CA's CRL and copies it
/// into the data dirs given; `--valid-days` is bounded and a later
/// certificate of the node is not revoked.
#[test]
fn revoke_cert_writes_the_crl_where_nodes_read_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = tmp.path().join("ca");
    let ca = ca.to_str().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    ok(&keel(&["cluster", "init-ca", "--ca-dir", ca]));
    for (node, dir) in [("node-a", &a), ("node-b", &b)] {
        let out = ok(&keel(&[
            "cluster",
            "issue-cert",
            node,
            "--ca-dir",
            ca,
            "--data-dir",
            dir.to_str().unwrap(),
            "--valid-days",
            "30",
        ]));
        assert!(out.contains("valid 30 days"), "{out}");
    }
    // The CA's record of what it issued: both certificates, 30 days each.
    let issued: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("ca").join("issued.json")).unwrap(),
    )
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let certs = issued["certs"].as_array().unwrap();
    assert_eq!(certs.len(), 2, "{issued}");
    for cert in certs {
        let left = cert["not_after"].as_i64().unwrap() - now;
        assert!((29 * 86_400..=31 * 86_400).contains(&left), "{cert}");
    }
    let crl = |dir: &std::path::Path| {
        std::fs::read_to_string(dir.join("migration-tls").join("ca-crl.pem")).unwrap()
    };
    let before = crl(&b);
    for days in ["0", "3651", "x"] {
        let err = fails(&keel(&[
            "cluster",
            "issue-cert",
            "node-a",
            "--ca-dir",
            ca,
            "--data-dir",
            a.to_str().unwrap(),
            "--valid-days",
            days,
        ]));
        assert!(err.contains("--valid-days"), "{days}: {err}");
    }

    let out = ok(&keel(&[
        "cluster",
        "revoke-cert",
        "node-a",
        "--ca-dir",
        ca,
        "--data-dir",
        b.to_str().unwrap(),
    ]));
    assert!(
        out.contains("revoked 1 certificate(s) of node node-a"),
        "{out}"
    );
    let after = crl(&b);
    assert_ne!(after, before, "node b did not get the new CRL");
    assert_eq!(
        after,
        std::fs::read_to_string(tmp.path().join("ca").join("ca-crl.pem")).unwrap()
    );
    let err = fails(&keel(&["cluster", "revoke-cert", "node-a", "--ca-dir", ca]));
    assert!(err.contains("revoked already"), "{err}");
    let err = fails(&keel(&["cluster", "revoke-cert", "node-c", "--ca-dir", ca]));
    assert!(err.contains("no certificate of node node-c"), "{err}");
}
