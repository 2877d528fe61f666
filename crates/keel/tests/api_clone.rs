//! `keel vm clone` through the API of a real in-process server (sim
//! driver): the CLI takes a snapshot first, the clone starts on copies of
//! the source's disks with its own MAC; each refusal names its field and
//! stores nothing.

mod common;

use common::cli::{fails, keel, ok};
use common::TestServer;
use serde_json::{json, Value};

fn refused(r: &common::Resp, status: u16, field: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    let body: Value = r.json();
    assert_eq!(body["field"], field, "{}", r.text);
}

#[test]
fn a_clone_is_made_from_a_snapshot_and_refusals_name_their_field() {
    let server = TestServer::start();
    server.create_vm(
        "src",
        json!({"cpus": 1, "memory_mib": 64,
               "disks": [{"name": "root", "size_mib": 64}]}),
    );
    server.wait_vm("src", "run", |v| common::phase(v) == "Running");

    // No snapshot named: the CLI takes clone-copy, then clones from it.
    let out = ok(&keel(&server, &["vm", "clone", "src", "copy", "--start"]));
    assert!(
        out.contains("cloned from src at snapshot clone-copy"),
        "{out}"
    );
    let copy = server.wait_vm("copy", "run", |v| common::phase(v) == "Running");
    let src = server.vm("src").unwrap();
    assert_ne!(
        copy["vm"]["spec"]["network"]["mac"],
        src["vm"]["spec"]["network"]["mac"]
    );
    assert_ne!(copy["vm"]["uid"], src["vm"]["uid"]);
    assert_eq!(copy["vm"]["status"]["clone_from"]["vm"], "src");
    assert_eq!(copy["vm"]["status"]["clone_from"]["snapshot"], "clone-copy");
    assert_eq!(copy["vm"]["status"]["clone_from"]["disks"], json!(["root"]));

    let before = server.settled_state();
    // To a name taken, from a snapshot not there or not a name, or with
    // a field the API does not know: refused, nothing stored.
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "copy", "snapshot": "clone-copy"}"#,
        ),
        409,
        "name",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "other", "snapshot": "nope"}"#,
        ),
        404,
        "snapshot",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/src/clone",
            r#"{"name": "Bad Name", "snapshot": "clone-copy"}"#,
        ),
        422,
        "name",
    );
    refused(
        &server.send(
            "POST",
            "/api/v1/vms/ghost/clone",
            r#"{"name": "other", "snapshot": "clone-copy"}"#,
        ),
        404,
        "name",
    );
    let r = server.send(
        "POST",
        "/api/v1/vms/src/clone",
        r#"{"name": "other", "snapshot": "clone-copy", "shallow": true}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("shallow"), "{}", r.text);
    let err = fails(&keel(
        &server,
        &["vm", "clone", "src", "copy", "--snapshot", "clone-copy"],
    ));
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(server.settled_state(), before, "nothing stored");

    // A clone stays its own VM: a clone of the clone, stopped.
    let out = ok(&keel(&server, &["vm", "clone", "copy", "copy2"]));
    assert!(out.contains("stopped"), "{out}");
    let copy2 = server.wait_settled_stopped("copy2");
    assert_eq!(copy2["vm"]["status"]["clone_from"]["vm"], "copy");
    assert!(copy2["vm"]["status"]["clone_from"].get("linked").is_none());

    // A linked clone is recorded as one, and runs.
    let out = ok(&keel(
        &server,
        &[
            "vm",
            "clone",
            "src",
            "thin",
            "--snapshot",
            "clone-copy",
            "--linked",
            "--start",
        ],
    ));
    assert!(out.contains("overlays on a frozen copy"), "{out}");
    let thin = server.wait_vm("thin", "run", |v| common::phase(v) == "Running");
    assert_eq!(thin["vm"]["status"]["clone_from"]["linked"], true);
}

/// The entries of a tar archive: (name, bytes).
fn archive_entries(file: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    use std::io::Read;
    let mut archive = tar::Archive::new(std::fs::File::open(file).unwrap());
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            e.read_to_end(&mut bytes).unwrap();
            (name, bytes)
        })
        .collect()
}

fn write_archive(file: &std::path::Path, entries: &[(String, Vec<u8>)]) {
    let mut tar = tar::Builder::new(std::fs::File::create(file).unwrap());
    for (name, bytes) in entries {
        let mut h = tar::Header::new_ustar();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o600);
        tar.append_data(&mut h, name, bytes.as_slice()).unwrap();
    }
    tar.finish().unwrap();
}

