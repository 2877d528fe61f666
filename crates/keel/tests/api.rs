//! The HTTP API against a real in-process server over a real socket.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::{instance, phase, small_spec, TestServer};
use serde_json::{json, Value};

/// `POST /vms/NAME/reboot` resets the running guest inside its instance
/// (the sim guest's agent answers, so through the agent), once; a VM that
/// is not Running gets a 409 naming `status.phase` and nothing changes.
#[test]
fn vm_reboot_resets_the_guest_in_the_same_instance_and_is_refused_when_stopped() {
    let server = TestServer::start();
    server.create_vm("rb", small_spec());
    let running = server.wait_vm("rb", "run", |v| phase(v) == "Running");
    let first = instance(&running).expect("an instance");

    let r = server.send("POST", "/api/v1/vms/rb/reboot", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["vm"]["reboot_generation"], 1);
    let rebooted = server.wait_vm("rb", "reboot", |v| {
        v["vm"]["status"]["observed_reboot_generation"] == 1
            && v["vm"]["status"]["instance"]["resets"] == 1
    });
    assert_eq!(instance(&rebooted), Some(first.clone()), "same instance");
    assert_eq!(phase(&rebooted), "Running");
    assert!(rebooted["vm"]["status"].get("last_exit").is_none());
    let events = server.get("/api/v1/events?vm=rb").json();
    let reasons: Vec<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["event"]["reason"].as_str())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.starts_with("guest rebooted as requested")),
        "{reasons:?}"
    );

    let r = server.send("POST", "/api/v1/vms/rb/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_vm("rb", "stop", |v| {
        phase(v) == "Stopped" && v["vm"]["status"].get("instance").is_none()
    });
    let r = server.send("POST", "/api/v1/vms/rb/reboot", "");
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json()["field"], "status.phase", "{}", r.text);
    assert_eq!(
        server.get("/api/v1/vms/rb").json()["vm"]["reboot_generation"],
        1,
        "the refused request changed nothing"
    );
}

#[test]
fn token_file_is_private_and_stable_across_restarts() {
    let server = TestServer::start();
    let path = server.dir.path().join("token");
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), server.token);
    assert_eq!(server.token.len(), 64);
    assert!(server.token.bytes().all(|b| b.is_ascii_hexdigit()));
    let token = server.token.clone();
    server.create_vm(
        "keep",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );

    let dir = server.stop();
    let again = TestServer::start_in(dir);
    assert_eq!(again.token, token, "the token is generated once");
    assert!(again.vm("keep").is_some(), "the store persisted the VM");
}

#[test]
fn a_second_server_on_the_same_data_dir_is_refused() {
    let server = TestServer::start();
    let cfg = common::fast_config(server.dir.path());
    let err = server
        .rt
        .block_on(keel::serve::start(cfg))
        .err()
        .expect("second server refused")
        .to_string();
    assert!(err.contains("another keel server"), "{err}");
}

/// The lock is taken before the hypervisor driver starts: a second
/// server on a locked data dir must not get as far as the qemu driver,
/// which would create `node/instances/` and adopt (and record exits of)
/// the first server's instances there.
#[test]
fn a_second_server_is_refused_before_its_driver_touches_the_data_dir() {
    let server = TestServer::start();
    // The first server runs the sim driver, which keeps nothing on disk.
    assert!(!server.dir.path().join("node").exists());
    let mut cfg = common::fast_config(server.dir.path());
    cfg.hypervisor = keel::args::HypervisorKind::Qemu;
    let err = server
        .rt
        .block_on(keel::serve::start(cfg))
        .err()
        .expect("second server refused")
        .to_string();
    assert!(err.contains("another keel server"), "{err}");
    assert!(
        !server.dir.path().join("node").exists(),
        "the qemu driver started before the data dir was locked"
    );

    // `keel agent` the same: refused before its driver or the store.
    let cfg = keel::agent::AgentConfig::new(
        "etcd://127.0.0.1:1".parse().unwrap(),
        server.dir.path().to_path_buf(),
        "second".into(),
        keel::args::HypervisorKind::Qemu,
    );
    let err = server
        .rt
        .block_on(keel::agent::start(cfg))
        .err()
        .expect("agent refused")
        .to_string();
    assert!(err.contains("another keel server"), "{err}");
    assert!(
        !server.dir.path().join("node").exists(),
        "the agent's qemu driver started before the data dir was locked"
    );
}

