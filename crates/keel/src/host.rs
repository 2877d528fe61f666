//! What a Keel process does to its host before any work: a private umask,
//! logging, signals, the node name, and the data directory (private, and
//! locked to one process). Shared by `keel serve` and `keel agent`.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{anyhow, bail, Context};
use keel_api::validate_name;

const LOCK_FILE: &str = "keel.lock";

/// Everything Keel and its QEMUs create — disks, images, sockets, records —
/// is private to the user it runs as (0600/0700), whatever umask it was
/// started with: VM disks hold guests' data.
pub(crate) fn private_umask() {
    // SAFETY: umask only sets the process's file creation mask.
    unsafe { libc::umask(0o077) };
}

/// Raises the soft descriptor limit to the hard one, as Go's runtime does:
/// the soft default (often 1024) is a relic of select(2), which Keel does
/// not use, and every guest costs a few descriptors (QMP, console, agent
/// sockets). The HTTP listeners size their caps from the result.
pub(crate) fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one rlimit we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

pub(crate) fn init_logging() {
    use tracing_subscriber::filter::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter(filter),
        )
        .try_init();
}

pub(crate) async fn wait_for_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => { r.context("waiting for SIGINT")?; Ok("SIGINT") }
        _ = term.recv() => Ok("SIGTERM"),
    }
}

/// The host name, lowercased, up to the first dot, if it is a valid name.
pub fn default_node_name() -> anyhow::Result<String> {
    let host = hostname().context("cannot read the host name; pass --node NAME")?;
    let name = host.split('.').next().unwrap_or("").to_ascii_lowercase();
    validate_name("node", &name).map_err(|e| {
        anyhow!("host name {host:?} is not usable as a node name ({e}); pass --node NAME")
    })?;
    Ok(name)
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which outlives the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..end].to_vec()).ok()
}

/// Creates the data directory with mode 0700 if it is missing, and makes
/// an existing one private (0700): it holds the token and the store. Call
/// it, and [`lock_data_dir`], before anything else uses the directory.
pub(crate) fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating data directory {}", dir.display()))?;
    let meta = fs::metadata(dir)?;
    if !meta.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    // Before the chmod below: a directory another user made stays theirs
    // whatever its mode, and they could replace the token in it.
    keel_hv::ownership::ensure_owned("data directory", dir)?;
    let mode = meta.permissions().mode() & 0o777;
    if mode != 0o700 {
        tracing::warn!(dir = %dir.display(), mode = format!("{mode:o}"), "data directory was not private; making it 0700");
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("making data directory {} private", dir.display()))?;
    }
    Ok(())
}

/// One server per data directory: the store's watches only see writes made
/// through the owning process. Released when the returned file is closed.
pub(crate) fn lock_data_dir(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a file descriptor this function owns.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::WouldBlock {
            bail!(
                "another keel server is using data directory {}",
                dir.display()
            );
        }
        return Err(err).with_context(|| format!("locking {}", path.display()));
    }
    Ok(file)
}
