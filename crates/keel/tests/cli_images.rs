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