/// A data dir the server creates is 0700 from the start, also when the
/// qemu driver keeps its instances inside it; one that exists with a
/// looser mode is made private.
#[test]
fn the_data_dir_is_private() {
    let server = TestServer::start_with(|cfg| {
        cfg.data_dir = cfg.data_dir.join("fresh");
        cfg.hypervisor = keel::args::HypervisorKind::Qemu;
    });
    let dir = server.dir.path().join("fresh");
    assert!(dir.join("node").join("instances").is_dir());
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");
    drop(server);

    let loose = tempfile::tempdir().unwrap();
    std::fs::set_permissions(loose.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = TestServer::start_in(loose);
    let mode = std::fs::metadata(server.dir.path())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");
}

#[test]
fn requests_without_the_token_are_refused_and_change_nothing() {
    let server = TestServer::start();
    server.create_vm(
        "keep",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_settled_stopped("keep");
    let before = server.store_state();
    let create = json!({"name": "intruder", "spec": small_spec()}).to_string();
    let wrong = "0".repeat(64);
    let attempts: Vec<(&str, &str, Option<&str>)> = vec![
        ("POST", "/api/v1/vms", Some(create.as_str())),
        ("POST", "/api/v1/vms/keep/start", None),
        ("DELETE", "/api/v1/vms/keep", None),
        ("GET", "/api/v1/vms", None),
        ("GET", "/api/v1/vms/keep", None),
        ("GET", "/api/v1/events", None),
        ("GET", "/api/v1/nodes", None),
        ("GET", "/api/v1/openapi.json", None),
        ("GET", "/api/v1/no-such-endpoint", None),
        ("GET", "/metrics", None),
        (
            "POST",
            "/api/v1/vms/keep/snapshots",
            Some(r#"{"name":"s"}"#),
        ),
        ("GET", "/api/v1/vms/keep/snapshots", None),
        ("DELETE", "/api/v1/vms/keep/snapshots/s", None),
        (
            "POST",
            "/api/v1/vms/keep/restore",
            Some(r#"{"snapshot":"s"}"#),
        ),
        ("POST", "/api/v1/nodes/test-node/cordon", None),
        (
            "POST",
            "/api/v1/nodes/test-node/uncordon",
            Some(r#"{"operator":true}"#),
        ),
        ("POST", "/api/v1/nodes/test-node/drain", None),
        ("GET", "/api/v1/migrations", None),
    ];
    for (method, path, body) in &attempts {
        for token in [None, Some(wrong.as_str()), Some(&server.token[..63])] {
            let r = server.request(method, path, token, body.map(str::as_bytes), &[]);
            assert_eq!(r.status, 401, "{method} {path} with {token:?}: {}", r.text);
            assert!(r.json()["error"].as_str().unwrap().contains("token"));
            assert!(r.header("www-authenticate").is_some());
        }
    }
    let r = server.request(
        "GET",
        "/api/v1/vms",
        None,
        None,
        &[("Authorization", &format!("Basic {}", server.token))],
    );
    assert_eq!(r.status, 401);
    assert_eq!(
        server.store_state(),
        before,
        "refused requests changed the store"
    );
    assert!(server.vm("intruder").is_none());

    let r = server.request("GET", "/healthz", None, None, &[]);
    assert_eq!((r.status, r.json()["status"].clone()), (200, json!("ok")));
}

#[test]
fn vm_round_trip_create_restart_stop_start_delete_with_events() {
    let server = TestServer::start();
    let created = server.create_vm(
        "web",
        json!({"cpus": 2, "memory_mib": 128, "disks": [{"name": "data", "size_mib": 64}]}),
    );
    assert_eq!(created["vm"]["name"], "web");
    assert!(created["revision"].as_u64().unwrap() > 0);

    let running = server.wait_vm("web", "run", |v| phase(v) == "Running");
    let first = instance(&running).expect("an instance");

    let list = server.get("/api/v1/vms").json();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["vm"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["web"]);
    assert!(list["revision"].as_u64().unwrap() >= running["revision"].as_u64().unwrap());

    let got = server.get("/api/v1/vms/web");
    assert_eq!(got.status, 200);
    assert_eq!(
        got.header("etag").unwrap(),
        format!("\"{}\"", got.json()["revision"])
    );
    assert_eq!(got.json()["vm"]["spec"]["cpus"], 2);

    // Restart: a new instance runs, the old one is gone first.
    let r = server.send("POST", "/api/v1/vms/web/restart", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["vm"]["spec"]["restart_generation"], 1);
    let restarted = server.wait_vm("web", "restart", |v| {
        phase(v) == "Running" && instance(v).is_some_and(|i| i != first)
    });
    assert_eq!(
        restarted["vm"]["status"]["last_exit"]["instance"],
        json!(first)
    );

    let r = server.send("POST", "/api/v1/vms/web/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["vm"]["spec"]["power"], "Stopped");
    server.wait_vm("web", "stop", |v| {
        phase(v) == "Stopped" && v["vm"]["status"].get("instance").is_none()
    });

    let r = server.send("POST", "/api/v1/vms/web/start", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_vm("web", "start again", |v| phase(v) == "Running");

    let r = server.send("DELETE", "/api/v1/vms/web", "");
    assert_eq!(r.status, 202, "{}", r.text);
    assert!(r.json()["vm"]["deletion_requested_at"].as_u64().is_some());
    server.wait_gone("web");
    assert_eq!(server.send("DELETE", "/api/v1/vms/web", "").status, 404);

    // Every phase change was recorded, in order, for this VM.
    let events = server.get("/api/v1/events?vm=web").json();
    let items = events["items"].as_array().unwrap();
    let revisions: Vec<u64> = items
        .iter()
        .map(|i| i["revision"].as_u64().unwrap())
        .collect();
    let mut sorted = revisions.clone();
    sorted.sort();
    assert_eq!(revisions, sorted, "events are ordered");
    let changes: Vec<(String, String)> = items
        .iter()
        .map(|i| {
            assert_eq!(i["event"]["vm"], "web");
            (
                i["event"]["from"].as_str().unwrap().to_string(),
                i["event"]["to"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for expected in [
        ("Pending", "Starting"),
        ("Starting", "Running"),
        ("Running", "Stopping"),
        ("Stopping", "Stopped"),
        ("Stopped", "Starting"),
    ] {
        assert!(
            changes
                .iter()
                .any(|(f, t)| (f.as_str(), t.as_str()) == expected),
            "no {expected:?} event in {changes:?}"
        );
    }
    assert_eq!(changes.last().unwrap().1, "Deleting");
    // The list of all events holds the audit trail of these requests
    // too, and of the VM's phase changes exactly these.
    let all = server.get("/api/v1/events").json();
    let all = all["items"].as_array().unwrap();
    let phase_changes = all.iter().filter(|i| i["audit"].is_null()).count();
    assert_eq!(phase_changes, items.len());
    assert!(
        all.iter()
            .any(|i| i["audit"]["path"] == "/api/v1/vms/web/stop"),
        "the stop request is not in the audit trail with its address: {all:?}"
    );
}

#[test]
fn bad_input_is_refused_with_the_field_and_changes_nothing() {
    let server = TestServer::start();
    server.create_vm(
        "keep",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped", "run_policy": "Manual"}),
    );
    let settled = server.wait_settled_stopped("keep");
    let revision = settled["revision"].as_u64().unwrap();
    let before = server.snapshot();

    let spec = |extra: Value| {
        let mut s = json!({"cpus": 1, "memory_mib": 64});
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s
    };
    let create = |name: Value, spec: Value| json!({"name": name, "spec": spec}).to_string();
    let huge = format!(
        r#"{{"name":"big","spec":{{"cpus":1,"memory_mib":64,"boot":{{"cmdline":"{}"}}}}}}"#,
        "x".repeat(keel::api::MAX_BODY_BYTES + 1024)
    );
    let long_name = "a".repeat(64);
    // Fits a name (63), but not with the instance suffix Keel derives from it.
    let long_vm_name = "a".repeat(keel_api::name::MAX_VM_NAME_LEN + 1);
    let if_match = revision.to_string();
    // (method, path, body, extra headers, expected status, expected field)
    type Case<'a> = (
        &'a str,
        String,
        String,
        Vec<(&'a str, &'a str)>,
        u16,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/api/v1/vms".into(),
            r#"{"name": "x", "spec": "#.into(),
            vec![],
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            "".into(),
            vec![],
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            "[]".into(),
            vec![],
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            r#"["x", {"cpus": 1, "memory_mib": 64}]"#.into(),
            vec![],
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            r#"{"name":"x","spec":{"cpus":1,"memory_mib":64}} trailing"#.into(),
            vec![],
            400,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            json!({"name": "x", "spec": small_spec(), "bogus": 1}).to_string(),
            vec![],
            400,
            Some("bogus"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            json!({"name": "x", "spec": small_spec(), "status": {"phase": "Running"}}).to_string(),
            vec![],
            400,
            Some("status"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"bogus": true}))),
            vec![],
            400,
            Some("spec.bogus"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(
                json!("x"),
                spec(json!({"boot": {"kernel": "/k", "bogus": 1}})),
            ),
            vec![],
            400,
            Some("spec.boot.bogus"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            json!({"spec": small_spec()}).to_string(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), json!({"cpus": 1})),
            vec![],
            400,
            Some("spec.memory_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            huge,
            vec![],
            413,
            Some("body"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("a/b"), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!(".."), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("a\u{0}b"), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!(long_name), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!(long_vm_name), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!(""), small_spec()),
            vec![],
            422,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!(7), small_spec()),
            vec![],
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"memory_mib": 0}))),
            vec![],
            422,
            Some("spec.memory_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"memory_mib": -256}))),
            vec![],
            400,
            Some("spec.memory_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"memory_mib": "lots"}))),
            vec![],
            400,
            Some("spec.memory_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"memory_mib": 1.5}))),
            vec![],
            400,
            Some("spec.memory_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"cpus": 0}))),
            vec![],
            422,
            Some("spec.cpus"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"cpus": true}))),
            vec![],
            400,
            Some("spec.cpus"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(
                json!("x"),
                spec(json!({"disks": [{"name": "../etc", "size_mib": 1}]})),
            ),
            vec![],
            422,
            Some("spec.disks[0].name"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(
                json!("x"),
                spec(json!({"disks": [{"name": "d", "size_mib": "1"}]})),
            ),
            vec![],
            400,
            Some("spec.disks[0].size_mib"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"run_policy": "Sometimes"}))),
            vec![],
            400,
            Some("spec.run_policy"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(
                json!("x"),
                spec(json!({"boot": {"kernel": "relative/vmlinuz"}})),
            ),
            vec![],
            422,
            Some("spec.boot.kernel"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("x"), spec(json!({"stop_grace_period_s": 0}))),
            vec![],
            422,
            Some("spec.stop_grace_period_s"),
        ),
        (
            "POST",
            "/api/v1/vms?dry=1".into(),
            create(json!("x"), small_spec()),
            vec![],
            400,
            Some("dry"),
        ),
        (
            "POST",
            "/api/v1/vms".into(),
            create(json!("keep"), small_spec()),
            vec![],
            409,
            Some("name"),
        ),
        // Names in the path.
        (
            "GET",
            "/api/v1/vms/a%2Fb".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/a%2Fkeep/start".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/%2E%2E/stop".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "DELETE",
            "/api/v1/vms/..".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "DELETE",
            "/api/v1/vms/a%00b".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "DELETE",
            format!("/api/v1/vms/{long_name}"),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "DELETE",
            "/api/v1/vms/KEEP".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/ghost/start".into(),
            "".into(),
            vec![],
            404,
            Some("name"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/start?revision=abc".into(),
            "".into(),
            vec![],
            400,
            Some("revision"),
        ),
        (
            "POST",
            "/api/v1/vms/keep/start".into(),
            "".into(),
            vec![("If-Match", "soon")],
            400,
            Some("If-Match"),
        ),
        // Spec replacement.
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!({"spec": small_spec()}).to_string(),
            vec![],
            428,
            Some("revision"),
        ),
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!({"spec": spec(json!({"memory_mib": 0})), "revision": revision}).to_string(),
            vec![],
            422,
            Some("spec.memory_mib"),
        ),
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!({"spec": small_spec(), "revision": "1"}).to_string(),
            vec![],
            400,
            Some("revision"),
        ),
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!({"spec": small_spec()}).to_string(),
            vec![("If-Match", "\"1\"")],
            409,
            Some("revision"),
        ),
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!({"spec": small_spec(), "revision": revision}).to_string(),
            vec![("If-Match", "\"1\"")],
            400,
            Some("revision"),
        ),
        (
            "PUT",
            "/api/v1/vms/keep/spec".into(),
            json!(small_spec()).to_string(),
            vec![("If-Match", if_match.as_str())],
            400,
            Some("cpus"),
        ),
        // Queries, routes, methods.
        (
            "GET",
            "/api/v1/events?follow=maybe".into(),
            "".into(),
            vec![],
            400,
            Some("follow"),
        ),
        (
            "GET",
            "/api/v1/events?vm=a%2Fb".into(),
            "".into(),
            vec![],
            400,
            Some("vm"),
        ),
        (
            "GET",
            "/api/v1/events?vm=keep&vm=other".into(),
            "".into(),
            vec![],
            400,
            Some("vm"),
        ),
        (
            "GET",
            "/api/v1/nodes/Bad_Name".into(),
            "".into(),
            vec![],
            400,
            Some("name"),
        ),
        (
            "GET",
            "/api/v1/nodes/ghost".into(),
            "".into(),
            vec![],
            404,
            Some("name"),
        ),
        ("GET", "/api/v1/nope".into(), "".into(), vec![], 404, None),
        (
            "PATCH",
            "/api/v1/vms/keep".into(),
            "{}".into(),
            vec![],
            405,
            None,
        ),
        ("PUT", "/api/v1/vms".into(), "{}".into(), vec![], 405, None),
    ];
    for (method, path, body, headers, status, field) in &cases {
        let body = (!body.is_empty()).then_some(body.as_bytes());
        let r = server.request(method, path, Some(&server.token), body, headers);
        let what = format!(
            "{method} {path} {:?}",
            body.map(|b| String::from_utf8_lossy(&b[..b.len().min(120)]))
        );
        assert_eq!(r.status, *status, "{what}: {}", r.text);
        assert!(
            r.header("content-type")
                .unwrap_or("")
                .starts_with("application/json"),
            "{what}: not JSON"
        );
        let err = r.json();
        assert!(
            err["error"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: no message in {err}"
        );
        assert_eq!(err["field"].as_str(), *field, "{what}: {err}");
        assert_eq!(server.snapshot(), before, "{what} changed the store");
    }
    assert!(server.vm("x").is_none() && server.vm("big").is_none());
}

#[test]
fn stale_revision_conflicts_and_current_revision_succeeds() {
    let server = TestServer::start();
    server.create_vm(
        "db",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped", "run_policy": "Manual"}),
    );
    let settled = server.wait_settled_stopped("db");
    let rev = settled["revision"].as_u64().unwrap();
    let new_spec =
        json!({"cpus": 2, "memory_mib": 128, "power": "Stopped", "run_policy": "Manual"});

    let before = server.snapshot();
    for (headers, body) in [
        (
            vec![("If-Match", format!("\"{}\"", rev - 1))],
            json!({"spec": new_spec}),
        ),
        (vec![], json!({"spec": new_spec, "revision": rev + 1})),
    ] {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = server.request(
            "PUT",
            "/api/v1/vms/db/spec",
            Some(&server.token),
            Some(body.to_string().as_bytes()),
            &headers,
        );
        assert_eq!(r.status, 409, "{}", r.text);
        assert_eq!(r.json()["field"], "revision");
        assert!(r.json()["error"].as_str().unwrap().contains("db"));
    }
    let r = server.send(
        "POST",
        &format!("/api/v1/vms/db/stop?revision={}", rev - 1),
        "",
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(server.snapshot(), before);

    let etag = format!("\"{rev}\"");
    let r = server.request(
        "PUT",
        "/api/v1/vms/db/spec",
        Some(&server.token),
        Some(json!({"spec": new_spec}).to_string().as_bytes()),
        &[("If-Match", &etag)],
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let body = r.json();
    assert_eq!(body["vm"]["spec"]["cpus"], 2);
    assert_eq!(
        body["vm"]["generation"],
        settled["vm"]["generation"].as_u64().unwrap() + 1
    );
    assert!(body["revision"].as_u64().unwrap() > rev);
    // The same revision again is now stale.
    let r = server.request(
        "PUT",
        "/api/v1/vms/db/spec",
        Some(&server.token),
        Some(json!({"spec": new_spec}).to_string().as_bytes()),
        &[("If-Match", &etag)],
    );
    assert_eq!(r.status, 409);
}

#[test]
fn policy_refusals_name_the_run_policy_and_change_nothing() {
    let server = TestServer::start();
    server.create_vm(
        "off",
        json!({"cpus": 1, "memory_mib": 64, "run_policy": "AlwaysOff"}),
    );
    server.wait_settled_stopped("off");
    let before = server.snapshot();
    for action in ["start", "restart"] {
        let r = server.send("POST", &format!("/api/v1/vms/off/{action}"), "");
        assert_eq!(r.status, 409, "{}", r.text);
        assert_eq!(r.json()["field"], "spec.run_policy");
        assert!(r.json()["error"].as_str().unwrap().contains("AlwaysOff"));
    }
    assert_eq!(server.snapshot(), before);

    // Once runs its one run; a start or restart would be another.
    server.create_vm(
        "once",
        json!({"cpus": 1, "memory_mib": 64, "run_policy": "Once"}),
    );
    server.wait_vm("once", "run", |v| phase(v) == "Running");
    for action in ["start", "restart"] {
        let r = server.send("POST", &format!("/api/v1/vms/once/{action}"), "");
        assert_eq!(r.status, 409, "{}", r.text);
        assert_eq!(r.json()["field"], "spec.run_policy");
        assert!(r.json()["error"].as_str().unwrap().contains("Once"));
    }
    let r = server.send("POST", "/api/v1/vms/once/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("once");

    // A VM being deleted refuses power changes, naming why.
    let r = server.send("DELETE", "/api/v1/vms/off", "");
    assert_eq!(r.status, 202);
    let r = server.send("POST", "/api/v1/vms/off/stop", "");
    assert!(
        r.status == 409 || r.status == 404,
        "{} {}",
        r.status,
        r.text
    );
    if r.status == 409 {
        assert_eq!(r.json()["field"], "deletion_requested_at");
    }
}

#[test]
fn concurrent_requests_lose_no_update() {
    let server = TestServer::start();
    server.create_vm("busy", json!({"cpus": 1, "memory_mib": 64}));
    let threads = 4;
    let per_thread = 3;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..per_thread {
                    let r = server.send("POST", "/api/v1/vms/busy/restart", "");
                    assert_eq!(r.status, 200, "{}", r.text);
                }
            });
        }
    });
    let vm = server.vm("busy").unwrap();
    assert_eq!(
        vm["vm"]["spec"]["restart_generation"],
        json!(threads * per_thread),
        "every restart request was recorded"
    );
}

