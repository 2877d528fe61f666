//! The web console in a real browser: Debian's chromium, headless, driven
//! over WebDriver (chromedriver) against a real `keel serve --demo`
//! process whose demo VM is a real QEMU test guest (TCG). An admin signs
//! in, sees the demo VM Running and ready in the live list, opens its
//! page and its serial console (xterm.js over the console WebSocket, the
//! token sent as a subprotocol) and gets an answer from the guest's
//! shell, opens the graphical console of a second guest made with
//! `--graphics vnc` (noVNC over the VNC WebSocket) and sees its screen
//! drawn, stops the VM from the page and sees the stop's progress end in
//! Stopped; a viewer token then sees no action buttons, and the API
//! refuses the viewer's start all the same.
//!
//! The server speaks plain HTTP on loopback (`--insecure-http`), so the
//! browser needs no certificate exception. With `KEEL_WEBUI_SCREENSHOTS=1`
//! the test writes the README's pictures (`docs/webui-vms.png`,
//! `docs/webui-vm.png`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::key::Key;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// Every wait of the test is bounded by this; each returns as soon as
/// its condition holds.
const WAIT: Duration = Duration::from_secs(60);

/// The processes the test started, ended however the test ends.
struct Processes {
    server: Option<Child>,
    driver: Option<Child>,
    data_dir: PathBuf,
}

impl Drop for Processes {
    fn drop(&mut self) {
        if let Some(server) = &mut self.server {
            // SAFETY: signalling the child this test spawned.
            unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
            let _ = server.wait();
        }
        if let Some(driver) = &mut self.driver {
            let _ = driver.kill();
            let _ = driver.wait();
        }
        // A guest the server left behind (its QEMU names the data dir).
        keel_testkit::procs::kill_mentioning(&self.data_dir);
    }
}

/// `keel serve --demo` on a free loopback port; its base URL.
fn start_server(procs: &mut Processes) -> String {
    let guest = keel_testkit::guest::required_dir();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "serve",
            "--demo",
            "--accel",
            "tcg",
            "--insecure-http",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(&procs.data_dir)
        .env("KEEL_GUEST_DIR", &guest)
        .env_remove("KEEL_RUNTIME_DIR")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run keel serve");
    let stderr = child.stderr.take().unwrap();
    procs.server = Some(child);
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("keel serving") {
                if let Some(addr) = line.split("addr=").nth(1) {
                    let _ = addr_tx.send(addr.split_whitespace().next().unwrap().to_string());
                }
            }
        }
    });
    let addr = addr_rx
        .recv_timeout(WAIT)
        .expect("keel serve did not say where it listens");
    format!("http://{addr}")
}

/// chromedriver on a free loopback port; its URL.
fn start_driver(procs: &mut Processes) -> String {
    for tool in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            Path::new(tool).is_file(),
            "{tool} missing: scripts/setup installs chromium and chromium-driver"
        );
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(CHROMEDRIVER)
        .arg(format!("--port={port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run chromedriver");
    let stdout = child.stdout.take().unwrap();
    procs.driver = Some(child);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("started successfully") {
                let _ = ready_tx.send(());
            }
        }
    });
    ready_rx
        .recv_timeout(WAIT)
        .expect("chromedriver did not start");
    format!("http://127.0.0.1:{port}")
}

async fn browser(driver: &str, profile: &Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                "--window-size=1360,900",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(driver)
        .await
        .expect("a WebDriver session with chromium")
}

