//! The image store over the real HTTP API: import (a streamed upload,
//! checked with the real qemu-img), list, get, delete refused while a VM
//! uses the image, bad images refused, boot files only from the store.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{TestServer, DEADLINE};
use serde_json::{json, Value};

fn qemu_img(args: &[&str]) {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img runs");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// A refused upload is answered before its body is read, and the server
/// then closes the connection: not one to pool.
fn upload(server: &TestServer, name: &str, query: &str, file: &Path) -> common::Resp {
    let bytes = std::fs::read(file).unwrap();
    server.request(
        "PUT",
        &format!("/api/v1/images/{name}{query}"),
        Some(&server.token),
        Some(&bytes),
        &[("Connection", "close")],
    )
}

fn image_dir(server: &TestServer) -> PathBuf {
    server.dir.path().join("images")
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn field(r: &common::Resp) -> Value {
    r.json()["field"].clone()
}

#[test]
fn import_list_get_and_delete_refused_while_a_vm_uses_it() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", file.to_str().unwrap(), "10M"]);

    let r = upload(&server, "base", "", &file);
    assert_eq!(r.status, 201, "{}", r.text);
    let image = &r.json()["image"];
    assert_eq!(image["kind"], "disk");
    assert_eq!(image["format"], "qcow2");
    assert_eq!(image["virtual_size_bytes"], 10 << 20);
    assert_eq!(image["size_bytes"], std::fs::metadata(&file).unwrap().len());
    assert_eq!(
        image["sha256"],
        sha256(&file),
        "the checksum of what was sent"
    );
    let stored = image_dir(&server).join(format!("base.{}.qcow2", sha256(&file)));
    assert_eq!(sha256(&stored), sha256(&file));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&stored).unwrap().permissions().mode() & 0o777,
        0o444
    );

    let again = upload(&server, "base", "", &file);
    assert_eq!(
        (again.status, field(&again)),
        (409, json!("name")),
        "{}",
        again.text
    );

    let list = server.get("/api/v1/images").json();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["image"]["name"], "base");
    assert_eq!(server.get("/api/v1/images/base").status, 200);
    assert_eq!(server.get("/api/v1/images/nope").status, 404);

    // A disk from the image, its size left out: the image's virtual size.
    let vm = server.create_vm(
        "web",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped",
               "disks": [{"name": "root", "image": "base"}, {"name": "data", "size_mib": 8}]}),
    );
    assert_eq!(vm["vm"]["spec"]["disks"][0]["size_mib"], 10);
    assert_eq!(vm["vm"]["spec"]["disks"][0]["image"], "base");
    // Smaller than the image: refused, naming the field.
    let r = server.send(
        "POST",
        "/api/v1/vms",
        &json!({"name": "small", "spec": {"cpus": 1, "memory_mib": 64,
            "disks": [{"name": "root", "image": "base", "size_mib": 5}]}})
        .to_string(),
    );
    assert_eq!(
        (r.status, field(&r)),
        (422, json!("spec.disks[0].size_mib")),
        "{}",
        r.text
    );
    let r = server.send(
        "POST",
        "/api/v1/vms",
        &json!({"name": "other", "spec": {"cpus": 1, "memory_mib": 64,
            "disks": [{"name": "root", "image": "missing"}]}})
        .to_string(),
    );
    assert_eq!(
        (r.status, field(&r)),
        (422, json!("spec.disks[0].image")),
        "{}",
        r.text
    );
    assert!(server.vm("small").is_none() && server.vm("other").is_none());

    // In use: refused, naming the VM; image and file stay.
    let r = server.send("DELETE", "/api/v1/images/base", "");
    assert_eq!((r.status, field(&r)), (409, json!("name")), "{}", r.text);
    assert!(
        r.json()["error"].as_str().unwrap().contains("web"),
        "{}",
        r.text
    );
    assert!(stored.exists());
    assert_eq!(server.get("/api/v1/images/base").status, 200);

    // A disk's image is fixed for its life.
    let vm = server.wait_settled_stopped("web");
    let mut spec = vm["vm"]["spec"].clone();
    spec["disks"][0].as_object_mut().unwrap().remove("image");
    let rev = vm["revision"].to_string();
    let r = server.request(
        "PUT",
        "/api/v1/vms/web/spec",
        Some(&server.token),
        Some(json!({"spec": spec}).to_string().as_bytes()),
        &[("If-Match", &rev)],
    );
    assert_eq!(
        (r.status, field(&r)),
        (409, json!("spec.disks[0].image")),
        "{}",
        r.text
    );

    assert_eq!(server.send("DELETE", "/api/v1/vms/web", "").status, 202);
    server.wait_gone("web");
    let r = server.send("DELETE", "/api/v1/images/base", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(!stored.exists(), "the file goes with the record");
    assert_eq!(server.get("/api/v1/images/base").status, 404);
    assert!(files_in(&image_dir(&server)).is_empty());
}

