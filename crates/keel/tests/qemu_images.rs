//! Real QEMU: a bootable disk image (built by scripts/build-boot-image from
//! the test guest) imported over the API, a VM created from it and booted
//! through firmware (SeaBIOS; OVMF with `firmware: uefi`) from its own
//! overlay root disk, up to the guest's ready marker on its console. And a
//! changed image, or a host path in an old record, fails the start with the
//! reason on the VM and boots nothing. An installer ISO (built by
//! scripts/build-boot-iso) imported as kind iso boots a VM with a blank
//! disk from its CD-ROM, and its graphical console answers a VNC client
//! over the API's WebSocket. And a running guest's VM exported
//! (`keel vm export`) and imported on a second server with its own data
//! dir, where it boots with the data the guest wrote before the export.
//! And a VM with Secure Boot and a TPM keeps its variable store and TPM
//! state across restarts.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::TestServer;
use keel_hv::qemu::AccelChoice;
use serde_json::{json, Value};

/// Generous for TCG on a loaded 2-core machine: SeaBIOS boots the guest in
/// ~6 s, OVMF in ~13 s.
const BOOT: Duration = Duration::from_secs(120);

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

use keel_testkit::guest::dir as guest_dir;

/// Builds (or reuses) the bootable disk image.
fn boot_image(guest: &Path) -> PathBuf {
    let out = workspace().join("target/boot-image");
    let status = Command::new("bash")
        .arg(workspace().join("scripts/build-boot-image"))
        .arg(&out)
        .env("KEEL_GUEST_DIR", guest)
        .status()
        .expect("bash runs");
    assert!(
        status.success(),
        "scripts/build-boot-image failed (run scripts/setup)"
    );
    out.join("boot.raw")
}

/// Builds (or reuses) the bootable ISO (an installer CD in miniature).
fn boot_iso(guest: &Path) -> PathBuf {
    let out = workspace().join("target/boot-iso");
    let status = Command::new("bash")
        .arg(workspace().join("scripts/build-boot-iso"))
        .arg(&out)
        .env("KEEL_GUEST_DIR", guest)
        .status()
        .expect("bash runs");
    assert!(
        status.success(),
        "scripts/build-boot-iso failed (run scripts/setup)"
    );
    out.join("boot.iso")
}

/// SIGKILLs every process whose command line names the data dir, so a
/// failed assertion leaves no guest behind.
struct KillGuard(String);

impl Drop for KillGuard {
    fn drop(&mut self) {
        keel_testkit::procs::kill_mentioning(Path::new(&self.0));
    }
}

fn qemu_server(guest: &Path) -> (TestServer, KillGuard) {
    let guest = guest.to_path_buf();
    let server = TestServer::start_with(move |cfg| {
        cfg.hypervisor = keel::args::HypervisorKind::Qemu;
        cfg.guest_dir = Some(guest);
        cfg.accel = AccelChoice::Tcg;
        // The first boot under TCG takes seconds: not a crash loop.
        cfg.lifecycle.boot_settle_ms = 1_000;
    });
    let guard = KillGuard(
        server
            .dir
            .path()
            .canonicalize()
            .unwrap()
            .to_string_lossy()
            .into_owned(),
    );
    (server, guard)
}

fn import(server: &TestServer, name: &str, file: &Path) -> Value {
    let bytes = std::fs::read(file).unwrap();
    let r = server.request(
        "PUT",
        &format!("/api/v1/images/{name}"),
        Some(&server.token),
        Some(&bytes),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 201, "{}", r.text);
    r.json()
}

fn instance_dir(server: &TestServer, vm: &Value) -> PathBuf {
    let id = vm["vm"]["status"]["instance"]["id"]
        .as_str()
        .expect("an instance");
    server.dir.path().join("node/instances").join(id)
}

/// Waits for the guest's ready marker on the instance's serial console.
fn wait_ready(dir: &Path) -> (Duration, String) {
    wait_console(dir, "KEEL-GUEST-READY")
}