#[test]
fn events_follow_streams_new_events() {
    let server = TestServer::start();
    server.create_vm(
        "tail",
        json!({"cpus": 1, "memory_mib": 64, "run_policy": "Manual"}),
    );
    server.wait_vm("tail", "run", |v| phase(v) == "Running");

    let mut resp = server
        .trust
        .agent(ureq::Agent::config_builder().proxy(None).build())
        .get(format!("{}/api/v1/events?vm=tail&follow=true", server.base))
        .header("Authorization", format!("Bearer {}", server.token))
        .call()
        .unwrap();
    assert_eq!(
        resp.headers().get("content-type").unwrap(),
        "application/x-ndjson"
    );
    let r = server.send("POST", "/api/v1/vms/tail/stop", "");
    assert_eq!(r.status, 200);
    use std::io::BufRead;
    let reader = std::io::BufReader::new(resp.body_mut().as_reader());
    let mut seen = Vec::new();
    for line in reader.lines() {
        let item: Value = serde_json::from_str(&line.unwrap()).unwrap();
        let to = item["event"]["to"].as_str().unwrap().to_string();
        seen.push(to.clone());
        if to == "Stopped" {
            break;
        }
    }
    assert_eq!(
        seen.first().map(String::as_str),
        Some("Starting"),
        "{seen:?}"
    );
    assert!(seen.contains(&"Stopping".to_string()), "{seen:?}");
}

