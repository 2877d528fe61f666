//! The web console embeds xterm.js from `web/node_modules`, which
//! `scripts/setup` installs (`npm ci` in `crates/keel/web`, from the
//! committed lockfile). Without it the build would fail on an
//! `include_bytes!` of a missing file; this says what to run instead.

use std::path::Path;

const XTERM_FILES: [&str; 2] = [
    "web/node_modules/@xterm/xterm/lib/xterm.mjs",
    "web/node_modules/@xterm/xterm/css/xterm.css",
];

fn main() {
    println!("cargo:rerun-if-changed=web/package-lock.json");
    for file in XTERM_FILES {
        println!("cargo:rerun-if-changed={file}");
        if !Path::new(file).is_file() {
            panic!(
                "crates/keel/{file} is missing: the web console embeds xterm.js from npm; \
                 run scripts/setup (or `npm ci` in crates/keel/web)"
            );
        }
    }
}
