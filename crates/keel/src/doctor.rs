//! `keel doctor`: checks a host for running Keel and prints each check with
//! what to do about it. Read-only: it starts no server and changes nothing,
//! so it is safe beside a running Keel.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use keel_hv::qemu::{
    forced_accelerator, probe_kvm, AccelChoice, AccelVerdict, KvmUnavailable, QemuConfig,
};
use serde::Serialize;

use crate::args::DoctorArgs;
use crate::distributed::StoreSpec;

/// The QEMU release Keel is tested with (Debian 12's); older ones lack
/// QMP commands the driver uses.
const MIN_QEMU: (u32, u32) = (7, 2);
/// Below this free space a data or disk directory is reported as failing:
/// qcow2 overlays grow on guest writes, and a full disk pauses guests.
const MIN_FREE_BYTES: u64 = 2 << 30;
const LOW_FREE_BYTES: u64 = 10 << 30;
/// Wall clocks further apart than this are reported. Liveness does not
/// depend on them (it is judged on the observer's clock), but event times,
/// certificates and logs read across nodes do.
const MAX_CLOCK_OFFSET: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    /// What to do; empty when nothing is to be done.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub fix: String,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: String::new(),
        }
    }
    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Warn,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            status: Status::Fail,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

pub fn main(args: DoctorArgs) -> anyhow::Result<()> {
    let checks = run(&args);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        for c in &checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
            };
            println!("[{tag}] {:<12} {}", c.name, c.detail);
            if !c.fix.is_empty() {
                println!("       {:<12} fix: {}", "", c.fix);
            }
        }
    }
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    if failed > 0 {
        anyhow::bail!("{failed} check(s) failed");
    }
    Ok(())
}

pub fn run(args: &DoctorArgs) -> Vec<Check> {
    let mut checks = Vec::new();
    let qemu = check_qemu(&args.qemu);
    let qemu_version = qemu.1;
    checks.push(qemu.0);
    checks.push(check_qemu_img(qemu_version));
    checks.push(check_passt());
    checks.push(check_kvm(args));
    checks.push(check_firmware());
    checks.push(check_secure_boot_and_tpm());
    checks.push(check_data_dir(&args.data_dir));
    let disk_dir = args
        .disk_dir
        .clone()
        .unwrap_or_else(|| args.data_dir.join("node").join("disks"));
    checks.push(check_space("disk dir", &disk_dir));
    let image_dir = crate::hypervisor::image_dir(&args.data_dir, args.image_dir.as_deref());
    checks.push(check_space("image store", &image_dir));
    match args.store_access.resolve(args.store.clone()) {
        Ok(store) => checks.extend(check_store(&store)),
        Err(e) => checks.push(Check::fail(
            "store",
            format!("{e:#}"),
            "fix --store or its --etcd-* / --insecure-store flags",
        )),
    }
    checks
}

/// `QEMU emulator version 7.2.22 (…)` → (7, 2, 22).
pub fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let rest = text.split("version ").nth(1)?;
    let mut parts = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

fn version_of(binary: &Path) -> Result<(String, (u32, u32, u32)), String> {
    let out = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("").trim().to_string();
    let version = parse_version(&first).ok_or_else(|| format!("unrecognised version {first:?}"))?;
    Ok((first, version))
}

fn check_qemu(binary: &Path) -> (Check, Option<(u32, u32, u32)>) {
    match version_of(binary) {
        Err(e) => (
            Check::fail(
                "qemu",
                format!("cannot run {}: {e}", binary.display()),
                "apt-get install qemu-system-x86 (or set KEEL_QEMU to its path)",
            ),
            None,
        ),
        Ok((line, v)) if (v.0, v.1) < MIN_QEMU => (
            Check::fail(
                "qemu",
                format!("{line}: older than {}.{}", MIN_QEMU.0, MIN_QEMU.1),
                "install QEMU 7.2 or newer (Debian 12's qemu-system-x86)",
            ),
            Some(v),
        ),
        Ok((line, v)) => (Check::ok("qemu", line), Some(v)),
    }
}

fn check_qemu_img(qemu: Option<(u32, u32, u32)>) -> Check {
    match version_of(Path::new("qemu-img")) {
        Err(e) => Check::fail(
            "qemu-img",
            format!("cannot run qemu-img: {e}"),
            "apt-get install qemu-utils",
        ),
        Ok((line, v)) => match qemu {
            Some(q) if (q.0, q.1) != (v.0, v.1) => Check::warn(
                "qemu-img",
                format!("{line}: not the QEMU release ({}.{})", q.0, q.1),
                "install qemu-utils at qemu-system-x86's version (scripts/setup pins both)",
            ),
            _ => Check::ok("qemu-img", line),
        },
    }
}

