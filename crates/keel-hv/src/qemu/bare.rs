//! QEMU as Keel ran it, without Keel: the argument vector an instance's
//! launch record keeps (`spec.json`'s `argv`), run again by hand. This is
//! the "bare" side of `keel bench start`, which must start exactly what
//! Keel starts: the same binary, flags, disks and kernel, the same passt
//! network peer on the same descriptor, the same QMP handshake. Only the
//! instance's two directories (its files and its sockets) are moved to
//! private ones, so that Keel never takes the bare QEMU for an instance
//! of its own (it finds instances by their directories).
//!
//! Readiness by console is found as Keel's driver finds it
//! ([`console_shows`]): woken by each change to the log, scanning what was
//! added.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::console::MAX_LOG_READ;
use super::console_log::ConsoleLog;
use super::console_watch::ConsoleChanges;
use super::layout::{InstancePaths, LaunchRecord};
use super::passt;
use super::qmp::QmpClient;

/// What Keel launched for one instance, read from its record.
#[derive(Debug, Clone)]
pub struct RecordedLaunch {
    /// The binary first, then its arguments, exactly as Keel spawned them.
    pub argv: Vec<String>,
    pub instance_dir: PathBuf,
    pub socket_dir: PathBuf,
    /// passt's published ports when QEMU expects passt's socket at
    /// [`passt::QEMU_NET_FD`] (a user-mode NIC); `None` for a tap.
    pub user_net: Option<Vec<keel_api::PortForward>>,
}

impl RecordedLaunch {
    /// The launch record of the instance whose directory is `instance_dir`.
    pub fn read(instance_dir: &Path) -> io::Result<RecordedLaunch> {
        let spec = InstancePaths::new(instance_dir.to_path_buf(), instance_dir.to_path_buf()).spec;
        let record: LaunchRecord = serde_json::from_slice(&std::fs::read(&spec)?).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: {e}", spec.display()),
            )
        })?;
        let user_net = match record.spec.network.mode {
            keel_api::NetworkMode::User => Some(record.spec.network.publish.clone()),
            keel_api::NetworkMode::Bridge => None,
        };
        Ok(RecordedLaunch {
            argv: record.argv,
            instance_dir: instance_dir.to_path_buf(),
            socket_dir: record
                .socket_dir
                .unwrap_or_else(|| instance_dir.to_path_buf()),
            user_net,
        })
    }

    /// The same argument vector with the instance's directories replaced
    /// by `dir` and `sockets`; every other byte is Keel's.
    pub fn argv_in(&self, dir: &Path, sockets: &Path) -> Vec<String> {
        let (from_dir, from_sockets) = (
            self.instance_dir.to_string_lossy().into_owned(),
            self.socket_dir.to_string_lossy().into_owned(),
        );
        let (to_dir, to_sockets) = (
            dir.to_string_lossy().into_owned(),
            sockets.to_string_lossy().into_owned(),
        );
        self.argv
            .iter()
            .map(|a| {
                a.replace(&from_sockets, &to_sockets)
                    .replace(&from_dir, &to_dir)
            })
            .collect()
    }
}

/// A QEMU started from a recorded argument vector, its QMP handshake done.
pub struct BareQemu {
    pub child: tokio::process::Child,
    pub qmp: QmpClient,
    /// When QEMU was spawned (after passt was up) and when QMP answered.
    pub spawned: Instant,
    pub qmp_ready: Instant,
}

/// Starts `argv` (binary first) in `dir` as Keel's launch does: passt
/// first when `user_net` is some (its socket at [`passt::QEMU_NET_FD`]), QEMU in a
/// session of its own with its output in `dir/qemu.log`, then the QMP
/// handshake on `qmp_socket` (polled every 20 ms, as Keel polls), then
/// `cont` if the vector has `-S`.
pub async fn start(
    argv: &[String],
    dir: &Path,
    qmp_socket: &Path,
    user_net: Option<&[keel_api::PortForward]>,
    passt_binary: &Path,
    timeout: Duration,
) -> Result<BareQemu, String> {
    let Some((binary, args)) = argv.split_first() else {
        return Err("empty argument vector".into());
    };
    let net = match user_net {
        Some(forwards) => Some(passt::start(passt_binary, forwards, dir).await?),
        None => None,
    };
    let mut child =
        spawn(binary, args, dir, net.as_ref()).map_err(|e| format!("spawn {binary}: {e}"))?;
    let spawned = Instant::now();
    drop(net);
    let deadline = spawned + timeout;
    let qmp = loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("qemu exited during start ({status})"));
        }
        if qmp_socket.exists() {
            if let Ok((client, _events)) = QmpClient::connect(qmp_socket, timeout).await {
                break client;
            }
        }
        if Instant::now() >= deadline {
            let _ = child.start_kill();
            return Err(format!("QMP did not answer within {timeout:?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if argv.iter().any(|a| a == "-S") {
        qmp.execute("cont", None)
            .await
            .map_err(|e| format!("cont: {e}"))?;
    }
    Ok(BareQemu {
        child,
        qmp,
        spawned,
        qmp_ready: Instant::now(),
    })
}

fn spawn(
    binary: &str,
    args: &[String],
    dir: &Path,
    net: Option<&OwnedFd>,
) -> io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(binary);
    // Unlike Keel's own, a bare run ends with the bench.
    cmd.args(args).kill_on_drop(true);
    super::launch::spawn_in_own_session(cmd, dir, &dir.join("qemu.log"), net)
}

/// Waits until the console log at `log` shows `text`, the way the QEMU
/// driver's console watch does: the same incremental scan, woken by the
/// same changes (`changes`, taken on `log` before QEMU started).
pub async fn console_shows(changes: &mut ConsoleChanges, log: &Path, text: &str) -> io::Result<()> {
    let console = Arc::new(ConsoleLog::open(log.to_path_buf()));
    let mut scan = crate::guest_info::LogScan::default();
    loop {
        let (console, needle) = (console.clone(), text.as_bytes().to_vec());
        scan = tokio::task::spawn_blocking(move || console.scan(scan, &needle, MAX_LOG_READ))
            .await
            .map_err(io::Error::other)??;
        if scan.found {
            return Ok(());
        }
        changes.changed().await?;
    }
}
