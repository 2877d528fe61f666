//! The built `keel` binary against a [`TestServer`], for the CLI tests.

use std::process::{Command, Output};

use super::TestServer;

/// Runs `keel ARGS` against `server`; the token comes from the data dir,
/// as for a local operator.
pub fn keel(server: &TestServer, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("KEEL_SERVER", &server.base)
        .env("KEEL_DATA_DIR", server.dir.path())
        .env("KEEL_CONFIG", "")
        .env_remove("KEEL_TOKEN")
        .output()
        .expect("run keel")
}

/// Its stdout, after asserting it succeeded.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Its stderr, after asserting it failed.
pub fn fails(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "expected a failure; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}
