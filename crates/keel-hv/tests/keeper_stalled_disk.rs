//! The fence keeper kills on time when the disk under its files hangs: its
//! lease is read by a thread of its own into memory, and the kill comes
//! before any record is written. A hanging disk is modelled by named pipes
//! with no writer or reader: opening one blocks, as a read or write on a
//! stalled device does, and no kernel module or root is needed.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel_hv::qemu::keeper::FenceLease;

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path we own.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {path:?}");
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    // A zombie has been killed; only its parent has not reaped it yet.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|t| !t.trim_start().starts_with('Z'))
    })
}

#[test]
fn the_keeper_kills_on_time_though_its_lease_and_marker_files_hang() {
    let dir = tempfile::tempdir().unwrap();
    let instance = dir.path().join("instance");
    std::fs::create_dir(&instance).unwrap();
    let record = serde_json::json!({
        "spec": {
            "vm": "stalled", "instance": "stalled-1", "cpus": 1, "memory_mib": 64,
            "disks": [], "boot": {}, "create_disks": false,
        },
        "started_at": 0,
        "accelerator": "Tcg",
        "argv": ["sleep", "600"],
    });
    std::fs::write(instance.join("spec.json"), record.to_string()).unwrap();
    let lease_path = dir.path().join("lease");
    let lease = FenceLease::new(&lease_path);
    const LEASE: Duration = Duration::from_millis(2_500);
    lease.renew(LEASE).unwrap();
    let renewed = Instant::now();
    let mut keeper = Command::new(env!("CARGO_BIN_EXE_keel-keeper"))
        .arg("--instance-dir")
        .arg(&instance)
        .arg("--lease")
        .arg(&lease_path)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let guest = loop {
        if let Some(&pid) = children_of(keeper.id()).first() {
            break pid;
        }
        if let Some(status) = keeper.try_wait().unwrap() {
            panic!("keeper exited before starting its guest: {status}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "no guest started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // The disk stalls: every open of the lease or the kill marker hangs.
    std::fs::remove_file(&lease_path).unwrap();
    mkfifo(&lease_path);
    mkfifo(&instance.join("kill-requested"));
    let deadline = renewed + LEASE;
    while alive(guest) && Instant::now() < deadline + Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let gone_at = Instant::now();
    let still_alive = alive(guest);
    // Unblock and end the keeper before asserting, so nothing is left.
    let _ = keeper.kill();
    let _ = keeper.wait();
    if still_alive {
        // SAFETY: plain kill of a pid this test started (via the keeper).
        unsafe { libc::kill(guest as i32, libc::SIGKILL) };
    }
    assert!(
        !still_alive,
        "the guest outlived its lease by 5 s: the kill waited on a hanging file"
    );
    assert!(
        gone_at < deadline + Duration::from_secs(1),
        "killed {:?} after the lease lapsed",
        gone_at - deadline
    );
}
