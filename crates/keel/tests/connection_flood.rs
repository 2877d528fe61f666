//! A `keel serve` process under a flood of half-open connections: a valid
//! request still gets through at once and the guest it runs is untouched.
//! Before the listener had caps and a header timeout, 1,100 half-sent
//! request heads held the API for more than 75 s (`Too many open files`).
//! The server runs with a descriptor limit of 1,024 (soft and hard, so it
//! cannot raise it), the limit of that report. Traffic goes to loopback only.

mod procs;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel::cli::server_trust::ServerTrust;
use procs::{processes_naming, qemus_of, test_guest};

const FLOOD: usize = 2_000;

#[test]
fn two_thousand_half_open_connections_delay_no_request_and_kill_no_guest() {
    let scratch = tempfile::tempdir().unwrap();
    let data_dir = scratch.path().join("data");
    let mut server = Command::new(env!("CARGO_BIN_EXE_keel"));
    server
        .args([
            "serve",
            "--accel",
            "tcg",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(&data_dir)
        .env("KEEL_GUEST_DIR", test_guest())
        .env("KEEL_CONFIG", "")
        .env_remove("KEEL_STORE")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe and writes nothing of ours.
    unsafe {
        server.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut server = server.spawn().unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let stderr = server.stderr.take().unwrap();
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
    let stop = |server: &mut std::process::Child| {
        let _ = server.kill();
        let _ = server.wait();
        for (pid, _) in processes_naming(&data_dir.to_string_lossy()) {
            // SAFETY: kill(2) on a process (QEMU, passt) naming this test's
            // data dir.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    };
    let Ok(addr) = addr_rx.recv_timeout(Duration::from_secs(60)) else {
        stop(&mut server);
        panic!("server did not come up: {}", log.join().unwrap());
    };
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .env("KEEL_SERVER", format!("https://{addr}"))
            .env("KEEL_DATA_DIR", &data_dir)
            .env_remove("KEEL_TOKEN")
            .env("KEEL_CONFIG", "")
            .output()
            .unwrap()
    };
    let created = cli(&[
        "vm",
        "create",
        "web",
        "--cpus",
        "1",
        "--memory",
        "128",
        "--readiness",
        "console:KEEL-GUEST-READY",
        "--wait",
    ]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let qemus_before = qemus_of(&data_dir, "web");
    assert_eq!(qemus_before.len(), 1, "{qemus_before:?}");

    // Each connection sends half a TLS handshake record (a header that
    // announces 512 bytes, then 3 of them) and then nothing: it stalls in
    // the handshake, before any request head.
    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        match TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5)) {
            Ok(mut s) => {
                let _ = s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01]);
                flood.push(s);
            }
            Err(e) => panic!(
                "connection {} was not accepted: {e}; the server is out of descriptors or places",
                flood.len()
            ),
        }
    }
    // Given a moment to be accepted (and displace each other).
    std::thread::sleep(Duration::from_millis(500));

    for attempt in 0..3 {
        let began = Instant::now();
        let answer = health(&addr, &data_dir);
        let took = began.elapsed();
        eprintln!("request {attempt} under the flood: {took:?}: {answer:?}");
        assert_eq!(answer, 200, "GET /healthz");
        assert!(
            took < Duration::from_secs(1),
            "a valid request took {took:?} under {FLOOD} half-open connections"
        );
    }
    let began = Instant::now();
    let got = cli(&["vm", "get", "web", "-o", "json"]);
    eprintln!("keel vm get under the flood: {:?}", began.elapsed());
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    let vm: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(vm["vm"]["status"]["phase"], "Running", "{vm}");
    assert_eq!(
        qemus_of(&data_dir, "web"),
        qemus_before,
        "the guest changed"
    );

    // Past the header timeout every half-sent handshake has been dropped.
    std::thread::sleep(Duration::from_secs(11));
    let open = flood
        .iter_mut()
        .map(still_open)
        .filter(|open| *open)
        .count();
    drop(flood);
    assert_eq!(open, 0, "half-open connections outlived the header timeout");
    assert_eq!(health(&addr, &data_dir), 200);
    assert_eq!(
        qemus_of(&data_dir, "web"),
        qemus_before,
        "the guest changed"
    );
    stop(&mut server);
    let log = log.join().unwrap();
    assert!(
        !log.contains("Too many open files"),
        "the server ran out of descriptors:\n{log}"
    );
}

/// Whether the server still holds `s` open: a read would block rather
/// than see the end (or a reset).
fn still_open(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => continue,
            Err(e) => {
                return matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

/// `GET /healthz` over HTTPS on a connection of its own (trusting the
/// server's certificate from its data dir); the status.
fn health(addr: &str, data_dir: &std::path::Path) -> u16 {
    let trust = ServerTrust::of_data_dir(data_dir).unwrap();
    let agent = trust.agent(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(Duration::from_secs(5)))
            .build(),
    );
    match agent.get(format!("https://{addr}/healthz")).call() {
        Ok(resp) => resp.status().as_u16(),
        Err(e) => panic!("GET /healthz: {e}"),
    }
}