/// passt is the network of every user-mode guest: without it such a VM
/// cannot start.
fn check_passt() -> Check {
    match std::process::Command::new("passt")
        .arg("--version")
        .output()
    {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text.lines().next().unwrap_or("passt").trim();
            match keel_hv::qemu::passt::guest_address() {
                Some(addr) => Check::ok(
                    "passt",
                    format!("{line}; user-mode guests get {addr}, this host's address, and no way into its loopback"),
                ),
                None => Check::fail(
                    "passt",
                    format!("{line}, but this host has no IPv4 default route, and passt gives guests nothing without one"),
                    "configure a default route, or use bridge networking (--network bridge=NAME)",
                ),
            }
        }
        Ok(out) => Check::fail(
            "passt",
            format!("passt --version failed ({})", out.status),
            "apt-get install passt",
        ),
        Err(e) => Check::fail(
            "passt",
            format!("cannot run passt ({e}): VMs on the user-mode network cannot start"),
            "apt-get install passt",
        ),
    }
}

/// Runs the driver's own KVM probe (it boots the test guest under KVM, see
/// `keel_hv::qemu::probe_kvm`) and reports what `keel serve` will do with
/// its outcome: a weaker check here (e.g. only creating a vCPU) would pass
/// on hosts where the probe, and so serve, falls back to TCG. A probe guest
/// of its own, in a private directory, leaves a running Keel's alone.
fn check_kvm(args: &DoctorArgs) -> Check {
    const NAME: &str = "kvm";
    let mut config = QemuConfig::new(std::env::temp_dir());
    config.qemu_binary = args.qemu.clone();
    config.accel = args.accel;
    if let Some(dir) = crate::hypervisor::guest_dir_or_built(args.guest_dir.clone()) {
        // The driver is handed the directory canonicalized, as here.
        config = config.with_test_guest(&dir.canonicalize().unwrap_or(dir));
    }
    if config.accel == AccelChoice::Tcg {
        return Check::ok(
            NAME,
            format!(
                "serve will use TCG: {} (--accel or KEEL_ACCEL), so it runs no KVM probe",
                forced_accelerator(AccelChoice::Tcg).note
            ),
        );
    }
    let probed = match probe_in_scratch(&config) {
        Ok(outcome) => outcome,
        Err(e) => {
            return Check::warn(
                NAME,
                format!("could not run the KVM probe: {e:#}"),
                "run doctor where it may create a directory in $TMPDIR",
            )
        }
    };
    if config.accel == AccelChoice::Kvm {
        return match probed {
            Ok(_) => Check::ok(
                NAME,
                format!(
                    "serve will use KVM: {} (--accel or KEEL_ACCEL); the probe agrees: {}",
                    forced_accelerator(AccelChoice::Kvm).note,
                    AccelVerdict::of_probe(&probed).note
                ),
            ),
            Err(KvmUnavailable::NoGuest) => Check::ok(
                NAME,
                format!(
                    "serve will use KVM: {} (--accel or KEEL_ACCEL); not probed: {}",
                    forced_accelerator(AccelChoice::Kvm).note,
                    KvmUnavailable::NoGuest
                ),
            ),
            Err(why) => Check::warn(
                NAME,
                format!(
                    "serve will use KVM, forced by --accel or KEEL_ACCEL, but KVM does not run the test \
                     guest here ({}): guests may hang or not start",
                    keel_ctrl::error_chain(&why)
                ),
                "unset KEEL_ACCEL (auto falls back to TCG), or fix KVM (see the reason)",
            ),
        };
    }
    let verdict = AccelVerdict::of_probe(&probed);
    match &probed {
        Ok(_) => Check::ok(NAME, format!("serve will use KVM: {}", verdict.note)),
        Err(why) => Check::warn(
            NAME,
            format!(
                "serve will use TCG (software emulation, about 10x slower): {}",
                verdict.note
            ),
            kvm_fix(why),
        ),
    }
}

/// The probe with its files in a directory of doctor's own, removed after.
fn probe_in_scratch(config: &QemuConfig) -> anyhow::Result<Result<Duration, KvmUnavailable>> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = std::env::temp_dir().join(format!("keel-doctor-{}", std::process::id()));
    let runtime = dir.join("run");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&runtime)
        .with_context(|| format!("creating {}", runtime.display()))?;
    let outcome = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime for the probe")?
        .block_on(probe_kvm(config, &dir.join("probe"), &runtime));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(outcome)
}

