//! `keel image …` and `keel vm create --image` with the built binary
//! against an in-process server (sim hypervisor, real qemu-img).

mod common;

use common::cli::{fails, keel, ok};
use std::process::Command;

use common::TestServer;
use serde_json::Value;

#[test]
fn import_create_from_image_list_and_delete() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("debian.qcow2");
    let made = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&file)
        .arg("20M")
        .status()
        .unwrap();
    assert!(made.success());
    let f = file.to_str().unwrap();

    let out = ok(&keel(&server, &["image", "import", "debian", f]));
    assert!(out.contains("image debian imported: disk qcow2"), "{out}");
    let err = fails(&keel(&server, &["image", "import", "debian", f]));
    assert!(err.contains("already exists"), "{err}");
    let err = fails(&keel(
        &server,
        &["image", "import", "k", f, "--kind", "kernel"],
    ));
    assert!(
        err.contains("not a Linux kernel") && err.contains("[field: file]"),
        "{err}"
    );
    let err = fails(&keel(&server, &["image", "import", "x", "/nonexistent"]));
    assert!(err.contains("/nonexistent"), "{err}");

    let table = ok(&keel(&server, &["image", "list"]));
    assert!(
        table.starts_with("NAME") && table.contains("debian") && table.contains("20Mi"),
        "{table}"
    );
    let one = ok(&keel(&server, &["image", "get", "debian"]));
    assert!(one.contains("sha256:") && one.contains("qcow2"), "{one}");

    // The root disk from the image comes first; too small is refused, naming the field.
    let err = fails(&keel(
        &server,
        &[
            "vm",
            "create",
            "small",
            "--image",
            "debian",
            "--disk-size",
            "10",
        ],
    ));
    assert!(err.contains("[field: spec.disks[0].size_mib]"), "{err}");
    let err = fails(&keel(
        &server,
        &["vm", "create", "web", "--kernel", "/etc/shadow"],
    ));
    assert!(
        err.contains("[field: spec.boot.kernel]") && err.contains("host path"),
        "{err}"
    );
    let err = fails(&keel(
        &server,
        &["vm", "create", "web", "--disk-size", "64"],
    ));
    assert!(err.contains("--image"), "{err}");
    ok(&keel(
        &server,
        &[
            "vm",
            "create",
            "web",
            "--image",
            "debian",
            "--disk-size",
            "64",
            "--disk",
            "data:8",
            "--firmware",
            "uefi",
            "--stopped",
        ],
    ));
    let vm: Value =
        serde_json::from_str(&ok(&keel(&server, &["vm", "get", "web", "-o", "json"]))).unwrap();
    let disks = &vm["vm"]["spec"]["disks"];
    assert_eq!(
        (
            disks[0]["name"].as_str(),
            disks[0]["image"].as_str(),
            disks[0]["size_mib"].as_u64()
        ),
        (Some("root"), Some("debian"), Some(64))
    );
    assert_eq!(disks[1]["name"], "data");
    assert_eq!(vm["vm"]["spec"]["boot"]["firmware"], "uefi");
    let shown = ok(&keel(&server, &["vm", "get", "web"]));
    assert!(
        shown.contains("root (64 MiB, from image debian)") && shown.contains("uefi"),
        "{shown}"
    );

    ok(&keel(&server, &["snapshot", "create", "web", "s1"]));
    let err = fails(&keel(&server, &["image", "delete", "debian"]));
    assert!(
        err.contains("used by VM web, snapshot web/s1") && err.contains("HTTP 409"),
        "{err}"
    );
    ok(&keel(
        &server,
        &["vm", "delete", "web", "--wait", "--timeout", "30"],
    ));
    let out = ok(&keel(&server, &["image", "delete", "debian"]));
    assert!(out.contains("image debian deleted"), "{out}");
    let table = ok(&keel(&server, &["image", "list"]));
    assert!(!table.contains("debian"), "{table}");
}

