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
