//! Below the free-space floor a VM's start fails before QEMU runs, and
//! the reason, naming the floor's flag, is on the VM (`keel vm get`'s
//! message), not only in the log.

mod common;

use common::TestServer;
use keel_hv::qemu::AccelChoice;
use serde_json::json;

use keel_testkit::guest::dir as guest_dir;

#[test]
fn a_start_below_the_floor_says_why_on_the_vm() {
    let Some(guest) = guest_dir() else { return };
    let server = TestServer::start_with(move |cfg| {
        cfg.hypervisor = keel::args::HypervisorKind::Qemu;
        cfg.guest_dir = Some(guest);
        cfg.accel = AccelChoice::Tcg;
        // Above any real filesystem's free space.
        cfg.min_free_disk_bytes = u64::MAX / 4;
    });
    server.create_vm(
        "floor-e2e",
        json!({"cpus": 1, "memory_mib": 128, "disks": [{"name": "data", "size_mib": 64}],
               "run_policy": "Manual", "power": "Running", "readiness": "none"}),
    );
    let vm = server.wait_vm("floor-e2e", "the floor's reason", |v| {
        v["vm"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--min-free-disk-mib"))
    });
    let message = vm["vm"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("not creating disk data of VM floor-e2e"),
        "{message}"
    );
    assert!(!server
        .dir
        .path()
        .join("node/disks/floor-e2e/data.qcow2")
        .exists());
}
