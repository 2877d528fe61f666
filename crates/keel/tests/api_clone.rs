//! `keel vm clone` through the API of a real in-process server (sim
//! driver): the CLI takes a snapshot first, the clone starts on copies of
//! the source's disks with its own MAC; each refusal names its field and
//! stores nothing.

mod common;

use common::cli::{fails, keel, ok};
use common::TestServer;
use serde_json::{json, Value};

fn refused(r: &common::Resp, status: u16, field: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    let body: Value = r.json();
    assert_eq!(body["field"], field, "{}", r.text);
}

#[test]
fn a_clone_is_made_from_a_snapshot_and_refusals_name_their_field() {
    let server = TestServer::start();
    server.create_vm(
        "src",
        json!({"cpus": 1, "memory_mib": 64,
               "disks": [{"name": "root", "size_mib": 64}]}),
    );
    server.wait_vm("src", "run", |v| common::phase(v) == "Running");

    // No snapshot named: the CLI takes clone-copy, then clones from it.
    let out = ok(&keel(&server, &["vm", "clone", "src", "copy", "--start"]));
    assert!(
        out.contains("cloned from src at snapshot clone-copy"),
        "{out}"
    );
    let copy = server.wait_vm("copy", "run", |v| common::phase(v) == "Running");
    let src = server.vm("src").unwrap();
    assert_ne!(
        copy["vm"]["spec"]["network"]["mac"],
        src["vm"]["spec"]["network"]["mac"]
    );
    assert_ne!(copy["vm"]["uid"], src["vm"]["uid"]);
    assert_eq!(copy["vm"]["status"]["clone_from"]["vm"], "src");
    assert_eq!(copy["vm"]["status"]["clone_from"]["snapshot"], "clone-copy");
    assert_eq!(copy["vm"]["status"]["clone_from"]["disks"], json!(["root"]));

    let before = server.settled_state();
    // To a name taken, from a snapshot not there or not a name, or with
    // a field the API does not know: refused, nothing stored.
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "copy", "snapshot": "clone-copy"}"#,
        ),
        409,
        "name",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "other", "snapshot": "nope"}"#,
        ),
        404,
        "snapshot",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "Bad Name", "snapshot": "clone-copy"}"#,
        ),
        422,
        "name",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/ghost/clone",
            r#"{"name": "other", "snapshot": "clone-copy"}"#,
        ),
        404,
        "name",
    );
    let r = server.send(
        "POST",
        "/api/v1/vms/src/clone",
        r#"{"name": "other", "snapshot": "clone-copy", "linked": true}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("linked"), "{}", r.text);
    let err = fails(&keel(
        &server,
        &["vm", "clone", "src", "copy", "--snapshot", "clone-copy"],
    ));
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(server.settled_state(), before, "nothing stored");

    // A clone stays its own VM: a clone of the clone, stopped.
    let out = ok(&keel(&server, &["vm", "clone", "copy", "copy2"]));
    assert!(out.contains("stopped"), "{out}");
    let copy2 = server.wait_settled_stopped("copy2");
    assert_eq!(copy2["vm"]["status"]["clone_from"]["vm"], "copy");
}
