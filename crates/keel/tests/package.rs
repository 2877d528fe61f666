//! Keel as an installed service: the Debian package and its files and
//! modes, the systemd units, the config file's precedence, `keel doctor`,
//! and a server that runs as an unprivileged user with private files.

mod procs;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use procs::{processes_naming, test_guest, Keel, KillAll};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn keel() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.env("KEEL_CONFIG", "")
        .env_remove("KEEL_DATA_DIR")
        .env_remove("KEEL_SERVER")
        .env_remove("KEEL_TOKEN")
        .env_remove("KEEL_STORE");
    c
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Builds the .deb from the binary under test and unpacks it into a
/// scratch root, as `dpkg -x` would on a host.
fn built_package(scratch: &Path) -> (PathBuf, PathBuf) {
    let out = Command::new(repo().join("scripts/build-deb"))
        .arg("--binary")
        .arg(env!("CARGO_BIN_EXE_keel"))
        .arg(scratch.join("deb"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "build-deb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deb = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let root = scratch.join("root");
    let x = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .status()
        .unwrap();
    assert!(x.success());
    (deb, root)
}

#[test]
fn the_package_has_its_files_with_their_modes() {
    let scratch = tempfile::tempdir().unwrap();
    let (deb, root) = built_package(scratch.path());
    for (file, want) in [
        ("usr/bin/keel", 0o755),
        ("lib/systemd/system/keel.service", 0o644),
        ("lib/systemd/system/keel-agent.service", 0o644),
        ("etc/keel/keel.toml", 0o644),
        ("usr/share/man/man1/keel.1.gz", 0o644),
        ("usr/share/man/man1/keel-serve.1.gz", 0o644),
        ("usr/share/man/man1/keel-doctor.1.gz", 0o644),
        ("usr/share/bash-completion/completions/keel", 0o644),
        ("usr/share/zsh/vendor-completions/_keel", 0o644),
        ("usr/share/fish/vendor_completions.d/keel.fish", 0o644),
        ("usr/share/doc/keel/copyright", 0o644),
    ] {
        assert_eq!(mode(&root.join(file)), want, "{file}");
    }
    // Owned by root in the archive, whoever built it.
    let listing = Command::new("dpkg-deb")
        .arg("-c")
        .arg(&deb)
        .output()
        .unwrap();
    let listing = String::from_utf8(listing.stdout).unwrap();
    assert!(
        listing.lines().all(|l| l.contains("root/root")),
        "{listing}"
    );
    // The packaged binary is the one under test and runs.
    let version = Command::new(root.join("usr/bin/keel"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("keel "));
    let bash =
        std::fs::read_to_string(root.join("usr/share/bash-completion/completions/keel")).unwrap();
    assert!(bash.contains("doctor") && bash.contains("--data-dir"));

    let info = |field: &str| {
        let out = Command::new("dpkg-deb")
            .args(["-f"])
            .arg(&deb)
            .arg(field)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert_eq!(info("Package"), "keel");
    assert!(info("Depends").contains("qemu-system-x86"));
    let control = scratch.path().join("control");
    Command::new("dpkg-deb")
        .arg("-e")
        .arg(&deb)
        .arg(&control)
        .status()
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(control.join("conffiles"))
            .unwrap()
            .trim(),
        "/etc/keel/keel.toml"
    );
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("adduser --system"), "{postinst}");
    assert!(postinst.contains("install -d -m 0700 -o keel -g keel /var/lib/keel"));
    assert!(postinst.contains("token init-file /etc/keel/token --group keel"));
    // The shipped config file is one the binary accepts.
    let out = keel()
        .env("KEEL_CONFIG", root.join("etc/keel/keel.toml"))
        .args([
            "vm",
            "list",
            "--server",
            "http://127.0.0.1:1",
            "--token",
            "x",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach"), "{err}");
}

/// systemd itself checks the units (it is not PID 1 here, so they are
/// verified, not started). The properties the fencing design rests on are
/// asserted by name: a unit that kills guests on restart must not pass.
#[test]
fn systemd_accepts_the_units_and_they_never_kill_guests() {
    let scratch = tempfile::tempdir().unwrap();
    let (_, root) = built_package(scratch.path());
    let verify_dir = scratch.path().join("verify");
    std::fs::create_dir(&verify_dir).unwrap();
    let mut units = Vec::new();
    for unit in ["keel.service", "keel-agent.service"] {
        let text = std::fs::read_to_string(root.join("lib/systemd/system").join(unit)).unwrap();
        for needed in [
            "KillMode=process",
            "RuntimeDirectoryPreserve=yes",
            "User=keel",
            "SupplementaryGroups=kvm",
            "StateDirectoryMode=0700",
            "UMask=0077",
            "Environment=KEEL_CONFIG=/etc/keel/keel.toml",
        ] {
            assert!(text.contains(needed), "{unit} lacks {needed}");
        }
        // systemd-analyze wants ExecStart's binary to exist: point it at
        // the unpacked one.
        let path = verify_dir.join(unit);
        std::fs::write(
            &path,
            text.replace(
                "/usr/bin/keel",
                &root.join("usr/bin/keel").to_string_lossy(),
            ),
        )
        .unwrap();
        units.push(path);
    }
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&units)
        .output()
        .expect("systemd-analyze (package systemd)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
}

#[test]
fn doctor_prints_each_check_with_a_fix() {
    let data = tempfile::tempdir().unwrap();
    let doctor = || {
        keel()
            .args(["doctor", "--data-dir"])
            .arg(data.path())
            .output()
            .unwrap()
    };
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = String::from_utf8(doctor().stdout).unwrap();
    assert!(
        text.contains("has mode 0755") && text.contains("fix: chmod 700"),
        "{text}"
    );
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = doctor();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for check in [
        "qemu",
        "qemu-img",
        "kvm",
        "firmware",
        "secure boot, tpm",
        "data dir",
        "disk dir",
        "image store",
        "store",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("[ok  ] ") && l[7..].starts_with(check)
                    || l.starts_with("[warn] ") && l[7..].starts_with(check)),
            "no line for {check}:\n{text}"
        );
    }
    assert!(text.contains("QEMU emulator version"), "{text}");
    // A private data dir draws no complaint about its mode; its free
    // space is reported (a warning when the disk runs low).
    assert!(
        !text.contains("has mode") && text.contains("GiB free"),
        "{text}"
    );
    // KVM: either usable, or a warning that says why and how to fix it.
    let kvm = text.lines().find(|l| l[7..].starts_with("kvm")).unwrap();
    if kvm.starts_with("[warn]") {
        assert!(text.contains("TCG"), "{text}");
    }

    // A missing QEMU fails, with the fix, and the exit status says so.
    let out = keel()
        .args([
            "doctor",
            "--qemu",
            "/nonexistent/qemu-system-x86_64",
            "--data-dir",
        ])
        .arg(data.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(text.contains("[FAIL] qemu"), "{text}");
    assert!(
        text.contains("fix: apt-get install qemu-system-x86"),
        "{text}"
    );

    // An etcd nobody listens on: unreachable, with what to do.
    let out = keel()
        .args([
            "doctor",
            "--json",
            "--store",
            "etcd://127.0.0.1:1",
            "--insecure-store",
            "--data-dir",
        ])
        .arg(data.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let checks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let etcd = checks
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "etcd")
        .unwrap();
    assert_eq!(etcd["status"], "fail");
    assert!(etcd["fix"].as_str().unwrap().contains("start etcd"));

    // The test etcd (scripts/start-etcd): healthy, and the clock compared.
    if std::env::var("KEEL_SKIP_ETCD_TESTS").as_deref() != Ok("1") {
        let endpoint =
            std::env::var("KEEL_ETCD_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:2379".into());
        let out = keel()
            .args(["doctor", "--store"])
            .arg(format!("etcd://{}", endpoint.trim_start_matches("http://")))
            .arg("--insecure-store")
            .arg("--data-dir")
            .arg(data.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("healthy") && text.contains("clock is"),
            "{text}"
        );
    }
}

/// Doctor and serve on one host name the same accelerator for the same
/// reason: doctor runs the driver's KVM probe, not a weaker check of its own
/// that passes where serve then falls back to TCG. And serve answers before
/// its probe has a verdict.
#[test]
fn doctor_names_the_accelerator_serve_settles_on() {
    let Some(work) = procs::Workdir::start("doctor_accel") else {
        return;
    };
    let doctor = |accel: &str| {
        let out = keel()
            .args(["doctor", "--json", "--accel", accel, "--guest-dir"])
            .arg(&work.guest_dir)
            .arg("--data-dir")
            .arg(work.root.join("doctor"))
            .output()
            .unwrap();
        let checks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let kvm = checks
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "kvm")
            .unwrap()
            .clone();
        (
            kvm["status"].clone(),
            kvm["detail"].as_str().unwrap().to_string(),
        )
    };
    let (status, detail) = doctor("tcg");
    assert_eq!(status, "ok", "{detail}");
    assert!(
        detail.starts_with("serve will use TCG: tcg forced by configuration"),
        "{detail}"
    );
    let (_, detail) = doctor("auto");

    let serve = Keel::spawn(
        "serve",
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            &work.dir("serve"),
            "--runtime-dir",
            &work.dir("run"),
            "--guest-dir",
            &work.guest_dir,
        ],
    );
    // The probe's own timeouts (5 s of silence, 20 s to the marker) bound this.
    let deadline = Instant::now() + Duration::from_secs(60);
    let settled = loop {
        let log = serve.log();
        if let Some(line) = log.lines().find(|l| l.contains("accelerator settled")) {
            break line.to_string();
        }
        assert!(Instant::now() < deadline, "no verdict:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let accelerator = settled
        .split(" accelerator=")
        .nth(1)
        .and_then(|a| a.split_whitespace().next())
        .unwrap();
    let note = settled.split(" note=").nth(1).unwrap();
    match accelerator {
        "Tcg" => assert_eq!(
            detail,
            format!("serve will use TCG (software emulation, about 10x slower): {note}")
        ),
        "Kvm" => assert!(
            detail.starts_with("serve will use KVM: kvm probe booted the test guest in"),
            "doctor: {detail}\nserve: {note}"
        ),
        other => panic!("serve settled on {other}: {settled}"),
    }
    // A probe that booted a guest takes seconds; the API was up before.
    let booted = ["booted the test guest", "printed nothing", "printed no "];
    if booted.iter().any(|b| note.contains(b)) {
        let log = serve.log();
        let serving = log
            .find("keel serving")
            .expect("serving before the verdict");
        assert!(serving < log.find("accelerator settled").unwrap(), "{log}");
    }
}

#[test]
fn config_file_settings_yield_to_environment_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keel.toml");
    std::fs::write(&file, "server = \"http://127.0.0.1:9\"\ntoken = \"t\"\n").unwrap();
    let run = |env: Option<&str>, flag: Option<&str>| {
        let mut c = keel();
        c.env("KEEL_CONFIG", &file).args(["vm", "list"]);
        if let Some(e) = env {
            c.env("KEEL_SERVER", e);
        }
        if let Some(f) = flag {
            c.args(["--server", f]);
        }
        String::from_utf8(c.output().unwrap().stderr).unwrap()
    };
    assert!(run(None, None).contains("http://127.0.0.1:9 "));
    assert!(run(Some("http://127.0.0.1:10"), None).contains("http://127.0.0.1:10 "));
    assert!(
        run(Some("http://127.0.0.1:10"), Some("http://127.0.0.1:11"))
            .contains("http://127.0.0.1:11 ")
    );

    std::fs::write(&file, "data_dir = \"/x\"\n").unwrap();
    let out = keel()
        .env("KEEL_CONFIG", &file)
        .args(["vm", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown setting `data_dir`") && err.contains("keel.toml"),
        "{err}"
    );
}

/// A server started as an unprivileged user (as keel.service does with
/// User=keel) runs its QEMU as that user, and what it creates is private:
/// data dir 0700, token and disks 0600, whatever umask it inherited. A
/// token file shared with a group (0640) is accepted.
#[test]
fn an_unprivileged_server_runs_qemu_as_itself_with_private_files() {
    if std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to switch to an unprivileged user");
        return;
    }
    const UID: u32 = 65534;
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path().to_path_buf();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _kill = KillAll(root.clone());
    // The guest must be readable by that user: the checkout may be in a
    // home directory it cannot enter.
    let guest = root.join("guest");
    std::fs::create_dir(&guest).unwrap();
    for f in ["vmlinuz", "initramfs.cpio.gz"] {
        std::fs::copy(test_guest().join(f), guest.join(f)).unwrap();
    }
    let data = root.join("data");
    let runtime = root.join("run");
    std::fs::create_dir(&runtime).unwrap();
    let shared = root.join("etc-keel");
    std::fs::create_dir(&shared).unwrap();
    let token_file = shared.join("token");
    let status = keel()
        .args(["token", "init-file"])
        .arg(&token_file)
        .status()
        .unwrap();
    assert!(status.success());
    // Made by the package (postinst, StateDirectory=) for the user; 0755
    // here, to see Keel make it private.
    std::fs::create_dir(&data).unwrap();
    for p in [&data, &runtime, &shared, &token_file] {
        std::os::unix::fs::chown(p, Some(UID), Some(UID)).unwrap();
    }
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let server = format!("https://{listen}");
    // setpriv (util-linux) drops to the user as systemd's User= would, and
    // a permissive umask shows that Keel sets its own.
    let script = format!(
        "umask 022; exec setpriv --reuid={UID} --regid={UID} --clear-groups {} serve --data-dir {} --runtime-dir {} --token-file {} --listen {listen} --guest-dir {} --accel tcg",
        env!("CARGO_BIN_EXE_keel"),
        data.display(),
        runtime.display(),
        token_file.display(),
        guest.display(),
    );
    let mut serve = Keel::spawn_with("serve", Command::new("sh").args(["-c", &script]));
    let token = std::fs::read_to_string(&token_file).unwrap();
    let cli = |args: &[&str]| {
        keel()
            .args(args)
            .env("KEEL_SERVER", &server)
            .env("KEEL_TOKEN", token.trim())
            // The server's certificate, pinned from its data dir.
            .env("KEEL_DATA_DIR", &data)
            .output()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cli(&["vm", "list"]).status.success() {
        let exited = serve.child.try_wait().unwrap().is_some();
        assert!(
            !exited && Instant::now() < deadline,
            "server did not come up:\n{}",
            serve.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = cli(&["vm", "create", "lp", "--disk", "data:64"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let qemu = loop {
        let found: Vec<_> = processes_naming(&root.to_string_lossy())
            .into_iter()
            .filter(|(_, c)| c.starts_with("qemu-system"))
            .collect();
        if let Some((pid, _)) = found.first() {
            break *pid;
        }
        assert!(Instant::now() < deadline, "no QEMU:\n{}", serve.log());
        std::thread::sleep(Duration::from_millis(200));
    };
    let status = std::fs::read_to_string(format!("/proc/{qemu}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line
            .split_whitespace()
            .skip(1)
            .all(|u| u == UID.to_string()),
        "QEMU runs as {uid_line}"
    );
    assert_eq!(mode(&data), 0o700);
    assert_eq!(std::fs::metadata(&data).unwrap().uid(), UID);
    let disk = data.join("node/disks/lp/data.qcow2");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !disk.exists() {
        assert!(Instant::now() < deadline, "no disk at {}", disk.display());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(mode(&disk), 0o600, "{}", disk.display());
    assert_eq!(std::fs::metadata(&disk).unwrap().uid(), UID);
    assert_eq!(
        mode(&token_file),
        0o640,
        "the shared token file is left as it is"
    );
    drop(serve);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A data directory or token file another user owns is refused at start,
/// naming the owner: whatever its mode, its owner could replace the token
/// in it (a chmod by Keel used to leave such a directory theirs).
#[test]
fn a_data_dir_or_token_file_another_user_owns_is_refused_naming_the_owner() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: only root can give a directory to another user");
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let theirs = scratch.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let err = refused_start(&theirs);
    assert!(
        err.contains("data directory") && err.contains("owned by uid 65534"),
        "{err}"
    );
    assert!(
        !theirs.join("token").exists(),
        "a token was written into a foreign directory"
    );

    let ours = scratch.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    let token = ours.join("token");
    std::fs::write(&token, "their-chosen-token\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&token, Some(65534), None).unwrap();
    let err = refused_start(&ours);
    assert!(
        err.contains("token file") && err.contains("owned by uid 65534"),
        "{err}"
    );
}

/// Starts `keel serve` on `data_dir` and returns what it said when it
/// refused to start; fails the test if it serves (bounded: 20 s).
fn refused_start(data_dir: &Path) -> String {
    let mut child = keel()
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "keel serve started on {}: {}",
                data_dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}