/// The 409 of a refused delete: its message, after checking the image and
/// its file stayed.
#[track_caller]
fn delete_refused(server: &TestServer, name: &str, file: &Path) -> String {
    let r = server.send("DELETE", &format!("/api/v1/images/{name}"), "");
    assert_eq!((r.status, field(&r)), (409, json!("name")), "{}", r.text);
    assert!(file.exists(), "the file stays");
    assert_eq!(server.get(&format!("/api/v1/images/{name}")).status, 200);
    r.json()["error"].as_str().unwrap().to_string()
}

#[test]
fn delete_refused_while_a_vm_a_snapshot_or_an_overlay_needs_the_image() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("base.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", file.to_str().unwrap(), "10M"]);
    assert_eq!(upload(&server, "base", "", &file).status, 201);
    let stored = image_dir(&server)
        .canonicalize()
        .unwrap()
        .join(format!("base.{}.qcow2", sha256(&file)));

    server.create_vm(
        "keep",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped",
               "disks": [{"name": "root", "image": "base"}, {"name": "data", "size_mib": 8}]}),
    );
    let message = delete_refused(&server, "base", &stored);
    assert!(message.contains("VM keep"), "{message}");

    // A snapshot taken with the image: once the VM's spec no longer names
    // it, the snapshot still does (a restore brings the disk back).
    let r = server.send(
        "POST",
        "/api/v1/vms/keep/snapshots",
        &json!({"name": "s1"}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    server.wait_snapshot("keep", "s1", "become Ready", |s| {
        s["snapshot"]["status"]["phase"] == "Ready"
    });
    let vm = server.wait_settled_stopped("keep");
    let mut spec = vm["vm"]["spec"].clone();
    spec["disks"].as_array_mut().unwrap().remove(0);
    let r = server.request(
        "PUT",
        "/api/v1/vms/keep/spec",
        Some(&server.token),
        Some(json!({"spec": spec}).to_string().as_bytes()),
        &[("If-Match", &vm["revision"].to_string())],
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let message = delete_refused(&server, "base", &stored);
    assert!(
        message.contains("snapshot keep/s1") && !message.contains("VM keep"),
        "{message}"
    );
    let r = server.send("DELETE", "/api/v1/vms/keep/snapshots/s1", "");
    assert_eq!(r.status, 202, "{}", r.text);
    let start = Instant::now();
    while server.get("/api/v1/vms/keep/snapshots/s1").status != 404 {
        assert!(start.elapsed() < DEADLINE, "snapshot keep/s1 not deleted");
        std::thread::sleep(Duration::from_millis(20));
    }

    // An overlay made on the image, noted as a node's driver notes it,
    // still on disk though no record names the image any more.
    let disks = tmp.path().canonicalize().unwrap().join("disks");
    std::fs::create_dir_all(disks.join("gone")).unwrap();
    std::fs::write(
        disks.join(keel_hv::image_refs::STORAGE_ID_FILE),
        "test-storage",
    )
    .unwrap();
    let overlay = disks.join("gone/root.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        stored.to_str().unwrap(),
        overlay.to_str().unwrap(),
    ]);
    let notes = keel_hv::images::ImageStore::open(
        &image_dir(&server),
        Path::new("qemu-img"),
        Duration::from_secs(30),
    )
    .unwrap();
    notes
        .note_overlay(&stored, &overlay, "test-storage")
        .unwrap();
    let message = delete_refused(&server, "base", &stored);
    assert!(
        message.contains(&format!("overlay {}", overlay.display())),
        "{message}"
    );
    // One on another node's own disk dir cannot be seen gone from here.
    let elsewhere = disks.join("elsewhere/root.qcow2");
    notes
        .note_overlay(&stored, &elsewhere, "other-node")
        .unwrap();
    let message = delete_refused(&server, "base", &stored);
    assert!(
        message.contains(&format!("overlay {}", elsewhere.display()))
            && message.contains("does not see"),
        "{message}"
    );
    // Its node dropped the note with the VM's disks.
    notes.forget_overlay(&stored, &elsewhere).unwrap();
    // An overlay seen gone no longer holds the image.
    std::fs::remove_file(&overlay).unwrap();
    let r = server.send("DELETE", "/api/v1/images/base", "");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(!stored.exists());
    assert!(
        files_in(&image_dir(&server).join(".overlays")).is_empty(),
        "the note of the gone overlay went"
    );
}

#[test]
fn images_keel_would_not_boot_safely_are_refused_and_leave_nothing() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n).to_string_lossy().into_owned();
    qemu_img(&["create", "-q", "-f", "qcow2", &p("base.qcow2"), "4M"]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        &p("base.qcow2"),
        &p("overlay.qcow2"),
    ]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("data_file={}", p("data.raw")),
        &p("datafile.qcow2"),
        "4M",
    ]);
    qemu_img(&["create", "-q", "-f", "vmdk", &p("disk.vmdk"), "4M"]);
    std::fs::write(p("empty"), b"").unwrap();
    std::fs::write(p("text"), b"not a kernel at all").unwrap();
    for (file, query, why) in [
        ("overlay.qcow2", "", "backing file"),
        ("datafile.qcow2", "", "data file"),
        ("disk.vmdk", "", "vmdk"),
        ("text", "?kind=kernel", "not a Linux kernel"),
        ("empty", "?kind=initrd", "empty"),
    ] {
        let r = upload(&server, "bad", query, Path::new(&p(file)));
        assert_eq!(
            (r.status, field(&r)),
            (422, json!("file")),
            "{file}: {}",
            r.text
        );
        assert!(
            r.json()["error"].as_str().unwrap().contains(why),
            "{file}: {}",
            r.text
        );
        assert_eq!(server.get("/api/v1/images/bad").status, 404);
        assert!(
            files_in(&image_dir(&server)).is_empty(),
            "{file} left {:?}",
            files_in(&image_dir(&server))
        );
    }
    let r = upload(&server, "bad", "?kind=floppy", Path::new(&p("text")));
    assert_eq!((r.status, field(&r)), (422, json!("kind")), "{}", r.text);
    let r = upload(&server, "Bad", "", Path::new(&p("base.qcow2")));
    assert_eq!(r.status / 100, 4, "{}", r.text);
    // Unauthenticated: refused before anything is written, and before the
    // body is read (nobody's upload is taken in without the token). So the
    // body is one that fits the socket's buffers: a client still writing a
    // bigger one when the refusal closes the connection gets a broken pipe.
    let bytes = std::fs::read(p("base.qcow2")).unwrap();
    let r = server.request(
        "PUT",
        "/api/v1/images/x",
        None,
        Some(&bytes[..4096]),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 401);
    assert!(files_in(&image_dir(&server)).is_empty());
}