#[test]
fn nodes_report_heartbeat_and_accelerator() {
    let server = TestServer::start();
    let start = std::time::Instant::now();
    let list = loop {
        let list = server.get("/api/v1/nodes").json();
        if !list["items"].as_array().unwrap().is_empty() {
            break list;
        }
        assert!(start.elapsed() < common::DEADLINE, "no heartbeat");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(list["items"][0]["node"]["name"], "test-node");
    let node = server.get("/api/v1/nodes/test-node");
    assert_eq!(node.status, 200);
    let node = node.json();
    assert_eq!(node["node"]["status"]["accelerator"], "Sim");
    assert!(node["node"]["status"]["last_heartbeat"].as_u64().unwrap() > 0);
    assert!(node["node"]["status"]["hypervisor"].is_string());
}

#[test]
fn openapi_describes_every_route_and_metrics_are_prometheus_text() {
    let server = TestServer::start();
    let doc = server.get("/api/v1/openapi.json").json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let policies = &doc["components"]["schemas"]["VmSpec"]["properties"]["run_policy"];
    let names: Vec<String> = keel_api::RunPolicy::ALL
        .iter()
        .map(|p| format!("{p:?}"))
        .collect();
    assert_eq!(policies["enum"], serde_json::json!(names), "{policies}");
    assert!(names.contains(&"RerunOnFailure".into()) && names.contains(&"Once".into()));
    let paths = doc["paths"].as_object().unwrap();
    for (path, methods) in [
        ("/healthz", vec!["get"]),
        ("/metrics", vec!["get"]),
        ("/api/v1/openapi.json", vec!["get"]),
        ("/api/v1/vms", vec!["get", "post"]),
        ("/api/v1/vms/{name}", vec!["get", "delete"]),
        ("/api/v1/vms/{name}/spec", vec!["put"]),
        ("/api/v1/vms/{name}/start", vec!["post"]),
        ("/api/v1/vms/{name}/stop", vec!["post"]),
        ("/api/v1/vms/{name}/restart", vec!["post"]),
        ("/api/v1/vms/{name}/reboot", vec!["post"]),
        ("/api/v1/events", vec!["get"]),
        ("/api/v1/nodes", vec!["get"]),
        ("/api/v1/nodes/{name}", vec!["get"]),
        ("/api/v1/nodes/{name}/cordon", vec!["post"]),
        ("/api/v1/nodes/{name}/uncordon", vec!["post"]),
        ("/api/v1/nodes/{name}/drain", vec!["post"]),
        ("/api/v1/nodes/{name}/freeze", vec!["post"]),
        ("/api/v1/vms/{name}/restore", vec!["post"]),
        ("/api/v1/vms/{name}/migrate", vec!["post"]),
        ("/api/v1/vms/{name}/snapshots", vec!["get", "post"]),
        ("/api/v1/vms/{name}/snapshots/{snap}", vec!["get", "delete"]),
        ("/api/v1/migrations", vec!["get"]),
    ] {
        for m in methods {
            assert!(paths[path].get(m).is_some(), "{m} {path} undocumented");
        }
    }
    // Every $ref resolves.
    let text = doc.to_string();
    for piece in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = piece.split('"').next().unwrap();
        assert!(
            doc["components"]["schemas"].get(name).is_some(),
            "dangling $ref {name}"
        );
    }

    server.create_vm(
        "m",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_settled_stopped("m");
    let _ = server.request("GET", "/api/v1/vms", None, None, &[]);
    // The counts follow the store's watch, so they may trail the record
    // just read by the time it takes an event to arrive.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let r = loop {
        let r = server.get("/metrics");
        if r.text.contains("keel_vms{phase=\"Stopped\"} 1") || std::time::Instant::now() > deadline
        {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .contains("openmetrics-text"));
    assert!(
        r.text.contains("keel_vms{phase=\"Stopped\"} 1"),
        "{}",
        r.text
    );
    assert!(
        r.text.contains("keel_vms{phase=\"Running\"} 0"),
        "{}",
        r.text
    );
    assert!(
        r.text
            .contains("keel_reconcile_errors_total{controller=\"vm\"} 0"),
        "{}",
        r.text
    );
    assert!(
        r.text
            .contains("keel_api_requests_total{method=\"GET\",status=\"401\"} 1"),
        "{}",
        r.text
    );
    assert!(r.text.contains("status=\"201\""), "{}", r.text);
}

/// Stored records are read leniently: one written by a newer Keel (a field
/// this build lacks) is served; one that cannot be decoded is left out of
/// lists, never failing them, and reported: an event naming its key and
/// the `keel_undecodable_records` metric.
#[test]
fn newer_records_are_served_and_undecodable_ones_reported() {
    let server = TestServer::start();
    server.create_vm(
        "a",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.put_raw("/vms/broken", &json!({"name": "broken", "spec": "?"}));
    server.put_raw(
        "/vms/newer",
        &json!({"name": "newer", "schema_version": 2, "added_in_v2": {"x": 1},
                "spec": {"cpus": 1, "memory_mib": 64, "power": "Stopped", "added_in_v2": 1}}),
    );
    let r = server.get("/api/v1/vms");
    assert_eq!(r.status, 200, "{}", r.text);
    let names: Vec<String> = r.json()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["vm"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["a", "newer"]);
    server.wait_vm("newer", "settle stopped", |v| phase(v) == "Stopped");

    let start = std::time::Instant::now();
    let events = loop {
        let events = server.get("/api/v1/events?vm=broken").json()["items"].clone();
        if !events.as_array().unwrap().is_empty() {
            break events;
        }
        assert!(
            start.elapsed() < common::DEADLINE,
            "no event for /vms/broken"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(events[0]["event"]["key"], "/vms/broken", "{events}");
    let metrics = server.get("/metrics").text;
    assert!(metrics.contains("keel_undecodable_records 1"), "{metrics}");
}

/// `POST /api/v1/vms/{name}/migrate` refuses, naming the field, what it
/// cannot do; an accepted request is kept on the record, and a second one
/// while it is carried out is refused.
#[test]
fn migrate_refusals_name_the_field() {
    let server = TestServer::start();
    let refused = |path: &str, body: &str, status: u16, field: &str| {
        let resp = server.send("POST", path, body);
        assert_eq!(resp.status, status, "{path} {body}: {}", resp.text);
        assert_eq!(resp.json()["field"], field, "{path} {body}: {}", resp.text);
        resp.json()["error"].as_str().unwrap().to_string()
    };
    refused("/api/v1/vms/nope/migrate", "{}", 404, "name");
    server.create_vm(
        "off",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_settled_stopped("off");
    refused("/api/v1/vms/off/migrate", "{}", 409, "status.phase");
    server.create_vm("web", small_spec());
    server.wait_vm("web", "run", |v| phase(v) == "Running");
    refused("/api/v1/vms/web/migrate", r#"{"bogus":1}"#, 400, "bogus");
    refused("/api/v1/vms/web/migrate", r#"{"to":"Bad Name"}"#, 422, "to");
    let msg = refused(
        "/api/v1/vms/web/migrate",
        r#"{"to":"test-node"}"#,
        409,
        "to",
    );
    assert!(msg.contains("already runs on node test-node"), "{msg}");
    refused("/api/v1/vms/web/migrate", r#"{"to":"ghost"}"#, 404, "to");
    // Other nodes, as their agents would have registered them: one
    // cordoned, one silent for long, one ready.
    let me = server.get("/api/v1/nodes/test-node").json();
    let me = me.get("node").cloned().unwrap_or(me);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for (name, cordoned, heartbeat) in [
        ("cordoned", true, now_ms),
        ("silent", false, now_ms - 3_600_000),
        ("ready", false, now_ms + 60_000),
    ] {
        let mut node = me.clone();
        node["name"] = json!(name);
        node["cordoned"] = json!(cordoned);
        node["status"]["last_heartbeat"] = json!(heartbeat);
        server.put_raw(&format!("/nodes/{name}"), &node);
    }
    let msg = refused("/api/v1/vms/web/migrate", r#"{"to":"cordoned"}"#, 409, "to");
    assert!(msg.contains("cordoned"), "{msg}");
    let msg = refused("/api/v1/vms/web/migrate", r#"{"to":"silent"}"#, 409, "to");
    assert!(msg.contains("not ready"), "{msg}");
    // A TPM's state cannot go with a live migration: refused, not tried.
    let mut with_tpm = small_spec();
    with_tpm["tpm"] = json!({"version": "2.0"});
    with_tpm["node"] = json!("test-node");
    server.create_vm("sealed", with_tpm);
    server.wait_vm("sealed", "run", |v| phase(v) == "Running");
    let msg = refused(
        "/api/v1/vms/sealed/migrate",
        r#"{"to":"ready"}"#,
        409,
        "spec.tpm",
    );
    assert!(msg.contains("TPM"), "{msg}");
    // A stale revision is refused as for every other write.
    let resp = server.send(
        "POST",
        "/api/v1/vms/web/migrate?revision=1",
        r#"{"to":"ready"}"#,
    );
    assert_eq!(resp.status, 409, "{}", resp.text);
    let resp = server.send("POST", "/api/v1/vms/web/migrate", r#"{"to":"ready"}"#);
    assert_eq!(resp.status, 202, "{}", resp.text);
    let vm = &resp.json()["vm"];
    assert_eq!(vm["migrate"]["to"], "ready");
    assert_eq!(vm["migrate"]["from_node"], "test-node");
    assert_eq!(vm["generation"], 1, "not a spec change");
    // The node `ready` has no agent: its migration stays pending, and the
    // request in flight refuses another.
    server.wait_vm("web", "migration reserved", |v| {
        v["vm"]["status"]["eviction"]["migration"].is_string()
    });
    refused("/api/v1/vms/web/migrate", "{}", 409, "migrate");
    let ms = server.get("/api/v1/migrations?vm=web").json();
    assert_eq!(ms["items"][0]["migration"]["target_node"], "ready", "{ms}");
}

/// A request refused before its body is read (here: no token) is
/// answered with `Connection: close`, since the server closes that
/// connection rather than wait for the rest; a client's pool then never
/// sends the next request into a closed socket. A request whose body was
/// read keeps its connection.
#[test]
fn a_refusal_before_the_body_is_read_says_the_connection_closes() {
    let server = TestServer::start();
    let body = json!({"name": "x", "spec": {"cpus": 1, "memory_mib": 64, "run_policy": "Manual", "power": "Stopped"}})
        .to_string();
    for _ in 0..20 {
        let r = server.request("POST", "/api/v1/vms", None, Some(body.as_bytes()), &[]);
        assert_eq!(r.status, 401, "{}", r.text);
        assert_eq!(r.header("connection"), Some("close"), "{:?}", r.headers);
        // The pooled client goes on at once, on a new connection.
        assert_eq!(server.get("/api/v1/vms").status, 200);
    }
    let r = server.send("POST", "/api/v1/vms", &body);
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.header("connection"), None, "{:?}", r.headers);
}

/// `?watch=true&name=NAME` streams that one VM only (not those whose
/// names start like it), and `--wait` follows it
/// (`cli::wait::follow::states`): the VM as stored, each change, then its
/// deletion; `name` without `watch` is refused naming `name`.
#[test]
fn one_vms_watch_carries_only_it_and_the_waits_follow_it() {
    use keel::cli::wait::follow::{states, Seen};
    let server = TestServer::start();
    server.create_vm(
        "web",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.create_vm(
        "web2",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    let client = keel::cli::Client::new(&server.base, &server.token, server.trust.clone()).unwrap();
    let seen = states(&client, "web");
    let next = || {
        seen.recv_timeout(common::DEADLINE)
            .expect("the watch went on")
    };
    match next() {
        Seen::Vm(resp) => assert_eq!(resp.vm.name, "web"),
        other => panic!("first the VM as stored, not {other:?}"),
    }
    // A change of the other VM is not sent; this VM's start is.
    assert_eq!(
        server.send("POST", "/api/v1/vms/web2/start", "").status,
        200
    );
    assert_eq!(server.send("POST", "/api/v1/vms/web/start", "").status, 200);
    let running = loop {
        match next() {
            Seen::Vm(resp) if resp.vm.status.phase == keel_api::Phase::Running => break resp,
            Seen::Vm(resp) => assert_eq!(resp.vm.name, "web"),
            other => panic!("only the VM's changes, not {other:?}"),
        }
    };
    assert_eq!(running.vm.name, "web");
    assert_eq!(server.send("DELETE", "/api/v1/vms/web", "").status, 202);
    loop {
        match next() {
            Seen::Gone => break,
            Seen::Vm(resp) => assert_eq!(resp.vm.name, "web"),
            Seen::Broke(why) => panic!("the watch broke: {why}"),
        }
    }
    let missing = states(&client, "nothing");
    assert!(matches!(
        missing.recv_timeout(common::DEADLINE).unwrap(),
        Seen::Gone
    ));

    let r = server.get("/api/v1/vms?name=web");
    assert_eq!((r.status, r.json()["field"].clone()), (400, json!("name")));
}

/// `GET /api/v1/vms?watch=true` (the web console's live list): the VMs
/// as listed, `synced`, then each change as the store's watch delivers
/// it, `ready` as the server decides it, and the deletion; paging
/// parameters are refused with it, naming `watch`; `GET /api/v1/whoami`
/// names the caller's token and role.
#[test]
fn vm_watch_streams_the_list_then_each_change_and_whoami_names_the_token() {
    let server = TestServer::start();
    server.create_vm(
        "before",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    // Bounded: a change the stream never delivers fails the test.
    let mut resp = server
        .trust
        .agent(
            ureq::Agent::config_builder()
                .proxy(None)
                .timeout_global(Some(common::DEADLINE))
                .build(),
        )
        .get(format!("{}/api/v1/vms?watch=true", server.base))
        .header("Authorization", format!("Bearer {}", server.token))
        .call()
        .unwrap();
    assert_eq!(
        resp.headers().get("content-type").unwrap(),
        "application/x-ndjson"
    );
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(resp.body_mut().as_reader())
        .lines()
        .map(|l| serde_json::from_str::<Value>(&l.unwrap()).unwrap());
    let first = lines.next().unwrap();
    assert_eq!(
        (&first["type"], &first["vm"]["name"]),
        (&json!("put"), &json!("before"))
    );
    assert_eq!(lines.next().unwrap()["type"], "synced");

    server.create_vm(
        "live",
        json!({"cpus": 1, "memory_mib": 64, "readiness": "console:KEEL-GUEST-READY"}),
    );
    let ready = lines
        .by_ref()
        .find(|l| l["vm"]["name"] == "live" && l["ready"] == true)
        .expect("the watch saw the new VM become ready");
    assert_eq!(ready["vm"]["status"]["phase"], "Running", "{ready}");
    assert_eq!(server.send("DELETE", "/api/v1/vms/live", "").status, 202);
    let gone = lines
        .by_ref()
        .find(|l| l["type"] == "deleted")
        .expect("the watch saw the deletion");
    assert_eq!(gone["name"], "live");

    let r = server.get("/api/v1/vms?watch=true&limit=1");
    assert_eq!((r.status, r.json()["field"].clone()), (400, json!("watch")));

    let who = server.get("/api/v1/whoami");
    assert_eq!(who.status, 200, "{}", who.text);
    assert_eq!(who.json()["role"], "admin");
    assert!(!who.text.contains(&server.token), "never the secret");
}
