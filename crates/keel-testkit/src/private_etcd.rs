//! A private single-member etcd for a test that kills, pauses or compacts
//! it, or that must not share its history: `scripts/start-etcd` on a free
//! client port (and the peer port after it), its data in a temp dir or a
//! dir of the test's. Killed when dropped, also when the test panics. The
//! shared test etcd (`KEEL_ETCD_ENDPOINT`) keeps its whole history for the
//! conformance suite, which watches from revision 1.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub struct PrivateEtcd {
    dir: PathBuf,
    port: u16,
    /// Removed with the etcd when it is the etcd's own.
    _temp: Option<tempfile::TempDir>,
}

impl PrivateEtcd {
    /// An etcd with its data in a temp dir of its own.
    pub fn start() -> Self {
        let temp = tempfile::tempdir().expect("temp dir for etcd");
        let mut etcd = Self::start_in(temp.path());
        etcd._temp = Some(temp);
        etcd
    }

    /// An etcd with its data in `dir` (under a test's root, so that the
    /// test's own clean-up of that root's processes ends it too).
    pub fn start_in(dir: &Path) -> Self {
        let etcd = Self {
            dir: dir.to_path_buf(),
            port: free_port_pair(),
            _temp: None,
        };
        etcd.run_script();
        etcd
    }

    /// Its client port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT`, as an etcd client names it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// (Re)starts etcd on the same port and data dir: after [`Self::kill`],
    /// the same member with the data it had.
    pub fn run_script(&self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/start-etcd");
        let output = Command::new("bash")
            .arg(&script)
            .arg(&self.dir)
            .arg(self.port.to_string())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            output.status.success(),
            "scripts/start-etcd {} {} failed ({}); is etcd installed \
             (apt-get install -y etcd-server etcd-client)?\nstdout:\n{}\nstderr:\n{}",
            self.dir.display(),
            self.port,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
    }

    /// The running etcd's pid, from the script's pid file.
    pub fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("etcd.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Sends `signal` (`-STOP`, `-CONT`, …): a stopped etcd keeps its
    /// connections open but answers nothing, like a frozen machine or a
    /// partition without resets.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("etcd pid file");
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }

    /// SIGKILL, as in a crash, then waits until the process is gone so the
    /// ports are free for a restart.
    pub fn kill(&self) {
        let Some(pid) = self.pid() else { return };
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(pid) {
            assert!(Instant::now() < deadline, "etcd pid {pid} survived SIGKILL");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `pid` is a running process. etcd is detached from us, so if
/// nobody reaps it a killed etcd stays a zombie: that counts as gone.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
    }
}

/// A client port whose successor (etcd's peer port) is free too. A fixed
/// port would collide with a leftover etcd of an aborted run.
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let client = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = client.local_addr().expect("local addr").port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports on 127.0.0.1");
}
