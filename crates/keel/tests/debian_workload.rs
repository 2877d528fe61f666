//! Issue 12's acceptance flow on a real OS: the Debian 12 image of
//! `scripts/build-debian-image` (systemd, cloud-init, sshd,
//! qemu-guest-agent; user `debian`), driven only through the `keel` CLI
//! binary against a real `keel serve` process (SQLite store, QEMU driver,
//! accelerator probed). All traffic is on loopback: SSH reaches the guest
//! through a port published on 127.0.0.1.
//!
//! One VM is reused for every step, because each Debian boot costs 1–2
//! minutes under TCG:
//! 1. import → `vm create --image --publish --ssh-key --wait` (readiness by
//!    the guest agent) → SSH in with the key; `vm get` has the agent's
//!    address 10.0.2.15.
//! 2. a 128 KiB file written and fsynced survives a restart requested the
//!    moment the write returned.
//! 3. a live snapshot taken with the agent is quiesced.
//! 4. a stop ends by the guest's own power-off, well inside the grace
//!    period, recorded as such (not a kill).
//! 5. restored from the snapshot, the root filesystem is clean: checked
//!    offline (`qemu-img check`, then `e2fsck -fn` on the root partition of
//!    the restored disk, the VM stopped so nothing is mounted), then booted
//!    and SSHed into: the file of step 2 is intact and one written after the
//!    snapshot is gone.
//!
//! And in a second test, on etcd with two `keel agent` nodes: a live
//! migration (`keel node drain`) keeps the guest's boot and uptime, and its
//! kernel reports no trouble on the target.
//!
//! Needs QEMU, `ssh`, `ssh-keygen`, `e2fsck`, `sfdisk` and the image (built
//! or reused by the script), and for the migration the etcd of
//! `scripts/start-etcd`; `KEEL_SKIP_QEMU_TESTS=1` (or `KEEL_SKIP_ETCD_TESTS=1`
//! for the migration) skips them.

mod procs;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use procs::{Keel, KillAll};
use serde_json::Value;

/// Bounds, generous for TCG on a loaded 2-core machine (a boot to SSH takes
/// 70–120 s there).
const BOOT: Duration = Duration::from_secs(300);
const SSH_AFTER_READY: Duration = Duration::from_secs(180);
/// The VM's stop grace period; a guest power-off must end well before it.
const GRACE_S: u64 = 120;

/// Debian guests under TCG each take most of a core: the tests here run one
/// after the other, not side by side. This lock does it under `cargo test`;
/// nextest runs each test in a process of its own, where the test group
/// `debian-guests` of `.config/nextest.toml` does it.
static ONE_DEBIAN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn debian_image() -> PathBuf {
    let out = workspace().join("target/debian-image");
    let status = Command::new("bash")
        .arg(workspace().join("scripts/build-debian-image"))
        .arg(&out)
        .status()
        .expect("bash runs");
    assert!(
        status.success(),
        "scripts/build-debian-image failed (run scripts/setup)"
    );
    out.join("debian-12.qcow2")
}

struct Env {
    root: PathBuf,
    server: String,
    key: PathBuf,
    port: u16,
}

impl Env {
    fn keel(&self, args: &[&str]) -> Output {
        procs::cli(&self.root, &self.server, args)
    }

