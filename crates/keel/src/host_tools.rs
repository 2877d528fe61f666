//! Host-side chores that need no server: the shared token file, shell
//! completions and man pages (both generated from the clap definitions, so
//! they cannot drift from the real flags).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use anyhow::{bail, Context};

use crate::auth::{self, Token};

/// `keel token init-file FILE [--group G] [--rotate]`.
pub fn token_file(file: &Path, group: Option<&str>, rotate: bool) -> anyhow::Result<()> {
    let existing = match std::fs::read_to_string(file) {
        Ok(t) if !t.trim().is_empty() => Some(t),
        _ => None,
    };
    let mode = if group.is_some() { 0o640 } else { 0o600 };
    let token = match existing {
        Some(t) if !rotate => Token::new(t.trim().to_string()),
        _ => Token::new(auth::generate_secret()),
    };
    auth::write_token_file(file, &token, mode)?;
    if let Some(group) = group {
        chgrp(file, group)?;
    }
    eprintln!("token in {} (mode {mode:04o})", file.display());
    Ok(())
}

fn chgrp(path: &Path, group: &str) -> anyhow::Result<()> {
    let name = CString::new(group).context("group name")?;
    // SAFETY: getgrnam reads a NUL-terminated name; the result is only
    // read before the next call.
    let entry = unsafe { libc::getgrnam(name.as_ptr()) };
    if entry.is_null() {
        bail!("no group {group:?} on this host");
    }
    // SAFETY: non-null pointer from getgrnam, read at once.
    let gid = unsafe { (*entry).gr_gid };
    let c = CString::new(path.as_os_str().as_bytes()).context("token path")?;
    // SAFETY: NUL-terminated path; uid -1 leaves the owner unchanged.
    let rc = unsafe { libc::chown(c.as_ptr(), u32::MAX, gid) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("chgrp {group} {}", path.display()));
    }
    Ok(())
}

/// Generated whole, then written: a reader that closes early (`| head`)
/// ends the output, not the process with a panic.
pub fn completions(
    shell: clap_complete::Shell,
    cmd: &mut clap::Command,
    out: &mut dyn std::io::Write,
) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, cmd, "keel", &mut script);
    match out.write_all(&script).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// keel.1 and one page per visible subcommand (keel-serve.1, keel-vm.1, …).
pub fn man_pages(cmd: clap::Command, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cmd = cmd.name("keel");
    write_page(&cmd, "keel", dir)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("keel-{}", sub.get_name());
        write_page(
            &sub.clone()
                .display_name(name.clone())
                .bin_name(name.replace("-", " ")),
            &name,
            dir,
        )?;
    }
    Ok(())
}

fn write_page(cmd: &clap::Command, name: &str, dir: &Path) -> anyhow::Result<()> {
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))
}
