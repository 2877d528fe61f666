//! The guest agent against a real qemu-guest-agent: the Debian 12 image
//! that `scripts/build-debian-image` builds, booted through SeaBIOS from
//! its disk (`firmware: bios`). The VM's disk is a qcow2 overlay on the
//! image, so the image stays untouched.
//!
//! Skips, loudly, only when the image has not been built.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{wait_for, Fixture};
use keel_api::DiskSpec;
use keel_hv::qemu::guest_agent::QgaSession;
use keel_hv::{AgentState, DomainSpec, DomainState, ExitCause, Hypervisor};
use serde_json::{json, Value};

/// Booting Debian under TCG takes ~40 s to a login prompt on a quiet
/// machine; on a loaded one much longer.
const AGENT_UP: Duration = Duration::from_secs(300);

fn image() -> Option<PathBuf> {
    let path = std::env::var_os("KEEL_DEBIAN_IMAGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/debian-image/debian-12.qcow2")
        });
    if path.is_file() {
        return Some(path);
    }
    eprintln!(
        "\n*** SKIPPED: the Debian test image {} is not built. Run \
         `scripts/build-debian-image` (or set KEEL_DEBIAN_IMAGE). ***\n",
        path.display()
    );
    None
}

/// Runs a program in the guest through the agent and waits for it.
async fn guest_exec(session: &mut QgaSession, path: &str, args: &[&str]) -> i64 {
    let started = session
        .execute(
            "guest-exec",
            Some(json!({"path": path, "arg": args, "capture-output": true})),
            None,
        )
        .await
        .unwrap();
    let pid = started["pid"].as_i64().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status: Value = session
            .execute("guest-exec-status", Some(json!({ "pid": pid })), None)
            .await
            .unwrap();
        if status["exited"].as_bool() == Some(true) {
            return status["exitcode"].as_i64().unwrap_or(-1);
        }
        assert!(Instant::now() < deadline, "{path} {args:?} did not finish");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_answers_freezes_and_powers_off_a_guest_that_ignores_acpi() {
    let Some(image) = image() else { return };
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let disk = hv.disk_path("deb", "root");
    std::fs::create_dir_all(disk.parent().unwrap()).unwrap();
    let out = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&image)
        .arg(&disk)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let disks = vec![DiskSpec {
        name: "root".into(),
        size_mib: 2048,
        image: None,
    }];
    let spec = DomainSpec {
        vm: "deb".into(),
        instance: "deb-1".into(),
        cpus: 1,
        memory_mib: 512,
        disks: disks.clone(),
        boot: keel_api::BootSpec {
            firmware: Some(keel_api::Firmware::Bios),
            ..Default::default()
        },
        create_disks: keel_hv::DiskCreation::none(),
        images: vec![],
        // With a NIC, the agent reports the guest's DHCP address too.
        network: Default::default(),
        cloud_init: None,
        fenced: true,
        hardware: None,
        hotplug_ports: 0,
        plugged: Vec::new(),
        clone_from: None,
        recorded_firmware: None,
        tpm: None,
        balloon: false,
    };
    let t = Instant::now();
    hv.start(&spec).await.unwrap();

    // Ready: the agent answers.
    let info = loop {
        let info = hv.guest_info("deb-1").await.unwrap();
        if info.agent.is_answering() {
            break info;
        }
        assert!(
            t.elapsed() < AGENT_UP,
            "agent silent after {:?}: {info:?}\nconsole: {}",
            t.elapsed(),
            String::from_utf8_lossy(&hv.console_tail("deb-1", 4096).await.unwrap().0)
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    eprintln!("agent answered {:?} after start: {info:?}", t.elapsed());
    let AgentState::Answering { version } = &info.agent else {
        unreachable!()
    };
    assert!(version.is_some());
    // No NIC in this VM: loopback only.
    assert!(
        info.ips
            .iter()
            .any(|ip| ip.address.to_string() == "127.0.0.1"),
        "{info:?}"
    );

    // A quiesced live snapshot: freeze, snapshot, thaw.
    let frozen = hv.fs_freeze("deb-1").await.unwrap();
    assert!(frozen >= 1, "froze {frozen} filesystems");
    hv.snapshot_disks("deb", &disks, Some("deb-1"), "quiet")
        .await
        .unwrap();
    let thawed = hv.fs_thaw("deb-1").await.unwrap();
    assert_eq!(thawed, frozen);
    let mut session = QgaSession::open(&hv.agent_socket("deb-1"), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(session.fs_freeze_status().await.unwrap(), "thawed");
    assert!(common::image_snapshots(&disk).contains(&"quiet".to_string()));

    // The guest stops listening to the power button: logind handles it,
    // told to ignore it. (Masking logind would not do: `shutdown`, which
    // the agent runs, schedules through logind.)
    let rc = guest_exec(
        &mut session,
        "/bin/sh",
        &[
            "-c",
            "mkdir -p /etc/systemd/logind.conf.d && \
             printf '[Login]\\nHandlePowerKey=ignore\\n' \
               >/etc/systemd/logind.conf.d/keel-test.conf && \
             systemctl restart systemd-logind",
        ],
    )
    .await;
    assert_eq!(rc, 0);
    drop(session);
    hv.shutdown("deb-1").await.unwrap();
    let state = wait_for(hv, "deb-1", Duration::from_secs(15), DomainState::is_exited).await;
    assert_eq!(state, DomainState::Running, "ACPI was to be ignored");

    let asked = Instant::now();
    hv.guest_shutdown("deb-1").await.unwrap();
    let state = wait_for(
        hv,
        "deb-1",
        Duration::from_secs(120),
        DomainState::is_exited,
    )
    .await;
    assert_eq!(state, DomainState::Exited(ExitCause::Poweroff));
    eprintln!("powered off {:?} after guest-shutdown", asked.elapsed());
    hv.cleanup("deb-1").await.unwrap();
}
