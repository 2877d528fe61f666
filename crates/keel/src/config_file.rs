//! The config file (`/etc/keel/keel.toml`): the same settings as the flags,
//! one `key = value` per flag, named as the flag without its dashes
//! (`data-dir = "/var/lib/keel"`).
//!
//! Precedence is flag > `KEEL_*` environment > file > built-in default. The
//! file is applied by filling in each setting's environment variable when
//! the environment does not already have it, before the command line is
//! parsed: clap then gives a flag precedence over both, and there is one
//! parser for every source instead of a second one for the file that could
//! drift from the flags. Only flags with an environment variable can be
//! set; a key that names none of them is an error naming the key and the
//! file, so a typo never silently leaves a default in place.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// Read when it exists and `$KEEL_CONFIG` does not name another file.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/keel/keel.toml";
/// Names the config file; empty: no config file at all.
pub const CONFIG_ENV: &str = "KEEL_CONFIG";

/// The file to read: `$KEEL_CONFIG` (which must exist), else the default
/// if it exists.
pub fn config_path(env: Option<OsString>) -> anyhow::Result<Option<PathBuf>> {
    match env {
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => {
            let path = PathBuf::from(v);
            if !path.is_file() {
                bail!(
                    "${CONFIG_ENV} names {}, which is not a file",
                    path.display()
                );
            }
            Ok(Some(path))
        }
        None => {
            let path = PathBuf::from(DEFAULT_CONFIG_FILE);
            Ok(path.is_file().then_some(path))
        }
    }
}

/// Every long flag of `cmd` and its subcommands that has an environment
/// variable: flag name → variable(s).
pub fn settable(cmd: &clap::Command) -> BTreeMap<String, Vec<OsString>> {
    let mut out: BTreeMap<String, Vec<OsString>> = BTreeMap::new();
    collect(cmd, &mut out);
    out
}

fn collect(cmd: &clap::Command, out: &mut BTreeMap<String, Vec<OsString>>) {
    for arg in cmd.get_arguments() {
        if let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) {
            let vars = out.entry(long.to_string()).or_default();
            if !vars.iter().any(|v| v == env) {
                vars.push(env.to_os_string());
            }
        }
    }
    for sub in cmd.get_subcommands() {
        collect(sub, out);
    }
}

/// The environment assignments the file asks for: (variable, value), in
/// key order. Errors name the file and the key.
pub fn parse(
    path: &Path,
    text: &str,
    settable: &BTreeMap<String, Vec<OsString>>,
) -> anyhow::Result<Vec<(OsString, String)>> {
    let table: toml::Table =
        toml::from_str(text).with_context(|| format!("config file {}", path.display()))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let Some(vars) = settable.get(key) else {
            bail!(
                "config file {}: unknown setting `{key}` (settings are the long flags that have a KEEL_* variable, e.g. data-dir, listen, store, token-file)",
                path.display()
            );
        };
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            other => bail!(
                "config file {}: `{key}` must be a string, number or boolean, not {}",
                path.display(),
                other.type_str()
            ),
        };
        for var in vars {
            out.push((var.clone(), text.clone()));
        }
    }
    Ok(out)
}

/// Reads the config file, if any, and sets each of its settings' variables
/// that the environment does not already have. Call before any thread
/// starts (it changes the process environment). Returns the file read.
pub fn apply(cmd: &clap::Command) -> anyhow::Result<Option<PathBuf>> {
    let Some(path) = config_path(std::env::var_os(CONFIG_ENV))? else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading config file {}", path.display()))?;
    for (var, value) in parse(&path, &text, &settable(cmd))? {
        if std::env::var_os(&var).is_none() {
            std::env::set_var(&var, value);
        }
    }
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn settings() -> BTreeMap<String, Vec<OsString>> {
        settable(&crate::args::Cli::command())
    }

    #[test]
    fn the_flags_with_variables_are_the_settings() {
        let s = settings();
        for key in [
            "data-dir",
            "listen",
            "store",
            "token-file",
            "disk-dir",
            "node",
        ] {
            assert!(s.contains_key(key), "{key} not settable: {:?}", s.keys());
        }
        assert_eq!(s["data-dir"], vec![OsString::from("KEEL_DATA_DIR")]);
    }

    #[test]
    fn values_become_variables_and_unknown_keys_are_named() {
        let path = Path::new("/etc/keel/keel.toml");
        let got = parse(
            path,
            "data-dir = \"/var/lib/keel\"\nlisten = \"0.0.0.0:7280\"\n",
            &settings(),
        )
        .unwrap();
        assert!(got.contains(&("KEEL_DATA_DIR".into(), "/var/lib/keel".into())));
        assert!(got.contains(&("KEEL_LISTEN".into(), "0.0.0.0:7280".into())));

        let err = parse(path, "data_dir = \"/x\"\n", &settings())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`data_dir`") && err.contains("keel.toml"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            parse(path, "listen = [1, 2]\n", &settings()).unwrap_err()
        );
        assert!(err.contains("`listen`"), "{err}");
        let err = format!("{:#}", parse(path, "listen = \n", &settings()).unwrap_err());
        assert!(err.contains("keel.toml"), "{err}");
    }

    #[test]
    fn an_empty_keel_config_means_none_and_a_missing_named_file_fails() {
        assert_eq!(config_path(Some(OsString::new())).unwrap(), None);
        assert!(config_path(Some("/nonexistent/keel.toml".into())).is_err());
    }
}