    /// Runs `keel ARGS`, which must succeed; its stdout.
    fn ok(&self, args: &[&str], serve: &Keel) -> String {
        let out = self.keel(args);
        assert!(
            out.status.success(),
            "keel {args:?}: {:?}\nstdout: {}\nstderr: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            serve.log()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn vm(&self) -> Value {
        procs::vm_json(&self.root, &self.server, "deb").expect("vm deb exists")
    }

    fn ssh(&self, script: &str) -> Output {
        Command::new("ssh")
            .args([
                "-p",
                &self.port.to_string(),
                "-i",
                self.key.to_str().unwrap(),
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "ConnectTimeout=10",
                "-o",
                "ServerAliveInterval=5",
                "-o",
                "ServerAliveCountMax=3",
                "-o",
                "LogLevel=ERROR",
                "debian@127.0.0.1",
                script,
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("ssh runs")
    }

    /// Runs `script` over SSH, which must succeed; its stdout.
    fn ssh_ok(&self, script: &str) -> String {
        let out = self.ssh(script);
        assert!(
            out.status.success(),
            "ssh {script:?}: {:?}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Waits until SSH with the key logs in (sshd up and cloud-init has
    /// installed the key); how long it took.
    fn wait_ssh(&self, serve: &Keel) -> Duration {
        let start = Instant::now();
        loop {
            let out = self.ssh("true");
            if out.status.success() {
                return start.elapsed();
            }
            if start.elapsed() > SSH_AFTER_READY {
                let logs = self.keel(&["vm", "logs", "deb", "--tail", "40"]);
                panic!(
                    "no SSH login within {SSH_AFTER_READY:?}: {}\nconsole:\n{}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    String::from_utf8_lossy(&logs.stdout),
                    serve.log()
                );
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn sha256_of(out: &str) -> String {
    let sum = out
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert_eq!(sum.len(), 64, "not a sha256sum line: {out:?}");
    sum
}

/// The byte offset of partition `n` (1-based) of a raw disk image.
fn partition_offset(raw: &Path, n: usize) -> u64 {
    let out = Command::new("sfdisk")
        .arg("--json")
        .arg(raw)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table: Value = serde_json::from_slice(&out.stdout).unwrap();
    let sector = table["partitiontable"]["sectorsize"]
        .as_u64()
        .unwrap_or(512);
    table["partitiontable"]["partitions"][n - 1]["start"]
        .as_u64()
        .expect("partition start")
        * sector
}

#[test]
fn debian_import_ssh_restart_snapshot_stop_restore() {
    if std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1") {
        eprintln!("KEEL_SKIP_QEMU_TESTS=1: skipping the Debian workload test");
        return;
    }
    let _one_guest_at_a_time = ONE_DEBIAN.lock().unwrap_or_else(|e| e.into_inner());
    let total = Instant::now();
    let image = debian_image();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let _kill_all = KillAll(root.clone());
    let key = root.join("id_ed25519");
    let made = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "keel-e2e", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(made.success());

    let cp = root.join("cp");
    let serve = Keel::spawn(
        "keel serve",
        &[
            "serve",
            "--data-dir",
            cp.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--node",
            "e2e",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = loop {
        let log = serve.log.lock().unwrap().clone();
        if let Some(addr) = log.split("serving addr=").nth(1) {
            break format!("https://{}", addr.split_whitespace().next().unwrap());
        }
        assert!(
            Instant::now() < deadline,
            "keel serve did not come up:\n{}",
            serve.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let env = Env {
        root: root.clone(),
        server,
        key: key.clone(),
        port: free_port(),
    };

    // 1. Import, create with a published SSH port and a key, SSH in.
    let t = Instant::now();
    let out = env.ok(
        &["image", "import", "debian", image.to_str().unwrap()],
        &serve,
    );
    assert!(out.contains("image debian imported: disk qcow2"), "{out}");
    eprintln!("image import: {:?}", t.elapsed());
    let publish = format!("127.0.0.1:{}:22", env.port);
    let pubkey = format!("{}.pub", key.display());
    let grace = GRACE_S.to_string();
    let t = Instant::now();
    env.ok(
        &[
            "vm",
            "create",
            "deb",
            "--image",
            "debian",
            "--memory",
            "1024",
            "--publish",
            &publish,
            "--ssh-key",
            &pubkey,
            "--grace",
            &grace,
            "--wait",
            "--timeout",
            "300",
        ],
        &serve,
    );
    let ready = t.elapsed();
    assert!(ready < BOOT);
    let vm = env.vm();
    assert_eq!(vm["spec"]["readiness"], "agent", "{vm}");
    let readiness = &vm["status"]["instance"]["readiness"];
    assert!(
        readiness["ready_at"].is_u64() && readiness["agent"] == true,
        "--wait returned before the agent answered: {readiness}"
    );
    env.wait_ssh(&serve);
    let create_to_ssh = t.elapsed();
    eprintln!("create → agent ready: {ready:?}; create → SSH login: {create_to_ssh:?}");
    assert_eq!(env.ssh_ok("hostname").trim(), "deb");
    assert_eq!(env.ssh_ok("id -un").trim(), "debian");

    // The agent reports the guest's DHCP address from user-mode networking
    // (passt leases the host's own); it may take a look or two after the
    // first answer.
    let leased = keel_hv::qemu::passt::guest_address().expect("a default route");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let vm = env.vm();
        let addrs = &vm["status"]["instance"]["readiness"]["addresses"];
        if addrs
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["address"] == leased.as_str()))
        {
            assert_eq!(vm["status"]["instance"]["readiness"]["hostname"], "deb");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no {leased} from the agent: {vm}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }

    // 2. A file written with fsync survives a restart requested the moment
    // the write returned.
    let written = env.ssh_ok(
        "head -c 131072 /dev/urandom > kept && sync kept && stat -c %s kept && sha256sum kept",
    );
    let mut lines = written.lines();
    assert_eq!(lines.next(), Some("131072"), "{written}");
    let kept = sha256_of(lines.next().unwrap());
    let t = Instant::now();
    env.ok(
        &["vm", "restart", "deb", "--wait", "--timeout", "300"],
        &serve,
    );
    let restart_ready = t.elapsed();
    env.wait_ssh(&serve);
    let restart_to_ssh = t.elapsed();
    eprintln!("restart → agent ready: {restart_ready:?}; restart → SSH login: {restart_to_ssh:?}");
    assert_eq!(sha256_of(&env.ssh_ok("sha256sum kept")), kept);
    let boots = env.ssh_ok("journalctl --list-boots --no-pager | wc -l");
    assert!(boots.trim().parse::<u32>().unwrap() >= 1, "{boots}");

    // 3. A live snapshot with the agent freezes the filesystems: quiesced.
    let t = Instant::now();
    env.ok(
        &[
            "snapshot",
            "create",
            "deb",
            "s1",
            "--wait",
            "--timeout",
            "120",
        ],
        &serve,
    );
    let snapshot_took = t.elapsed();
    eprintln!("live snapshot (freeze, snapshot, thaw): {snapshot_took:?}");
    let snap: Value =
        serde_json::from_str(&env.ok(&["snapshot", "get", "deb", "s1", "-o", "json"], &serve))
            .unwrap();
    let status = &snap["snapshot"]["status"];
    assert_eq!(status["live"], true, "{snap}");
    assert_eq!(status["quiesced"], true, "{snap}");
    // Thawed afterwards: the guest writes again. This file is not in the
    // snapshot, so the restore must take it away.
    env.ssh_ok("echo after > after-snapshot && sync after-snapshot");

    // 4. A stop ends by the guest's own power-off on the ACPI button: not
    // by the kill at the end of the grace period, nor by the agent's
    // shutdown fallback at half of it (hence the bound).
    let t = Instant::now();
    env.ok(&["vm", "stop", "deb", "--wait", "--timeout", "180"], &serve);
    let stop_took = t.elapsed();
    eprintln!("stop (ACPI power-off by the guest): {stop_took:?}");
    assert!(
        stop_took < Duration::from_secs(GRACE_S / 2),
        "the stop took {stop_took:?} of a {GRACE_S} s grace period"
    );
    let vm = env.vm();
    let exit = &vm["status"]["last_exit"];
    assert_eq!(exit["kind"], "GuestPoweroff", "{vm}");
    assert_eq!(exit["requested"], true, "{vm}");
    let events = env.ok(&["events", "deb", "-o", "json"], &serve);
    let events: Value = serde_json::from_str(&events).unwrap();
    let reasons: Vec<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["event"]["reason"].as_str().or(e["reason"].as_str()))
        .collect();
    eprintln!("events: {reasons:#?}");
    let stop_at = reasons
        .iter()
        .rposition(|r| *r == "stop requested by user")
        .expect("the stop is an event");
    assert_eq!(
        reasons[stop_at + 1..],
        ["instance deb-2 exited (GuestPoweroff, requested)"],
        "the stop's exit, as recorded"
    );

    // 5. Restore (the VM stays stopped, as it was), then check the restored
    // root filesystem offline. Offline because `fsck -n` of a mounted root
    // reports the live journal as errors; with the VM stopped nothing has
    // the disk open, and ext4 checkpoints its journal and clears
    // needs_recovery when frozen, so a quiesced snapshot must pass a
    // forced read-only check with no fix-ups at all. (Checked: with the
    // freeze taken out of the snapshot task, this e2fsck skips journal
    // recovery, finds "Free blocks count wrong" and exits 4.)
    let t = Instant::now();
    env.ok(
        &["restore", "deb", "s1", "--wait", "--timeout", "120"],
        &serve,
    );
    eprintln!("restore (stopped VM): {:?}", t.elapsed());
    assert_eq!(env.vm()["status"]["phase"], "Stopped");
    let disk = cp.join("node/disks/deb/root.qcow2");
    let check = Command::new("qemu-img")
        .arg("check")
        .arg(&disk)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "qemu-img check: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let raw = root.join("restored.raw");
    let converted = Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(&disk)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(
        converted.status.success(),
        "{}",
        String::from_utf8_lossy(&converted.stderr)
    );
    // Partition 2 is the ext4 root (see scripts/build-debian-image);
    // e2fsprogs opens it inside the whole-disk file with `?offset=`.
    let offset = partition_offset(&raw, 2);
    let fsck = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(format!("{}?offset={offset}", raw.display()))
        .output()
        .unwrap();
    let fsck_out = format!(
        "{}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    eprintln!("e2fsck -fn of the restored root:\n{fsck_out}");
    assert_eq!(fsck.status.code(), Some(0), "{fsck_out}");
    std::fs::remove_file(&raw).unwrap();

    let t = Instant::now();
    env.ok(
        &["vm", "start", "deb", "--wait", "--timeout", "300"],
        &serve,
    );
    env.wait_ssh(&serve);
    eprintln!("start after restore → SSH login: {:?}", t.elapsed());
    assert_eq!(sha256_of(&env.ssh_ok("sha256sum kept")), kept);
    assert_eq!(
        env.ssh_ok("test -e after-snapshot && echo present || echo absent")
            .trim(),
        "absent"
    );
    let ext4_errors = env.ssh_ok("sudo dmesg | grep -ci 'ext4.*error' || true");
    assert_eq!(
        ext4_errors.trim(),
        "0",
        "ext4 errors in the restored guest's kernel log"
    );

    env.ok(
        &["vm", "delete", "deb", "--wait", "--timeout", "180"],
        &serve,
    );
    eprintln!("whole Debian workload test: {:?}", total.elapsed());
}

/// The guest's uptime and boot id, printed on its serial console every
/// second by a unit that cloud-init installs: the console is the one view
/// of a guest on a `keel agent` node the test has without SSH (published
/// ports cannot move between two nodes on one host), read from the files
/// of each instance as the driver writes them.
const UPTIME_USER_DATA: &str = r#"#cloud-config
write_files:
  - path: /usr/local/bin/keel-uptime
    permissions: "0755"
    content: |
      #!/bin/sh
      boot=$(cat /proc/sys/kernel/random/boot_id)
      while :; do
        read up idle < /proc/uptime
        echo "KEEL-UPTIME $up $boot" > /dev/ttyS0
        sleep 1
      done
  - path: /etc/systemd/system/keel-uptime.service
    content: |
      [Unit]
      Description=Uptime and boot id on the serial console (Keel's migration test)
      [Service]
      ExecStart=/usr/local/bin/keel-uptime
runcmd:
  - [systemctl, start, --no-block, keel-uptime.service]
"#;

/// How long (guest seconds) the target's console is watched after arrival.
const KEEP_WATCHING_S: f64 = 10.0;

/// Lines of a console log in which the guest's kernel reports a bug,
/// oops, warning or corruption.
fn kernel_trouble(console: &str) -> Vec<&str> {
    const SIGNS: [&str; 8] = [
        "BUG:",
        "Oops",
        "WARNING:",
        "corrupted",
        "preempt leak",
        "general protection fault",
        "Kernel panic",
        "Call Trace:",
    ];
    console
        .lines()
        .filter(|l| SIGNS.iter().any(|s| l.contains(s)))
        .collect()
}

/// The last `KEEL-UPTIME <seconds> <boot id>` line of a console log.
fn last_uptime(console: &Path) -> Option<(f64, String)> {
    let text = std::fs::read_to_string(console).unwrap_or_default();
    text.rsplit("KEEL-UPTIME ").find_map(|rest| {
        let mut words = rest.split_whitespace();
        let up = words.next()?.parse::<f64>().ok()?;
        let boot = words.next()?;
        (boot.len() == 36).then(|| (up, boot.to_string()))
    })
}

/// Issue 12's last step: a live migration keeps the guest running (the
/// same boot, its uptime going on). etcd, a control plane and two agents
/// on one machine, disks and images on directories all of them share.
///
/// Under TCG before QEMU 9.0 live pre-copy lost guest writes (QEMU's TCG
/// dirty tracking, see `keel_hv::qemu::migration::precopy`): in 2 of 7
/// runs this guest's kernel broke on the target within a second (a
/// corrupted timer, a corrupted `preempt_count`). Keel now pauses such a
/// source for the transfer, and the target's console must show no kernel
/// trouble for as long as the test watches it.
#[test]
fn debian_live_migration_keeps_the_guests_uptime() {
    if procs::skipped() {
        eprintln!("skipping the Debian live migration test");
        return;
    }
    let _one_guest_at_a_time = ONE_DEBIAN.lock().unwrap_or_else(|e| e.into_inner());
    let total = Instant::now();
    let image = debian_image();
    let store = procs::store_spec("debian-migrate");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let _kill_all = KillAll(root.clone());
    let dir = |name: &str| root.join(name).to_string_lossy().into_owned();
    let (disks, images) = (dir("disks"), dir("images"));
    let cp = procs::spawn_control_plane(&store, &dir("cp"), &["--image-dir", &images]);
    let agents: Vec<Keel> = ["n1", "n2"]
        .iter()
        .map(|node| {
            procs::spawn_agent(
                &store,
                node,
                &dir(node),
                &["--disk-dir", &disks, "--image-dir", &images],
            )
        })
        .collect();
    let logs = || {
        std::iter::once(cp.log())
            .chain(agents.iter().map(Keel::log))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = loop {
        let log = cp.log.lock().unwrap().clone();
        if let Some(addr) = log.split("serving addr=").nth(1) {
            break format!("https://{}", addr.split_whitespace().next().unwrap());
        }
        assert!(Instant::now() < deadline, "no control plane:\n{}", logs());
        std::thread::sleep(Duration::from_millis(100));
    };
    let keel = |args: &[&str]| {
        let out = procs::cli(&root, &server, args);
        assert!(
            out.status.success(),
            "keel {args:?}: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            logs()
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = procs::cli(&root, &server, &["node", "list", "-o", "json"]);
        let nodes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if nodes["items"].as_array().is_some_and(|a| a.len() == 2) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "agents did not register:\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    keel(&["image", "import", "debian", image.to_str().unwrap()]);
    let user_data = root.join("user-data");
    std::fs::write(&user_data, UPTIME_USER_DATA).unwrap();
    let t = Instant::now();
    keel(&[
        "vm",
        "create",
        "mig",
        "--image",
        "debian",
        "--memory",
        "512",
        "--user-data",
        user_data.to_str().unwrap(),
        "--wait",
        "--timeout",
        "300",
    ]);
    eprintln!(
        "create → agent ready (on a keel agent node): {:?}",
        t.elapsed()
    );
    let instance = |vm: &Value| {
        let inst = &vm["status"]["instance"];
        (
            inst["node"].as_str().unwrap().to_string(),
            inst["id"].as_str().unwrap().to_string(),
        )
    };
    let (source, source_id) = instance(&procs::vm_json(&root, &server, "mig").unwrap());
    let target = if source == "n1" { "n2" } else { "n1" };
    let console = |node: &str, id: &str| {
        root.join(node)
            .join("node/instances")
            .join(id)
            .join("console.log")
    };
    let deadline = Instant::now() + SSH_AFTER_READY;
    let (up_before, boot) = loop {
        if let Some(seen) = last_uptime(&console(&source, &source_id)) {
            break seen;
        }
        assert!(
            Instant::now() < deadline,
            "no uptime on the console: {}",
            std::fs::read_to_string(console(&source, &source_id)).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_secs(1));
    };

    let t = Instant::now();
    keel(&["node", "drain", &source, "--wait", "--timeout", "300"]);
    let drained = t.elapsed();
    let vm = procs::vm_json(&root, &server, "mig").unwrap();
    let (now_on, id) = instance(&vm);
    assert_eq!(now_on, target, "{vm}");
    // The source's QEMU ends once the target runs; bounded.
    let deadline = Instant::now() + Duration::from_secs(30);
    while procs::qemus_of(&root, "mig").len() != 1 {
        assert!(
            Instant::now() < deadline,
            "QEMUs of mig after the migration: {:?}",
            procs::qemus_of(&root, "mig")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let migrations = keel(&["migration", "list", "mig", "-o", "json"]);
    eprintln!("live migration {source} → {target} (drain --wait): {drained:?}; {migrations}");
    // The same boot on the target, its uptime going on from where it was:
    // not a fresh boot (new boot id, uptime from 0), and for a while: the
    // corrupted guests of lost writes oopsed within a second or two.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((up, after)) = last_uptime(&console(target, &id)) {
            assert_eq!(after, boot, "the guest rebooted");
            if up > up_before + KEEP_WATCHING_S {
                eprintln!("guest uptime {up_before} s before the drain, {up} s on {target}");
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no uptime from the guest on {target}: {}",
            std::fs::read_to_string(console(target, &id)).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    let on_target = std::fs::read_to_string(console(target, &id)).unwrap_or_default();
    let trouble = kernel_trouble(&on_target);
    assert!(
        trouble.is_empty(),
        "the guest's kernel on {target} after the migration:\n{}\n--- console:\n{on_target}",
        trouble.join("\n")
    );
    keel(&["vm", "delete", "mig", "--wait", "--timeout", "180"]);
    eprintln!("whole Debian migration test: {:?}", total.elapsed());
}
