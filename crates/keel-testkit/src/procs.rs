//! Processes by command line, from `/proc`: which QEMUs (or keepers, or
//! Keel binaries) a test started are alive, and killing what a failed test
//! left behind. Tests share the machine, so every scan can be narrowed to
//! a test's own data dir.

use std::path::{Path, PathBuf};

/// A process and its command line (arguments joined by spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub pid: i32,
    pub cmdline: String,
}

/// Every process whose command line can be read, with its command line.
/// Kernel threads (empty command lines) and processes that exit during the
/// scan are left out.
pub fn all() -> Vec<Process> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            if raw.is_empty() {
                return None;
            }
            let cmdline = raw
                .split(|b| *b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
            Some(Process { pid, cmdline })
        })
        .collect()
}

/// Pids of the processes whose command line contains every one of
/// `needles`.
pub fn pids_mentioning(needles: &[&str]) -> Vec<i32> {
    all()
        .into_iter()
        .filter(|p| needles.iter().all(|n| p.cmdline.contains(n)))
        .map(|p| p.pid)
        .collect()
}

/// Pids of QEMU processes whose command line names `needle`.
pub fn qemu_pids(needle: &str) -> Vec<i32> {
    pids_mentioning(&["qemu-system", needle])
}

/// [`qemu_pids`] of QEMUs under `data_dir` only: other tests on the
/// machine run guests of the same names.
pub fn qemu_pids_in(data_dir: &Path, needle: &str) -> Vec<i32> {
    let mine = data_dir.to_string_lossy();
    pids_mentioning(&["qemu-system", needle, &mine])
}

/// Whether `pid` is alive (a zombie counts as gone).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name, which may
        // itself hold spaces and parentheses.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// SIGKILLs every process whose command line mentions `data_dir`, except
/// this one (a test binary may have been given the path as an argument).
pub fn kill_mentioning(data_dir: &Path) {
    let me = std::process::id() as i32;
    for pid in pids_mentioning(&[&data_dir.to_string_lossy()]) {
        if pid == me {
            continue;
        }
        // SAFETY: plain kill(2) on a pid whose command line names the
        // test's own directory.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Kills every process whose command line mentions its data dir when
/// dropped, so a failed assertion does not leave guests behind.
pub struct KillGuard {
    pub data_dir: PathBuf,
}

impl Drop for KillGuard {
    fn drop(&mut self) {
        kill_mentioning(&self.data_dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_found_by_its_own_command_line_and_is_alive() {
        let me = std::process::id() as i32;
        let mine = all().into_iter().find(|p| p.pid == me).expect("listed");
        let first = mine.cmdline.split(' ').next().unwrap().to_string();
        assert!(pids_mentioning(&[&first]).contains(&me));
        assert!(!pids_mentioning(&[&first, "no such argument anywhere"]).contains(&me));
        assert!(alive(me));
        assert!(!alive(i32::MAX));
    }
}
