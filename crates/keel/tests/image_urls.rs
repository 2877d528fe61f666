//! Images imported from URLs, against a real in-process server and a tiny
//! HTTP file server on 127.0.0.1: the server downloads, checks the sum and
//! the format, and on every failure (wrong sum, unreachable URL, too large
//! announced or streamed, a body cut short) answers naming the field and
//! leaves neither a record nor a file in the image dir.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::cli::{fails, keel, ok};
use common::{Resp, TestServer, DEADLINE};
use serde_json::{json, Value};
use sha2::{Digest, Sha256, Sha512};

const LIMIT: u64 = 1 << 20;

/// What the file server answers for a path.
#[derive(Clone)]
enum Reply {
    /// 200 with this body and its true length.
    File(Vec<u8>),
    /// 200 announcing `announced` bytes, then sending `body` and closing.
    Lying { announced: u64, body: Vec<u8> },
    /// 200 with no Content-Length: the body ends when the connection does.
    Unannounced(Vec<u8>),
    /// 302 to another path.
    Redirect(String),
    /// 200 with the body's first half, the rest once the gate opens.
    Gated(Vec<u8>, Arc<Mutex<Option<mpsc::Receiver<()>>>>),
}

fn serve_files(routes: HashMap<&'static str, Reply>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let routes = Arc::new(routes);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let routes = routes.clone();
            std::thread::spawn(move || answer(conn, &routes));
        }
    });
    base
}

fn answer(mut conn: TcpStream, routes: &HashMap<&'static str, Reply>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
    }
    let path = request_line.split(' ').nth(1).unwrap_or("/").to_string();
    // The server may stop reading at any point: write errors are its choice.
    let _ = match routes.get(path.as_str()) {
        None => conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
        Some(Reply::File(body)) => write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .and_then(|()| conn.write_all(body)),
        Some(Reply::Lying { announced, body }) => write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {announced}\r\nConnection: close\r\n\r\n"
        )
        .and_then(|()| conn.write_all(body)),
        Some(Reply::Unannounced(body)) => conn
            .write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            .and_then(|()| conn.write_all(body)),
        Some(Reply::Redirect(to)) => write!(
            conn,
            "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\n\r\n"
        ),
        Some(Reply::Gated(body, gate)) => {
            let half = body.len() / 2;
            let first = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .and_then(|()| conn.write_all(&body[..half]))
            .and_then(|()| conn.flush());
            if let Some(gate) = gate.lock().unwrap().take() {
                let _ = gate.recv();
            }
            first.and_then(|()| conn.write_all(&body[half..]))
        }
    };
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

fn import(server: &TestServer, name: &str, body: Value) -> Resp {
    server.send(
        "POST",
        &format!("/api/v1/images/{name}/import-url"),
        &body.to_string(),
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".overlays")
        .collect();
    names.sort();
    names
}

/// The refusal names `field`, and the image dir and the store are as before.
fn refused(server: &TestServer, r: &Resp, status: u16, field: &str, name: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    assert_eq!(r.json()["field"], field, "{}", r.text);
    assert_eq!(
        server.get(&format!("/api/v1/images/{name}")).status,
        404,
        "no record of {name}"
    );
    let left: Vec<String> = files_in(&server.dir.path().join("images"))
        .into_iter()
        .filter(|f| f.starts_with(".import-") || f.starts_with(&format!("{name}.")))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn small_limit() -> TestServer {
    TestServer::start_with(|cfg| cfg.api_limits.max_image_bytes = LIMIT)
}

fn qcow2_bytes(extra: &[&str]) -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("d.qcow2");
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .args(extra)
        .args([file.to_str().unwrap(), "10M"])
        .output()
        .expect("qemu-img runs");
    assert!(out.status.success());
    std::fs::read(file).unwrap()
}

