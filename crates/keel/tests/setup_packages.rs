//! `scripts/install-packages`, the package step of `scripts/setup`, against
//! a fake `apt-get`, `apt-cache`, `dpkg-query` and `sudo` on `PATH`: no root,
//! no network. The fakes keep their state (refreshed lists, installed
//! packages, every call) in files of a scratch directory.
//!
//! Why: a machine whose package lists were older than the archive made setup
//! read a candidate QEMU version from them, refresh them, and then ask apt
//! for that version, which no longer existed; apt's error was swallowed and
//! setup exited 100 with no message.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install-packages")
}

const STALE: &str = "1:7.2+dfsg-7+deb12u18+b2";
const FRESH: &str = "1:7.2+dfsg-7+deb12u18+b3";

/// A scratch machine: `bin/` holds the fakes, `state/` what they know.
struct FakeApt {
    dir: tempfile::TempDir,
}

impl FakeApt {
    /// `installed`: `package version` lines dpkg knows. `fail`: a fake's
    /// call that fails, as `tool:subcommand` (`apt-get:update`,
    /// `apt-get:install-s`, `apt-get:install`).
    fn new(installed: &[(&str, &str)], fail: Option<&str>) -> FakeApt {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        let state = dir.path().join("state");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        let lines: String = installed
            .iter()
            .map(|(p, v)| format!("{p} {v}\n"))
            .collect();
        std::fs::write(state.join("installed"), lines).unwrap();
        std::fs::write(state.join("fail"), fail.unwrap_or("")).unwrap();
        let s = state.display();
        let fakes = [
            (
                "dpkg-query",
                format!(
                    r#"pkg="${{@: -1}}"
v=$(awk -v p="$pkg" '$1 == p {{print $2}}' {s}/installed)
[ -n "$v" ] || {{ echo "dpkg-query: no packages found matching $pkg" >&2; exit 1; }}
printf 'install ok installed %s' "$v""#
                ),
            ),
            (
                // The candidate is what the lists say: the stale one until
                // `apt-get update` has run.
                "apt-cache",
                format!(
                    r#"echo "apt-cache $*" >> {s}/calls
pkg="${{@: -1}}"
c={STALE}
[ -e {s}/updated ] && c={FRESH}
printf '%s:\n  Installed: (none)\n  Candidate: %s\n' "$pkg" "$c""#
                ),
            ),
            (
                // An install of a version the (fresh) archive lacks fails as
                // apt does; a simulation prints `Inst` lines and installs
                // nothing; a real install records each package.
                "apt-get",
                format!(
                    r#"echo "apt-get $*" >> {s}/calls
fail=$(cat {s}/fail)
case "$1" in
  update)
    [ "$fail" = apt-get:update ] && {{ echo "E: The repository 'fake bookworm' is not signed." >&2; exit 100; }}
    touch {s}/updated; exit 0 ;;
  install)
    sim=""; for a in "$@"; do [ "$a" = -s ] && sim=1; done
    [ -n "$sim" ] && [ "$fail" = apt-get:install-s ] && {{ echo "E: Unable to locate package no-such-package" >&2; exit 100; }}
    [ -z "$sim" ] && [ "$fail" = apt-get:install ] && {{ echo "E: Sub-process /usr/bin/dpkg returned an error code (1)" >&2; exit 100; }}
    for a in "$@"; do
      case "$a" in
        -*|install) ;;
        *=*) v="${{a#*=}}"
             if [ "$v" != {FRESH} ] || [ ! -e {s}/updated ]; then
               echo "E: Version '$v' for '${{a%%=*}}' was not found" >&2; exit 100
             fi
             [ -n "$sim" ] && echo "Inst ${{a%%=*}} ($v fake)" || echo "${{a%%=*}} $v" >> {s}/installed ;;
        *) [ -n "$sim" ] && echo "Inst $a (1.0 fake)" || echo "$a 1.0" >> {s}/installed ;;
      esac
    done ;;
esac"#
                ),
            ),
            ("sudo", r#"exec "$@""#.to_string()),
        ];
        for (name, body) in fakes {
            let path = bin.join(name);
            std::fs::write(&path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        FakeApt { dir }
    }

    fn run(&self, packages: &[&str]) -> Output {
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Command::new("bash")
            .arg(script())
            .args(packages)
            .env("PATH", path)
            .output()
            .unwrap()
    }

    fn state(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("state").join(name)).unwrap_or_default()
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn stale_lists_are_refreshed_before_qemus_version_is_read() {
    let apt = FakeApt::new(&[("cpio", "2.13")], None);
    let out = apt.run(&["qemu-system-x86", "qemu-utils", "cpio", "zstd"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let calls = apt.state("calls");
    let update = calls.find("apt-get update").expect("lists refreshed");
    let policy = calls.find("apt-cache policy").expect("candidate read");
    assert!(
        update < policy,
        "candidate read before the refresh:\n{calls}"
    );
    let installed = apt.state("installed");
    for p in ["qemu-system-x86", "qemu-utils"] {
        assert!(
            installed.contains(&format!("{p} {FRESH}")),
            "{p} not pinned to the fresh candidate:\n{installed}"
        );
    }
    assert!(installed.contains("zstd 1.0"), "{installed}");
    assert!(
        !calls.contains(STALE),
        "asked for the stale version:\n{calls}"
    );
}

#[test]
fn nothing_missing_asks_apt_nothing() {
    let apt = FakeApt::new(
        &[
            ("qemu-system-x86", STALE),
            ("qemu-utils", STALE),
            ("cpio", "2.13"),
        ],
        None,
    );
    let out = apt.run(&["qemu-system-x86", "qemu-utils", "cpio"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(apt.state("calls"), "", "apt called with nothing to install");
}

#[test]
fn a_qemu_utils_off_qemus_version_is_brought_to_the_installed_qemus() {
    let apt = FakeApt::new(
        &[("qemu-system-x86", FRESH), ("qemu-utils", "1:10.0.2+ds-2")],
        None,
    );
    let out = apt.run(&["qemu-system-x86", "qemu-utils"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let calls = apt.state("calls");
    assert!(calls.contains(&format!("qemu-utils={FRESH}")), "{calls}");
    assert!(!calls.contains("qemu-system-x86="), "{calls}");
}

#[test]
fn each_failing_apt_step_prints_apts_error_and_what_setup_was_doing() {
    for (fail, apt_says, doing) in [
        (
            "apt-get:update",
            "E: The repository 'fake bookworm' is not signed.",
            "refreshing the package lists failed (exit 100)",
        ),
        (
            "apt-get:install-s",
            "E: Unable to locate package no-such-package",
            "asking apt what installing",
        ),
        (
            "apt-get:install",
            "E: Sub-process /usr/bin/dpkg returned an error code (1)",
            "installing zstd",
        ),
    ] {
        let apt = FakeApt::new(&[], Some(fail));
        let out = apt.run(&["zstd"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(100), "{fail}: {err}");
        assert!(
            err.contains(apt_says),
            "{fail}: apt's own error hidden:\n{err}"
        );
        assert!(err.contains(doing), "{fail}: the step is not named:\n{err}");
        assert!(!apt.state("installed").contains("zstd"), "{fail}");
    }
}