/// Runs `script` (a function body returning a value) until `pred` holds
/// for its result; the last result on timeout.
async fn wait_js(c: &Client, what: &str, script: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let value = c.execute(script, vec![]).await.expect("script runs");
        if pred(&value) {
            return value;
        }
        if Instant::now() > deadline {
            let page = c
                .execute("return document.body.innerText", vec![])
                .await
                .unwrap_or_default();
            panic!("timed out waiting for {what}: last {value}; page:\n{page}");
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

fn text_of(selector: &str) -> String {
    format!("const e = document.querySelector({selector:?}); return e ? e.textContent : null;")
}

async fn sign_in(c: &Client, base: &str, token: &str) {
    c.goto(base).await.unwrap();
    let field = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#token"))
        .await
        .unwrap();
    field.send_keys(token).await.unwrap();
    c.find(Locator::Css("#login-button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_js(c, "signed in", &text_of("#who"), |v| {
        v.as_str().is_some_and(|t| !t.is_empty())
    })
    .await;
}

/// Clicks `selector` once it is there. The live list and pages redraw as
/// the VMs change, so the element found may be replaced before the click
/// lands (a stale reference): then it is found again and clicked again.
async fn click(c: &Client, selector: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let element = c
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(selector))
            .await
            .unwrap_or_else(|e| panic!("no {selector}: {e}"));
        match element.click().await {
            Ok(()) => return,
            Err(fantoccini::error::CmdError::Standard(e))
                if e.error == fantoccini::error::ErrorStatus::StaleElementReference
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("clicking {selector}: {e}"),
        }
    }
}

async fn action_buttons(c: &Client) -> u64 {
    c.execute(
        "return document.querySelectorAll('[data-action]').length",
        vec![],
    )
    .await
    .unwrap()
    .as_u64()
    .unwrap()
}