/// A client that goes away mid-upload leaves neither record nor file.
#[test]
fn a_partial_upload_never_becomes_an_image() {
    let server = TestServer::start_plain_with(|_| {});
    let addr = server.base.trim_start_matches("http://").to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "PUT /api/v1/images/half HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Content-Length: 10000000\r\n\r\n",
        server.token
    )
    .unwrap();
    conn.write_all(&[7u8; 300_000]).unwrap();
    conn.flush().unwrap();
    // The upload is under way: its temporary file exists.
    let dir = image_dir(&server);
    let start = Instant::now();
    while files_in(&dir).is_empty() {
        assert!(start.elapsed() < DEADLINE, "no upload in progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        files_in(&dir)[0].starts_with(".import-"),
        "{:?}",
        files_in(&dir)
    );
    drop(conn);
    let start = Instant::now();
    while !files_in(&dir).is_empty() {
        assert!(
            start.elapsed() < DEADLINE,
            "left behind: {:?}",
            files_in(&dir)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.get("/api/v1/images/half").status, 404);
    assert!(server.get("/api/v1/images").json()["items"]
        .as_array()
        .unwrap()
        .is_empty());
    // The connection is answered, not hung, when the client only half-closes.
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "PUT /api/v1/images/half HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Content-Length: 100\r\n\r\nshort",
        server.token
    )
    .unwrap();
    conn.shutdown(std::net::Shutdown::Write).unwrap();
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut answer = String::new();
    let _ = conn.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    assert_eq!(server.get("/api/v1/images/half").status, 404);
}