/// The installer's CLI: an ISO imported with `--kind iso`, a VM created
/// with `--cdrom` and `--graphics vnc` (shown by `keel vm get`), its
/// CD-ROM ejected, put back and put behind the disk with `keel vm cdrom`,
/// bad names refused naming the field and the spec left as it was.
#[test]
fn cdrom_create_eject_insert_and_boot_order() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let iso = tmp.path().join("inst.iso");
    let mut bytes = vec![0u8; 17 * 2048];
    bytes[32768..32774].copy_from_slice(b"\x01CD001");
    std::fs::write(&iso, &bytes).unwrap();
    let disk = tmp.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 17 * 2048]).unwrap();
    let (iso, disk) = (iso.to_str().unwrap(), disk.to_str().unwrap());

    let err = fails(&keel(
        &server,
        &["image", "import", "notiso", disk, "--kind", "iso"],
    ));
    assert!(
        err.contains("CD001") && err.contains("[field: file]"),
        "{err}"
    );
    let out = ok(&keel(
        &server,
        &["image", "import", "inst", iso, "--kind", "iso"],
    ));
    assert!(out.contains("image inst imported: iso raw"), "{out}");
    ok(&keel(&server, &["image", "import", "rawdisk", disk]));

    let err = fails(&keel(
        &server,
        &[
            "vm", "create", "w", "--disk", "root:64", "--cdrom", "rawdisk",
        ],
    ));
    assert!(err.contains("[field: spec.boot.cdrom]"), "{err}");
    ok(&keel(
        &server,
        &[
            "vm",
            "create",
            "w",
            "--disk",
            "root:64",
            "--cdrom",
            "inst",
            "--graphics",
            "vnc",
            "--stopped",
        ],
    ));
    let shown = ok(&keel(&server, &["vm", "get", "w"]));
    assert!(
        shown.contains("inst (boots first, then the first disk)")
            && shown.contains("/api/v1/vms/w/vnc"),
        "{shown}"
    );
    let boot = |server: &TestServer| server.vm("w").unwrap()["vm"]["spec"]["boot"].clone();

    let out = ok(&keel(&server, &["vm", "cdrom", "w", "--eject"]));
    assert!(out.contains("the CD-ROM is empty"), "{out}");
    assert!(boot(&server).get("cdrom").is_none(), "{}", boot(&server));
    assert_eq!(boot(&server)["graphics"], "vnc");

    let err = fails(&keel(&server, &["vm", "cdrom", "w", "--insert", "missing"]));
    assert!(err.contains("[field: spec.boot.cdrom]"), "{err}");
    assert!(boot(&server).get("cdrom").is_none(), "{}", boot(&server));
    let err = fails(&keel(&server, &["vm", "cdrom", "w"]));
    assert!(
        err.contains("--insert") || err.contains("required"),
        "{err}"
    );

    let out = ok(&keel(
        &server,
        &["vm", "cdrom", "w", "--insert", "inst", "--boot", "disk"],
    ));
    assert!(out.contains("the CD-ROM holds inst"), "{out}");
    assert_eq!(boot(&server)["cdrom"], "inst");
    assert_eq!(boot(&server)["first"], "disk");
    let shown = ok(&keel(&server, &["vm", "get", "w"]));
    assert!(shown.contains("inst (after the first disk)"), "{shown}");

    let err = fails(&keel(&server, &["image", "delete", "inst"]));
    assert!(err.contains("used by VM w"), "{err}");

    // A running VM keeps its CD-ROM until its next start.
    ok(&keel(
        &server,
        &["vm", "create", "r", "--disk", "root:64", "--cdrom", "inst"],
    ));
    server.wait_vm("r", "run", |v| common::phase(v) == "Running");
    let out = ok(&keel(&server, &["vm", "cdrom", "r", "--eject"]));
    assert!(out.contains("until its next start"), "{out}");
    let vm = server.wait_vm("r", "need a restart", |v| {
        v["vm"]["status"]["restart_required"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
    });
    assert_eq!(
        vm["vm"]["status"]["restart_required"],
        serde_json::json!(["boot"]),
        "{vm}"
    );
}
