//! Snapshots, restores, node cordon/drain/uncordon and the migration list
//! over HTTP, against a real in-process server with the sim hypervisor.

mod common;

use std::time::Duration;

use common::{instance, phase, TestServer};
use serde_json::{json, Value};

fn vm_field<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(&v["vm"], |v, k| &v[*k])
}

/// Replaces the VM's spec with `cpus` changed, retrying while the
/// controller's own writes make the read revision stale.
fn set_cpus(server: &TestServer, name: &str, cpus: u32) {
    for _ in 0..50 {
        let got = server.vm(name).unwrap();
        let mut spec = got["vm"]["spec"].clone();
        spec["cpus"] = json!(cpus);
        let etag = format!("\"{}\"", got["revision"]);
        let r = server.request(
            "PUT",
            &format!("/api/v1/vms/{name}/spec"),
            Some(&server.token),
            Some(json!({ "spec": spec }).to_string().as_bytes()),
            &[("If-Match", &etag)],
        );
        match r.status {
            200 => return,
            409 => std::thread::sleep(Duration::from_millis(20)),
            s => panic!("PUT spec of {name}: {s} {}", r.text),
        }
    }
    panic!("could not replace the spec of {name}");
}

fn snapshot_ready(server: &TestServer, vm: &str, name: &str) -> Value {
    let r = server.send(
        "POST",
        &format!("/api/v1/vms/{vm}/snapshots"),
        &json!({ "name": name }).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(
        r.header("location").unwrap(),
        format!("/api/v1/vms/{vm}/snapshots/{name}")
    );
    let created = r.json();
    assert_eq!(created["snapshot"]["status"]["phase"], "Pending");
    server.wait_snapshot(vm, name, "become Ready", |s| {
        s["snapshot"]["status"]["phase"] == "Ready"
    })
}

/// Restored VM: the request done, the intent fulfilled, in `power`.
fn restored(v: &Value, power: &str) -> bool {
    let vm = &v["vm"];
    vm.get("restore").is_none()
        && vm.get("power_intent").is_none()
        && vm["spec"]["power"] == power
        && match power {
            "Running" => phase(v) == "Running" && instance(v).is_some(),
            _ => phase(v) == "Stopped" && instance(v).is_none(),
        }
}

/// The snapshot's spec says the opposite power state each time, so only
/// the recorded intent can bring each VM back to where it was.
#[test]
fn restore_round_trip_keeps_the_power_state() {
    let server = TestServer::start();
    let disks = json!([{"name": "data", "size_mib": 64}]);
    // `up`: snapshot taken offline (its spec says Stopped), then started.
    server.create_vm(
        "up",
        json!({"cpus": 1, "memory_mib": 64, "disks": disks, "power": "Stopped"}),
    );
    // `down`: snapshot taken live (its spec says Running), then stopped.
    server.create_vm("down", json!({"cpus": 1, "memory_mib": 64, "disks": disks}));
    server.wait_settled_stopped("up");
    server.wait_vm("down", "run", |v| phase(v) == "Running");

    let up_snap = snapshot_ready(&server, "up", "s1");
    assert_eq!(up_snap["snapshot"]["status"]["live"], false);
    assert_eq!(up_snap["snapshot"]["spec"]["power"], "Stopped");
    assert_eq!(up_snap["snapshot"]["spec"]["disks"], disks);
    let down_snap = snapshot_ready(&server, "down", "s1");
    assert_eq!(down_snap["snapshot"]["status"]["live"], true);
    assert_eq!(down_snap["snapshot"]["spec"]["power"], "Running");

    let list = server.get("/api/v1/vms/up/snapshots");
    assert_eq!(list.status, 200, "{}", list.text);
    let list = list.json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["snapshot"]["name"], "s1");
    assert!(list["revision"].as_u64().unwrap() >= list["items"][0]["revision"].as_u64().unwrap());

    // Flip both power states and change the spec after the snapshots.
    assert_eq!(server.send("POST", "/api/v1/vms/up/start", "").status, 200);
    assert_eq!(server.send("POST", "/api/v1/vms/down/stop", "").status, 200);
    let up_before = server.wait_vm("up", "run", |v| phase(v) == "Running");
    let first_up = instance(&up_before).unwrap();
    server.wait_settled_stopped("down");
    set_cpus(&server, "up", 2);
    set_cpus(&server, "down", 2);

    let r = server.send("POST", "/api/v1/vms/up/restore", r#"{"snapshot":"s1"}"#);
    assert_eq!(r.status, 202, "{}", r.text);
    let accepted = r.json();
    assert_eq!(vm_field(&accepted, &["restore", "snapshot"]), "s1");
    assert_eq!(vm_field(&accepted, &["power_intent", "power"]), "Running");
    let r = server.send("POST", "/api/v1/vms/down/restore", r#"{"snapshot":"s1"}"#);
    assert_eq!(r.status, 202, "{}", r.text);
    let down_restore_rev = r.json()["revision"].as_u64().unwrap();
    assert_eq!(vm_field(&r.json(), &["power_intent", "power"]), "Stopped");

    let up = server.wait_vm("up", "be restored Running", |v| restored(v, "Running"));
    assert_ne!(
        instance(&up).unwrap(),
        first_up,
        "a new instance after the restore"
    );
    assert_eq!(
        vm_field(&up, &["spec", "cpus"]),
        1,
        "the snapshot's spec is back"
    );
    let down = server.wait_vm("down", "be restored Stopped", |v| restored(v, "Stopped"));
    assert_eq!(vm_field(&down, &["spec", "cpus"]), 1);
    // Stays stopped: no start at any time after the restore request.
    std::thread::sleep(Duration::from_millis(500));
    let down = server.vm("down").unwrap();
    assert!(restored(&down, "Stopped"), "{down}");
    let events = server.get("/api/v1/events?vm=down").json();
    let started_after: Vec<&Value> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["revision"].as_u64().unwrap() > down_restore_rev)
        .filter(|e| e["event"]["to"] == "Starting")
        .collect();
    assert!(started_after.is_empty(), "{started_after:?}");
    let events = server.get("/api/v1/events?vm=up").json();
    assert!(
        events["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["event"]["reason"] == "restore from snapshot"),
        "{events}"
    );

    // Delete: marked, then the controller removes it.
    let r = server.send("DELETE", "/api/v1/vms/up/snapshots/s1", "");
    assert_eq!(r.status, 202, "{}", r.text);
    assert!(r.json()["snapshot"]["deletion_requested_at"]
        .as_u64()
        .is_some());
    let start = std::time::Instant::now();
    while server.get("/api/v1/vms/up/snapshots/s1").status != 404 {
        assert!(start.elapsed() < common::DEADLINE, "snapshot not deleted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let list = server.get("/api/v1/vms/up/snapshots").json();
    assert!(list["items"].as_array().unwrap().is_empty(), "{list}");
    // Restoring from it now: 404 naming the snapshot.
    let r = server.send("POST", "/api/v1/vms/up/restore", r#"{"snapshot":"s1"}"#);
    assert_eq!(
        (r.status, r.json()["field"].clone()),
        (404, json!("snapshot"))
    );
}

/// Guests that ignore the power button keep a restore pending for the
/// whole grace period: every request that would race it is refused.
#[test]
fn requests_racing_a_pending_restore_are_refused() {
    let server = TestServer::start_with(|cfg| cfg.sim.faults.ignore_powerdown = 1.0);
    server.create_vm(
        "hung",
        json!({"cpus": 1, "memory_mib": 64, "stop_grace_period_s": 3,
               "disks": [{"name": "data", "size_mib": 64}]}),
    );
    let before = server.wait_vm("hung", "run", |v| phase(v) == "Running");
    snapshot_ready(&server, "hung", "s1");
    snapshot_ready(&server, "hung", "s2");

    let r = server.send("POST", "/api/v1/vms/hung/restore", r#"{"snapshot":"s1"}"#);
    assert_eq!(r.status, 202, "{}", r.text);
    let (snapshots_before, _) = server.store_state();
    let snapshots_before: Vec<_> = snapshots_before
        .into_iter()
        .filter(|e| e.key.starts_with("/snapshots/"))
        .collect();
    for (method, path, body, field) in [
        (
            "POST",
            "/api/v1/vms/hung/restore",
            r#"{"snapshot":"s1"}"#,
            "restore",
        ),
        (
            "POST",
            "/api/v1/vms/hung/restore",
            r#"{"snapshot":"s2"}"#,
            "restore",
        ),
        (
            "POST",
            "/api/v1/vms/hung/snapshots",
            r#"{"name":"s3"}"#,
            "restore",
        ),
        ("DELETE", "/api/v1/vms/hung/snapshots/s1", "", "snapshot"),
        ("POST", "/api/v1/vms/hung/stop", "", "restore"),
    ] {
        let r = server.send(method, path, body);
        assert_eq!(r.status, 409, "{method} {path} {body}: {}", r.text);
        assert_eq!(r.json()["field"], field, "{method} {path}: {}", r.text);
    }
    let (after, _) = server.store_state();
    let after: Vec<_> = after
        .into_iter()
        .filter(|e| e.key.starts_with("/snapshots/"))
        .collect();
    assert_eq!(
        after, snapshots_before,
        "refused requests changed snapshots"
    );
    assert!(
        server.vm("hung").unwrap()["vm"].get("restore").is_some(),
        "the restore was still pending during the checks"
    );

    // The guest ignores the power button; half-way through the grace
    // period its guest agent is asked to power off, which it does, before
    // the kill at the end of it. Then it runs again.
    let after = server.wait_vm("hung", "be restored Running", |v| restored(v, "Running"));
    assert_ne!(instance(&after), instance(&before));
    assert_eq!(
        vm_field(&after, &["status", "last_exit", "kind"]),
        "GuestPoweroff",
        "{after}"
    );
    let r = server.send("DELETE", "/api/v1/vms/hung/snapshots/s1", "");
    assert_eq!(r.status, 202, "{}", r.text);
}

#[test]
fn bad_snapshot_and_restore_input_is_refused_and_changes_nothing() {
    let server = TestServer::start();
    server.create_vm(
        "keep",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped", "run_policy": "Manual",
               "disks": [{"name": "data", "size_mib": 64}]}),
    );
    server.wait_settled_stopped("keep");
    snapshot_ready(&server, "keep", "ok");
    let keep = server.vm("keep").unwrap();
    let failed = json!({
        "vm": "keep", "name": "broken", "spec": keep["vm"]["spec"], "requested_at": 1,
        "status": {"phase": "Failed", "message": "disk full"}
    });
    server.put_raw("/snapshots/keep/broken", &failed);
    let before = server.settled_state();
    let long = "a".repeat(64);
    let snap_body = |name: Value| json!({ "name": name }).to_string();
    let cases: Vec<(&str, String, String, u16, Option<&str>)> = vec![
        // Creating snapshots.
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!("Bad_Name")),
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!("a/b")),
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!("")),
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!(long)),
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!(5)),
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            "{}".into(),
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            r#"{"name":"x","live":true}"#.into(),
            400,
            Some("live"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            "".into(),
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots?now=1".into(),
            snap_body(json!("x")),
            400,
            Some("now"),
        ),
        (
            "POST",
            "/api/v1/vms/ghost/snapshots".into(),
            snap_body(json!("x")),
            404,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/Ghost/snapshots".into(),
            snap_body(json!("x")),
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots".into(),
            snap_body(json!("ok")),
            409,
            Some("name"),
        ),
        // Reading and deleting.
        (
            "GET",
            "/api/v1/vms/ghost/snapshots".into(),
            "".into(),
            404,
            Some("name"),
        ),
        (
            "GET",
            "/api/v1/vms/keep/snapshots/missing".into(),
            "".into(),
            404,
            Some("snapshot"),
        ),
        (
            "GET",
            "/api/v1/vms/ghost/snapshots/ok".into(),
            "".into(),
            404,
            Some("name"),
        ),
        (
            "GET",
            "/api/v1/vms/keep/snapshots/Bad".into(),
            "".into(),
            400,
            Some("snapshot"),
        ),
        (
            "DELETE",
            "/api/v1/vms/keep/snapshots/missing".into(),
            "".into(),
            404,
            Some("snapshot"),
        ),
        (
            "DELETE",
            "/api/v1/vms/keep/snapshots/a%2Fb".into(),
            "".into(),
            400,
            Some("snapshot"),
        ),
        (
            "DELETE",
            "/api/v1/vms/keep/snapshots/%2E%2E".into(),
            "".into(),
            400,
            Some("snapshot"),
        ),
        (
            "DELETE",
            "/api/v1/vms/keep/snapshots/ok?revision=1".into(),
            "".into(),
            409,
            Some("revision"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/snapshots/ok".into(),
            "".into(),
            405,
            None,
        ),
        // Restoring.
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            r#"{"snapshot":"missing"}"#.into(),
            404,
            Some("snapshot"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            r#"{"snapshot":"broken"}"#.into(),
            409,
            Some("snapshot"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            r#"{"snapshot":"Bad/x"}"#.into(),
            422,
            Some("snapshot"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            r#"{"snapshot":7}"#.into(),
            400,
            Some("snapshot"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            "{}".into(),
            400,
            Some("snapshot"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            "".into(),
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore".into(),
            r#"{"snapshot":"ok","revision":"x"}"#.into(),
            400,
            Some("revision"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/restore?revision=1".into(),
            r#"{"snapshot":"ok"}"#.into(),
            409,
            Some("revision"),
        ),
        (
            "POST",
            "/api/v1/vms/ghost/restore".into(),
            r#"{"snapshot":"ok"}"#.into(),
            404,
            Some("name"),
        ),
        (
            "GET",
            "/api/v1/vms/keep/restore".into(),
            "".into(),
            405,
            None,
        ),
        // Migrations.
        (
            "GET",
            "/api/v1/migrations?vm=Bad".into(),
            "".into(),
            400,
            Some("vm"),
        ),
        (
            "GET",
            "/api/v1/migrations?since=1".into(),
            "".into(),
            400,
            Some("since"),
        ),
    ];
    for (method, path, body, status, field) in &cases {
        let body = (!body.is_empty()).then_some(body.as_bytes());
        let r = server.request(method, path, Some(&server.token), body, &[]);
        let what = format!("{method} {path} {:?}", body.map(String::from_utf8_lossy));
        assert_eq!(r.status, *status, "{what}: {}", r.text);
        let err = r.json();
        assert!(
            err["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {err}"
        );
        assert_eq!(err["field"].as_str(), *field, "{what}: {err}");
        assert_eq!(server.store_state(), before, "{what} changed the store");
    }
    let r = server.send(
        "POST",
        "/api/v1/vms/keep/restore",
        r#"{"snapshot":"broken"}"#,
    );
    assert!(
        r.json()["error"].as_str().unwrap().contains("Failed"),
        "{}",
        r.text
    );
    // The good requests still work afterwards.
    let r = server.get("/api/v1/migrations?vm=keep");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.json()["items"].as_array().unwrap().is_empty());
}

fn node(server: &TestServer) -> Value {
    server.wait_node("test-node", "register", |_| true)
}

fn post_node(server: &TestServer, verb: &str, body: &str) -> Value {
    let r = server.send("POST", &format!("/api/v1/nodes/test-node/{verb}"), body);
    assert!(
        r.status == 200 || r.status == 202,
        "{verb} {body}: {} {}",
        r.status,
        r.text
    );
    r.json()
}

#[test]
fn bad_node_requests_are_refused_and_change_nothing() {
    let server = TestServer::start();
    server.create_vm(
        "web",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_settled_stopped("web");
    node(&server);
    let before = server.settled_state();
    let drain = "/api/v1/nodes/test-node/drain";
    let cases: Vec<(&str, &str, &str, u16, Option<&str>)> = vec![
        (
            "POST",
            drain,
            r#"{"submit_window_s":0}"#,
            422,
            Some("submit_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"migrate_window_s":86401}"#,
            422,
            Some("migrate_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"submit_window_s":60,"fallback_window_s":100000}"#,
            422,
            Some("fallback_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"fallback_window_s":-1}"#,
            400,
            Some("fallback_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"submit_window_s":"10m"}"#,
            400,
            Some("submit_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"submit_window_s":1.5}"#,
            400,
            Some("submit_window_s"),
        ),
        (
            "POST",
            drain,
            r#"{"tuning":{"parallel_per_node":0}}"#,
            422,
            Some("tuning.parallel_per_node"),
        ),
        (
            "POST",
            drain,
            r#"{"tuning":{"post_copy":true}}"#,
            400,
            Some("tuning.post_copy"),
        ),
        ("POST", drain, r#"{"window":60}"#, 400, Some("window")),
        ("POST", drain, "[60]", 400, Some("body")),
        ("POST", "/api/v1/nodes/ghost/drain", "", 404, Some("name")),
        (
            "POST",
            "/api/v1/nodes/Bad_Node/cordon",
            "",
            400,
            Some("name"),
        ),
        ("POST", "/api/v1/nodes/ghost/cordon", "", 404, Some("name")),
        (
            "POST",
            "/api/v1/nodes/test-node/cordon?revision=1",
            "",
            409,
            Some("revision"),
        ),
        (
            "POST",
            "/api/v1/nodes/test-node/uncordon",
            r#"{"operator":"yes"}"#,
            400,
            Some("operator"),
        ),
        (
            "POST",
            "/api/v1/nodes/test-node/uncordon",
            r#"{"force":true}"#,
            400,
            Some("force"),
        ),
        (
            "POST",
            "/api/v1/nodes/ghost/uncordon",
            "",
            404,
            Some("name"),
        ),
        ("GET", "/api/v1/nodes/test-node/drain", "", 405, None),
    ];
    for (method, path, body, status, field) in &cases {
        let r = server.send(method, path, body);
        let what = format!("{method} {path} {body}");
        assert_eq!(r.status, *status, "{what}: {}", r.text);
        assert_eq!(r.json()["field"].as_str(), *field, "{what}: {}", r.text);
        assert_eq!(server.store_state(), before, "{what} changed the store");
    }
    let n = node(&server)["node"].clone();
    assert_eq!(n["cordoned"], false);
    assert!(n.get("drain").is_none());
}

#[test]
fn operator_cordon_survives_a_plain_uncordon() {
    let server = TestServer::start();
    node(&server);
    let r = post_node(&server, "cordon", "");
    assert_eq!(
        (&r["node"]["cordoned"], &r["node"]["cordoned_by_keel"]),
        (&json!(true), &json!(false))
    );
    // Nothing new is placed on a cordoned node.
    server.create_vm("late", json!({"cpus": 1, "memory_mib": 64}));
    let pending = server.wait_vm("late", "report it cannot be placed", |v| {
        vm_field(v, &["status", "message"])
            .as_str()
            .is_some_and(|m| m.contains("no ready, uncordoned node"))
    });
    assert!(instance(&pending).is_none());

    let r = post_node(&server, "uncordon", "");
    assert_eq!(r["schedulable"], false);
    assert_eq!(r["operator_cordon"], true);
    assert_eq!(r["node"]["cordoned"], true);
    let r = post_node(&server, "uncordon", r#"{"operator":false}"#);
    assert_eq!(r["node"]["cordoned"], true);
    std::thread::sleep(Duration::from_millis(300));
    assert!(instance(&server.vm("late").unwrap()).is_none());

    // A drain of an operator-cordoned node keeps the cordon the operator's.
    let r = post_node(&server, "drain", "");
    assert_eq!(r["node"]["cordoned_by_keel"], false);
    assert_eq!(r["node"]["drain"]["windows"]["submit_ms"], 600_000);
    // The migrations' bounds by default, on the drain.
    assert_eq!(
        r["node"]["drain"]["tuning"],
        json!({"completion_timeout_per_gib_s": 150, "progress_timeout_s": 150,
               "auto_converge": true, "parallel_per_cluster": 5, "parallel_per_node": 2}),
        "{r}"
    );
    let r = post_node(&server, "uncordon", "");
    assert_eq!(
        (r["schedulable"].clone(), r["operator_cordon"].clone()),
        (json!(false), json!(true))
    );
    assert!(r["node"].get("drain").is_none(), "the drain ended: {r}");

    let r = post_node(&server, "uncordon", r#"{"operator":true}"#);
    assert_eq!(
        (r["schedulable"].clone(), r["operator_cordon"].clone()),
        (json!(true), json!(false))
    );
    assert_eq!(r["node"]["cordoned"], false);
    server.wait_vm("late", "run once uncordoned", |v| phase(v) == "Running");
}

/// One sim node: nowhere to migrate, so the drain falls back to a stop,
/// completes once the VM is off the node, and uncordon lets it run again.
#[test]
fn drain_of_the_only_node_stops_the_vm_and_uncordon_runs_it_again() {
    let server = TestServer::start();
    node(&server);
    server.create_vm("web", json!({"cpus": 1, "memory_mib": 64}));
    let running = server.wait_vm("web", "run", |v| phase(v) == "Running");
    let first = instance(&running).unwrap();

    let r = server.send(
        "POST",
        "/api/v1/nodes/test-node/drain",
        r#"{"submit_window_s":5,"migrate_window_s":5,"fallback_window_s":5}"#,
    );
    assert_eq!(r.status, 202, "{}", r.text);
    let n = &r.json()["node"];
    assert_eq!(
        (&n["cordoned"], &n["cordoned_by_keel"]),
        (&json!(true), &json!(true))
    );
    assert_eq!(
        n["drain"]["windows"],
        json!({"submit_ms": 5000, "migrate_ms": 5000, "fallback_ms": 5000})
    );
    let requested_at = n["drain"]["requested_at"].clone();
    // Repeating it keeps the drain (and its deadlines).
    let again = post_node(&server, "drain", r#"{"submit_window_s":60}"#);
    assert_eq!(again["node"]["drain"]["requested_at"], requested_at);
    assert_eq!(again["node"]["drain"]["windows"]["submit_ms"], 5000);

    let stopped = server.wait_vm("web", "be evicted", |v| {
        instance(v).is_none() && v["vm"]["status"].get("last_exit").is_some()
    });
    let exit = vm_field(&stopped, &["status", "last_exit"]);
    assert_eq!(exit["instance"], json!(first));
    assert_eq!(exit["requested"], true, "{stopped}");
    assert_eq!(
        vm_field(&stopped, &["spec", "power"]),
        "Running",
        "an eviction is not a user stop"
    );
    let drained = server.wait_node("test-node", "complete its drain", |n| {
        n["node"]["drain"]["completed_at"].as_u64().is_some()
    });
    assert_eq!(drained["node"]["cordoned"], true);
    let waiting = server.wait_vm("web", "say why it waits", |v| {
        vm_field(v, &["status", "message"])
            .as_str()
            .is_some_and(|m| m.contains("no ready, uncordoned node"))
    });
    assert!(instance(&waiting).is_none());
    assert!(
        matches!(phase(&waiting), "Pending" | "BackOff"),
        "{waiting}"
    );
    let events = server.get("/api/v1/events?vm=web").json();
    assert!(
        events["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["event"]["reason"] == "evicted from a draining node"),
        "{events}"
    );
    let migrations = server.get("/api/v1/migrations").json();
    assert!(
        migrations["items"].as_array().unwrap().is_empty(),
        "{migrations}"
    );

    let r = post_node(&server, "uncordon", "");
    assert_eq!(
        (r["schedulable"].clone(), r["operator_cordon"].clone()),
        (json!(true), json!(false))
    );
    assert!(r["node"].get("drain").is_none());
    let back = server.wait_vm("web", "run again", |v| phase(v) == "Running");
    assert_ne!(instance(&back).unwrap(), first);
}

/// A stopped VM placed on the node has nothing running there; the drain
/// should hand it back to the scheduler and complete. Today keel-ctrl's
/// `decide` returns for a VM that does not want to run before its drain
/// branch, so `status.node` keeps naming the draining node and
/// `drain.completed_at` is never set.
#[test]
fn drain_completes_with_a_stopped_vm_on_the_node() {
    let server = TestServer::start();
    node(&server);
    server.create_vm(
        "idle",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_vm("idle", "be placed and settle", |v| {
        phase(v) == "Stopped" && v["vm"]["status"]["node"] == "test-node"
    });
    post_node(&server, "drain", "");
    server.wait_node("test-node", "complete its drain", |n| {
        n["node"]["drain"]["completed_at"].as_u64().is_some()
    });
    let idle = server.vm("idle").unwrap();
    assert_eq!(phase(&idle), "Stopped", "{idle}");
    assert_eq!(vm_field(&idle, &["spec", "power"]), "Stopped");
}

/// `POST /nodes/{name}/freeze`: bounded, never shortened, refused with the
/// field named and nothing stored; a live agent keeps the freeze (only its
/// return from a restart, or the freeze's end, removes it).
#[test]
fn a_freeze_is_bounded_never_shortened_and_kept_by_a_live_agent() {
    let server = TestServer::start();
    let before_hb = node(&server)["node"]["status"]["last_heartbeat"].clone();
    let freeze = "/api/v1/nodes/test-node/freeze";
    let r = post_node(&server, "freeze", r#"{"for_s":600,"reason":"upgrade"}"#);
    assert_eq!(r["node"]["freeze"]["duration_ms"], 600_000);
    assert_eq!(r["node"]["freeze"]["reason"], "upgrade");
    let before = server.store_state();
    let cases = [
        (freeze, r#"{"for_s":60}"#, 409, Some("for_s")),
        (freeze, r#"{"for_s":0}"#, 422, Some("for_s")),
        (freeze, r#"{"for_s":3601}"#, 422, Some("for_s")),
        (freeze, r#"{"for_s":"5m"}"#, 400, Some("for_s")),
        (freeze, r#"{"for_s":600,"until":1}"#, 400, Some("until")),
        (
            freeze,
            r#"{"for_s":600,"reason":"a\nb"}"#,
            422,
            Some("reason"),
        ),
        (freeze, "", 400, Some("body")),
        (
            "/api/v1/nodes/ghost/freeze",
            r#"{"for_s":60}"#,
            404,
            Some("name"),
        ),
    ];
    for (path, body, status, field) in &cases {
        let r = server.send("POST", path, body);
        let what = format!("POST {path} {body}");
        assert_eq!(r.status, *status, "{what}: {}", r.text);
        assert_eq!(r.json()["field"].as_str(), *field, "{what}: {}", r.text);
        assert_eq!(server.store_state(), before, "{what} changed the store");
    }
    let n = server.wait_node("test-node", "a heartbeat after the freeze", |n| {
        n["node"]["status"]["last_heartbeat"] != before_hb
            && n["node"]["status"]["last_heartbeat"].as_u64()
                > r["node"]["status"]["last_heartbeat"].as_u64()
    });
    assert_eq!(n["node"]["freeze"]["duration_ms"], 600_000, "{n}");
    let out = post_node(&server, "freeze", r#"{"for_s":900}"#);
    assert_eq!(out["node"]["freeze"]["duration_ms"], 900_000);
}