#[test]
fn a_download_is_checked_and_every_failure_leaves_nothing() {
    let server = small_limit();
    let disk = qcow2_bytes(&[]);
    // QEMU would open whatever path a backing file names.
    let unsafe_disk = qcow2_bytes(&["-u", "-b", "/etc/shadow", "-F", "raw"]);
    let initrd = b"an initrd from the web".to_vec();
    let closed_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let base = serve_files(HashMap::from([
        ("/disk.qcow2", Reply::File(disk.clone())),
        ("/initrd", Reply::File(initrd.clone())),
        ("/moved", Reply::Redirect("/initrd".into())),
        (
            "/announced-too-big",
            Reply::Lying {
                announced: LIMIT + 1,
                body: Vec::new(),
            },
        ),
        (
            "/unannounced-too-big",
            Reply::Unannounced(vec![7; LIMIT as usize + 4096]),
        ),
        (
            "/sends-more-than-announced",
            Reply::Lying {
                announced: 1000,
                body: vec![9; 2 * LIMIT as usize],
            },
        ),
        (
            "/cut-short",
            Reply::Lying {
                announced: 100_000,
                body: vec![1; 10],
            },
        ),
        ("/backed.qcow2", Reply::File(unsafe_disk)),
        ("/not-a-kernel", Reply::File(b"<html>oops</html>".to_vec())),
    ]));

    // Good: a qcow2 with the right sha256 is listed with its size and sum.
    let sum = hex(&Sha256::digest(&disk));
    let r = import(
        &server,
        "web",
        json!({"url": format!("{base}/disk.qcow2"), "sha256": sum}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let list = server.get("/api/v1/images").json();
    let image = &list["items"][0]["image"];
    assert_eq!(image["name"], "web");
    assert_eq!(image["format"], "qcow2");
    assert_eq!(image["size_bytes"], disk.len());
    assert_eq!(image["sha256"], sum);
    assert_eq!(image["virtual_size_bytes"], 10 << 20);
    assert_eq!(
        files_in(&server.dir.path().join("images")),
        [format!("web.{sum}.qcow2")]
    );

    // A redirect is followed; a SHA-512 (Debian's SHA512SUMS) checked.
    let r = import(
        &server,
        "moved",
        json!({"url": format!("{base}/moved"), "kind": "initrd",
               "sha512": hex(&Sha512::digest(&initrd))}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json()["image"]["size_bytes"], initrd.len());

    // A wrong checksum.
    let wrong = hex(&Sha256::digest(b"something else"));
    let r = import(
        &server,
        "bad-sum",
        json!({"url": format!("{base}/initrd"), "kind": "initrd", "sha256": wrong}),
    );
    refused(&server, &r, 422, "sha256", "bad-sum");
    assert!(r.text.contains(&wrong), "{}", r.text);
    let r = import(
        &server,
        "bad-sum",
        json!({"url": format!("{base}/initrd"), "kind": "initrd", "sha512": "00".repeat(64)}),
    );
    refused(&server, &r, 422, "sha512", "bad-sum");

    // Nowhere: a closed port, a 404.
    let r = import(
        &server,
        "nowhere",
        json!({"url": format!("http://127.0.0.1:{closed_port}/x"), "kind": "initrd"}),
    );
    refused(&server, &r, 502, "url", "nowhere");
    let r = import(
        &server,
        "nowhere",
        json!({"url": format!("{base}/missing"), "kind": "initrd"}),
    );
    refused(&server, &r, 502, "url", "nowhere");
    assert!(r.text.contains("404"), "{}", r.text);

    // Too large: announced (refused before a byte is written), or growing
    // past the limit with no length announced (cut off).
    let r = import(
        &server,
        "big",
        json!({"url": format!("{base}/announced-too-big"), "kind": "initrd"}),
    );
    refused(&server, &r, 413, "size", "big");
    assert!(r.text.contains("--max-image-size"), "{}", r.text);
    let r = import(
        &server,
        "big",
        json!({"url": format!("{base}/unannounced-too-big"), "kind": "initrd"}),
    );
    refused(&server, &r, 413, "size", "big");

    // A body shorter than announced broke off: nothing kept.
    let r = import(
        &server,
        "short",
        json!({"url": format!("{base}/cut-short"), "kind": "initrd"}),
    );
    refused(&server, &r, 502, "url", "short");

    // A server sending more than it announced gets only what it announced
    // into the image (HTTP framing): never past the limit.
    let r = import(
        &server,
        "liar",
        json!({"url": format!("{base}/sends-more-than-announced"), "kind": "initrd"}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.json()["image"]["size_bytes"], 1000);
    assert_eq!(
        r.json()["image"]["sha256"],
        hex(&Sha256::digest(vec![9u8; 1000]))
    );

    // Not an image Keel boots: the upload path's probe refuses it.
    let r = import(
        &server,
        "backed",
        json!({"url": format!("{base}/backed.qcow2")}),
    );
    refused(&server, &r, 422, "url", "backed");
    assert!(r.text.contains("backing file"), "{}", r.text);
    let r = import(
        &server,
        "html",
        json!({"url": format!("{base}/not-a-kernel"), "kind": "kernel"}),
    );
    refused(&server, &r, 422, "url", "html");

    // Bad requests name their field.
    for (body, field) in [
        (json!({"url": "ftp://host/x"}), "url"),
        (json!({"url": "file:///etc/shadow"}), "url"),
        (
            json!({"url": format!("{base}/initrd"), "sha256": "abc"}),
            "sha256",
        ),
        (
            json!({"url": format!("{base}/initrd"), "sha256": sum, "sha512": "00"}),
            "sha512",
        ),
        (
            json!({"url": format!("{base}/initrd"), "checksum": "x"}),
            "checksum",
        ),
    ] {
        let r = import(&server, "req", body.clone());
        assert_eq!(
            (r.status, r.json()["field"].clone()),
            (400, json!(field)),
            "{body}: {}",
            r.text
        );
    }
    let r = import(&server, "web", json!({"url": format!("{base}/initrd")}));
    assert_eq!((r.status, r.json()["field"].clone()), (409, json!("name")));
}

#[test]
fn progress_is_reported_while_the_download_runs() {
    let server = small_limit();
    let body = vec![3u8; 200_000];
    let (open_gate, gate) = mpsc::channel();
    let base = serve_files(HashMap::from([(
        "/slow",
        Reply::Gated(body.clone(), Arc::new(Mutex::new(Some(gate)))),
    )]));
    std::thread::scope(|s| {
        let done = s.spawn(|| {
            import(
                &server,
                "slow",
                json!({"url": format!("{base}/slow"), "kind": "initrd"}),
            )
        });
        let start = Instant::now();
        let progress = loop {
            let r = server.get("/api/v1/images/slow/import-url");
            if r.status == 200 && r.json()["bytes_done"] == 100_000 {
                break r.json();
            }
            assert!(start.elapsed() < DEADLINE, "no progress: {}", r.text);
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(progress["phase"], "downloading");
        assert_eq!(progress["total_bytes"], 200_000);
        assert_eq!(progress["url"], format!("{base}/slow"));
        open_gate.send(()).unwrap();
        let r = done.join().unwrap();
        assert_eq!(r.status, 201, "{}", r.text);
    });
    assert_eq!(server.get("/api/v1/images/slow/import-url").status, 404);
}

#[test]
fn no_room_for_the_announced_size_is_507_naming_size() {
    let server = TestServer::start_with(|cfg| cfg.api_limits.max_image_bytes = u64::MAX);
    let base = serve_files(HashMap::from([(
        "/a-petabyte",
        Reply::Lying {
            announced: 1 << 50,
            body: Vec::new(),
        },
    )]));
    let r = import(
        &server,
        "pb",
        json!({"url": format!("{base}/a-petabyte"), "kind": "initrd"}),
    );
    refused(&server, &r, 507, "size", "pb");
}

#[test]
fn the_cli_imports_from_a_url_and_names_the_field_it_refuses() {
    let server = small_limit();
    let initrd = b"initrd over the CLI".to_vec();
    let base = serve_files(HashMap::from([("/initrd", Reply::File(initrd.clone()))]));
    let url = format!("{base}/initrd");
    let sum = hex(&Sha256::digest(&initrd));
    let out = ok(&keel(
        &server,
        &[
            "image", "import", "cli", &url, "--kind", "initrd", "--sha256", &sum,
        ],
    ));
    assert!(
        out.contains("image cli imported") && out.contains(&sum),
        "{out}"
    );
    let err = fails(&keel(
        &server,
        &[
            "image",
            "import",
            "cli2",
            &url,
            "--kind",
            "initrd",
            "--sha256",
            &"0".repeat(64),
        ],
    ));
    assert!(err.contains("[field: sha256]"), "{err}");
    let err = fails(&keel(
        &server,
        &[
            "image",
            "import",
            "cli2",
            "http://127.0.0.1:1/x",
            "--kind",
            "initrd",
        ],
    ));
    assert!(err.contains("[field: url]"), "{err}");
    assert_eq!(server.get("/api/v1/images/cli2").status, 404);
}

/// The limit holds for uploads as well: one past it is cut off, leaving
/// nothing.
#[test]
fn an_upload_past_the_limit_is_413_naming_size() {
    let server = small_limit();
    let r = server.request(
        "PUT",
        "/api/v1/images/up?kind=initrd",
        Some(&server.token),
        Some(&vec![5u8; LIMIT as usize + 1]),
        &[("Connection", "close")],
    );
    refused(&server, &r, 413, "size", "up");
    let r = server.request(
        "PUT",
        "/api/v1/images/up?kind=initrd",
        Some(&server.token),
        Some(&vec![5u8; LIMIT as usize]),
        &[("Connection", "close")],
    );
    assert_eq!(r.status, 201, "{}", r.text);
}

/// HTTPS is verified against the webpki roots: the Keel server's own
/// self-signed certificate is not trusted, and the refusal names `url`.
#[test]
fn an_https_url_with_an_untrusted_certificate_is_refused() {
    let server = small_limit();
    assert!(server.base.starts_with("https://"), "{}", server.base);
    let r = import(
        &server,
        "self-signed",
        json!({"url": format!("{}/healthz", server.base), "kind": "initrd"}),
    );
    refused(&server, &r, 502, "url", "self-signed");
    assert!(r.text.to_lowercase().contains("certificate"), "{}", r.text);
}