fn kvm_fix(why: &KvmUnavailable) -> String {
    match why {
        KvmUnavailable::Missing => "load kvm_intel or kvm_amd, enable virtualisation in the firmware, or nested virtualisation on the host's hypervisor".into(),
        KvmUnavailable::NotUsable(_) => "add the user Keel runs as to group kvm (the package's keel user is), then log in again".into(),
        KvmUnavailable::NoGuest => "give serve (and doctor) the test guest with --guest-dir or KEEL_GUEST_DIR (scripts/build-test-guest builds it): without a guest the driver cannot probe KVM".into(),
        KvmUnavailable::Scratch { .. } | KvmUnavailable::Spawn(_) => "fix the qemu check first, and make $TMPDIR writable".into(),
        KvmUnavailable::QemuExited { .. } | KvmUnavailable::Silent { .. } | KvmUnavailable::NotReady { .. } => "on nested virtualisation, update the outer hypervisor or run Keel on bare metal; KEEL_ACCEL=tcg skips the probe".into(),
    }
}

fn check_firmware() -> Check {
    let bios = Path::new("/usr/share/seabios/bios-256k.bin");
    let ovmf = Path::new("/usr/share/OVMF/OVMF_CODE_4M.fd");
    match (bios.is_file(), ovmf.is_file()) {
        (true, true) => Check::ok("firmware", "SeaBIOS and OVMF (UEFI) present"),
        (true, false) => Check::warn(
            "firmware",
            "SeaBIOS present, OVMF missing: VMs asking for UEFI will not start",
            "apt-get install ovmf",
        ),
        (false, _) => Check::fail(
            "firmware",
            format!("{} missing", bios.display()),
            "apt-get install seabios (it comes with qemu-system-x86)",
        ),
    }
}

/// `--secure-boot` needs OVMF's Secure Boot build and the variable store
/// with Microsoft's keys; `--tpm` needs swtpm and swtpm_setup. Only the
/// VMs that ask for them fail without: a warning.
fn check_secure_boot_and_tpm() -> Check {
    const NAME: &str = "secure boot, tpm";
    let mut missing: Vec<String> = [
        "/usr/share/OVMF/OVMF_CODE_4M.ms.fd",
        "/usr/share/OVMF/OVMF_VARS_4M.ms.fd",
    ]
    .into_iter()
    .filter(|f| !Path::new(f).is_file())
    .map(String::from)
    .collect();
    for tool in ["swtpm", "swtpm_setup"] {
        let runs = std::process::Command::new(tool)
            .arg("--help")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok();
        if !runs {
            missing.push(tool.to_string());
        }
    }
    if missing.is_empty() {
        Check::ok(
            NAME,
            "OVMF's Secure Boot build, swtpm and swtpm_setup present",
        )
    } else {
        Check::warn(
            NAME,
            format!(
                "missing {}: VMs with --secure-boot or --tpm will not start",
                missing.join(", ")
            ),
            "apt-get install ovmf swtpm swtpm-tools",
        )
    }
}

fn check_data_dir(dir: &Path) -> Check {
    const NAME: &str = "data dir";
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Check::warn(
                NAME,
                format!(
                    "{} does not exist yet (made 0700 at the first start)",
                    dir.display()
                ),
                "",
            )
        }
        Err(e) => {
            return Check::fail(
                NAME,
                format!("{}: {e}", dir.display()),
                "run doctor as the user Keel runs as (e.g. sudo -u keel keel doctor)",
            )
        }
    };
    let mode = meta.permissions().mode() & 0o777;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Check::warn(
            NAME,
            format!(
                "{} is owned by uid {}, not by this user (uid {me})",
                dir.display(),
                meta.uid()
            ),
            "run doctor as the user Keel runs as (e.g. sudo -u keel keel doctor)",
        );
    }
    if mode != 0o700 {
        return Check::warn(
            NAME,
            format!(
                "{} has mode {mode:04o}; it holds the store and the token",
                dir.display()
            ),
            format!("chmod 700 {} (Keel also does so at start)", dir.display()),
        );
    }
    let space = check_space(NAME, dir);
    if space.status != Status::Ok {
        return space;
    }
    Check::ok(
        NAME,
        format!("{} (mode 0700); {}", dir.display(), space.detail),
    )
}