/// Staging left in the image dir by an export or import (none, once each
/// request is answered).
fn staging_left(server: &TestServer) -> Vec<String> {
    let images = server.dir.path().join("images");
    std::fs::read_dir(&images)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".vm-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn an_export_is_imported_as_a_new_vm_elsewhere_and_refusals_name_their_field() {
    let server = TestServer::start();
    server.create_vm(
        "src",
        json!({"cpus": 1, "memory_mib": 64,
               "disks": [{"name": "root", "size_mib": 64}, {"name": "data", "size_mib": 32}]}),
    );
    server.wait_vm("src", "run", |v| common::phase(v) == "Running");
    let out_dir = tempfile::tempdir().unwrap();
    let file = out_dir.path().join("src.tar");
    let file_arg = file.to_str().unwrap();

    // What a crashed server left a day ago goes with the next export; a
    // staging directory in use (changed lately) stays.
    let images = server.dir.path().join("images");
    let (abandoned, in_use) = (
        images.join(".vm-export-1-dead"),
        images.join(".vm-import-2-live"),
    );
    std::fs::create_dir_all(&abandoned).unwrap();
    std::fs::create_dir_all(&in_use).unwrap();
    let touched = std::process::Command::new("touch")
        .args(["-d", "2 days ago"])
        .arg(&abandoned)
        .status()
        .unwrap();
    assert!(touched.success());

    // Export while it runs: the CLI's snapshot is taken, then deleted.
    let err = String::from_utf8(keel(&server, &["vm", "export", "src", file_arg]).stderr).unwrap();
    assert!(err.contains("src: exported at snapshot export-"), "{err}");
    server.wait_no_snapshots("src");
    let entries = archive_entries(&file);
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["manifest.json", "root.qcow2", "data.qcow2"]);
    let manifest: Value = serde_json::from_slice(&entries[0].1).unwrap();
    assert_eq!(manifest["format"], "keel-vm-export");
    assert_eq!(manifest["format_version"], 1);
    assert_eq!(manifest["vm"], "src");
    assert!(manifest["spec"].get("node").is_none(), "{manifest}");
    assert_eq!(staging_left(&server), [".vm-import-2-live"]);
    std::fs::remove_dir(&in_use).unwrap();

    // Imported on another server (its own data dir): a new VM with its
    // own MAC, its disks recorded as made and used, running.
    let other = TestServer::start();
    let out = ok(&keel(
        &other,
        &["vm", "import", file_arg, "--name", "copy", "--start"],
    ));
    assert!(out.contains("copy: imported from VM src"), "{out}");
    let copy = other.wait_vm("copy", "run", |v| common::phase(v) == "Running");
    let src = server.vm("src").unwrap();
    assert_ne!(
        copy["vm"]["spec"]["network"]["mac"],
        src["vm"]["spec"]["network"]["mac"]
    );
    let disks = copy["vm"]["status"]["disks"].as_array().unwrap();
    assert_eq!(disks.len(), 2, "{copy}");
    assert!(disks.iter().all(|d| d["used"] == true), "{copy}");

    // Refusals: each names its field, stores nothing, leaves no file.
    let before = other.settled_state();
    let bytes = std::fs::read(&file).unwrap();
    let put = |name: &str, body: &[u8]| {
        other.request(
            "PUT",
            &format!("/api/v1/vms/{name}/import"),
            Some(&other.token),
            Some(body),
            &[("Connection", "close")],
        )
    };
    refused(&put("copy", &bytes), 409, "name");
    refused(&put("fresh", b"not a tar archive at all"), 422, "file");
    let mut damaged = entries.clone();
    damaged[1].1[0] ^= 0xff;
    let damaged_file = out_dir.path().join("damaged.tar");
    write_archive(&damaged_file, &damaged);
    let r = put("fresh", &std::fs::read(&damaged_file).unwrap());
    refused(&r, 422, "file");
    assert!(r.text.contains("does not match its manifest"), "{}", r.text);
    let mut foreign = entries.clone();
    foreign.swap(0, 1);
    write_archive(&damaged_file, &foreign);
    refused(
        &put("fresh", &std::fs::read(&damaged_file).unwrap()),
        422,
        "file",
    );
    assert_eq!(other.settled_state(), before, "nothing stored");
    assert!(other.vm("fresh").is_none());

    // An upload larger than --max-image-size is refused as it arrives,
    // also when what is over the limit follows the archive's end.
    let cap = bytes.len() as u64 + 1024;
    let small = TestServer::start_with(move |cfg| cfg.api_limits.max_image_bytes = cap);
    let before_small = small.settled_state();
    let mut padded = bytes.clone();
    padded.extend(std::iter::repeat_n(0u8, 64 << 10));
    let r = small.request(
        "PUT",
        "/api/v1/vms/fresh/import",
        Some(&small.token),
        Some(&padded),
        &[("Connection", "close")],
    );
    refused(&r, 413, "size");
    assert_eq!(small.settled_state(), before_small, "nothing stored");
    assert!(
        staging_left(&small).is_empty(),
        "{:?}",
        staging_left(&small)
    );
    assert!(
        staging_left(&other).is_empty(),
        "{:?}",
        staging_left(&other)
    );

    // The CLI refuses a file that is not an export before sending it, and
    // the server an export of a VM or snapshot it does not have.
    let err = fails(&keel(
        &other,
        &["vm", "import", damaged_file.to_str().unwrap()],
    ));
    assert!(err.contains("not a Keel VM export"), "{err}");
    assert!(err.contains("damaged.tar"), "{err}");
    refused(
        &server.get("/api/v1/vms/ghost/export?snapshot=s1"),
        404,
        "name",
    );
    refused(
        &server.get("/api/v1/vms/src/export?snapshot=nope"),
        404,
        "snapshot",
    );
    refused(&server.get("/api/v1/vms/src/export"), 400, "snapshot");
    let err = fails(&keel(&server, &["vm", "export", "ghost", file_arg]));
    assert!(err.contains("ghost"), "{err}");

    // A stopped VM exports the same way, and its import starts stopped.
    let r = server.send("POST", "/api/v1/vms/src/stop", "");
    assert_eq!(r.status, 200, "{}", r.text);
    server.wait_settled_stopped("src");
    let stopped_file = out_dir.path().join("stopped.tar");
    ok(&keel(
        &server,
        &["vm", "export", "src", stopped_file.to_str().unwrap()],
    ));
    ok(&keel(
        &other,
        &["vm", "import", stopped_file.to_str().unwrap()],
    ));
    let imported = other.wait_settled_stopped("src");
    assert_eq!(imported["vm"]["spec"]["power"], "Stopped");
    let r = other.send("POST", "/api/v1/vms/src/start", "");
    assert_eq!(r.status, 200, "{}", r.text);
    other.wait_vm("src", "run", |v| common::phase(v) == "Running");
}
