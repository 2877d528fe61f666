//! Placement rules through the API and CLI of a real in-process server
//! (one node, sim driver): node labels and a VM's node selector (required:
//! it waits with the reason until the node carries the label), a required
//! anti-affinity group on one node (the second member waits, saying
//! which member holds the node), and published host ports as the node's
//! resource (a second VM publishing the same port is refused, naming the
//! holder; nothing stored changes).

mod common;

use common::cli::{keel, ok};
use common::TestServer;
use serde_json::json;

fn message(v: &serde_json::Value) -> String {
    v["vm"]["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_node_selector_waits_for_its_label() {
    let server = TestServer::start();
    let spec = json!({"cpus": 1, "memory_mib": 64,
        "placement": {"node_selector": {"disk": "ssd"}}});
    server.create_vm("db", spec);
    let db = server.wait_vm("db", "say why it waits", |v| {
        message(v).contains("lacks label")
    });
    assert_eq!(common::phase(&db), "Pending");
    assert_eq!(
        message(&db),
        "no node may take VM db by its placement rules: test-node lacks label disk=ssd"
    );
    let out = ok(&keel(
        &server,
        &["node", "label", "test-node", "disk=ssd", "zone=a"],
    ));
    assert!(out.contains("labels disk=ssd,zone=a"), "{out}");
    server.wait_vm("db", "run once labelled", |v| common::phase(v) == "Running");
    let out = ok(&keel(&server, &["node", "info"]));
    assert!(out.contains("disk=ssd,zone=a"), "{out}");
    let out = ok(&keel(&server, &["node", "list"]));
    let (head, row) = out.split_once('\n').unwrap();
    assert!(head.ends_with("LABELS"), "{out}");
    assert!(row.trim_end().ends_with("disk=ssd,zone=a"), "{out}");
    let out = ok(&keel(&server, &["vm", "get", "db"]));
    assert!(out.contains("nodes labelled disk=ssd"), "{out}");
    let out = ok(&keel(&server, &["node", "label", "test-node", "zone-"]));
    assert!(out.contains("labels disk=ssd\n"), "{out}");

    // Bad labels are refused naming the field; the node keeps its own.
    let r = server.send(
        "POST",
        "/api/v1/nodes/test-node/labels",
        &json!({"set": {"-bad": "x"}}).to_string(),
    );
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.json()["field"], "set.-bad", "{}", r.text);
    let r = server.send(
        "POST",
        "/api/v1/nodes/test-node/labels",
        &json!({"sets": {}}).to_string(),
    );
    assert_eq!(r.status, 400, "{}", r.text);
    let node = server.get("/api/v1/nodes/test-node").json();
    assert_eq!(node["node"]["labels"], json!({"disk": "ssd"}));
    let out = keel(&server, &["node", "label", "test-node", "zone"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("KEY=VALUE"),
        "{out:?}"
    );
    // An unknown placement field is the client's mistake.
    let r = server.send(
        "POST",
        "/api/v1/vms",
        &json!({"name": "x", "spec": {"cpus": 1, "memory_mib": 64,
            "placement": {"node_selectors": {}}}})
        .to_string(),
    );
    assert_eq!(r.status, 400, "{}", r.text);
}

#[test]
fn a_required_group_on_one_node_holds_one_member() {
    let server = TestServer::start();
    let out = ok(&keel(
        &server,
        &[
            "vm",
            "create",
            "w1",
            "--cpus",
            "1",
            "--memory",
            "64",
            "--readiness",
            "none",
            "--anti-affinity",
            "web",
        ],
    ));
    assert!(out.contains("w1"), "{out}");
    server.wait_vm("w1", "run", |v| common::phase(v) == "Running");
    server.create_vm(
        "w2",
        json!({"cpus": 1, "memory_mib": 64, "placement": {"anti_affinity": {"group": "web"}}}),
    );
    let w2 = server.wait_vm("w2", "say why it waits", |v| {
        message(v).contains("anti-affinity")
    });
    assert_eq!(common::phase(&w2), "Pending");
    assert_eq!(
        message(&w2),
        "no node may take VM w2 by its placement rules: test-node has VM w1 of anti-affinity group web"
    );
    // Preferred members share the node when there is no other way.
    server.create_vm(
        "p1",
        json!({"cpus": 1, "memory_mib": 64, "placement": {"anti_affinity": {"group": "cache", "preferred": true}}}),
    );
    server.create_vm(
        "p2",
        json!({"cpus": 1, "memory_mib": 64, "placement": {"anti_affinity": {"group": "cache", "preferred": true}}}),
    );
    server.wait_vm("p1", "run", |v| common::phase(v) == "Running");
    server.wait_vm("p2", "run", |v| common::phase(v) == "Running");
    // Once w1 stops, w2 may have the node.
    ok(&keel(&server, &["vm", "stop", "w1", "--wait"]));
    server.wait_vm("w2", "run once w1 is off", |v| {
        common::phase(v) == "Running"
    });
}

#[test]
fn a_published_port_has_one_holder_on_one_host() {
    let server = TestServer::start();
    server.create_vm(
        "a1",
        json!({"cpus": 1, "memory_mib": 64, "network": {"publish": [{"host_port": 2400, "guest_port": 22}]}}),
    );
    let r = server.send(
        "POST",
        "/api/v1/vms",
        &json!({"name": "a2", "spec": {"cpus": 1, "memory_mib": 64, "network": {"publish": [
            {"host_port": 8080, "guest_port": 80},
            {"host_address": "0.0.0.0", "host_port": 2400, "guest_port": 22}
        ]}}})
        .to_string(),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    let err = r.json();
    assert_eq!(err["field"], "spec.network.publish[1]", "{err}");
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("host port 127.0.0.1:2400/tcp is published by VM a1 on this host"),
        "{err}"
    );
    assert_eq!(server.get("/api/v1/vms/a2").status, 404);
    // Another protocol, or another port, is another listener.
    server.create_vm(
        "a3",
        json!({"cpus": 1, "memory_mib": 64, "network": {"publish": [{"host_port": 2400, "guest_port": 53, "protocol": "udp"}]}}),
    );
    // A spec change that would take a1's port is refused the same way,
    // and a3 keeps the spec it had.
    let a3 = server.get("/api/v1/vms/a3").json();
    let mut spec = a3["vm"]["spec"].clone();
    spec["network"]["publish"][0]["protocol"] = json!("tcp");
    let r = server.send(
        "PUT",
        "/api/v1/vms/a3/spec",
        &json!({"spec": spec, "revision": a3["revision"]}).to_string(),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json()["field"], "spec.network.publish[0]", "{}", r.text);
    let after = server.get("/api/v1/vms/a3").json();
    assert_eq!(
        after["vm"]["spec"]["network"]["publish"][0]["protocol"],
        "udp"
    );
}

#[test]
fn a_return_needs_a_node_that_takes_vms() {
    let server = TestServer::start();
    ok(&keel(&server, &["node", "cordon", "test-node"]));
    let r = server.send(
        "POST",
        "/api/v1/nodes/test-node/uncordon",
        &json!({"return": true}).to_string(),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json()["field"], "return", "{}", r.text);
    let node = server.get("/api/v1/nodes/test-node").json();
    assert_eq!(node["node"]["cordoned"], true, "nothing changed: {node}");
    let out = ok(&keel(
        &server,
        &["node", "uncordon", "test-node", "--operator", "--return"],
    ));
    assert!(out.contains("no VM to migrate back"), "{out}");
}