/// Waits for `marker` on the instance's serial console.
fn wait_console(dir: &Path, marker: &str) -> (Duration, String) {
    let start = Instant::now();
    loop {
        let console = std::fs::read_to_string(dir.join("console.log")).unwrap_or_default();
        if console.contains(marker) {
            return (start.elapsed(), console);
        }
        assert!(
            start.elapsed() < BOOT,
            "no {marker} within {BOOT:?}; console: {console:?}; qemu log: {:?}",
            std::fs::read_to_string(dir.join("qemu.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn argv(dir: &Path) -> Vec<String> {
    let record: Value =
        serde_json::from_slice(&std::fs::read(dir.join("spec.json")).unwrap()).unwrap();
    serde_json::from_value(record["argv"].clone()).unwrap()
}

fn delete_and_wait(server: &TestServer, name: &str) {
    assert_eq!(
        server
            .send("DELETE", &format!("/api/v1/vms/{name}"), "")
            .status,
        202
    );
    server.wait_gone(name);
}

#[test]
fn a_vm_from_an_image_boots_its_own_disk_through_seabios() {
    let Some(guest) = guest_dir() else { return };
    let image = boot_image(&guest);
    let (server, _guard) = qemu_server(&guest);
    let imported = import(&server, "boot", &image);
    assert_eq!(imported["image"]["format"], "raw");

    server.create_vm(
        "fw",
        json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 30,
               "disks": [{"name": "root", "image": "boot", "size_mib": 128}]}),
    );
    let vm = server.wait_vm("fw", "run", |v| common::phase(v) == "Running");
    let dir = instance_dir(&server, &vm);
    let (took, console) = wait_ready(&dir);
    eprintln!("SeaBIOS boot from the image's overlay: ready marker after {took:?}");
    // Booted by the firmware from the disk (syslinux on it), not by QEMU.
    assert!(console.contains("SYSLINUX"), "{console}");
    let args = argv(&dir);
    assert!(!args.iter().any(|a| a == "-kernel"), "{args:?}");
    assert!(args.iter().any(|a| a.ends_with("bootindex=0")), "{args:?}");
    assert!(!args.iter().any(|a| a.contains("pflash")), "{args:?}");

    // The root disk is the VM's own overlay; the image is untouched.
    let root = server.dir.path().join("node/disks/fw/root.qcow2");
    let info = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(&root)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    let stored = server.dir.path().canonicalize().unwrap().join(format!(
        "images/boot.{}.raw",
        imported["image"]["sha256"].as_str().unwrap()
    ));
    assert_eq!(info["backing-filename"], stored.to_string_lossy().as_ref());
    assert_eq!(info["backing-filename-format"], "raw");
    assert_eq!(info["virtual-size"], 128 << 20);

    // Stopped, the image changed behind Keel's back: the next start fails
    // with the reason on the VM, and nothing boots.
    let r = server.send("POST", "/api/v1/vms/fw/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("fw");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&stored, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes[1 << 20] ^= 0xff;
    std::fs::write(&stored, &bytes).unwrap();
    assert_eq!(server.send("POST", "/api/v1/vms/fw/start", "").status, 200);
    let vm = server.wait_vm("fw", "fail its start", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sha256"))
    });
    let message = vm["vm"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("changed or replaced") && message.contains(&stored.display().to_string()),
        "{message}"
    );
    assert!(
        !std::fs::read_dir(server.dir.path().join("node/instances"))
            .unwrap()
            .flatten()
            .any(|e| e.path().join("qemu.pid").exists()),
        "a QEMU runs on a changed image"
    );
    let r = server.send("POST", "/api/v1/vms/fw/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    delete_and_wait(&server, "fw");

    // A record from before the image store, naming host files: refused at
    // start with the reason, nothing read.
    server.put_raw(
        "/vms/old",
        &json!({"name": "old", "generation": 1,
                "spec": {"cpus": 1, "memory_mib": 128, "run_policy": "Manual",
                         "boot": {"kernel": "/boot/vmlinuz", "initrd": "/etc/shadow"}}}),
    );
    let vm = server.wait_vm("old", "fail its start", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("host path"))
    });
    assert!(
        vm["vm"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("spec.boot.kernel"),
        "{vm}"
    );
    let r = server.send("POST", "/api/v1/vms/old/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    delete_and_wait(&server, "old");
}

#[test]
fn a_vm_from_an_image_boots_through_uefi_with_its_own_variable_store() {
    let Some(guest) = guest_dir() else { return };
    let image = boot_image(&guest);
    let (server, _guard) = qemu_server(&guest);
    import(&server, "boot", &image);
    server.create_vm(
        "efi",
        json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 30,
               "disks": [{"name": "root", "image": "boot"}],
               "boot": {"firmware": "uefi"}}),
    );
    let vm = server.wait_vm("efi", "run", |v| common::phase(v) == "Running");
    let dir = instance_dir(&server, &vm);
    let (took, console) = wait_ready(&dir);
    eprintln!("OVMF boot from the image's overlay: ready marker after {took:?}");
    assert!(
        console.contains("BdsDxe"),
        "OVMF's boot manager booted it: {console}"
    );
    let vars = server.dir.path().join("node/disks/efi/uefi-vars.fd");
    assert_eq!(
        std::fs::metadata(&vars).unwrap().len(),
        std::fs::metadata("/usr/share/OVMF/OVMF_VARS_4M.fd")
            .unwrap()
            .len(),
        "the VM's own copy of the template, beside its disks"
    );
    let joined = argv(&dir).join(" ");
    assert!(
        joined.contains(
            "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd"
        ),
        "{joined}"
    );
    assert!(
        joined.contains(&format!(
            "unit=1,file={}",
            vars.canonicalize().unwrap().display()
        )),
        "{joined}"
    );
    delete_and_wait(&server, "efi");
}

/// A UEFI VM's variable store is part of its snapshots: a restore brings
/// back the store as it was at the snapshot (taken live here, while the
/// guest was paused for the disks), not the one the VM had since, and the
/// VM boots with it.
#[test]
fn a_snapshot_of_a_uefi_vm_keeps_its_variable_store_and_a_restore_brings_it_back() {
    let Some(guest) = guest_dir() else { return };
    let image = boot_image(&guest);
    let (server, _guard) = qemu_server(&guest);
    import(&server, "boot", &image);
    server.create_vm(
        "efivars",
        json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 30,
               "disks": [{"name": "root", "image": "boot"}],
               "boot": {"firmware": "uefi"}}),
    );
    let vm = server.wait_vm("efivars", "run", |v| common::phase(v) == "Running");
    wait_ready(&instance_dir(&server, &vm));
    let vars = server.dir.path().join("node/disks/efivars/uefi-vars.fd");
    let template = std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.fd").unwrap();
    let at_snapshot = std::fs::read(&vars).unwrap();
    assert_ne!(
        at_snapshot, template,
        "OVMF records its boot options in the VM's store on the first boot"
    );

    let r = server.send(
        "POST",
        "/api/v1/vms/efivars/snapshots",
        &json!({"name": "s1"}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let snap = server.wait_snapshot("efivars", "s1", "become Ready", |s| {
        s["snapshot"]["status"]["phase"] == "Ready"
    });
    assert_eq!(snap["snapshot"]["status"]["live"], true, "{snap}");

    let r = server.send("POST", "/api/v1/vms/efivars/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("efivars");
    // After the snapshot the store loses what the firmware wrote (as a
    // reset to defaults, or a guest that rewrote its boot entries, would).
    std::fs::write(&vars, &template).unwrap();

    let r = server.send(
        "POST",
        "/api/v1/vms/efivars/restore",
        r#"{"snapshot":"s1"}"#,
    );
    assert_eq!(r.status, 202, "{}", r.text);
    server.wait_vm("efivars", "be restored, stopped", |v| {
        let vm = &v["vm"];
        vm.get("restore").is_none()
            && vm.get("power_intent").is_none()
            && common::phase(v) == "Stopped"
    });
    assert!(
        std::fs::read(&vars).unwrap() == at_snapshot,
        "the restore brought back the variable store of the snapshot"
    );

    // It boots with it.
    let r = server.send("POST", "/api/v1/vms/efivars/start", "");
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = server.wait_vm("efivars", "run again", |v| common::phase(v) == "Running");
    let (took, _) = wait_ready(&instance_dir(&server, &vm));
    eprintln!("UEFI boot with the restored variable store: ready after {took:?}");

    // Deleting the snapshot deletes its copy of the store.
    let r = server.send("DELETE", "/api/v1/vms/efivars/snapshots/s1", "");
    assert_eq!(r.status, 202, "{}", r.text);
    let copy = server
        .dir
        .path()
        .join("node/disks/efivars/uefi-vars.snapshots/s1.fd");
    let start = Instant::now();
    while server.get("/api/v1/vms/efivars/snapshots/s1").status != 404 {
        assert!(start.elapsed() < BOOT, "snapshot not deleted");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!copy.exists(), "{} is left", copy.display());
    delete_and_wait(&server, "efivars");
}

/// The image a VM's root disk was made on, deleted behind the API's back
/// (as a Keel that checked only VM specs let happen) and other content
/// imported under its name: the VM's next start and a restore of its
/// snapshot both fail with the reason on the VM, and nothing boots.
#[test]
fn a_disk_whose_image_was_imported_again_fails_start_and_restore_with_the_reason() {
    let Some(guest) = guest_dir() else { return };
    let image = boot_image(&guest);
    let (server, _guard) = qemu_server(&guest);
    let first = import(&server, "boot", &image);
    server.create_vm(
        "rebased",
        json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 30,
               "disks": [{"name": "root", "image": "boot"}]}),
    );
    let vm = server.wait_vm("rebased", "run", |v| common::phase(v) == "Running");
    wait_ready(&instance_dir(&server, &vm));
    let r = server.send("POST", "/api/v1/vms/rebased/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("rebased");
    let r = server.send(
        "POST",
        "/api/v1/vms/rebased/snapshots",
        &json!({"name": "s1"}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    server.wait_snapshot("rebased", "s1", "become Ready", |s| {
        s["snapshot"]["status"]["phase"] == "Ready"
    });
    let r = server.send("DELETE", "/api/v1/images/boot", "");
    assert_eq!(r.status, 409, "{}", r.text);

    let images = server.dir.path().canonicalize().unwrap().join("images");
    let sha = |v: &Value| v["image"]["sha256"].as_str().unwrap().to_string();
    let first_file = images.join(format!("boot.{}.raw", sha(&first)));
    server.delete_raw("/images/boot");
    std::fs::remove_file(&first_file).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other.raw");
    let mut bytes = std::fs::read(&image).unwrap();
    bytes[1 << 20] ^= 0xff;
    std::fs::write(&other, &bytes).unwrap();
    let second = import(&server, "boot", &other);
    assert_ne!(sha(&second), sha(&first));

    let qemu_runs = || {
        std::fs::read_dir(server.dir.path().join("node/instances"))
            .unwrap()
            .flatten()
            .any(|e| e.path().join("qemu.pid").exists())
    };
    let r = server.send("POST", "/api/v1/vms/rebased/start", "");
    assert_eq!(r.status, 200, "{}", r.text);
    let vm = server.wait_vm("rebased", "fail its start", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("different base"))
    });
    let message = vm["vm"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains(&first_file.display().to_string()) && message.contains(&sha(&second)),
        "{message}"
    );
    assert!(!qemu_runs(), "nothing booted");

    let r = server.send("POST", "/api/v1/vms/rebased/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("rebased");
    let r = server.send(
        "POST",
        "/api/v1/vms/rebased/restore",
        r#"{"snapshot":"s1"}"#,
    );
    assert_eq!(r.status, 202, "{}", r.text);
    let vm = server.wait_vm("rebased", "fail its restore", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not restored onto it"))
    });
    let message = vm["vm"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains(&first_file.display().to_string()),
        "{message}"
    );
    assert!(!qemu_runs(), "nothing booted");
    delete_and_wait(&server, "rebased");
}

/// The installer path: an ISO imported as kind iso, a VM with a blank disk
/// and the ISO as its CD-ROM, booted by SeaBIOS from the CD (the marker
/// the ISO's boot loader puts on the kernel's command line shows on the
/// console). Bad input names its field; the ISO is kept while the VM names
/// it, and is no disk's base.
#[test]
fn an_installer_iso_boots_a_vm_from_its_cdrom() {
    let Some(guest) = guest_dir() else { return };
    let iso = boot_iso(&guest);
    let (server, _guard) = qemu_server(&guest);

    // Not an ISO: refused at import, naming the file.
    let r = server.request(
        "PUT",
        "/api/v1/images/fake?kind=iso",
        Some(&server.token),
        Some(&vec![0u8; 64 << 10]),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.json()["field"], "file", "{}", r.text);
    assert!(r.text.contains("CD001"), "{}", r.text);

    let bytes = std::fs::read(&iso).unwrap();
    let r = server.request(
        "PUT",
        "/api/v1/images/installer?kind=iso",
        Some(&server.token),
        Some(&bytes),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json()["image"]["kind"], "iso", "{}", r.text);
    // The same file as a disk image (qemu-img reads it as raw).
    let r = server.request(
        "PUT",
        "/api/v1/images/rawdisk",
        Some(&server.token),
        Some(&bytes),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 201, "{}", r.text);

    let refused = |spec: Value, field: &str| {
        let r = server.send(
            "POST",
            "/api/v1/vms",
            &json!({"name": "bad", "spec": spec}).to_string(),
        );
        assert_eq!(r.status, 422, "{spec}: {}", r.text);
        assert_eq!(r.json()["field"], field, "{spec}: {}", r.text);
    };
    let disk = json!([{"name": "root", "size_mib": 64}]);
    refused(
        json!({"cpus": 1, "memory_mib": 256, "disks": disk, "boot": {"cdrom": "missing"}}),
        "spec.boot.cdrom",
    );
    refused(
        json!({"cpus": 1, "memory_mib": 256, "disks": disk, "boot": {"cdrom": "rawdisk"}}),
        "spec.boot.cdrom",
    );
    refused(
        json!({"cpus": 1, "memory_mib": 256, "disks": [{"name": "root", "image": "installer"}]}),
        "spec.disks[0].image",
    );
    assert!(server.vm("bad").is_none());

    server.create_vm(
        "inst",
        json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 30,
               "disks": disk, "boot": {"cdrom": "installer", "graphics": "vnc"},
               "readiness": "console:KEEL-GUEST-READY"}),
    );
    let vm = server.wait_vm("inst", "run", |v| common::phase(v) == "Running");
    let dir = instance_dir(&server, &vm);
    let (took, console) = wait_console(&dir, "KEEL-ISO-BOOT");
    eprintln!("SeaBIOS boot from the CD-ROM: marker after {took:?}");
    assert!(console.contains("ISOLINUX"), "{console}");
    wait_ready(&dir);
    let args = argv(&dir);
    let joined = args.join(" ");
    assert!(!args.iter().any(|a| a == "-kernel"), "{joined}");
    assert!(
        joined.contains("-device ide-cd,drive=cdrom0,bootindex=0")
            && joined.contains("drive=disk0,bootindex=1")
            && joined.contains("media=cdrom,readonly=on"),
        "{joined}"
    );
    server.wait_vm("inst", "be ready", |v| {
        v["vm"]["status"]["instance"]["readiness"]["ready_at"].is_u64()
    });

    // The graphical console: VNC on the instance's unix socket only, its
    // screen over the API's WebSocket.
    let vnc = args
        .windows(2)
        .find(|w| w[0] == "-vnc")
        .map(|w| w[1].clone())
        .expect("a -vnc argument");
    assert!(
        vnc.starts_with("unix:") && vnc.ends_with("/vnc.sock"),
        "{vnc}"
    );
    // The display device follows its VNC server (the balloon, added
    // last, may come after both).
    assert!(
        joined.contains(&format!("-vnc {vnc} -device VGA")),
        "{joined}"
    );
    let r = server.send(
        "POST",
        "/api/v1/tokens",
        &json!({"name": "watcher", "role": "viewer"}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let viewer = r.json()["secret"].as_str().unwrap().to_string();
    let token = server.token.clone();
    server.rt.block_on(async {
        assert_eq!(vnc_refusal(&server, "inst", None).await, 401);
        assert_eq!(vnc_refusal(&server, "inst", Some(&viewer)).await, 403);
        let (update, took) = vnc_framebuffer_update(&server, "inst", &token).await;
        eprintln!("VNC over the WebSocket: a FramebufferUpdate of {update:?} after {took:?}");
    });

    let r = server.send("DELETE", "/api/v1/images/installer", "");
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.text.contains("VM inst"), "{}", r.text);
    delete_and_wait(&server, "inst");
    let r = server.send("DELETE", "/api/v1/images/installer", "");
    assert_eq!(r.status, 200, "{}", r.text);
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn vnc_connect(
    server: &TestServer,
    vm: &str,
    token: Option<&str>,
) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::http::HeaderValue;
    let (url, connector) = server.ws_url(&format!("/api/v1/vms/{vm}/vnc"));
    let mut req = url.into_client_request().unwrap();
    // What noVNC asks for.
    req.headers_mut()
        .insert("sec-websocket-protocol", HeaderValue::from_static("binary"));
    if let Some(token) = token {
        req.headers_mut().insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
    }
    let (ws, resp) =
        tokio_tungstenite::connect_async_tls_with_config(req, None, false, connector).await?;
    assert_eq!(
        resp.headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok()),
        Some("binary")
    );
    Ok(ws)
}

