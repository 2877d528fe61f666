//! What a hostile guest agent can cost the process that asks it (issue 32:
//! a 99 KB reply took a node agent from 15 MB to 331 MB, and a full 1 MiB
//! one would have been ~13 GB). A test binary of its own, so the memory it
//! reads is this test's alone.

use std::time::Duration;

use keel_hv::qemu::guest_agent::{probe, MAX_REPLY};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

/// The issue's shape: one interface with a 20 KB name and `addresses`
/// addresses.
fn interfaces(addresses: u32) -> Value {
    let addrs: Vec<Value> = (0..addresses)
        .map(|i| json!({"ip-address-type": "ipv4", "ip-address": format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255), "prefix": 24}))
        .collect();
    json!([{"name": "x".repeat(20_000), "ip-addresses": addrs}])
}

/// Answers syncs and a few commands, `guest-network-get-interfaces` with
/// `reply`, for as many sessions as are opened.
async fn agent(listener: UnixListener, reply: Vec<u8>) {
    loop {
        let (stream, _) = listener.accept().await.unwrap();
        let reply = reply.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).split(b'\n');
            while let Ok(Some(line)) = lines.next_segment().await {
                let text: Vec<u8> = line.into_iter().filter(|b| *b != 0xff).collect();
                let msg: Value = serde_json::from_slice(&text).unwrap();
                let answer = match msg["execute"].as_str().unwrap() {
                    "guest-sync-delimited" => {
                        let mut a = b"\xff".to_vec();
                        a.extend(
                            serde_json::to_vec(&json!({"return": msg["arguments"]["id"]})).unwrap(),
                        );
                        a
                    }
                    "guest-info" => br#"{"return": {"version": "8.0"}}"#.to_vec(),
                    "guest-get-host-name" => br#"{"return": {"host-name": "web"}}"#.to_vec(),
                    "guest-network-get-interfaces" => reply.clone(),
                    _ => br#"{"error": {"class": "CommandNotFound", "desc": "no"}}"#.to_vec(),
                };
                // The guest may close first: the session was abandoned.
                if write.write_all(&answer).await.is_err() || write.write_all(b"\n").await.is_err()
                {
                    return;
                }
            }
        });
    }
}

/// This process's resident and peak resident memory, in KiB.
fn memory_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_replies_cost_bounded_memory_and_leave_the_agent_answering() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qga.sock");
    // A full 1 MiB reply: 20 KB of name and ~19,000 addresses.
    let reply = serde_json::to_vec(&json!({"return": interfaces(19_000)})).unwrap();
    let reply_kib = reply.len() / 1024;
    assert!(reply_kib > 1024 && reply_kib < 2048, "{reply_kib}");
    tokio::spawn(agent(UnixListener::bind(&path).unwrap(), reply));

    let first = probe(&path, Duration::from_secs(5)).await;
    let (rss_before, _) = memory_kib();
    // Every reconcile probes again: the cost must not add up either.
    for _ in 0..20 {
        let info = probe(&path, Duration::from_secs(5)).await;
        assert_eq!(info, first);
    }
    let (rss_after, peak) = memory_kib();
    eprintln!(
        "VmRSS before {rss_before} KiB, after 20 probes of a {reply_kib} KiB reply \
         (bound {} KiB) {rss_after} KiB, peak {peak} KiB",
        MAX_REPLY / 1024
    );
    assert!(first.agent.is_answering(), "{first:?}");
    assert_eq!(first.hostname.as_deref(), Some("web"));
    assert!(first.ips.is_empty());
    assert!(
        first.note.as_deref().unwrap().contains("reply over 64 KiB"),
        "{first:?}"
    );
    assert!(
        rss_after < rss_before + 10 * 1024,
        "{rss_before} KiB -> {rss_after} KiB"
    );
    assert!(peak < 100 * 1024, "peak {peak} KiB");
    // What the driver hands on is small by construction.
    assert!(serde_json::to_vec(&first).unwrap().len() < 1024);
}
