//! The serial console and guest-agent channel against real QEMU and the
//! test guest (busybox `sh` on ttyS0 after its ready marker; no agent).

mod common;

use std::time::{Duration, Instant};

use common::{stop_and_cleanup, Fixture};
use keel_hv::{AgentState, Hypervisor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_attach_runs_a_command_and_the_log_keeps_it() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let _ch = fx.boot("con", "con-1").await;
    assert!(hv
        .console_contains("con-1", "KEEL-GUEST-READY")
        .await
        .unwrap());
    assert!(!hv.console_contains("con-1", "NOT-THERE").await.unwrap());

    let mut console = hv.open_console("con-1").await.unwrap();
    // One session at a time.
    let second = hv.open_console("con-1").await.unwrap_err();
    assert!(
        second.to_string().contains("only one at a time"),
        "{second}"
    );

    // The shell may still be starting: send until it answers.
    let t = Instant::now();
    let mut seen = String::new();
    let mut buf = [0u8; 1024];
    'outer: while t.elapsed() < Duration::from_secs(60) {
        console
            .io
            .write_all(b"echo keel-$((6*7))-answer\n")
            .await
            .unwrap();
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            match tokio::time::timeout(Duration::from_millis(500), console.io.read(&mut buf)).await
            {
                Ok(Ok(0)) => panic!("console closed; saw {seen:?}"),
                Ok(Ok(n)) => {
                    seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                    // The arithmetic is the shell's, not an echo of our input.
                    if seen.contains("keel-42-answer") {
                        break 'outer;
                    }
                }
                Ok(Err(e)) => panic!("console read: {e}"),
                Err(_) => {}
            }
        }
    }
    assert!(seen.contains("keel-42-answer"), "no answer; saw {seen:?}");
    eprintln!("console answered after {:?}", t.elapsed());
    drop(console);
    // Detached: the slot is free again.
    let again = hv.open_console("con-1").await.unwrap();
    drop(again);

    // What the shell printed is in the log as well. QEMU writes a console
    // byte to the socket before it appends it to the log, so the log may
    // be a moment behind what the session just read.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (log, len) = loop {
        let (log, len) = hv.console_tail("con-1", 1 << 20).await.unwrap();
        if String::from_utf8_lossy(&log).contains("keel-42-answer") || Instant::now() >= deadline {
            break (log, len);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text = String::from_utf8_lossy(&log);
    assert!(
        text.contains("KEEL-GUEST-READY") && text.contains("keel-42-answer"),
        "console log after 10 s: {text:?}"
    );
    assert_eq!(len as usize, log.len());
    let (tail, _) = hv.console_tail("con-1", 16).await.unwrap();
    assert_eq!(tail.len(), 16);

    // No agent in this guest: silent, and within the driver's bound.
    let t = Instant::now();
    let info = hv.guest_info("con-1").await.unwrap();
    let AgentState::Silent { reason } = &info.agent else {
        panic!("{info:?}")
    };
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    eprintln!("silent agent reported in {:?}: {reason}", t.elapsed());
    assert!(hv.fs_freeze("con-1").await.is_err());
    assert!(hv.guest_shutdown("con-1").await.is_err());

    stop_and_cleanup(hv, "con-1").await;
}

/// A guest that prints without end cannot fill the host's disk: its console
/// log and the log's previous part stay bounded, and a marker printed after
/// a rotation is still found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_guest_keeps_its_console_log_under_the_cap() {
    const CAP: u64 = 64 << 10;
    let Some(fx) = Fixture::with(|mut c| {
        c.console_log_max_bytes = CAP;
        c.console_log_check = Duration::from_millis(200);
        c
    })
    .await
    else {
        return;
    };
    let hv = fx.hv();
    let _ch = fx.boot("flood", "flood-1").await;
    let log = hv.console_log("flood-1");
    let rotated = keel_hv::qemu::console_log::rotated(&log);
    let mut console = hv.open_console("flood-1").await.unwrap();
    console
        .io
        .write_all(b"yes FLOOD-FLOOD-FLOOD-FLOOD-FLOOD-FLOOD | head -c 1200000; echo AFTER-$((40+2))-ROTATION\n")
        .await
        .unwrap();
    // Read what the console says, as an attached operator would, while
    // the logs are measured.
    let mut printed = 0u64;
    let mut largest = (0u64, 0u64);
    let mut buf = vec![0u8; 64 << 10];
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(30) && printed < 1_100_000 {
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(100), console.io.read(&mut buf)).await
        {
            printed += n as u64;
        }
        let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        largest = (largest.0.max(size(&log)), largest.1.max(size(&rotated)));
    }
    eprintln!(
        "printed {printed} bytes in {:?}; largest log {} bytes, previous part {} bytes",
        began.elapsed(),
        largest.0,
        largest.1
    );
    assert!(
        printed >= 4 * CAP,
        "the guest printed too little to tell ({printed})"
    );
    assert!(
        largest.1 <= CAP,
        "the previous part is over the cap: {largest:?}"
    );
    // Between two looks (200 ms) the guest may print on; 256 KiB is more
    // than TCG's serial port gets through in that time (about 60 KiB).
    assert!(
        largest.0 <= CAP + (256 << 10),
        "the log grew past its cap: {largest:?}"
    );
    // The flood ends; the marker printed after it (and after rotations) is
    // still found.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _ = tokio::time::timeout(Duration::from_millis(100), console.io.read(&mut buf)).await;
        if hv
            .console_contains("flood-1", "AFTER-42-ROTATION")
            .await
            .unwrap()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the marker after a rotation was not found"
        );
    }
    drop(console);
    stop_and_cleanup(hv, "flood-1").await;
}
