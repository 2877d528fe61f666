//! A directory whose disk can be made to stall, without a kernel module:
//! a FUSE filesystem mounted over it that passes everything through to a
//! real directory (Debian's `fuse-overlayfs`, its upper dir the real one
//! and its lower dir empty; `bindfs` would do, but refuses the
//! `RENAME_NOREPLACE` that claims an instance dir). SIGSTOP of the FUSE
//! daemon stalls every access below the mount (each call hangs, as on a
//! disk that stopped answering), SIGCONT resumes them. Needs root (a FUSE
//! mount other users' processes reach) and fuse-overlayfs.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct StallableDir {
    pub mount: PathBuf,
    /// The FUSE daemon serving the mount.
    pid: i32,
}

impl StallableDir {
    /// Mounts `<at>.real` over `at` (both created, with `<at>.lower` and
    /// `<at>.work` beside them). `Err` says why it cannot be had here.
    pub fn mount(at: &Path) -> Result<StallableDir, String> {
        let [real, lower, work] = ["real", "lower", "work"].map(|ext| at.with_extension(ext));
        for dir in [&real, &lower, &work, &at.to_path_buf()] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            real.display(),
            work.display()
        );
        let out = Command::new("fuse-overlayfs")
            .arg("-o")
            .arg(&options)
            .arg(at)
            .output()
            .map_err(|e| format!("fuse-overlayfs not runnable ({e}); scripts/setup installs it"))?;
        if !out.status.success() {
            return Err(format!(
                "fuse-overlayfs -o {options} {}: {}",
                at.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        // It forks its daemon: found by its command line.
        let pid = super::processes_naming(&options)
            .into_iter()
            .find(|(_, c)| c.starts_with("fuse-overlayfs "))
            .map(|(pid, _)| pid)
            .ok_or_else(|| format!("no fuse-overlayfs daemon for {}", at.display()))?;
        Ok(StallableDir {
            mount: at.to_path_buf(),
            pid,
        })
    }

    /// Stalls the disk, and checks that it does: a file created below the
    /// mount is not there after a second.
    pub fn stall(&self) {
        // SAFETY: kill(2) of the FUSE daemon this test started.
        unsafe { libc::kill(self.pid, libc::SIGSTOP) };
        let (done, finished) = std::sync::mpsc::channel();
        let probe = self.mount.join(".stall-probe");
        std::thread::spawn(move || {
            let _ = std::fs::write(&probe, b"");
            let _ = done.send(());
        });
        assert!(
            finished
                .recv_timeout(std::time::Duration::from_secs(1))
                .is_err(),
            "{} did not stall",
            self.mount.display()
        );
    }

    pub fn resume(&self) {
        // SAFETY: as in `stall`.
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }
}

impl Drop for StallableDir {
    fn drop(&mut self) {
        // Lazily: processes may still hold files open below it. The
        // daemon, continued, then ends by itself once nothing is left.
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        self.resume();
    }
}
