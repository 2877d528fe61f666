//! The small test guest (`scripts/build-test-guest`: a kernel and an
//! initramfs) that real-QEMU tests boot, found the same way by every test:
//! in `$KEEL_GUEST_DIR`, else in the workspace's `target/guest`.
//!
//! `KEEL_SKIP_QEMU_TESTS=1` skips real-QEMU tests; anything else missing is
//! a failure, not a skip, because these tests are the only proof the QEMU
//! driver works.

use std::path::{Path, PathBuf};

/// The files a test guest directory holds.
pub const FILES: [&str; 2] = ["vmlinuz", "initramfs.cpio.gz"];

/// Whether real-QEMU tests are switched off (`KEEL_SKIP_QEMU_TESTS=1`).
pub fn qemu_tests_skipped() -> bool {
    std::env::var("KEEL_SKIP_QEMU_TESTS").as_deref() == Ok("1")
}

/// The workspace root (this crate lives in `<root>/crates/keel-testkit`).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// Where the test guest is expected: `$KEEL_GUEST_DIR` or
/// `<workspace>/target/guest`, whether or not it is there.
pub fn expected_dir() -> PathBuf {
    std::env::var_os("KEEL_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/guest"))
}

/// The test guest's directory (absolute), or why it cannot be used. For
/// benchmarks, which report rather than panic.
pub fn locate() -> Result<PathBuf, String> {
    let dir = expected_dir();
    for file in FILES {
        if !dir.join(file).is_file() {
            return Err(format!(
                "test guest missing: {} not found; build it with `bash scripts/build-test-guest` \
                 (or point KEEL_GUEST_DIR at a directory holding {})",
                dir.join(file).display(),
                FILES.join(" and ")
            ));
        }
    }
    dir.canonicalize()
        .map_err(|e| format!("test guest {}: {e}", dir.display()))
}

/// The test guest's directory for a real-QEMU test, or `None` when
/// `KEEL_SKIP_QEMU_TESTS=1`. Panics, naming what to run, when the guest or
/// QEMU is missing.
pub fn dir() -> Option<PathBuf> {
    if qemu_tests_skipped() {
        eprintln!("KEEL_SKIP_QEMU_TESTS=1: skipping real-QEMU test");
        return None;
    }
    Some(required_dir())
}

/// The test guest's directory, for tests that always need it (the process
/// tests, which `scripts/test` runs on their own). Panics when it or QEMU is
/// missing; ignores `KEEL_SKIP_QEMU_TESTS`.
pub fn required_dir() -> PathBuf {
    let dir = locate()
        .unwrap_or_else(|e| panic!("{e} (KEEL_SKIP_QEMU_TESTS=1 skips the real-QEMU tests)"));
    let qemu = std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output();
    assert!(
        qemu.is_ok_and(|o| o.status.success()),
        "qemu-system-x86_64 does not run: install qemu-system-x86 (scripts/setup), \
         then run `bash scripts/build-test-guest`"
    );
    dir
}