/// Free space of the filesystem holding `dir` (or its nearest existing
/// parent, since Keel makes the directory on first use).
fn check_space(name: &'static str, dir: &Path) -> Check {
    let mut probe: PathBuf = dir.to_path_buf();
    while !probe.exists() {
        match probe.parent() {
            Some(p) => probe = p.to_path_buf(),
            None => break,
        }
    }
    let free = match keel_hv::free_space::free_bytes(&probe) {
        Ok(f) => f,
        Err(e) => return Check::fail(name, format!("{}: {e}", probe.display()), "check the mount"),
    };
    let gib = free as f64 / (1u64 << 30) as f64;
    let detail = format!("{}: {gib:.1} GiB free", dir.display());
    if free < MIN_FREE_BYTES {
        Check::fail(
            name,
            detail,
            "free space or move the directory (--data-dir / --disk-dir): a full disk pauses guests on their next write",
        )
    } else if free < LOW_FREE_BYTES {
        Check::warn(
            name,
            detail,
            "keep more room for disks that grow on guest writes",
        )
    } else {
        Check::ok(name, detail)
    }
}

fn check_store(store: &StoreSpec) -> Vec<Check> {
    let StoreSpec::Etcd { endpoints, .. } = store else {
        return vec![Check::ok("store", "sqlite in the data dir")];
    };
    if store.is_tls() {
        return vec![check_etcd_tls(store)];
    }
    endpoints.iter().map(|e| check_etcd(e)).collect()
}

/// An `etcds://` store: one connect with the client certificate, which
/// proves the CA, the certificate and reachability together. The clock is
/// not compared: that needs etcd's HTTP `Date` header, read here over
/// plain HTTP only.
fn check_etcd_tls(store: &StoreSpec) -> Check {
    const NAME: &str = "etcd";
    let store = store.clone();
    // Its own thread and runtime: doctor may be called from async code.
    let outcome = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(store.connect_etcd()).map(drop)
    })
    .join();
    match outcome {
        Ok(Ok(())) => Check::ok(NAME, "healthy over TLS with the client certificate"),
        Ok(Err(e)) => Check::fail(
            NAME,
            format!("{e:#}"),
            "check --etcd-ca/--etcd-cert/--etcd-key against etcd's --trusted-ca-file and certificate",
        ),
        Err(_) => Check::fail(NAME, "the TLS check panicked", ""),
    }
}

/// Reachability through etcd's `/health`, and the clock offset from the
/// `Date` header of its answer (one-second resolution, taken against the
/// midpoint of the round trip).
fn check_etcd(endpoint: &str) -> Check {
    const NAME: &str = "etcd";
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .timeout_global(Some(Duration::from_secs(5)))
        .http_status_as_error(false)
        .build()
        .into();
    let sent = SystemTime::now();
    let began = Instant::now();
    let url = format!("{}/health", endpoint.trim_end_matches('/'));
    let mut resp = match agent.get(&url).call() {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("{endpoint} unreachable: {e}"),
                "start etcd (scripts/start-etcd for a local one) or fix --store",
            )
        }
    };
    let rtt = began.elapsed();
    let body = resp.body_mut().read_to_string().unwrap_or_default();
    if !body.contains("\"true\"") {
        return Check::fail(
            NAME,
            format!("{endpoint} answers but is not healthy: {}", body.trim()),
            "check etcd's log; a member without quorum answers health=false",
        );
    }
    let date = resp
        .headers()
        .get("date")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| httpdate::parse_http_date(s).ok());
    let Some(date) = date else {
        return Check::ok(
            NAME,
            format!(
                "{endpoint} healthy ({} ms); no Date header to compare clocks",
                rtt.as_millis()
            ),
        );
    };
    let local = sent + rtt / 2;
    let (offset, ahead) = match date.duration_since(local) {
        Ok(d) => (d, "ahead of"),
        Err(e) => (e.duration(), "behind"),
    };
    // The header has one-second resolution: anything under it is noise.
    let offset = offset.saturating_sub(Duration::from_secs(1));
    let detail = format!(
        "{endpoint} healthy ({} ms); its clock is {:.1} s {ahead} this host's",
        rtt.as_millis(),
        offset.as_secs_f64()
    );
    if offset > MAX_CLOCK_OFFSET {
        Check::warn(
            NAME,
            detail,
            "run NTP (systemd-timesyncd or chrony) on every node and etcd member",
        )
    } else {
        Check::ok(NAME, detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_versions_parse() {
        assert_eq!(
            parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)"),
            Some((7, 2, 22))
        );
        assert_eq!(
            parse_version("qemu-img version 10.0.2 (Debian)"),
            Some((10, 0, 2))
        );
        assert_eq!(parse_version("QEMU emulator version 8.1"), Some((8, 1, 0)));
        assert_eq!(parse_version("nonsense"), None);
    }
}
