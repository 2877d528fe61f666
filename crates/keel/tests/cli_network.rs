//! `keel vm create` network and cloud-init flags, and what `keel vm get`
//! shows of them, with the built binary against an in-process server.

mod common;

use common::cli::{fails, keel, ok};

use common::TestServer;

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvQ4m8y8kJqkVv6Zl9m8oQb2F2k9eW4k2q0o1v2w3x4 me@host";

#[test]
fn create_with_forwards_keys_and_user_data_then_get_shows_them() {
    let server = TestServer::start();
    let files = tempfile::tempdir().unwrap();
    let key = files.path().join("id.pub");
    std::fs::write(&key, format!("{KEY}\n")).unwrap();
    let user = files.path().join("user-data");
    std::fs::write(&user, "#cloud-config\npackages: [htop]\n").unwrap();
    let (key, user) = (key.to_str().unwrap(), user.to_str().unwrap());

    ok(&keel(
        &server,
        &[
            "vm",
            "create",
            "web",
            "--stopped",
            "--publish",
            "2222:22",
            "-p",
            "0.0.0.0:5353:53/udp",
            "--ssh-key",
            key,
            "--user-data",
            user,
        ],
    ));
    let got = ok(&keel(&server, &["vm", "get", "web"]));
    let mac = server.vm("web").unwrap()["vm"]["spec"]["network"]["mac"]
        .as_str()
        .unwrap()
        .to_string();
    for want in [
        format!("mac: {mac}").as_str(),
        "network: user",
        "127.0.0.1:2222 -> 22/tcp, 0.0.0.0:5353 -> 53/udp",
        "1 ssh key(s), user-data 31 bytes, instance-id i-",
    ] {
        assert!(
            got.lines().any(|l| l
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .contains(want)),
            "{want:?} not in:\n{got}"
        );
    }

    ok(&keel(
        &server,
        &[
            "vm",
            "create",
            "lan",
            "--stopped",
            "--network",
            "bridge=br0",
            "--mac",
            "52:54:00:00:00:aa",
        ],
    ));
    let got = ok(&keel(&server, &["vm", "get", "lan"]));
    assert!(
        got.contains("bridge br0") && got.contains("52:54:00:00:00:aa"),
        "{got}"
    );
}

#[test]
fn bad_flags_are_refused_naming_them() {
    let server = TestServer::start();
    let err = fails(&keel(
        &server,
        &["vm", "create", "a", "--publish", "2222:0"],
    ));
    assert!(err.contains("--publish"), "{err}");
    let err = fails(&keel(&server, &["vm", "create", "a", "--network", "tap"]));
    assert!(err.contains("--network"), "{err}");
    let err = fails(&keel(
        &server,
        &["vm", "create", "a", "--mac", "01:00:5e:00:00:01"],
    ));
    assert!(err.contains("spec.network.mac"), "{err}");
    let err = fails(&keel(
        &server,
        &["vm", "create", "a", "-p", "22:22", "-p", "22:23"],
    ));
    assert!(err.contains("spec.network.publish[1].host_port"), "{err}");
    let err = fails(&keel(
        &server,
        &["vm", "create", "a", "--ssh-key", "/nonexistent/key.pub"],
    ));
    assert!(err.contains("--ssh-key"), "{err}");
    assert!(server.vm("a").is_none());
}
