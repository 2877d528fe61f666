//! `keel vm export NAME FILE [--snapshot S]` and `keel vm import FILE
//! [--name NEW] [--start] [--keep-identity]`.
//!
//! Export takes a snapshot first when none is named (`export-<seconds>`,
//! live if the VM runs: the guest is paused and its filesystems frozen
//! through its agent for it), downloads the archive made from it into a
//! temporary file beside FILE, moves it onto FILE once complete, and
//! deletes the snapshot it took, whatever happened.
//!
//! Import reads the archive's manifest first (a file that is not an
//! export is refused here, naming it, before anything is sent), then
//! uploads the whole file.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use keel_api::vm_export::{MANIFEST_FILE, MAX_MANIFEST_BYTES};
use keel_api::ExportManifest;
use ureq::http::Method;

use super::output;
use super::snapshot::wait_taken;
use super::{encode, Client};
use crate::api::snapshots::{CreateSnapshotRequest, SnapshotResponse};
use crate::api::vms::VmResponse;
use crate::args::{OutputFormat, VmExportArgs, VmImportArgs};

pub fn export(client: &Client, args: VmExportArgs) -> anyhow::Result<()> {
    let taken = match &args.snapshot {
        Some(_) => None,
        None => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let name = format!("export-{secs}");
            let _: SnapshotResponse = client.call(
                Method::POST,
                &format!("/api/v1/vms/{}/snapshots", encode(&args.name)),
                Some(&CreateSnapshotRequest { name: name.clone() }),
            )?;
            Some(name)
        }
    };
    let snapshot = args
        .snapshot
        .clone()
        .or_else(|| taken.clone())
        .expect("named or taken");
    let result = download_at(client, &args, &snapshot);
    if let Some(name) = taken {
        let path = format!(
            "/api/v1/vms/{}/snapshots/{}",
            encode(&args.name),
            encode(&name)
        );
        if let Err(e) = client.call::<serde_json::Value, ()>(Method::DELETE, &path, None) {
            eprintln!(
                "could not delete snapshot {}/{name} taken for the export: {e:#} \
                 (keel snapshot delete {} {name})",
                args.name, args.name
            );
        }
    }
    let bytes = result?;
    eprintln!(
        "{}: exported at snapshot {snapshot} to {} ({} MiB)",
        args.name,
        args.file.display(),
        bytes.div_ceil(1 << 20)
    );
    Ok(())
}

fn download_at(client: &Client, args: &VmExportArgs, snapshot: &str) -> anyhow::Result<u64> {
    wait_taken(
        client,
        &args.name,
        snapshot,
        Duration::from_secs(args.timeout),
    )?;
    let tmp = partial_path(&args.file);
    let mut out = File::create(&tmp).with_context(|| {
        format!(
            "FILE {}: cannot create {}",
            args.file.display(),
            tmp.display()
        )
    })?;
    let path = format!(
        "/api/v1/vms/{}/export?snapshot={}",
        encode(&args.name),
        encode(snapshot)
    );
    let mut shown = Progress::new(&mut out, &args.name);
    let downloaded = client.download(&path, &mut shown);
    shown.finish();
    let written = downloaded.and_then(|n| {
        out.sync_all().context("sync")?;
        std::fs::rename(&tmp, &args.file)
            .with_context(|| format!("FILE {}: move into place", args.file.display()))?;
        Ok(n)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// How much of the archive has arrived, on stderr when it is a terminal
/// (an export takes as long as the disks are big); nothing in scripts.
struct Progress<'a, W: std::io::Write> {
    inner: W,
    vm: &'a str,
    written: u64,
    shown_at: Option<std::time::Instant>,
    on_terminal: bool,
}

impl<'a, W: std::io::Write> Progress<'a, W> {
    fn new(inner: W, vm: &'a str) -> Self {
        use std::io::IsTerminal;
        Self {
            inner,
            vm,
            written: 0,
            shown_at: None,
            on_terminal: std::io::stderr().is_terminal(),
        }
    }

    fn finish(&self) {
        if self.on_terminal && self.shown_at.is_some() {
            eprintln!();
        }
    }
}

impl<W: std::io::Write> std::io::Write for Progress<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        let due = self
            .shown_at
            .is_none_or(|at| at.elapsed() >= Duration::from_millis(500));
        if self.on_terminal && due {
            eprint!("\r{}: {} MiB received", self.vm, self.written >> 20);
            self.shown_at = Some(std::time::Instant::now());
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Where the download goes until it is complete: beside FILE, so the
/// move onto it is a rename.
fn partial_path(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    file.with_file_name(name)
}

/// The manifest at the start of an export file, or an error naming FILE.
pub fn read_manifest(file: &Path) -> anyhow::Result<ExportManifest> {
    let not_export =
        |why: String| anyhow::anyhow!("FILE {}: not a Keel VM export: {why}", file.display());
    let f = File::open(file).with_context(|| format!("FILE {}", file.display()))?;
    let mut archive = tar::Archive::new(f);
    let mut entries = archive.entries().map_err(|e| not_export(e.to_string()))?;
    let Some(first) = entries.next() else {
        return Err(not_export("it is empty".into()));
    };
    let mut first = first.map_err(|e| not_export(e.to_string()))?;
    let path = first
        .path()
        .map_err(|e| not_export(e.to_string()))?
        .to_string_lossy()
        .into_owned();
    if path != MANIFEST_FILE || first.size() > MAX_MANIFEST_BYTES {
        return Err(not_export(format!(
            "it does not begin with {MANIFEST_FILE}"
        )));
    }
    let mut bytes = Vec::new();
    first
        .read_to_end(&mut bytes)
        .map_err(|e| not_export(e.to_string()))?;
    let manifest: ExportManifest =
        serde_json::from_slice(&bytes).map_err(|e| not_export(format!("{MANIFEST_FILE}: {e}")))?;
    manifest
        .check()
        .map_err(|e| not_export(e.message.clone()))?;
    Ok(manifest)
}

pub fn import(client: &Client, out: OutputFormat, args: VmImportArgs) -> anyhow::Result<()> {
    let manifest = read_manifest(&args.file)?;
    let name = args.name.clone().unwrap_or_else(|| manifest.vm.clone());
    if keel_api::validate_name("name", &name).is_err() {
        bail!("--name {name:?}: not a valid VM name (lowercase letters, digits and '-')");
    }
    let file = File::open(&args.file).with_context(|| format!("FILE {}", args.file.display()))?;
    let mut path = format!("/api/v1/vms/{}/import", encode(&name));
    let mut query = Vec::new();
    if args.start {
        query.push("start=true");
    }
    if args.keep_identity {
        query.push("keep_identity=true");
    }
    if !query.is_empty() {
        path.push('?');
        path.push_str(&query.join("&"));
    }
    let resp: VmResponse = client.upload(&path, file, &args.file.display().to_string())?;
    output::print(out, &resp, || {
        format!(
            "{name}: imported from VM {} at snapshot {} ({}; its disks are the export's) \
             (revision {})\n",
            manifest.vm,
            manifest.snapshot,
            if args.start { "starting" } else { "stopped" },
            resp.revision
        )
    })
}