fn screenshot(png: &[u8], name: &str) {
    if std::env::var("KEEL_WEBUI_SCREENSHOTS").as_deref() != Ok("1") {
        return;
    }
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(docs.join(name), png).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_console_in_a_real_browser() {
    if std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1") {
        return;
    }
    let started = Instant::now();
    let scratch = tempfile::tempdir().unwrap();
    let mut procs = Processes {
        server: None,
        driver: None,
        data_dir: scratch.path().join("data"),
    };
    let base = start_server(&mut procs);
    let driver = start_driver(&mut procs);
    let admin = std::fs::read_to_string(procs.data_dir.join("token"))
        .unwrap()
        .trim()
        .to_string();
    let viewer = {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["token", "create", "web-viewer", "--role", "viewer"])
            .env("KEEL_SERVER", &base)
            .env("KEEL_DATA_DIR", &procs.data_dir)
            .env_remove("KEEL_TOKEN")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let keel_cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .env("KEEL_SERVER", &base)
            .env("KEEL_TOKEN", &admin)
            .output()
            .unwrap();
        assert!(out.status.success(), "keel {args:?}: {out:?}");
    };
    // A guest with a graphical console, booting beside the demo VM.
    keel_cli(&[
        "vm",
        "create",
        "gfx",
        "--cpus",
        "1",
        "--memory",
        "256",
        "--graphics",
        "vnc",
        // Its screen is what is looked at, not its guest's readiness.
        "--readiness",
        "none",
    ]);
    let c = browser(&driver, &scratch.path().join("profile")).await;

    // The admin's list: the demo VM Running and ready, from the watch.
    sign_in(&c, &base, &admin).await;
    wait_js(
        &c,
        "the demo VM Running and ready in the list",
        "const r = document.querySelector('tr[data-vm=\"demo\"]'); \
         return r ? [r.querySelector('td.phase').textContent, r.querySelector('td.ready').textContent] : null;",
        |v| v == &json!(["Running", "yes"]),
    )
    .await;
    // The token is in the tab's session only, never in the URL.
    let where_token = c
        .execute(
            "return [location.href, sessionStorage.getItem('keel.token'), localStorage.length]",
            vec![],
        )
        .await
        .unwrap();
    assert!(!where_token[0].as_str().unwrap().contains(&admin));
    assert_eq!(where_token[1], json!(admin));
    assert_eq!(where_token[2], json!(0));
    screenshot(&c.screenshot().await.unwrap(), "webui-vms.png");

    // Its page, and its serial console: the guest's shell answers.
    click(&c, "tr[data-vm=\"demo\"] a").await;
    wait_js(&c, "the VM page", &text_of("#vm-page h1"), |v| v == "demo").await;
    click(&c, "[data-action=console]").await;
    wait_js(
        &c,
        "the console attached",
        "return document.getElementById('console-panel').dataset.state",
        |v| v == "open",
    )
    .await;
    let keys = c
        .find(Locator::Css("#terminal .xterm-helper-textarea"))
        .await
        .unwrap();
    keys.send_keys(&format!("echo web$((6*7)){}", char::from(Key::Enter)))
        .await
        .unwrap();
    let screen = wait_js(
        &c,
        "the guest's shell to answer in the terminal",
        &text_of("#terminal .xterm-rows"),
        |v| v.as_str().is_some_and(|t| t.contains("web42")),
    )
    .await;
    // The prompt came back after the answer: a live root shell.
    let screen = screen.as_str().unwrap();
    assert!(
        screen[screen.find("web42").unwrap()..].contains('#'),
        "{screen}"
    );
    if std::env::var("KEEL_WEBUI_SCREENSHOTS").as_deref() == Ok("1") {
        // The whole page, its head and its console in one picture.
        c.set_window_size(1360, 1900).await.unwrap();
        c.execute("window.scrollTo(0, 0)", vec![]).await.unwrap();
        screenshot(&c.screenshot().await.unwrap(), "webui-vm.png");
        c.set_window_size(1360, 900).await.unwrap();
    }

    // The graphical console of the VNC guest: noVNC connects through the
    // VNC WebSocket and draws the guest's screen (the firmware's and the
    // kernel's text) on its canvas.
    click(&c, "#console-close").await;
    click(&c, "a[data-nav=vms]").await;
    wait_js(
        &c,
        "the VNC VM Running and ready in the list",
        "const r = document.querySelector('tr[data-vm=\"gfx\"]'); \
         return r ? [r.querySelector('td.phase').textContent, r.querySelector('td.ready').textContent] : null;",
        |v| v == &json!(["Running", "yes"]),
    )
    .await;
    click(&c, "tr[data-vm=\"gfx\"] a").await;
    wait_js(&c, "the VNC VM's page", &text_of("#vm-page h1"), |v| {
        v == "gfx"
    })
    .await;
    click(&c, "#vm-page [data-action=screen]").await;
    wait_js(
        &c,
        "the graphical console connected",
        "return document.getElementById('screen-panel').dataset.state",
        |v| v == "connected",
    )
    .await;
    let drawn = wait_js(
        &c,
        "the guest's screen drawn on the canvas",
        "const c = document.querySelector('#screen canvas'); \
         if (!c || !c.width || !c.height) return null; \
         const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; \
         let lit = 0; for (let i = 0; i < d.length; i += 4) if (d[i] | d[i + 1] | d[i + 2]) lit++; \
         return [c.width, c.height, lit];",
        |v| v[2].as_u64().is_some_and(|lit| lit > 0),
    )
    .await;
    // QEMU's VGA mode at boot, not a blank default canvas.
    assert!(drawn[0].as_u64().unwrap() >= 640, "{drawn}");
    click(&c, "#screen-close").await;
    keel_cli(&["vm", "delete", "gfx"]);
    click(&c, "a[data-nav=vms]").await;
    click(&c, "tr[data-vm=\"demo\"] a").await;
    wait_js(&c, "the VM page", &text_of("#vm-page h1"), |v| v == "demo").await;

    // Stop from the page: the progress follows it to Stopped.
    click(&c, "#vm-page [data-action=stop]").await;
    let progress = wait_js(
        &c,
        "the stop's progress to finish",
        "const p = document.getElementById('progress'); \
         return p && p.textContent.includes('stop') && p.dataset.state !== 'busy' ? [p.dataset.state, p.textContent] : null;",
        |v| v[0] == "done" || v[0] == "failed",
    )
    .await;
    assert_eq!(progress[0], "done", "{progress}");

    // A snapshot of the stopped VM, named in the page's prompt, followed
    // to Ready and listed on the page.
    click(&c, "#vm-page [data-action=snapshot]").await;
    c.send_alert_text("from-the-page").await.unwrap();
    c.accept_alert().await.unwrap();
    wait_js(
        &c,
        "the snapshot Ready in the VM's list",
        &text_of("tr[data-snapshot=\"from-the-page\"] td.phase"),
        |v| v == "Ready",
    )
    .await;
    // Restored from it (confirmed in the page's dialog): the progress
    // ends with the VM back Stopped, as it was.
    click(
        &c,
        "tr[data-snapshot=\"from-the-page\"] [data-action=restore]",
    )
    .await;
    c.accept_alert().await.unwrap();
    let restored = wait_js(
        &c,
        "the restore's progress to finish",
        "const p = document.getElementById('progress'); \
         return p && p.textContent.includes('restore') && p.dataset.state !== 'busy' ? [p.dataset.state, p.textContent] : null;",
        |v| v[0] == "done" || v[0] == "failed",
    )
    .await;
    assert_eq!(restored[0], "done", "{restored}");
    assert!(
        restored[1].as_str().unwrap().contains("Stopped"),
        "{restored}"
    );
    click(&c, "a[data-nav=vms]").await;
    wait_js(
        &c,
        "the demo VM Stopped in the list",
        &text_of("tr[data-vm=\"demo\"] td.phase"),
        |v| v == "Stopped",
    )
    .await;

    // The create form posts the fields of `keel vm create`: a stopped VM
    // appears in the list through the watch.
    click(&c, "[data-action=create]").await;
    let form = c
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css("#create-form"))
        .await
        .unwrap();
    let input = |name: &'static str| {
        let form = form.clone();
        async move {
            form.find(Locator::Css(&format!("[name={name}]")))
                .await
                .unwrap()
        }
    };
    input("name")
        .await
        .send_keys("from-the-form")
        .await
        .unwrap();
    let memory = input("memory_mib").await;
    memory.clear().await.unwrap();
    memory.send_keys("64").await.unwrap();
    input("power")
        .await
        .select_by_label("Stopped")
        .await
        .unwrap();
    click(&c, "#create-form button[type=submit]").await;
    wait_js(
        &c,
        "the VM made with the form, Stopped, in the list",
        "const r = document.querySelector('tr[data-vm=\"from-the-form\"]'); \
         return r ? [r.querySelector('td.phase').textContent, r.children[5].textContent] : null;",
        |v| v == &json!(["Stopped", "1 / 64 MiB"]),
    )
    .await;

    // The node page lists this server's node, with Drain for an admin;
    // the events page has the demo VM's phase changes.
    click(&c, "a[data-nav=nodes]").await;
    wait_js(
        &c,
        "the node with its Drain button",
        "return document.querySelectorAll('tr[data-node] [data-action=drain]').length",
        |v| v == 1,
    )
    .await;
    // Drained (confirmed in the dialog; nothing runs there now, so the
    // drain completes) and uncordoned again from the page.
    click(&c, "tr[data-node] [data-action=drain]").await;
    c.accept_alert().await.unwrap();
    click(&c, "tr[data-node] [data-action=uncordon]").await;
    wait_js(
        &c,
        "the node ready again, with its Drain button",
        "const r = document.querySelector('tr[data-node]'); \
         return r ? [r.querySelector('td.state').textContent, r.querySelectorAll('[data-action=drain]').length] : null;",
        |v| v == &json!(["ready", 1]),
    )
    .await;
    click(&c, "a[data-nav=events]").await;
    wait_js(
        &c,
        "the demo VM's events",
        "return document.getElementById('view').innerText",
        |v| v.as_str().is_some_and(|t| t.contains("Stopping → Stopped")),
    )
    .await;
    click(&c, "a[data-nav=vms]").await;

    // A viewer: the same pages, no action buttons; the API refuses anyway.
    click(&c, "#logout").await;
    sign_in(&c, &base, &viewer).await;
    wait_js(
        &c,
        "the viewer's list",
        &text_of("tr[data-vm=\"demo\"] td.phase"),
        |v| v == "Stopped",
    )
    .await;
    assert_eq!(action_buttons(&c).await, 0, "buttons on the viewer's list");
    click(&c, "tr[data-vm=\"demo\"] a").await;
    wait_js(&c, "the viewer's VM page", &text_of("#vm-page h1"), |v| {
        v == "demo"
    })
    .await;
    assert_eq!(
        action_buttons(&c).await,
        0,
        "buttons on the viewer's VM page"
    );
    let refused = c
        .execute_async(
            "const done = arguments[arguments.length - 1];
             fetch('/api/v1/vms/demo/start', {method: 'POST',
                 headers: {Authorization: 'Bearer ' + sessionStorage.getItem('keel.token')}})
               .then(r => done(r.status), e => done(String(e)));",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(refused, json!(403));

    c.close().await.unwrap();
    drop(procs);
    eprintln!("web console test: {:?}", started.elapsed());
}
