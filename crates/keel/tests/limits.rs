//! What a client can make the server keep is bounded (issue 32, items 5
//! and 9): lists come in pages, creates past a cap are a 409 naming the
//! cap and its flag, follow streams are capped while open, and below the
//! free-space floor no image is imported. Nothing refused is stored.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::{json, Value};

fn stopped() -> Value {
    json!({"cpus": 1, "memory_mib": 64, "power": "Stopped"})
}

fn names(list: &Value, field: &str) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i[field]["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn lists_come_in_pages_and_a_bad_limit_names_the_field() {
    let server = TestServer::start();
    for name in ["e", "b", "d", "a", "c"] {
        server.create_vm(name, stopped());
    }
    let mut seen = Vec::new();
    let mut path = "/api/v1/vms?limit=2".to_string();
    loop {
        let page = server.get(&path).json();
        let got = names(&page, "vm");
        assert!(got.len() <= 2, "{page}");
        seen.extend(got);
        match page["continue"].as_str() {
            Some(token) => path = format!("/api/v1/vms?limit=2&continue={token}"),
            None => break,
        }
    }
    assert_eq!(seen, ["a", "b", "c", "d", "e"]);
    let all = server.get("/api/v1/vms").json();
    assert_eq!(names(&all, "vm").len(), 5);
    assert!(all.get("continue").is_none(), "{all}");

    for bad in ["0", "x", "5001", "-1"] {
        let r = server.get(&format!("/api/v1/vms?limit={bad}"));
        assert_eq!(
            (r.status, r.json()["field"].as_str()),
            (400, Some("limit")),
            "{}",
            r.text
        );
    }

    // Events page by revision, oldest first.
    let mut revisions = Vec::new();
    let mut path = "/api/v1/events?limit=1".to_string();
    let deadline = Instant::now() + common::DEADLINE;
    while revisions.len() < 2 && Instant::now() < deadline {
        revisions.clear();
        path = "/api/v1/events?limit=1".to_string();
        loop {
            let page = server.get(&path).json();
            let items = page["items"].as_array().unwrap();
            assert!(items.len() <= 1, "{page}");
            revisions.extend(items.iter().map(|i| i["revision"].as_u64().unwrap()));
            match page["continue"].as_str() {
                Some(token) => path = format!("/api/v1/events?limit=1&continue={token}"),
                None => break,
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(revisions.len() >= 2, "{revisions:?} {path}");
    assert!(revisions.windows(2).all(|w| w[0] < w[1]), "{revisions:?}");
    let r = server.get("/api/v1/events?continue=nope");
    assert_eq!(
        (r.status, r.json()["field"].as_str()),
        (400, Some("continue"))
    );
    let r = server.get("/api/v1/events?follow=true&limit=5");
    assert_eq!((r.status, r.json()["field"].as_str()), (400, Some("limit")));
}

#[test]
fn creating_past_a_cap_is_refused_naming_it_and_stores_nothing() {
    let server = TestServer::start_with(|cfg| {
        cfg.api_limits.max_vms = 2;
        cfg.api_limits.max_snapshots_per_vm = 1;
        cfg.api_limits.max_images = 0;
    });
    server.create_vm("a", stopped());
    server.create_vm("b", stopped());
    let body = json!({"name": "c", "spec": stopped()}).to_string();
    let r = server.send("POST", "/api/v1/vms", &body);
    assert_eq!(r.status, 409, "{}", r.text);
    let msg = r.json()["error"].as_str().unwrap().to_string();
    assert!(
        msg.contains("at most 2 VMs") && msg.contains("--max-vms"),
        "{msg}"
    );
    assert_eq!(server.get("/api/v1/vms/c").status, 404);

    server.wait_settled_stopped("a");
    let r = server.send("POST", "/api/v1/vms/a/snapshots", r#"{"name":"s1"}"#);
    assert_eq!(r.status, 201, "{}", r.text);
    let r = server.send("POST", "/api/v1/vms/a/snapshots", r#"{"name":"s2"}"#);
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.text.contains("--max-snapshots-per-vm"), "{}", r.text);
    assert_eq!(server.get("/api/v1/vms/a/snapshots/s2").status, 404);

    let r = server.request(
        "PUT",
        "/api/v1/images/base",
        Some(&server.token),
        Some(b"x"),
        &[],
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.text.contains("--max-images"), "{}", r.text);
    assert_eq!(server.get("/api/v1/images/base").status, 404);
}

/// Creates racing each other never pass `--max-vms` together, and the
/// count follows deletions: a VM deleted makes room for the next create.
#[test]
fn racing_creates_stop_at_the_vm_cap_and_a_deletion_makes_room() {
    let server = TestServer::start_with(|cfg| cfg.api_limits.max_vms = 3);
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let creates: Vec<_> = (0..12)
            .map(|i| {
                let server = &server;
                s.spawn(move || {
                    let body = json!({"name": format!("r{i}"), "spec": stopped()}).to_string();
                    server.send("POST", "/api/v1/vms", &body).status
                })
            })
            .collect();
        creates.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        3,
        "{statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 409),
        "{statuses:?}"
    );
    let list = server.get("/api/v1/vms").json();
    let stored = names(&list, "vm");
    assert_eq!(stored.len(), 3, "{stored:?}");

    let body = json!({"name": "late", "spec": stopped()}).to_string();
    assert_eq!(server.send("POST", "/api/v1/vms", &body).status, 409);
    assert_eq!(
        server
            .send("DELETE", &format!("/api/v1/vms/{}", stored[0]), "")
            .status,
        202
    );
    server.wait_gone(&stored[0]);
    let r = server.send("POST", "/api/v1/vms", &body);
    assert_eq!(r.status, 201, "{}", r.text);
}

/// Sends a follow request on a socket of its own and returns it with the
/// response's status line.
fn follow(server: &TestServer) -> (TcpStream, String) {
    let addr = server.base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /api/v1/events?follow=true HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\r\n",
        server.token
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n") {
        s.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    (s, String::from_utf8_lossy(&head).trim().to_string())
}

#[test]
fn follow_streams_are_capped_while_they_last() {
    let server = TestServer::start_plain_with(|cfg| cfg.api_limits.max_follows = 1);
    let (first, status) = follow(&server);
    assert!(status.contains(" 200 "), "{status}");
    let r = server.get("/api/v1/events?follow=true");
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.text.contains("--max-follows"), "{}", r.text);
    // The list itself is not a stream and stays open to all.
    assert_eq!(server.get("/api/v1/events").status, 200);

    drop(first);
    let deadline = Instant::now() + common::DEADLINE;
    loop {
        let (_again, status) = follow(&server);
        if status.contains(" 200 ") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was never given back: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn below_the_free_space_floor_no_image_is_imported() {
    let server = TestServer::start_with(|cfg| cfg.min_free_disk_bytes = u64::MAX / 4);
    let r = server.request(
        "PUT",
        "/api/v1/images/base",
        Some(&server.token),
        Some(b"x"),
        &[],
    );
    assert_eq!(r.status, 507, "{}", r.text);
    assert!(r.text.contains("--min-free-disk-mib"), "{}", r.text);
    assert_eq!(server.get("/api/v1/images/base").status, 404);
}

/// The CLI follows the pages: `vm list` shows every VM past one page.
#[test]
fn the_cli_lists_past_one_page() {
    // The setup's 501 creates come faster than one token's default rate.
    let server = TestServer::start_with(|c| c.token_limits.requests_per_second = 100_000);
    let count = keel::api::paging::DEFAULT_PAGE + 1;
    for i in 0..count {
        let body = json!({"name": format!("p{i:04}"), "spec": stopped()}).to_string();
        let r = server.send("POST", "/api/v1/vms", &body);
        assert_eq!(r.status, 201, "{}", r.text);
    }
    let first = server.get("/api/v1/vms").json();
    assert!(first["continue"].is_string(), "one page is not all of them");
    let out = common::cli::ok(&common::cli::keel(&server, &["vm", "list", "-o", "json"]));
    let list: Value = serde_json::from_str(&out).unwrap();
    let got = names(&list, "vm");
    let want: Vec<String> = (0..count).map(|i| format!("p{i:04}")).collect();
    assert_eq!(got, want);
    assert!(list.get("continue").is_none(), "{}", list["continue"]);
}
