//! The built `keel` binary against an in-process server.

mod common;

use std::process::{Command, Output};

use common::{instance, phase, TestServer};
use serde_json::Value;

fn keel(server: &TestServer, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_SERVER", &server.base)
        // The token comes from the data dir, as for a local operator.
        .env("KEEL_DATA_DIR", server.dir.path())
        .env_remove("KEEL_TOKEN")
        .output()
        .expect("run keel")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

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
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));

    let out = ok(&keel(&server, &["vm", "delete", "web", "--wait"]));
    assert!(out.contains("web: deleted"), "{out}");
    assert!(server.vm("web").is_none());
}

/// The README's main command, in small: `keel serve --demo` with the real
/// QEMU driver boots the demo VM's guest, and `node info` names the
/// accelerator the driver settled on.
#[test]
fn serve_demo_boots_a_real_guest() {
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
    let data_dir = dir.path().canonicalize().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["serve", "--hypervisor", "qemu", "--accel", "tcg", "--demo"])
        .args(["--node", "n1", "--listen", "127.0.0.1:0"])
        .arg("--guest-dir")
        .arg(&guest)
        .arg("--data-dir")
        .arg(&data_dir)
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
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*data_dir.to_string_lossy())
                && pid != server_pid
            {
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
            .env("KEEL_SERVER", format!("http://{addr}"))
            .env("KEEL_DATA_DIR", &data_dir)
            .env_remove("KEEL_TOKEN")
            .output()
            .unwrap()
    };
    let start = Instant::now();
    let running = loop {
        let out = cli(&["vm", "get", "demo", "-o", "json"]);
        if out.status.success() {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            if v["vm"]["status"]["phase"] == "Running" {
                break true;
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
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
    assert!(running, "demo VM never ran: {log}");
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
            .env("KEEL_SERVER", format!("http://{addr}"))
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
