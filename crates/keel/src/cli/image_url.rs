//! `keel image import NAME URL`: the server downloads the image itself;
//! on a terminal, the CLI shows the download's progress (bytes, total,
//! rate) from `GET …/import-url` while it waits.

use std::io::{IsTerminal, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ureq::http::Method;

use super::{encode, Client};
use crate::api::image_urls::{ImportPhase, ImportProgress, ImportUrlRequest};
use crate::api::images::ImageResponse;
use crate::args::ImportArgs;

const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Whether `source` names a URL for the server to download, not a file.
pub fn is_url(source: &str) -> bool {
    let lower = source.to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

pub fn import(client: &Client, args: &ImportArgs) -> anyhow::Result<ImageResponse> {
    let request = ImportUrlRequest {
        url: args.source.clone(),
        kind: args.kind,
        sha256: args.sha256.clone(),
        sha512: args.sha512.clone(),
    };
    let path = format!("/api/v1/images/{}/import-url", encode(&args.name));
    let call = || client.call_untimed::<ImageResponse, _>(Method::POST, &path, Some(&request));
    // Progress is for a person watching; a script's output stays clean.
    if !(std::io::stdout().is_terminal() && std::io::stderr().is_terminal()) {
        return call();
    }
    let (finished, until_finished) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(|| show_progress(client, &path, until_finished));
        let result = call();
        drop(finished);
        result
    })
}

fn show_progress(client: &Client, path: &str, until_finished: mpsc::Receiver<()>) {
    let mut first: Option<(Instant, u64)> = None;
    let mut shown = false;
    while let Err(mpsc::RecvTimeoutError::Timeout) = until_finished.recv_timeout(PROGRESS_EVERY) {
        // Before the import starts and after it ends there is none.
        let Ok(Some(p)) = client.get_opt::<ImportProgress>(path) else {
            continue;
        };
        let (since, from) = *first.get_or_insert((Instant::now(), p.bytes_done));
        let secs = since.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            (p.bytes_done - from) as f64 / secs
        } else {
            0.0
        };
        eprint!("\r\x1b[K{}", progress_line(&p, rate));
        let _ = std::io::stderr().flush();
        shown = true;
    }
    if shown {
        eprint!("\r\x1b[K");
    }
}

fn progress_line(p: &ImportProgress, bytes_per_sec: f64) -> String {
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let phase = match p.phase {
        ImportPhase::Connecting => "connecting",
        ImportPhase::Downloading => "downloading",
        ImportPhase::Checking => "checking",
    };
    let of = match p.total_bytes {
        Some(total) if total > 0 => format!(
            " / {:.1} MiB ({:.0}%)",
            mib(total),
            100.0 * p.bytes_done as f64 / total as f64
        ),
        _ => String::new(),
    };
    format!(
        "{phase} {}: {:.1} MiB{of}, {:.1} MiB/s",
        p.name,
        mib(p.bytes_done),
        bytes_per_sec / f64::from(1 << 20)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_files_are_told_apart_and_progress_reads_well() {
        assert!(is_url("https://cloud.debian.org/x.qcow2"));
        assert!(is_url("HTTP://host/x"));
        assert!(!is_url("./https.qcow2"));
        let p = ImportProgress {
            name: "debian".into(),
            url: "https://h/x".into(),
            phase: ImportPhase::Downloading,
            bytes_done: 512 << 20,
            total_bytes: Some(1 << 30),
            started_at: 0,
        };
        assert_eq!(
            progress_line(&p, f64::from(10 << 20)),
            "downloading debian: 512.0 MiB / 1024.0 MiB (50%), 10.0 MiB/s"
        );
    }
}
