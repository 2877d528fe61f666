//! The built `keel` binary against an in-process server.

mod common;

use common::cli::{fails, keel, ok};
use std::process::Command;

use common::{instance, phase, TestServer};
use serde_json::Value;

#[test]
fn create_list_restart_wait_and_errors() {
    let server = TestServer::start();

    let out = ok(&keel(
        &server,
        &[
            "vm", "create", "web", "--cpus", "2", "--memory", "128", "--disk", "data:64",
            "--policy", "manual",
        ],
    ));
    assert!(out.contains("vm web created"), "{out}");

    let list: Value =
        serde_json::from_str(&ok(&keel(&server, &["vm", "list", "-o", "json"]))).unwrap();
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["vm"]["name"], "web");
    assert_eq!(items[0]["vm"]["spec"]["disks"][0]["size_mib"], 64);
    assert_eq!(items[0]["vm"]["spec"]["run_policy"], "Manual");

    let running = server.wait_vm("web", "run", |v| phase(v) == "Running");
    let first = instance(&running).unwrap();

    let out = keel(
        &server,
        &["vm", "restart", "web", "--wait", "--timeout", "60"],
    );
    let stdout = ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let after = server.vm("web").unwrap();
    let second = instance(&after).unwrap();
    assert_ne!(first, second, "a new instance runs");
    assert_eq!(phase(&after), "Running");
    assert!(
        stdout.contains(&format!("web: Running (instance {second})")),
        "{stdout}"
    );
    assert!(
        stderr.lines().count() >= 2,
        "progress lines on stderr: {stderr}"
    );
    assert!(stderr.contains("web: "), "{stderr}");

    // A reboot: the same instance, its guest reset and ready again.
    let out = ok(&keel(
        &server,
        &["vm", "reboot", "web", "--wait", "--timeout", "60"],
    ));
    assert!(
        out.contains(&format!("web: Running (instance {second})")),
        "{out}"
    );
    let got = ok(&keel(&server, &["vm", "get", "web"]));
    let resets = got.lines().find(|l| l.starts_with("guest resets:"));
    assert!(
        resets.is_some_and(|l| l.split_whitespace().nth(2) == Some("1,")),
        "{got}"
    );

    let table = ok(&keel(&server, &["vm", "list"]));
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.contains(&second), "{table}");
    let yaml = ok(&keel(&server, &["vm", "get", "web", "-o", "yaml"]));
    assert!(yaml.contains("name: web"), "{yaml}");

    let out = ok(&keel(&server, &["vm", "stop", "web", "--wait"]));
    assert!(out.contains("web: Stopped"), "{out}");
    let events = ok(&keel(&server, &["events", "web"]));
    assert!(
        events.contains("Stopping") && events.contains("Stopped"),
        "{events}"
    );
    let node = ok(&keel(&server, &["node", "info"]));
    assert!(
        node.contains("accelerator:") && node.contains("Sim"),
        "{node}"
    );

    // Server-side validation errors reach the user with the field, non-zero exit.
    let out = keel(&server, &["vm", "create", "Bad/Name"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("field: name") && stderr.contains("422"),
        "{stderr}"
    );
    let out = keel(&server, &["vm", "create", "tiny", "--memory", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.memory_mib"));
    let out = keel(&server, &["vm", "create", "web"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists"));
    let out = keel(&server, &["vm", "start", "ghost"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ghost"));

    // A wrong token is refused.
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["vm", "list", "--server", &server.base, "--token", "nope"])
        .env("KEEL_DATA_DIR", server.dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));

    let out = ok(&keel(&server, &["vm", "delete", "web", "--wait"]));
    assert!(out.contains("web: deleted"), "{out}");
    assert!(server.vm("web").is_none());
}

#[test]
fn snapshot_create_wait_and_restore_wait_keep_the_power_state() {
    let server = TestServer::start();
    ok(&keel(
        &server,
        &[
            "vm", "create", "db", "--disk", "data:64", "--policy", "manual",
        ],
    ));
    server.wait_vm("db", "run", |v| phase(v) == "Running");

    let out = keel(&server, &["snapshot", "create", "db", "nightly", "--wait"]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("snapshot db/nightly: Ready (live"),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("db/nightly: "),
        "progress on stderr: {stderr}"
    );

    let table = ok(&keel(&server, &["snapshot", "list", "db"]));
    assert!(table.starts_with("NAME"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("nightly") && l.contains("Ready")),
        "{table}"
    );
    let list: Value = serde_json::from_str(&ok(&keel(
        &server,
        &["snapshot", "list", "db", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(list["items"][0]["snapshot"]["status"]["phase"], "Ready");
    let yaml = ok(&keel(
        &server,
        &["snapshot", "get", "db", "nightly", "-o", "yaml"],
    ));
    assert!(yaml.contains("name: nightly"), "{yaml}");

    // Stopped before the restore: stays stopped (the snapshot's spec says Running).
    ok(&keel(&server, &["vm", "stop", "db", "--wait"]));
    let out = keel(&server, &["restore", "db", "nightly", "--wait"]);
    let stdout = ok(&out);
    assert!(
        stdout.contains("db: restored from snapshot nightly; Stopped"),
        "{stdout}"
    );
    let vm = server.vm("db").unwrap();
    assert_eq!(phase(&vm), "Stopped");
    assert!(instance(&vm).is_none() && vm["vm"].get("restore").is_none());

    // Running before: runs after, in a new instance.
    ok(&keel(&server, &["vm", "start", "db", "--wait"]));
    let before = instance(&server.vm("db").unwrap()).unwrap();
    let out = keel(
        &server,
        &["restore", "db", "nightly", "--wait", "--timeout", "60"],
    );
    let stdout = ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let vm = server.vm("db").unwrap();
    let after = instance(&vm).unwrap();
    assert_ne!(before, after);
    assert_eq!(phase(&vm), "Running");
    assert!(vm["vm"].get("power_intent").is_none(), "{vm}");
    assert!(
        stdout.contains(&format!(
            "db: restored from snapshot nightly; Running (instance {after})"
        )),
        "{stdout}"
    );
    assert!(
        stderr.contains("[restoring from snapshot nightly]"),
        "progress on stderr: {stderr}"
    );
    let json_out: Value = serde_json::from_str(&ok(&keel(
        &server,
        &["restore", "db", "nightly", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(json_out["vm"]["restore"]["snapshot"], "nightly");
    server.wait_vm("db", "finish the restore", |v| {
        v["vm"].get("restore").is_none() && phase(v) == "Running"
    });

    // Errors name the field.
    let stderr = fails(&keel(&server, &["restore", "db", "missing"]));
    assert!(
        stderr.contains("field: snapshot") && stderr.contains("404"),
        "{stderr}"
    );
    let stderr = fails(&keel(&server, &["snapshot", "create", "db", "Bad_Name"]));
    assert!(
        stderr.contains("field: name") && stderr.contains("422"),
        "{stderr}"
    );
    let stderr = fails(&keel(&server, &["snapshot", "create", "db", "nightly"]));
    assert!(stderr.contains("409"), "{stderr}");

    let out = ok(&keel(&server, &["snapshot", "delete", "db", "nightly"]));
    assert!(out.contains("deletion requested"), "{out}");
    let migrations = ok(&keel(&server, &["migration", "list", "db"]));
    assert!(migrations.starts_with("ID"), "{migrations}");
    // A migration shows the bounds it runs under.
    server.put_raw(
        "/migrations/db/db-m1",
        &serde_json::json!({"id": "db-m1", "vm": "db", "source_node": "a",
            "source_instance": "db-1", "target_node": "b", "target_instance": "db-2",
            "created_at": 1, "tuning": {"downtime_limit_ms": 200},
            "status": {"phase": "Failed", "message": "no progress for 150s"}}),
    );
    let migrations = ok(&keel(&server, &["migration", "list", "db"]));
    assert!(
        migrations.lines().next().unwrap().contains("TUNING")
            && migrations.contains("timeout 150s/GiB, progress 150s, bandwidth node default, auto-converge on, downtime 200ms"),
        "{migrations}"
    );
}

/// Snapshotted while AlwaysOn and running, then switched to Manual and
/// stopped: the restore keeps Manual and Stopped, and `keel restore --wait`
/// waits for exactly that (it used to wait for Stopped while the VM came
/// back Running under the snapshot's AlwaysOn, and time out).
#[test]
fn restore_wait_agrees_with_the_controller_on_policy_and_power() {
    let server = TestServer::start();
    ok(&keel(
        &server,
        &[
            "vm", "create", "app", "--disk", "data:64", "--policy", "AlwaysOn",
        ],
    ));
    server.wait_vm("app", "run", |v| phase(v) == "Running");
    ok(&keel(
        &server,
        &["snapshot", "create", "app", "on", "--wait"],
    ));
    let rev = server.vm("app").unwrap()["revision"].clone();
    let r = server.send(
        "PUT",
        "/api/v1/vms/app/spec",
        &serde_json::json!({"revision": rev, "spec": {"cpus": 1, "memory_mib": 128,
            "disks": [{"name": "data", "size_mib": 64}], "run_policy": "Manual"}})
        .to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    ok(&keel(&server, &["vm", "stop", "app", "--wait"]));
    let out = keel(
        &server,
        &["restore", "app", "on", "--wait", "--timeout", "20"],
    );
    let stdout = ok(&out);
    assert!(
        stdout.contains("app: restored from snapshot on; Stopped"),
        "{stdout}"
    );
    let vm = server.vm("app").unwrap();
    assert_eq!(vm["vm"]["spec"]["run_policy"], "Manual", "{vm}");
    assert_eq!(vm["vm"]["spec"]["power"], "Stopped", "{vm}");
    assert_eq!(phase(&vm), "Stopped");
    assert!(instance(&vm).is_none(), "{vm}");
}

#[test]
fn node_cordon_uncordon_and_drain_wait() {
    let server = TestServer::start();
    ok(&keel(&server, &["vm", "create", "web"]));
    server.wait_vm("web", "run", |v| phase(v) == "Running");

    let out = ok(&keel(&server, &["node", "cordon", "test-node"]));
    assert!(out.contains("cordoned by operator"), "{out}");
    let out = ok(&keel(&server, &["node", "uncordon", "test-node"]));
    assert!(out.contains("an operator's cordon remains"), "{out}");
    let list = ok(&keel(&server, &["node", "list"]));
    assert!(list.contains("true (operator)"), "{list}");
    let out = ok(&keel(
        &server,
        &["node", "uncordon", "test-node", "--operator"],
    ));
    assert!(out.contains("uncordoned; new VMs may be placed"), "{out}");

    let stderr = fails(&keel(
        &server,
        &["node", "drain", "test-node", "--submit-window", "0s"],
    ));
    assert!(
        stderr.contains("field: submit_window_s") && stderr.contains("422"),
        "{stderr}"
    );
    let stderr = fails(&keel(
        &server,
        &["node", "drain", "test-node", "--fallback-window", "soon"],
    ));
    assert!(stderr.contains("soon"), "{stderr}");

    let out = keel(
        &server,
        &[
            "node",
            "drain",
            "test-node",
            "--wait",
            "--submit-window",
            "5s",
            "--migrate-window",
            "5s",
            "--fallback-window",
            "5s",
            "--max-parallel",
            "3",
            "--bandwidth",
            "64",
            "--no-auto-converge",
            "--timeout",
            "60",
        ],
    );
    let stdout = ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("node test-node: drained"), "{stdout}");
    assert!(stderr.contains("web: off node test-node"), "{stderr}");
    let vm = server.vm("web").unwrap();
    assert!(instance(&vm).is_none(), "{vm}");
    let info = ok(&keel(&server, &["node", "info", "test-node"]));
    assert!(
        info.contains("timeout 150s/GiB, progress 150s, bandwidth 64 MiB/s, auto-converge off, downtime default, parallel 3/cluster 2/node"),
        "the drain's migration bounds: {info}"
    );
    assert!(
        info.contains("true (keel)") && info.contains("completed"),
        "{info}"
    );

    let out = ok(&keel(&server, &["node", "uncordon", "test-node"]));
    assert!(out.contains("uncordoned"), "{out}");
    server.wait_vm("web", "run again", |v| phase(v) == "Running");
}

/// The README's main command, as a user runs it from a clone at a long
/// path: `keel serve --demo` with no flags but the port, from a working
/// directory of over 150 characters, so the default data dir (`./keel-data`)
/// is that long too (Unix sockets hold 107 bytes: Keel's must not live
/// there) and the guest is found at the default `./target/guest`. The
/// demo guest prints its ready marker, and `node info` names the
/// accelerator the driver settled on.
#[test]
fn serve_demo_boots_a_real_guest_from_a_deep_directory() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    if std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1") {
        return;
    }
    let guest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/guest");
    assert!(
        guest.join("vmlinuz").is_file(),
        "test guest missing; run `bash scripts/build-test-guest`"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut checkout = dir.path().canonicalize().unwrap();
    for part in [
        "home",
        "someone-with-a-long-name",
        "src",
        "github.com",
        "example-org",
    ] {
        checkout.push(part);
    }
    while checkout.as_os_str().len() < 150 {
        checkout.push("keel-checkout-at-a-long-path");
    }
    std::fs::create_dir_all(checkout.join("target/guest")).unwrap();
    for file in ["vmlinuz", "initramfs.cpio.gz"] {
        std::fs::copy(guest.join(file), checkout.join("target/guest").join(file)).unwrap();
    }
    let data_dir = checkout.join("keel-data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "serve",
            "--demo",
            "--accel",
            "tcg",
            "--listen",
            "127.0.0.1:0",
        ])
        .current_dir(&checkout)
        .env_remove("KEEL_DATA_DIR")
        .env_remove("KEEL_GUEST_DIR")
        .env_remove("KEEL_RUNTIME_DIR")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("keel serving") {
                if let Some(addr) = line.split("addr=").nth(1) {
                    let _ = addr_tx.send(addr.split_whitespace().next().unwrap().to_string());
                }
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let server_pid = child.id() as i32;
    let kill_guests = || {
        for pid in keel_testkit::procs::pids_mentioning(&[&data_dir.to_string_lossy()]) {
            if pid != server_pid {
                // SAFETY: a QEMU whose command line names this test's data dir.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    };
    let Ok(addr) = addr_rx.recv_timeout(Duration::from_secs(60)) else {
        let _ = child.kill();
        kill_guests();
        panic!("server did not come up: {}", log.join().unwrap());
    };
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .current_dir(&checkout)
            .env("KEEL_SERVER", format!("https://{addr}"))
            // The CLI finds the token in the default data dir, as the server's.
            .env_remove("KEEL_DATA_DIR")
            .env_remove("KEEL_TOKEN")
            .output()
            .unwrap()
    };
    let start = Instant::now();
    let mut last = Value::Null;
    let ready = loop {
        let out = cli(&["vm", "get", "demo", "-o", "json"]);
        if out.status.success() {
            last = serde_json::from_slice(&out.stdout).unwrap();
            if let Some(inst) = last["vm"]["status"]["instance"]["id"].as_str() {
                let console = data_dir
                    .join("node/instances")
                    .join(inst)
                    .join("console.log");
                let text = std::fs::read_to_string(console).unwrap_or_default();
                if last["vm"]["status"]["phase"] == "Running" && text.contains("KEEL-GUEST-READY") {
                    break true;
                }
            }
        }
        if start.elapsed() > Duration::from_secs(90) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let node = String::from_utf8_lossy(&cli(&["node", "info"]).stdout).into_owned();
    // SAFETY: signalling the child this test spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    kill_guests();
    let log = log.join().unwrap();
    assert!(ready, "demo guest never got ready: {last}\n{log}");
    assert!(node.contains("Tcg") && node.contains("qemu"), "{node}");
}

#[test]
fn serve_shuts_down_cleanly_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "serve",
            "--hypervisor",
            "sim",
            "--node",
            "n1",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The bound address is in the "keel serving" log line; the rest of the
    // log is collected for the failure message.
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("keel serving") {
                if let Some(addr) = line.split("addr=").nth(1) {
                    let _ = addr_tx.send(addr.split_whitespace().next().unwrap().to_string());
                }
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let addr = match addr_rx.recv_timeout(common::DEADLINE) {
        Ok(addr) => addr,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("server did not come up: {}", log.join().unwrap());
        }
    };
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .env("KEEL_SERVER", format!("https://{addr}"))
            .env("KEEL_DATA_DIR", dir.path())
            .env_remove("KEEL_TOKEN")
            .output()
            .unwrap()
    };
    let out = cli(&["vm", "create", "web", "--stopped"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: signalling the child this test spawned.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < common::DEADLINE, "server ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = log.join().unwrap();
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("SIGTERM"), "{log}");
    assert!(
        !cli(&["vm", "list"]).status.success(),
        "server still answering"
    );
}

/// `--max-concurrent-reconciles 0` (flag or environment) is a usage error
/// naming the flag, for `keel serve` and `keel agent` alike, before
/// anything starts.
#[test]
fn max_concurrent_reconciles_of_zero_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let serve = ["serve", "--hypervisor", "sim", "--listen", "127.0.0.1:0"];
    let agent = [
        "agent",
        "--store",
        "etcd://127.0.0.1:1",
        "--hypervisor",
        "sim",
    ];
    for command in [&serve[..], &agent[..]] {
        for by_env in [false, true] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel"));
            cmd.args(command)
                .args(["--data-dir", data_dir])
                // No settings file of the host's.
                .env("KEEL_CONFIG", "")
                .env_remove("KEEL_MAX_CONCURRENT_RECONCILES");
            if by_env {
                cmd.env("KEEL_MAX_CONCURRENT_RECONCILES", "0");
            } else {
                cmd.args(["--max-concurrent-reconciles", "0"]);
            }
            // Bounded: a build that accepted 0 would start serving.
            let mut child = cmd
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let deadline = std::time::Instant::now() + common::DEADLINE;
            while child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("{command:?} env={by_env}: started instead of refusing 0");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let out = child.wait_with_output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{command:?} env={by_env}: {stderr}"
            );
            assert!(
                stderr.contains("--max-concurrent-reconciles") && stderr.contains("at least 1"),
                "{command:?} env={by_env}: {stderr}"
            );
        }
    }
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing started"
    );
}

/// CPU and memory changed on a running VM wait for a restart, and `vm get`
/// and `vm list` say so until one has run.
#[test]
fn vm_get_and_list_show_the_fields_a_restart_would_apply() {
    let server = TestServer::start();
    ok(&keel(
        &server,
        &[
            "vm", "create", "rr", "--memory", "128", "--policy", "manual",
        ],
    ));
    let running = server.wait_vm("rr", "run", |v| phase(v) == "Running");
    let mut spec = running["vm"]["spec"].clone();
    spec["cpus"] = 2.into();
    spec["memory_mib"] = 256.into();
    let r = server.send(
        "PUT",
        "/api/v1/vms/rr/spec",
        &serde_json::json!({"spec": spec, "revision": running["revision"]}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = server.wait_vm("rr", "show the restart required", |v| {
        v["vm"]["status"]["restart_required"] == serde_json::json!(["cpus", "memory"])
    });
    assert_eq!(instance(&vm), instance(&running), "not restarted by itself");
    let get = ok(&keel(&server, &["vm", "get", "rr"]));
    assert!(get.contains("restart required: cpus, memory"), "{get}");
    let table = ok(&keel(&server, &["vm", "list"]));
    assert!(
        table.contains("RESTART") && table.contains("cpus,memory"),
        "{table}"
    );

    ok(&keel(
        &server,
        &["vm", "restart", "rr", "--wait", "--timeout", "60"],
    ));
    let get = ok(&keel(&server, &["vm", "get", "rr"]));
    assert!(!get.contains("restart required"), "{get}");
    assert!(get.contains("cpus:") && get.contains("2"), "{get}");
}

/// The per-VM series on `/metrics` (labels vm, node, instance; a disk
/// label on disk counters), the stats route for a viewer, `keel vm top
/// --once` on a pipe, and a stopped VM's series gone.
#[test]
fn vm_series_stats_route_and_top() {
    let server = TestServer::start();
    let mut spec = common::small_spec();
    spec["disks"] = serde_json::json!([{"name": "data", "size_mib": 64}]);
    server.create_vm("web", spec);
    let running = server.wait_vm("web", "run", |v| phase(v) == "Running");
    let inst = instance(&running).unwrap();
    let deadline = std::time::Instant::now() + common::DEADLINE;
    let page = loop {
        let page = server.get("/api/v1/vm-stats").json();
        if page["vms"][0]["ready"] == true && page["vms"][0]["cpu_seconds"].as_f64() > Some(0.0) {
            break page;
        }
        assert!(std::time::Instant::now() < deadline, "not ready: {page}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(page["node"], "test-node");
    assert_eq!(page["vms"][0]["instance"], inst.as_str());
    assert_eq!(page["vms"][0]["memory_configured_bytes"], 64 << 20);

    let labels = format!("vm=\"web\",node=\"test-node\",instance=\"{inst}\"");
    let text = server.get("/metrics").text;
    for needle in [
        format!("keel_vm_memory_configured_bytes{{{labels}}} 67108864"),
        format!("keel_vm_ready{{{labels}}} 1"),
        format!("keel_vm_vcpus{{{labels}}} 1"),
        format!("keel_vm_cpu_seconds_total{{{labels}}} "),
        format!("keel_vm_memory_rss_bytes{{{labels}}} "),
        // The sim guest's balloon report: 97 % of its memory managed, a
        // quarter of that used.
        format!("keel_vm_memory_guest_total_bytes{{{labels}}} 65095536"),
        format!("keel_vm_memory_guest_free_bytes{{{labels}}} 48821652"),
        format!("keel_vm_memory_guest_available_bytes{{{labels}}} 56958594"),
        format!("keel_vm_uptime_seconds{{{labels}}} "),
        format!("keel_vm_restarts_total{{{labels}}} 0"),
        format!("keel_vm_disk_write_bytes_total{{{labels},disk=\"data\"}} "),
        format!("keel_vm_network_receive_bytes_total{{{labels},nic=\"net0\"}} "),
        "# TYPE keel_vm_cpu_seconds counter".to_string(),
        "# HELP keel_vm_memory_rss_bytes ".to_string(),
    ] {
        assert!(text.contains(&needle), "{needle} missing in:\n{text}");
    }
    assert!(text.ends_with("# EOF\n"), "one end marker, at the end");
    assert_eq!(text.matches("# EOF").count(), 1);

    // A viewer reads the figures; no token reads nothing.
    let r = server.send(
        "POST",
        "/api/v1/tokens",
        &serde_json::json!({"name": "watcher", "role": "viewer"}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let viewer = r.json()["secret"].as_str().unwrap().to_string();
    let r = server.request("GET", "/api/v1/vm-stats", Some(&viewer), None, &[]);
    assert_eq!(r.status, 200, "{}", r.text);
    let r = server.request("GET", "/api/v1/vm-stats", None, None, &[]);
    assert_eq!(r.status, 401, "{}", r.text);

    // stdout is a pipe here: one table, not a live redraw.
    let out = ok(&keel(&server, &["vm", "top"]));
    assert!(
        !out.contains('\x1b'),
        "no screen control on a pipe: {out:?}"
    );
    assert!(out.starts_with("node test-node: 1 VMs running\n"), "{out}");
    assert!(out.contains("GUEST AVAIL"), "{out}");
    let line = out.lines().find(|l| l.starts_with("web ")).expect(&out);
    assert!(line.contains("yes"), "{line}");
    assert!(line.contains("54.3Mi/62.1Mi"), "the guest's view: {line}");
    // The sim guest keeps its vCPU 5 % busy.
    assert!(
        line.contains("5.0") || line.contains("4.9") || line.contains("5.1"),
        "{out}"
    );
    let rows: Value = serde_json::from_str(&ok(&keel(
        &server,
        &["vm", "top", "--once", "web", "-o", "json"],
    )))
    .unwrap();
    assert_eq!(rows[0]["vm"], "web");
    assert_eq!(rows[0]["guest_total_bytes"], 65095536, "{rows}");
    assert_eq!(rows[0]["guest_available_bytes"], 56958594, "{rows}");
    assert!(
        rows[0]["disk_write_bytes_per_s"].as_f64().unwrap() > 0.0,
        "{rows}"
    );
    let out = ok(&keel(&server, &["vm", "top", "--once", "nope"]));
    assert!(out.contains("not running on this node: nope"), "{out}");

    ok(&keel(
        &server,
        &["vm", "stop", "web", "--wait", "--timeout", "60"],
    ));
    // The rows follow the records by a watch: gone within moments.
    let deadline = std::time::Instant::now() + common::DEADLINE;
    loop {
        let text = server.get("/metrics").text;
        let rows = server.get("/api/v1/vm-stats").json()["vms"].clone();
        if !text.contains("vm=\"web\"") && rows == serde_json::json!([]) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a stopped VM still has series:\n{text}\n{rows}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `keel apply -f`: a dry run changes nothing; missing VMs are created,
/// a second apply finds nothing to do; `vm get -o yaml` and `vm list -o
/// json` output apply unchanged (from stdin too); a changed field shows in
/// the dry run's diff before it is applied; a VM the file leaves out is
/// deleted only with --prune, and named; an unknown field is refused
/// naming it, and nothing is changed.
#[test]
fn apply_creates_updates_and_prunes_only_when_asked() {
    use std::io::Write;
    let server = TestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vms.yaml");
    let f = file.to_str().unwrap();
    let apply_stdin = |args: &[&str], input: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .env("KEEL_SERVER", &server.base)
            .env("KEEL_DATA_DIR", server.dir.path())
            .env("KEEL_CONFIG", "")
            .env_remove("KEEL_TOKEN")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    std::fs::write(
        &file,
        "- name: web\n  spec: {cpus: 1, memory_mib: 64, power: Stopped}\n\
         - name: db\n  spec: {cpus: 1, memory_mib: 64, power: Stopped}\n",
    )
    .unwrap();
    let out = ok(&keel(&server, &["apply", "-f", f, "--dry-run"]));
    assert_eq!(out, "web: would be created\ndb: would be created\n");
    assert!(server.vm("web").is_none(), "a dry run changes nothing");
    let out = ok(&keel(&server, &["apply", "-f", f]));
    assert_eq!(out, "web: created\ndb: created\n");
    let out = ok(&keel(&server, &["apply", "-f", f]));
    assert_eq!(out, "web: unchanged\ndb: unchanged\n");

    // A VM's own output applies as it is: no diff.
    let yaml = ok(&keel(&server, &["vm", "get", "web", "-o", "yaml"]));
    let out = ok(&apply_stdin(&["apply", "-f", "-", "--dry-run"], &yaml));
    assert_eq!(out, "web: unchanged\n");
    let json = ok(&keel(&server, &["vm", "list", "-o", "json"]));
    let out = ok(&apply_stdin(&["apply", "-f", "-"], &json));
    assert_eq!(
        out, "db: unchanged\nweb: unchanged\n",
        "in the list's order"
    );

    let before = server.vm("web").unwrap();
    std::fs::write(
        &file,
        "name: web\nspec: {cpus: 2, memory_mib: 64, power: Stopped}\n",
    )
    .unwrap();
    let out = ok(&keel(&server, &["apply", "-f", f, "--dry-run"]));
    assert_eq!(out, "web: would be updated\n  spec.cpus: 1 -> 2\n");
    assert_eq!(server.vm("web").unwrap()["revision"], before["revision"]);
    let out = ok(&keel(&server, &["apply", "-f", f, "--prune", "--dry-run"]));
    assert!(
        out.ends_with("db: would be deleted (--prune: not in the file)\n"),
        "{out}"
    );
    let out = ok(&keel(&server, &["apply", "-f", f]));
    assert_eq!(
        out, "web: updated\n  spec.cpus: 1 -> 2\n",
        "db is left alone"
    );
    assert_eq!(server.vm("web").unwrap()["vm"]["spec"]["cpus"], 2);
    assert!(server.vm("db").is_some());
    let out = ok(&keel(&server, &["apply", "-f", f, "--prune"]));
    assert_eq!(
        out,
        "web: unchanged\ndb: deleted (--prune: not in the file)\n"
    );
    server.wait_gone("db");

    std::fs::write(
        &file,
        "name: web\nspec: {cpus: 4, memory_mib: 64, colour: red}\n",
    )
    .unwrap();
    let err = fails(&keel(&server, &["apply", "-f", f]));
    assert!(err.contains("[field: spec.colour]"), "{err}");
    assert_eq!(server.vm("web").unwrap()["vm"]["spec"]["cpus"], 2);
}