#[test]
fn boot_files_are_images_of_the_store_never_host_paths() {
    let server = TestServer::start();
    let create = |spec: Value| {
        server.send(
            "POST",
            "/api/v1/vms",
            &json!({"name": "boot", "spec": spec}).to_string(),
        )
    };
    for (boot, field_name) in [
        (json!({"kernel": "/etc/shadow"}), "spec.boot.kernel"),
        (
            json!({"kernel": "/boot/vmlinuz", "initrd": "/etc/shadow"}),
            "spec.boot.kernel",
        ),
        (json!({"initrd": "/etc/shadow"}), "spec.boot.initrd"),
        (json!({"kernel": "vmlinuz"}), "spec.boot.kernel"),
    ] {
        let r = create(json!({"cpus": 1, "memory_mib": 64, "boot": boot}));
        assert_eq!(r.status, 422, "{boot}: {}", r.text);
        assert_eq!(field(&r), json!(field_name), "{boot}: {}", r.text);
        assert!(server.vm("boot").is_none());
    }
    let r = create(json!({"cpus": 1, "memory_mib": 64, "boot": {"kernel": "/etc/shadow"}}));
    assert!(
        r.json()["error"].as_str().unwrap().contains("host path"),
        "{}",
        r.text
    );

    // Images of the right kind are accepted; of the wrong kind, refused.
    let tmp = tempfile::tempdir().unwrap();
    let mut kernel = vec![0u8; 0x400];
    kernel[0x202..0x206].copy_from_slice(b"HdrS");
    std::fs::write(tmp.path().join("k"), &kernel).unwrap();
    std::fs::write(tmp.path().join("i"), b"initrd").unwrap();
    assert_eq!(
        upload(&server, "k", "?kind=kernel", &tmp.path().join("k")).status,
        201
    );
    assert_eq!(
        upload(&server, "i", "?kind=initrd", &tmp.path().join("i")).status,
        201
    );
    let r = create(json!({"cpus": 1, "memory_mib": 64, "boot": {"kernel": "i"}}));
    assert_eq!(
        (r.status, field(&r)),
        (422, json!("spec.boot.kernel")),
        "{}",
        r.text
    );
    assert!(
        r.json()["error"].as_str().unwrap().contains("initrd image"),
        "{}",
        r.text
    );
    server.create_vm(
        "boot",
        json!({"cpus": 1, "memory_mib": 64, "power": "Stopped", "boot": {"kernel": "k", "initrd": "i"}}),
    );
    // Nor can an update bring a host path in.
    let vm = server.wait_settled_stopped("boot");
    let mut spec = vm["vm"]["spec"].clone();
    spec["boot"]["initrd"] = json!("/etc/shadow");
    let rev = vm["revision"].to_string();
    let r = server.request(
        "PUT",
        "/api/v1/vms/boot/spec",
        Some(&server.token),
        Some(json!({"spec": spec}).to_string().as_bytes()),
        &[("If-Match", &rev)],
    );
    assert_eq!(
        (r.status, field(&r)),
        (422, json!("spec.boot.initrd")),
        "{}",
        r.text
    );
    // Both are in use now.
    assert_eq!(server.send("DELETE", "/api/v1/images/i", "").status, 409);

    // A record stored before the image store, with host paths, still reads.
    server.put_raw(
        "/vms/old",
        &json!({"name": "old", "generation": 1,
                "spec": {"cpus": 1, "memory_mib": 64, "power": "Stopped",
                         "boot": {"kernel": "/boot/vmlinuz", "initrd": "/etc/shadow"}}}),
    );
    let old = server.vm("old").expect("decodes");
    assert_eq!(old["vm"]["spec"]["boot"]["initrd"], "/etc/shadow");
}

#[test]
fn the_sim_driver_runs_a_vm_made_from_an_image() {
    let server = TestServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("base.raw");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    let r = upload(&server, "base", "", &file);
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json()["image"]["format"], "raw");
    server.create_vm(
        "web",
        json!({"cpus": 1, "memory_mib": 64,
               "disks": [{"name": "root", "image": "base", "size_mib": 64}],
               "boot": {"firmware": "uefi"}}),
    );
    server.wait_vm("web", "run", |v| common::phase(v) == "Running");
}

#[test]
fn openapi_describes_the_image_routes() {
    let server = TestServer::start();
    let doc = server.get("/api/v1/openapi.json").json();
    for (path, method) in [
        ("/api/v1/images", "get"),
        ("/api/v1/images/{name}", "put"),
        ("/api/v1/images/{name}", "get"),
        ("/api/v1/images/{name}", "delete"),
    ] {
        assert!(
            doc["paths"][path].get(method).is_some(),
            "{method} {path} undocumented"
        );
    }
    let schemas = &doc["components"]["schemas"];
    assert!(schemas["Image"]["properties"]["sha256"].is_object());
    assert!(schemas["DiskSpec"]["properties"]["image"].is_object());
    assert_eq!(
        schemas["BootSpec"]["properties"]["firmware"]["enum"],
        json!(["bios", "uefi", "uefi-secure"])
    );
}
