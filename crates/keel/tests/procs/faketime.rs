//! A wall clock that steps, for one process tree: Debian's libfaketime
//! preloaded into a `keel` process, its offset read from a file the test
//! rewrites (`FAKETIME_NO_CACHE=1`: at every call), so the offset applies at
//! once, as an operator's `date -s` or an NTP step would.
//!
//! `FAKETIME_DONT_FAKE_MONOTONIC=1` leaves `CLOCK_MONOTONIC` and
//! `CLOCK_BOOTTIME` alone: only `CLOCK_REALTIME` steps. Whether the library
//! really does so is not taken on trust: [`verify`] checks it in a child
//! process and fails loudly if a monotonic clock moves with the wall clock,
//! since a test of "nothing is measured on the wall clock" would then prove
//! nothing.
//!
//! The children of a faked `keel` inherit the preload. The fence keeper is
//! `keel` too and is faked with its agent, as a host's own clock step would
//! reach it (its deadline is on `CLOCK_BOOTTIME`, so it must not care);
//! QEMU and passt are left real (`FAKETIME_ONLY_CMDS=keel`): Keel decides
//! nothing on their clocks, and the library's file read has no business in
//! their seccomp sandboxes.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Where Debian's `libfaketime` package puts the library.
pub const LIBRARY: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The environment variable that makes a test binary act as [`probe`].
pub const PROBE_ENV: &str = "KEEL_FAKETIME_PROBE";

/// Whether libfaketime is installed (`scripts/setup` installs it).
pub fn available() -> bool {
    Path::new(LIBRARY).is_file()
}

/// One process's wall-clock offset: a libfaketime timestamp file.
pub struct WallClock {
    file: PathBuf,
    offset_s: std::sync::Mutex<i64>,
}

impl WallClock {
    /// A clock file at `file`, offset 0.
    pub fn new(file: impl Into<PathBuf>) -> Self {
        let clock = Self {
            file: file.into(),
            offset_s: std::sync::Mutex::new(0),
        };
        clock.write(0);
        clock
    }

    /// `command` runs with this wall clock (only `keel` processes fake it).
    pub fn apply<'c>(&self, command: &'c mut Command) -> &'c mut Command {
        command
            .env("LD_PRELOAD", LIBRARY)
            .env("FAKETIME_TIMESTAMP_FILE", &self.file)
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("FAKETIME_ONLY_CMDS", "keel")
    }

    /// Steps the wall clock by `by_s` seconds (negative: back), at once.
    pub fn step(&self, by_s: i64) {
        let mut offset = self.offset_s.lock().unwrap();
        *offset += by_s;
        self.write(*offset);
    }

    /// The offset from the real wall clock now, in seconds.
    pub fn offset_s(&self) -> i64 {
        *self.offset_s.lock().unwrap()
    }

    // libfaketime's relative offset ("+90", "-90": seconds; README 4d),
    // written beside and renamed into place: a reader never sees a file
    // half written (which it would take for no offset).
    fn write(&self, offset_s: i64) {
        let tmp = self.file.with_extension("new");
        std::fs::write(&tmp, format!("{offset_s:+}\n")).unwrap();
        std::fs::rename(&tmp, &self.file).unwrap();
    }
}

/// One reading of a process's clocks, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Clocks {
    pub realtime: i64,
    pub boottime: i64,
    pub monotonic: i64,
}

fn read(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
    ts.tv_sec * 1000 + ts.tv_nsec / 1_000_000
}

impl Clocks {
    pub fn now() -> Self {
        Self {
            realtime: read(libc::CLOCK_REALTIME),
            boottime: read(libc::CLOCK_BOOTTIME),
            monotonic: read(libc::CLOCK_MONOTONIC),
        }
    }
}

/// The child's side of [`verify`]: with [`PROBE_ENV`] set, answers every
/// line on stdin with its clocks (`clocks REALTIME BOOTTIME MONOTONIC`),
/// read through the same libc calls `keel` makes. A test file that calls
/// [`verify`] runs this from a test named as `verify` is told.
pub fn probe() {
    if std::env::var_os(PROBE_ENV).is_none() {
        return;
    }
    let mut out = std::io::stdout().lock();
    for _ in std::io::stdin().lock().lines().map_while(Result::ok) {
        let c = Clocks::now();
        writeln!(out, "clocks {} {} {}", c.realtime, c.boottime, c.monotonic).unwrap();
        out.flush().unwrap();
    }
}

/// Checks that under [`WallClock::apply`] a step moves `CLOCK_REALTIME` by
/// the step and leaves `CLOCK_BOOTTIME` and `CLOCK_MONOTONIC` alone, in a
/// child process: this test binary run as its test `probe_test` (which
/// calls [`probe`]), its progname made `keel` as `FAKETIME_ONLY_CMDS`
/// wants (a symlink in `dir`). Panics, saying what moved, otherwise.
pub fn verify(dir: &Path, probe_test: &str) {
    let exe = std::env::current_exe().unwrap();
    let probe_dir = dir.join("faketime-probe");
    std::fs::create_dir_all(&probe_dir).unwrap();
    let keel = probe_dir.join("keel");
    let _ = std::fs::remove_file(&keel);
    std::os::unix::fs::symlink(&exe, &keel).unwrap();
    let clock = WallClock::new(probe_dir.join("clock"));
    let mut child = clock
        .apply(&mut Command::new(&keel))
        .args([probe_test, "--exact", "--nocapture", "--test-threads=1"])
        .env(PROBE_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    // Read on a thread of its own, so a probe that hangs fails the wait.
    let (tx, answers) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest's "test NAME ... " comes first on the same line.
            if let Some(rest) = line.split("clocks ").nth(1) {
                let v: Vec<i64> = rest.split(' ').map(|n| n.parse().unwrap()).collect();
                let clocks = Clocks {
                    realtime: v[0],
                    boottime: v[1],
                    monotonic: v[2],
                };
                if tx.send(clocks).is_err() {
                    return;
                }
            }
        }
    });
    let mut ask = || -> Clocks {
        writeln!(input, "?").unwrap();
        input.flush().unwrap();
        answers
            .recv_timeout(Duration::from_secs(10))
            .expect("the faketime probe did not answer within 10 s")
    };
    let mut before = ask();
    let mut real_before = Clocks::now();
    for step in [90, -180] {
        clock.step(step);
        let after = ask();
        let real_after = Clocks::now();
        let elapsed = real_after.boottime - real_before.boottime;
        let moved = |a: i64, b: i64| (b - a - elapsed).abs() > 2_000;
        assert!(
            !moved(before.realtime, after.realtime - step * 1000),
            "libfaketime did not step CLOCK_REALTIME by {step} s: {before:?} -> {after:?}"
        );
        assert!(
            !moved(before.boottime, after.boottime) && !moved(before.monotonic, after.monotonic),
            "libfaketime stepped a monotonic clock with the wall clock ({step} s): \
             {before:?} -> {after:?}; a clock-step test would prove nothing"
        );
        assert!(
            (after.boottime - real_after.boottime).abs() < 2_000,
            "CLOCK_BOOTTIME under libfaketime is not the host's: {after:?} vs {real_after:?}"
        );
        (before, real_before) = (after, real_after);
    }
    drop(input);
    let _ = child.kill();
    let _ = child.wait();
}
