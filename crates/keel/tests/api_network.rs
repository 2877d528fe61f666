//! The NIC and cloud-init parts of the VM API, against a real in-process
//! server (sim driver): identities assigned once and kept, bad input
//! refused naming the field.

mod common;

use common::{instance, phase, TestServer};
use serde_json::{json, Value};

fn mac(v: &Value) -> String {
    v["vm"]["spec"]["network"]["mac"]
        .as_str()
        .expect("a MAC in the spec")
        .to_string()
}

#[test]
fn a_mac_is_assigned_at_create_and_kept_across_restarts_and_spec_replacement() {
    let server = TestServer::start();
    let created = server.create_vm(
        "web",
        json!({"cpus": 1, "memory_mib": 64, "run_policy": "Manual",
               "network": {"publish": [{"host_port": 8080, "guest_port": 80}]},
               "cloud_init": {"user_data": "#cloud-config\n"}}),
    );
    let m = mac(&created);
    let parsed: keel_api::MacAddr = m.parse().expect("a valid MAC");
    assert!(parsed.is_unicast());
    assert_eq!(m, parsed.to_string(), "stored canonical");
    let iid = created["vm"]["spec"]["cloud_init"]["instance_id"]
        .as_str()
        .expect("an instance-id")
        .to_string();
    let publish = &created["vm"]["spec"]["network"]["publish"][0];
    assert_eq!(publish["host_address"], "127.0.0.1", "loopback by default");
    assert_eq!(publish["protocol"], "tcp");

    // Two VMs do not share a MAC.
    let other = server.create_vm("db", json!({"cpus": 1, "memory_mib": 64}));
    assert_ne!(mac(&other), m);

    let running = server.wait_vm("web", "run", |v| phase(v) == "Running");
    let first = instance(&running).unwrap();
    let r = server.send("POST", "/api/v1/vms/web/restart", "");
    assert_eq!(r.status, 200, "{}", r.text);
    let restarted = server.wait_vm("web", "restart", |v| {
        phase(v) == "Running" && instance(v).is_some_and(|i| i != first)
    });
    assert_eq!(mac(&restarted), m, "the MAC survives a restart");

    // A replacement spec without a MAC or instance-id keeps both.
    let revision = restarted["revision"].as_u64().unwrap();
    let r = server.send(
        "PUT",
        "/api/v1/vms/web/spec",
        &json!({"revision": revision,
                "spec": {"cpus": 2, "memory_mib": 64, "run_policy": "Manual",
                         "cloud_init": {"ssh_authorized_keys": [
                             "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvQ4m8y8kJqkVv6Zl9m8oQb2F2k9eW4k2q0o1v2w3x4 me"]}}})
        .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let replaced = r.json();
    assert_eq!(mac(&replaced), m, "the MAC survives a spec replacement");
    assert_eq!(replaced["vm"]["spec"]["cloud_init"]["instance_id"], iid);

    // A MAC the user gives is taken as given (canonical form).
    let given = server.create_vm(
        "given",
        json!({"cpus": 1, "memory_mib": 64, "network": {"mac": "52:54:00:AA:BB:0C"}}),
    );
    assert_eq!(mac(&given), "52:54:00:aa:bb:0c");
}

#[test]
fn a_record_from_before_nics_keeps_a_mac_derived_from_its_name() {
    let server = TestServer::start();
    // As an older Keel stored it: no network section at all.
    server.put_raw(
        "/vms/old",
        &json!({"name": "old", "generation": 1,
                "spec": {"cpus": 1, "memory_mib": 64, "power": "Stopped"}}),
    );
    let v = server.wait_settled_stopped("old");
    assert_eq!(v["vm"]["spec"]["network"]["mode"], "user");
    let revision = v["revision"].as_u64().unwrap();
    let r = server.send(
        "PUT",
        "/api/v1/vms/old/spec",
        &json!({"revision": revision, "spec": {"cpus": 2, "memory_mib": 64, "power": "Stopped"}})
            .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        mac(&r.json()),
        keel_api::MacAddr::derived("old").to_string(),
        "the replacement stores the MAC the VM already had"
    );
}

#[test]
fn bad_network_and_cloud_init_input_is_refused_naming_the_field() {
    let server = TestServer::start();
    let before = server.snapshot();
    let fwd = |extra: Value| {
        let mut f = json!({"host_port": 2222, "guest_port": 22});
        f.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        f
    };
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"network": {"mac": "01:00:5e:00:00:01"}}),
            422,
            "spec.network.mac",
        ),
        (
            json!({"network": {"mac": "52:54:00:00:01"}}),
            422,
            "spec.network.mac",
        ),
        (
            json!({"network": {"publish": [fwd(json!({"host_port": 0}))]}}),
            422,
            "spec.network.publish[0].host_port",
        ),
        (
            json!({"network": {"publish": [fwd(json!({"host_port": 70000}))]}}),
            400,
            "spec.network.publish[0].host_port",
        ),
        (
            json!({"network": {"publish": [fwd(json!({"host_address": "::1"}))]}}),
            422,
            "spec.network.publish[0].host_address",
        ),
        (
            json!({"network": {"publish": [fwd(json!({})), fwd(json!({"guest_port": 23}))]}}),
            422,
            "spec.network.publish[1].host_port",
        ),
        (
            json!({"network": {"publish": [fwd(json!({"protocol": "sctp"}))]}}),
            400,
            "spec.network.publish[0].protocol",
        ),
        (
            json!({"network": {"mode": "bridge"}}),
            422,
            "spec.network.bridge",
        ),
        (
            json!({"network": {"mode": "bridge", "bridge": "br,0"}}),
            422,
            "spec.network.bridge",
        ),
        (
            json!({"network": {"mode": "bridge", "bridge": "br0", "publish": [fwd(json!({}))]}}),
            422,
            "spec.network.publish",
        ),
        (
            json!({"cloud_init": {"user_data": "x".repeat(64 * 1024 + 1)}}),
            422,
            "spec.cloud_init.user_data",
        ),
        (
            json!({"cloud_init": {"ssh_authorized_keys": ["-----BEGIN OPENSSH PRIVATE KEY-----"]}}),
            422,
            "spec.cloud_init.ssh_authorized_keys[0]",
        ),
        (json!({"cloud_init": {}}), 422, "spec.cloud_init"),
    ];
    for (extra, status, field) in cases {
        let mut spec = json!({"cpus": 1, "memory_mib": 64});
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let body = json!({"name": "bad", "spec": spec}).to_string();
        let r = server.send("POST", "/api/v1/vms", &body);
        let what = &body[..body.len().min(160)];
        assert_eq!(r.status, status, "{what}: {}", r.text);
        assert_eq!(r.json()["field"], field, "{what}: {}", r.text);
        assert_eq!(server.snapshot(), before, "{what} changed the store");
    }
}
