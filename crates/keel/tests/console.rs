//! The console over the real HTTP API of an in-process `keel serve` (sim
//! driver): the WebSocket session (auth, one at a time, input reaches the
//! guest and its answer comes back), the console log, readiness in the
//! JSON status and the CLI's `logs`, `console` (without a terminal) and
//! `create --wait`.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{phase, TestServer};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

fn keel(server: &TestServer, args: &[&str], stdin: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_SERVER", &server.base)
        .env("KEEL_DATA_DIR", server.dir.path())
        .env_remove("KEEL_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run keel");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn running_vm(server: &TestServer, name: &str) {
    server.create_vm(
        name,
        json!({"cpus": 1, "memory_mib": 64, "readiness": "console:KEEL-GUEST-READY"}),
    );
    server.wait_vm(name, "ready", |v| {
        phase(v) == "Running" && v["vm"]["status"]["instance"]["readiness"]["ready_at"].is_u64()
    });
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(server: &TestServer, name: &str, token: &str) -> Result<Ws, WsError> {
    let (url, connector) = server.ws_url(&format!("/api/v1/vms/{name}/console"));
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector)
        .await
        .map(|(ws, _)| ws)
}

fn status_of(err: WsError) -> u16 {
    match err {
        WsError::Http(resp) => resp.status().as_u16(),
        other => panic!("expected an HTTP refusal, got {other}"),
    }
}

/// Reads binary messages until `needle` has arrived (bounded).
async fn read_until(ws: &mut Ws, needle: &str) -> String {
    let mut seen = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !seen.contains(needle) {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {seen:?}"))
            .expect("session open")
            .unwrap();
        if let Message::Binary(b) = msg {
            seen.push_str(&String::from_utf8_lossy(&b));
        }
    }
    seen
}

#[test]
fn console_session_log_and_readiness_over_the_api() {
    let server = TestServer::start();
    running_vm(&server, "web");
    let vm = server.vm("web").unwrap();
    let r = &vm["vm"]["status"]["instance"]["readiness"];
    assert!(r["ready_at"].is_u64(), "{vm}");
    assert_eq!(r["addresses"][0]["address"], "10.0.2.15/24", "{vm}");
    assert_eq!(vm["vm"]["spec"]["readiness"], "console:KEEL-GUEST-READY");

    // The log, whole and tailed.
    let log = server.get("/api/v1/vms/web/console/log");
    assert_eq!(log.status, 200);
    assert!(log.text.contains("KEEL-GUEST-READY"), "{}", log.text);
    assert!(log.header("x-keel-instance").unwrap().starts_with("web-"));
    let tail = server.get("/api/v1/vms/web/console/log?tail=1");
    assert_eq!(tail.text, "KEEL-GUEST-READY boot_id=sim\n");
    let bad = server.get("/api/v1/vms/web/console/log?tail=x");
    assert_eq!(
        (bad.status, bad.json()["field"].clone()),
        (400, json!("tail"))
    );
    assert_eq!(server.get("/api/v1/vms/nope/console/log").status, 404);
    // Same auth as the rest of the API.
    let anon = server.request("GET", "/api/v1/vms/web/console/log", None, None, &[]);
    assert_eq!(anon.status, 401);
    // A plain GET (no upgrade) is told what to do.
    let plain = server.get("/api/v1/vms/web/console");
    assert_eq!(plain.status, 400, "{}", plain.text);

    let token = server.token.clone();
    server.rt.block_on(async {
        assert_eq!(
            status_of(connect(&server, "web", "wrong").await.unwrap_err()),
            401
        );
        let mut ws = connect(&server, "web", &token).await.unwrap();
        // One session at a time.
        assert_eq!(
            status_of(connect(&server, "web", &token).await.unwrap_err()),
            409
        );
        ws.send(Message::binary(b"uname -a\n".to_vec()))
            .await
            .unwrap();
        let seen = read_until(&mut ws, "sim: uname -a").await;
        assert!(seen.starts_with("uname -a"), "{seen:?}");
        ws.close(None).await.unwrap();
        drop(ws);
        // Detached: the slot is free again.
        let mut again = None;
        for _ in 0..50 {
            match connect(&server, "web", &token).await {
                Ok(ws) => {
                    again = Some(ws);
                    break;
                }
                Err(e) => {
                    assert_eq!(status_of(e), 409);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        assert!(
            again.is_some(),
            "the first session never released the console"
        );
    });
    // What the session produced is in the log too.
    let log = server.get("/api/v1/vms/web/console/log");
    assert!(log.text.contains("sim: uname -a"), "{}", log.text);

    // A VM without an instance has no console.
    server.create_vm(
        "off",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"}),
    );
    server.wait_vm("off", "stopped", |v| phase(v) == "Stopped");
    let r = server.get("/api/v1/vms/off/console/log");
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json()["field"], "status.instance");
}

/// Console sessions are a per-token resource: past the cap the upgrade is
/// refused with a 429 naming the limit (whatever VM), another token is not
/// held back, and closing a session gives its slot back.
#[test]
fn too_many_consoles_for_one_token_are_refused_naming_the_limit() {
    let server = TestServer::start_with(|cfg| cfg.token_limits.consoles_per_token = 2);
    for name in ["c1", "c2", "c3"] {
        running_vm(&server, name);
    }
    let token = server.token.clone();
    let created = server.send(
        "POST",
        "/api/v1/tokens",
        &json!({"name": "second", "role": "operator"}).to_string(),
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let other = created.json()["secret"].as_str().unwrap().to_string();
    server.rt.block_on(async {
        let one = connect(&server, "c1", &token).await.unwrap();
        let _two = connect(&server, "c2", &token).await.unwrap();
        let refused = match connect(&server, "c3", &token).await.unwrap_err() {
            WsError::Http(resp) => {
                let body = resp.body().clone().unwrap_or_default();
                (
                    resp.status().as_u16(),
                    String::from_utf8_lossy(&body).to_string(),
                )
            }
            other => panic!("expected an HTTP refusal, got {other}"),
        };
        assert_eq!(refused.0, 429, "{}", refused.1);
        assert!(
            refused.1.contains("max-consoles-per-token"),
            "{}",
            refused.1
        );
        // Another token has its own sessions.
        let mut theirs = connect(&server, "c3", &other).await.unwrap();
        theirs.close(None).await.unwrap();
        drop(theirs);
        // Closing one of ours gives its slot back (the server notices the
        // close a moment later).
        let mut one = one;
        one.close(None).await.unwrap();
        drop(one);
        let mut opened = false;
        for _ in 0..100 {
            match connect(&server, "c3", &token).await {
                Ok(_) => {
                    opened = true;
                    break;
                }
                Err(e) => {
                    // Either slot may still be held an instant: the token's
                    // (429) or c3's own console, just closed by `other` (409).
                    let status = status_of(e);
                    assert!(status == 429 || status == 409, "{status}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        assert!(opened, "a closed session never gave its slot back");
    });
}

#[test]
fn cli_logs_console_and_create_wait() {
    let server = TestServer::start();
    let out = keel(
        &server,
        &[
            "vm",
            "create",
            "app",
            "--memory",
            "64",
            "--readiness",
            "agent",
            "--wait",
            "--timeout",
            "30",
        ],
        b"",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("vm app created: yes, since"), "{stdout}");

    let out = keel(&server, &["vm", "get", "app"], b"");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("10.0.2.15/24 (eth0)"), "{stdout}");
    assert!(
        stdout.contains("guest agent") && stdout.contains("answering"),
        "{stdout}"
    );
    let out = keel(&server, &["vm", "list"], b"");
    assert!(String::from_utf8_lossy(&out.stdout).contains("READY"));

    let out = keel(&server, &["vm", "logs", "app", "--tail", "1"], b"");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "KEEL-GUEST-READY boot_id=sim\n"
    );

    // No terminal: stdin goes to the guest as it is, the answer comes back.
    let out = keel(&server, &["vm", "console", "app"], b"echo hi\n");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("sim: echo hi"), "{stdout}");

    // Refusals carry the server's reason.
    let out = keel(&server, &["vm", "console", "ghost"], b"");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("HTTP 404"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = keel(
        &server,
        &["vm", "create", "x", "--readiness", "sometimes"],
        b"",
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.readiness"));

    // A guest whose agent never answers: --wait times out, saying why.
    let out = keel(
        &server,
        &[
            "vm",
            "create",
            "mute",
            "--memory",
            "64",
            "--readiness",
            "console:NEVER",
            "--wait",
            "--timeout",
            "2",
        ],
        b"",
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("timed out") && err.contains("NEVER"), "{err}");
}

/// Everything printed came from a hostile guest, or a record that kept
/// what one sent: no character of it may drive the operator's terminal.
/// A CR that ends a line (a guest's CR-LF, or the pty's own before each
/// LF) is allowed.
fn assert_terminal_safe(what: &str, out: &[u8]) {
    let text = String::from_utf8_lossy(out);
    let lines = text.replace("\r\n", "\n").replace("\r\n", "\n");
    let bad: Vec<char> = lines
        .chars()
        .filter(|c| !matches!(c, '\n' | '\t') && keel_api::untrusted::is_unsafe_char(*c))
        .collect();
    assert!(bad.is_empty(), "{what} printed {bad:?}: {text:?}");
}

const PWNED: &str = "\x1b]0;pwned\x07\x1b[2J";

/// Runs `keel ARGS` with its stdout on a pseudo-terminal; what it wrote.
fn keel_on_a_terminal(server: &TestServer, args: &[&str]) -> Vec<u8> {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills two descriptors this function then owns.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both were just opened and are owned nowhere else.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel"));
    cmd.args(args)
        .env("KEEL_SERVER", &server.base)
        .env("KEEL_DATA_DIR", server.dir.path())
        .env_remove("KEEL_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::from(slave))
        .stderr(Stdio::inherit());
    let status = cmd.status().unwrap();
    assert!(status.success(), "keel {args:?}: {status}");
    // The child is gone and `cmd` holds the last copy of the slave: once
    // it goes, reading the master ends (EIO) after what was written.
    drop(cmd);
    let mut out = Vec::new();
    let mut master = std::fs::File::from(master);
    let mut buf = [0u8; 4096];
    while let Ok(n) = master.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// Issue 32, item 4: a guest whose agent reports a host name and an
/// interface full of terminal escapes, an old record's event that quotes
/// them raw, and a console that prints them.
#[test]
fn guest_text_reaches_the_terminal_escaped() {
    let server = TestServer::start_with(|cfg| {
        cfg.sim.agent_answers = Some(keel_hv::sim::SimAgentAnswers {
            interfaces: json!([{"name": format!("eth0{PWNED}\u{202e}"), "ip-addresses": [
                {"ip-address": "10.0.2.15", "prefix": 24},
                {"ip-address": format!("10.0.2.16{PWNED}"), "prefix": 24}]}]),
            host_name: json!({"host-name": format!("web{PWNED}")}),
        });
    });
    server.create_vm(
        "app",
        json!({"cpus": 1, "memory_mib": 64, "readiness": "agent"}),
    );
    let v = server.wait_vm("app", "agent answering", |v| {
        v["vm"]["status"]["instance"]["readiness"]["hostname"].is_string()
    });
    let r = &v["vm"]["status"]["instance"]["readiness"];
    assert_eq!(r["hostname"], "web\\x1b]0;pwned\\x07\\x1b[2J", "{r}");
    assert_eq!(r["addresses"].as_array().unwrap().len(), 1, "{r}");
    // An event as an older Keel might have stored it, quoting the guest.
    server.put_raw(
        "/events/app/99999999999999999999",
        &json!({"at": 1, "vm": "app", "from": "Running", "to": "Running",
                "reason": format!("guest said {PWNED}\u{9b}2J")}),
    );
    for args in [
        &["vm", "get", "app"][..],
        &["vm", "get", "app", "-o", "json"],
        &["vm", "get", "app", "-o", "yaml"],
        &["vm", "list"],
        &["events", "app"],
        &["events", "app", "-o", "json"],
    ] {
        let out = keel(&server, args, b"");
        assert!(out.status.success(), "{args:?}");
        assert_terminal_safe(&format!("{args:?}"), &out.stdout);
    }
    let out = keel(&server, &["vm", "get", "app"], b"");
    let get = String::from_utf8_lossy(&out.stdout);
    assert!(
        get.contains("hostname:") && get.contains("web\\x1b]0;pwned\\x07"),
        "{get}"
    );
    let out = keel(&server, &["events", "app"], b"");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("guest said \\x1b]0;pwned\\x07\\x1b[2J\\u{9b}2J"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The guest's console prints the escapes (the sim echoes its input).
    let out = keel(
        &server,
        &["vm", "console", "app"],
        format!("title{PWNED}\n").as_bytes(),
    );
    assert!(out.status.success());
    let raw_log = |bytes: &[u8]| bytes.windows(PWNED.len()).any(|w| w == PWNED.as_bytes());
    // To a pipe, the log's bytes as they are: scripts see what the guest wrote.
    let out = keel(&server, &["vm", "logs", "app"], b"");
    assert!(
        raw_log(&out.stdout),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    // To a terminal, escaped, lines kept; and as they are with --raw.
    let shown = keel_on_a_terminal(&server, &["vm", "logs", "app"]);
    assert_terminal_safe("vm logs on a terminal", &shown);
    let shown = String::from_utf8_lossy(&shown);
    assert!(
        shown.contains("sim: title\\x1b]0;pwned\\x07\\x1b[2J"),
        "{shown:?}"
    );
    assert!(shown.contains("KEEL-GUEST-READY boot_id=sim"), "{shown:?}");
    let shown = keel_on_a_terminal(&server, &["vm", "logs", "app", "--raw"]);
    assert!(raw_log(&shown), "{:?}", String::from_utf8_lossy(&shown));
}

/// The graphical console's route on the sim driver (no display): a VM
/// without `spec.boot.graphics` is a 409 naming it, a plain GET is told to
/// upgrade, the sim's instance has no VNC server (409), it counts as one
/// of the token's console sessions, and `keel vm get` shows the installer
/// lines. The real VNC stream is in `qemu_images.rs`.
#[test]
fn the_graphical_console_route_names_what_is_missing() {
    let server = TestServer::start_with(|cfg| cfg.token_limits.consoles_per_token = 1);
    running_vm(&server, "plain");
    let r = server.get("/api/v1/vms/plain/vnc");
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.json()["field"], "spec.boot.graphics", "{}", r.text);
    assert_eq!(server.get("/api/v1/vms/nope/vnc").status, 404);

    server.create_vm(
        "gfx",
        json!({"cpus": 1, "memory_mib": 64, "readiness": "console:KEEL-GUEST-READY",
               "boot": {"graphics": "vnc"}}),
    );
    server.wait_vm("gfx", "ready", |v| {
        phase(v) == "Running" && v["vm"]["status"]["instance"]["readiness"]["ready_at"].is_u64()
    });
    let r = server.get("/api/v1/vms/gfx/vnc");
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json()["field"], "upgrade", "{}", r.text);
    let token = server.token.clone();
    server.rt.block_on(async {
        let (url, connector) = server.ws_url("/api/v1/vms/gfx/vnc");
        let mut req = url.into_client_request().unwrap();
        req.headers_mut().insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        let attempt = || {
            tokio_tungstenite::connect_async_tls_with_config(
                req.clone(),
                None,
                false,
                connector.clone(),
            )
        };
        let err = attempt().await.map(|_| ()).unwrap_err();
        assert_eq!(status_of(err), 409);
        // The token's one console session is taken by a serial console.
        let _serial = connect(&server, "plain", &token).await.unwrap();
        match attempt().await.map(|_| ()).unwrap_err() {
            WsError::Http(resp) => {
                let body = String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default())
                    .into_owned();
                assert_eq!(resp.status().as_u16(), 429, "{body}");
                assert!(body.contains("max-consoles-per-token"), "{body}");
            }
            other => panic!("expected an HTTP refusal, got {other}"),
        }
    });

    let shown = keel(&server, &["vm", "get", "gfx"], b"");
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("graphics") && text.contains("/api/v1/vms/gfx/vnc"),
        "{text}"
    );
}

/// The browser's way in (`api::ws_auth`): no `Authorization` header, the
/// token offered as the subprotocol `keel.bearer.<token>` beside
/// `keel.console`; the server selects `keel.console` (never the token's
/// entry), a wrong token is refused as without one, and outside a
/// WebSocket upgrade the subprotocol header authorises nothing.
#[test]
fn a_browser_attaches_with_its_token_as_a_subprotocol() {
    let server = TestServer::start();
    running_vm(&server, "web");
    let offer = |token: &str| format!("keel.console, keel.bearer.{token}");
    let token = server.token.clone();
    server.rt.block_on(async {
        let connect_offering = |protocols: String| {
            let (url, connector) = server.ws_url("/api/v1/vms/web/console");
            let mut req = url.into_client_request().unwrap();
            req.headers_mut().insert(
                "sec-websocket-protocol",
                HeaderValue::from_str(&protocols).unwrap(),
            );
            tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector)
        };
        let refused = connect_offering(offer("wrong")).await.unwrap_err();
        assert_eq!(status_of(refused), 401);
        let (mut ws, resp) = connect_offering(offer(&token)).await.unwrap();
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap()),
            Some("keel.console")
        );
        ws.send(Message::binary(b"uname -a\n".to_vec()))
            .await
            .unwrap();
        read_until(&mut ws, "sim: uname -a").await;
        ws.close(None).await.unwrap();
    });
    let plain = server.request(
        "GET",
        "/api/v1/vms/web",
        None,
        None,
        &[("sec-websocket-protocol", &offer(&token))],
    );
    assert_eq!(plain.status, 401, "{}", plain.text);
}
