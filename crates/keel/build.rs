//! The web console embeds xterm.js and noVNC from `web/node_modules`,
//! which `scripts/setup` installs (`npm ci` in `crates/keel/web`, from the
//! committed lockfile). Without them the build would fail on an
//! `include_bytes!` of a missing file; this says what to run instead.
//!
//! noVNC is ES modules importing each other by relative path (`core/`,
//! `vendor/pako/`), so all of its files are served under `/ui/novnc/` as
//! they lie; this writes their table (`novnc_assets.rs` in `OUT_DIR`),
//! which `webui.rs` includes.

use std::path::{Path, PathBuf};

const XTERM_FILES: [&str; 2] = [
    "web/node_modules/@xterm/xterm/lib/xterm.mjs",
    "web/node_modules/@xterm/xterm/css/xterm.css",
];

const NOVNC_ROOT: &str = "web/node_modules/@novnc/novnc";
/// The directories of noVNC's modules; `core/rfb.js` is its entry point.
const NOVNC_DIRS: [&str; 2] = ["core", "vendor/pako/lib"];

fn main() {
    println!("cargo:rerun-if-changed=web/package-lock.json");
    let entry = format!("{NOVNC_ROOT}/core/rfb.js");
    for file in XTERM_FILES.iter().copied().chain([entry.as_str()]) {
        println!("cargo:rerun-if-changed={file}");
        if !Path::new(file).is_file() {
            panic!(
                "crates/keel/{file} is missing: the web console embeds xterm.js and noVNC \
                 from npm; run scripts/setup (or `npm ci` in crates/keel/web)"
            );
        }
    }
    let mut modules = Vec::new();
    for dir in NOVNC_DIRS {
        collect_js(&Path::new(NOVNC_ROOT).join(dir), &mut modules);
    }
    modules.sort();
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let mut table = String::from("&[\n");
    for file in &modules {
        println!("cargo:rerun-if-changed={}", file.display());
        let relative = file.strip_prefix(NOVNC_ROOT).unwrap();
        table.push_str(&format!(
            "    ({:?}, include_bytes!({:?})),\n",
            format!("/ui/novnc/{}", relative.display()),
            manifest_dir.join(file).display().to_string(),
        ));
    }
    table.push(']');
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("novnc_assets.rs");
    std::fs::write(out, table).expect("write novnc_assets.rs");
}

fn collect_js(dir: &Path, into: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("crates/keel/{}: {e}; run scripts/setup", dir.display()));
    for entry in entries {
        let path = entry.expect("read a noVNC directory").path();
        if path.is_dir() {
            collect_js(&path, into);
        } else if path.extension().is_some_and(|e| e == "js") {
            into.push(path);
        }
    }
}