async fn vnc_refusal(server: &TestServer, vm: &str, token: Option<&str>) -> u16 {
    match vnc_connect(server, vm, token).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => resp.status().as_u16(),
        Err(other) => panic!("expected an HTTP refusal, got {other}"),
        Ok(_) => panic!("the graphical console opened"),
    }
}

/// Reads RFB bytes from binary messages until `buf` holds `n` (bounded).
async fn vnc_read(ws: &mut Ws, buf: &mut Vec<u8>, n: usize) -> Vec<u8> {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while buf.len() < n {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("only {buf:?} of {n} RFB bytes"))
            .expect("the WebSocket stays open")
            .unwrap();
        match msg {
            Message::Binary(b) => buf.extend_from_slice(&b),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("unexpected message {other:?}"),
        }
    }
    buf.drain(..n).collect()
}

/// The RFB 3.8 handshake with security type None, a
/// FramebufferUpdateRequest for the whole screen, and the first
/// FramebufferUpdate's header: (width, height, rectangles).
async fn vnc_framebuffer_update(
    server: &TestServer,
    vm: &str,
    token: &str,
) -> ((u16, u16, u16), Duration) {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let start = Instant::now();
    let mut ws = vnc_connect(server, vm, Some(token)).await.unwrap();
    let mut buf = Vec::new();
    let version = vnc_read(&mut ws, &mut buf, 12).await;
    assert_eq!(version, b"RFB 003.008\n", "{version:?}");
    let send = |bytes: Vec<u8>| Message::binary(bytes);
    ws.send(send(b"RFB 003.008\n".to_vec())).await.unwrap();
    let count = vnc_read(&mut ws, &mut buf, 1).await[0] as usize;
    assert!(count > 0, "the server offers no security type");
    let types = vnc_read(&mut ws, &mut buf, count).await;
    assert!(types.contains(&1), "no security type None in {types:?}");
    ws.send(send(vec![1])).await.unwrap();
    let result = vnc_read(&mut ws, &mut buf, 4).await;
    assert_eq!(result, [0, 0, 0, 0], "security handshake failed");
    ws.send(send(vec![1])).await.unwrap(); // ClientInit: shared
    let init = vnc_read(&mut ws, &mut buf, 24).await;
    let width = u16::from_be_bytes([init[0], init[1]]);
    let height = u16::from_be_bytes([init[2], init[3]]);
    let name_len = u32::from_be_bytes([init[20], init[21], init[22], init[23]]) as usize;
    vnc_read(&mut ws, &mut buf, name_len).await;
    assert!(width > 0 && height > 0, "{width}x{height}");
    // FramebufferUpdateRequest, not incremental, the whole screen.
    let mut request = vec![3, 0, 0, 0, 0, 0];
    request.extend_from_slice(&width.to_be_bytes());
    request.extend_from_slice(&height.to_be_bytes());
    ws.send(send(request)).await.unwrap();
    let header = vnc_read(&mut ws, &mut buf, 4).await;
    assert_eq!(header[0], 0, "not a FramebufferUpdate: {header:?}");
    let rectangles = u16::from_be_bytes([header[2], header[3]]);
    assert!(rectangles >= 1, "an update without rectangles");
    let _ = ws.close(None).await;
    ((width, height, rectangles), start.elapsed())
}

