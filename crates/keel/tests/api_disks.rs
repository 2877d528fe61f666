//! `keel vm disk add|remove|resize` through the API of a real in-process
//! server (sim driver): each change is a compare-and-swap of the spec, and
//! each refusal names its field and changes nothing.

mod common;

use common::cli::{fails, keel, ok};
use common::TestServer;
use serde_json::{json, Value};

fn disks(server: &TestServer, vm: &str) -> Vec<(String, u64)> {
    let v = server.vm(vm).expect("the VM");
    v["vm"]["spec"]["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["name"].as_str().unwrap().to_string(),
                d["size_mib"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn refused(r: &common::Resp, status: u16, field: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    let body: Value = r.json();
    assert_eq!(body["field"], field, "{}", r.text);
}

#[test]
fn disks_are_added_grown_and_removed_and_refusals_name_their_field() {
    let server = TestServer::start();
    // Boots through firmware from its first disk: `root` is the boot disk.
    server.create_vm(
        "d",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped",
               "boot": {"firmware": "bios"},
               "disks": [{"name": "root", "size_mib": 64}]}),
    );
    server.wait_settled_stopped("d");

    let r = server.send(
        "POST",
        "/api/v1/vms/d/disks",
        r#"{"name": "data", "size_mib": 32}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let revision = r.json()["revision"].as_u64().unwrap();
    assert_eq!(
        disks(&server, "d"),
        [("root".into(), 64), ("data".into(), 32)]
    );

    // A stale revision is a conflict, not a lost update.
    let stale = format!(r#"{{"size_mib": 48, "revision": {}}}"#, revision - 1);
    let r = server.send("POST", "/api/v1/vms/d/disks/data/resize", &stale);
    refused(&r, 409, "revision");

    let before = disks(&server, "d");
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/d/disks",
            r#"{"name": "data", "size_mib": 8}"#,
        ),
        409,
        "disk",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/d/disks/data/resize",
            r#"{"size_mib": 16}"#,
        ),
        422,
        "size",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/d/disks/nope/resize",
            r#"{"size_mib": 64}"#,
        ),
        404,
        "disk",
    );
    refused(
        &server.send("DELETE", "/api/v1/vms/d/disks/root", ""),
        409,
        "disk",
    );
    refused(
        &server.send("DELETE", "/api/v1/vms/d/disks/nope", ""),
        404,
        "disk",
    );
    assert_eq!(disks(&server, "d"), before, "refusals change nothing");

    let r = server.send(
        "POST",
        "/api/v1/vms/d/disks/data/resize",
        r#"{"size_mib": 48}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        disks(&server, "d"),
        [("root".into(), 64), ("data".into(), 48)]
    );

    let r = server.send("DELETE", "/api/v1/vms/d/disks/data", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(disks(&server, "d"), [("root".into(), 64)]);
}

/// The CLI: `keel vm disk add|resize|remove`, sizes with units, and the
/// server's refusal (with its field) as a failed command.
#[test]
fn the_cli_adds_grows_and_removes_a_disk() {
    let server = TestServer::start();
    server.create_vm(
        "c",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    let out = ok(&keel(
        &server,
        &["vm", "disk", "add", "c", "data", "--size", "1G"],
    ));
    assert!(out.contains("disk data (1024 MiB) added"), "{out}");
    let err = fails(&keel(
        &server,
        &["vm", "disk", "resize", "c", "data", "--size", "512"],
    ));
    assert!(err.contains("size"), "{err}");
    ok(&keel(
        &server,
        &["vm", "disk", "resize", "c", "data", "--size", "2G"],
    ));
    assert_eq!(disks(&server, "c"), [("data".into(), 2048)]);
    let out = ok(&keel(&server, &["vm", "disk", "remove", "c", "data"]));
    assert!(out.contains("its file stays"), "{out}");
    assert!(disks(&server, "c").is_empty());
    let err = fails(&keel(&server, &["vm", "disk", "remove", "c", "data"]));
    assert!(err.contains("no disk data"), "{err}");
}
