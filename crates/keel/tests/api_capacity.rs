//! Node capacity through the API and CLI of a real in-process server (sim
//! driver reporting a 1-CPU, 2 GiB host: 4 vCPUs and 1 GiB offered): the
//! node's record and `keel node list` show what is offered and
//! allocated, and a VM that does not fit stays Pending with the reason.

mod common;

use common::cli::{keel, ok};
use common::TestServer;
use serde_json::json;

#[test]
fn nodes_show_capacity_and_a_vm_that_does_not_fit_says_why() {
    let server = TestServer::start_with(|cfg| {
        cfg.sim.host = Some(keel_api::HostResources {
            cpus: 1,
            memory_mib: 2_048,
        });
    });
    server.create_vm("a", json!({"cpus": 1, "memory_mib": 768}));
    server.wait_vm("a", "run", |v| common::phase(v) == "Running");
    let nodes = server.get("/api/v1/nodes").json();
    let node = &nodes["items"][0];
    assert_eq!(node["node"]["status"]["capacity"]["cpus"], 4, "{node}");
    assert_eq!(node["node"]["status"]["capacity"]["memory_mib"], 1_024);
    assert_eq!(node["allocated"], json!({"cpus": 1, "memory_mib": 768}));
    let out = ok(&keel(&server, &["node", "list"]));
    assert!(
        out.contains("1/4") && out.contains("768 MiB/1 GiB"),
        "{out}"
    );
    let out = ok(&keel(&server, &["node", "info"]));
    assert!(out.contains("1 CPU, 2 GiB"), "the host: {out}");

    server.create_vm("b", json!({"cpus": 1, "memory_mib": 512}));
    let b = server.wait_vm("b", "say why it waits", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no node has"))
    });
    assert_eq!(common::phase(&b), "Pending");
    assert_eq!(
        b["vm"]["status"]["message"],
        "no node has 1 CPU and 512 MiB free for VM b (free: test-node 3 CPU, 256 MiB)"
    );
}