/// A synced command channel to the guest of the instance in `dir`.
async fn guest_channel(dir: &Path) -> keel_hv::guest::GuestChannel {
    let record: Value =
        serde_json::from_slice(&std::fs::read(dir.join("spec.json")).unwrap()).unwrap();
    let sockets = PathBuf::from(record["socket_dir"].as_str().expect("socket_dir"));
    keel_hv::guest::GuestChannel::connect_ready(
        &dir.join("console.log"),
        &sockets.join("cmd.sock"),
        BOOT,
    )
    .await
    .unwrap_or_else(|e| panic!("guest in {} not ready: {e}", dir.display()))
}

#[test]
fn a_running_guests_export_imported_on_another_data_dir_boots_with_its_data() {
    use common::cli::{keel, ok};
    let Some(guest) = guest_dir() else { return };
    let began = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (server, _guard) = qemu_server(&guest);
    server.create_vm(
        "exp-src",
        json!({"cpus": 1, "memory_mib": 128, "run_policy": "Manual", "readiness": "none",
               "disks": [{"name": "data", "size_mib": 64}]}),
    );
    let src = server.wait_vm("exp-src", "run", |v| {
        common::phase(v) == "Running" && common::instance(v).is_some()
    });
    let src_dir = instance_dir(&server, &src);
    rt.block_on(async {
        let mut g = guest_channel(&src_dir).await;
        g.put(1, "written before the export").await.unwrap();
    });

    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("exp-src.tar");
    let exported = keel(
        &server,
        &["vm", "export", "exp-src", file.to_str().unwrap()],
    );
    ok(&exported);
    // Exported live: the same instance runs on.
    let after = server.vm("exp-src").unwrap();
    assert_eq!(common::phase(&after), "Running");
    assert_eq!(common::instance(&after), common::instance(&src));

    let (other, _other_guard) = qemu_server(&guest);
    ok(&keel(
        &other,
        &[
            "vm",
            "import",
            file.to_str().unwrap(),
            "--name",
            "exp-copy",
            "--start",
        ],
    ));
    let copy = other.wait_vm("exp-copy", "run", |v| {
        common::phase(v) == "Running" && common::instance(v).is_some()
    });
    let copy_dir = instance_dir(&other, &copy);
    let read = rt.block_on(async {
        let mut g = guest_channel(&copy_dir).await;
        g.get(1).await.unwrap()
    });
    assert_eq!(read, "written before the export");
    let mac = |v: &Value| v["vm"]["spec"]["network"]["mac"].clone();
    assert_ne!(mac(&copy), mac(&src));
    assert!(argv(&copy_dir)
        .iter()
        .any(|a| a.contains(&format!("mac={}", mac(&copy).as_str().unwrap()))));
    // The disk is a standalone qcow2 in the second server's own disk dir.
    let disk = other.dir.path().join("node/disks/exp-copy/data.qcow2");
    let info = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(&disk)
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["format"], "qcow2", "{info}");
    assert!(info.get("backing-filename").is_none(), "{info}");
    eprintln!("export, import and boot: {:?}", began.elapsed());
}

/// Imports `file` as an image of `kind` (kernel, initrd).
fn import_kind(server: &TestServer, name: &str, kind: &str, file: &Path) {
    let bytes = std::fs::read(file).unwrap();
    let r = server.request(
        "PUT",
        &format!("/api/v1/images/{name}?kind={kind}"),
        Some(&server.token),
        Some(&bytes),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 201, "{}", r.text);
}

/// The pids of the swtpm processes serving the TPM state in `state`.
fn swtpms_of(state: &Path) -> Vec<i32> {
    let want = format!("dir={}", state.display());
    keel_testkit::procs::all()
        .into_iter()
        .filter(|p| p.cmdline.starts_with("swtpm") && p.cmdline.contains(&want))
        .map(|p| p.pid)
        .filter(|pid| keel_testkit::procs::alive(*pid))
        .collect()
}

fn wait_swtpms_gone(state: &Path) {
    let start = Instant::now();
    while !swtpms_of(state).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "swtpm outlived its QEMU: {:?}",
            swtpms_of(state)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// UEFI Secure Boot and a TPM, on one VM (one OVMF boot, to keep the
/// wall time small): the guest's kernel reports Secure Boot on (the
/// Secure Boot build of OVMF, with the VM's own store holding Microsoft's
/// keys) and finds the TPM (`tpm_crb`); the swtpm serving it ends with
/// its QEMU. The firmware is recorded at the first start: a spec naming
/// another is refused at the next start with the reason on the VM, and
/// the refused start touches neither the variable store nor the TPM
/// state. Started again as recorded, the VM has the same store (same file,
/// the bytes as the first run left them) and the same TPM state.
#[test]
fn secure_boot_and_a_tpm_stay_the_vms_own_across_restarts() {
    let Some(guest) = guest_dir() else { return };
    let (server, _guard) = qemu_server(&guest);
    import_kind(&server, "vmlinuz", "kernel", &guest.join("vmlinuz"));
    import_kind(
        &server,
        "initrd",
        "initrd",
        &guest.join("initramfs.cpio.gz"),
    );
    // No `quiet`: the kernel's Secure Boot and TPM lines are info level.
    let spec = json!({"cpus": 1, "memory_mib": 256, "stop_grace_period_s": 5,
        "boot": {"kernel": "vmlinuz", "initrd": "initrd", "cmdline": "console=ttyS0 panic=-1",
                 "firmware": "uefi-secure"},
        "tpm": {"version": "2.0"}});
    server.create_vm("sb", spec.clone());
    let vm = server.wait_vm("sb", "run", |v| common::phase(v) == "Running");
    let dir = instance_dir(&server, &vm);
    let (took, console) = wait_ready(&dir);
    eprintln!("Secure Boot OVMF with a TPM: ready after {took:?}");
    assert!(
        console.contains("Secure boot enabled"),
        "the guest's kernel found Secure Boot on: {console}"
    );
    assert!(
        console.contains("tpm_crb"),
        "the guest's kernel found the TPM: {console}"
    );
    let disks = server
        .dir
        .path()
        .join("node/disks/sb")
        .canonicalize()
        .unwrap();
    let vars = disks.join("uefi-vars.fd");
    let state = disks.join("tpm");
    let joined = argv(&dir).join(" ");
    for wanted in [
        "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.ms.fd"
            .to_string(),
        format!("if=pflash,format=raw,unit=1,file={}", vars.display()),
        "-machine smm=on".into(),
        "-global driver=cfi.pflash01,property=secure,value=on".into(),
        "-tpmdev emulator,id=tpm0,chardev=chrtpm -device tpm-crb,tpmdev=tpm0".into(),
    ] {
        assert!(joined.contains(&wanted), "{wanted} in {joined}");
    }
    assert_eq!(
        std::fs::metadata(&vars).unwrap().len(),
        std::fs::metadata("/usr/share/OVMF/OVMF_VARS_4M.ms.fd")
            .unwrap()
            .len(),
        "the VM's own copy of the template with Microsoft's keys"
    );
    assert!(state.join("tpm2-00.permall").is_file(), "TPM state made");
    assert_eq!(swtpms_of(&state).len(), 1, "one swtpm for the instance");
    assert_eq!(vm["vm"]["status"]["firmware"], "uefi-secure", "{vm}");

    let r = server.send("POST", "/api/v1/vms/sb/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    let stopped = server.wait_settled_stopped("sb");
    wait_swtpms_gone(&state);
    assert!(
        stopped["vm"]["status"]["tpm_used_since"].is_u64(),
        "the TPM ran: its state is the VM's data now: {stopped}"
    );
    let vars_after_run = std::fs::read(&vars).unwrap();
    assert_ne!(
        vars_after_run,
        std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.ms.fd").unwrap(),
        "the firmware wrote into the VM's own store"
    );
    use std::os::unix::fs::MetadataExt;
    let vars_inode = std::fs::metadata(&vars).unwrap().ino();
    // A file beside the state: a state dir made again would lose it.
    std::fs::write(state.join("kept-by-the-test"), b"x").unwrap();

    // Other firmware named: refused at the start, with the reason on the
    // VM, and nothing of the VM's touched.
    let mut plain = spec.clone();
    plain["boot"]["firmware"] = json!("uefi");
    // The spec's power is Running (the default): replacing it starts the VM.
    replace_spec(&server, "sb", &plain);
    let refused = server.wait_vm("sb", "refuse other firmware", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("first started with uefi-secure"))
    });
    eprintln!("refused: {}", refused["vm"]["status"]["message"]);
    assert_eq!(std::fs::read(&vars).unwrap(), vars_after_run);
    assert!(swtpms_of(&state).is_empty());

    // As recorded again: the same store and TPM state.
    replace_spec(&server, "sb", &spec);
    let vm = server.wait_vm("sb", "run again", |v| {
        common::phase(v) == "Running" && common::instance(v).is_some_and(|i| i != vm_id(&vm))
    });
    assert_eq!(std::fs::metadata(&vars).unwrap().ino(), vars_inode);
    assert!(
        state.join("kept-by-the-test").is_file(),
        "the same TPM state dir"
    );
    assert!(state.join("tpm2-00.permall").is_file());
    assert_eq!(swtpms_of(&state).len(), 1);
    let dir = instance_dir(&server, &vm);
    assert!(argv(&dir).join(" ").contains("OVMF_CODE_4M.ms.fd"));

    // Deleted: QEMU killed at the end of the grace period if the firmware
    // is still booting; its swtpm goes with it, and the state with the disks.
    delete_and_wait(&server, "sb");
    wait_swtpms_gone(&state);
    assert!(!disks.exists(), "the TPM state went with the disks");
}

/// `PUT /vms/{name}/spec` at the revision just read (again, if the
/// controller wrote in between).
fn replace_spec(server: &TestServer, name: &str, spec: &Value) {
    for _ in 0..20 {
        let revision = server.vm(name).expect("the VM")["revision"].clone();
        let r = server.send(
            "PUT",
            &format!("/api/v1/vms/{name}/spec"),
            &json!({ "spec": spec, "revision": revision }).to_string(),
        );
        if r.status == 200 {
            return;
        }
        assert_eq!(r.status, 409, "{}", r.text);
    }
    panic!("the spec of {name} could not be replaced");
}

fn vm_id(vm: &Value) -> String {
    common::instance(vm).expect("an instance")
}
