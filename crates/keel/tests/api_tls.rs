//! HTTPS on the API, against real `keel serve` processes (sim driver, so
//! no guest boots) and the real CLI: the self-signed certificate of the
//! data dir and the CLI's pins, an operator's certificate with
//! `--ca-file`, `--insecure-http` only on loopback, and plain HTTP to the
//! HTTPS port answered rather than hung. Traffic goes to loopback only.

mod procs;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use procs::Keel;

const WRONG_PIN: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// `keel serve` with the sim driver on an ephemeral loopback port.
fn serve(data_dir: &Path, extra: &[&str]) -> Keel {
    let data = data_dir.to_str().unwrap();
    let mut args = vec![
        "serve",
        "--hypervisor",
        "sim",
        "--node",
        "tls",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data,
    ];
    args.extend_from_slice(extra);
    Keel::spawn("serve", &args)
}

/// The API's address and its logged fingerprint, once it serves.
fn serving(server: &mut Keel) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = server.log.lock().unwrap().clone();
        if let Some(rest) = log.split("serving addr=").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().to_string();
            let fp = rest
                .split("fingerprint=")
                .nth(1)
                .and_then(|f| f.split_whitespace().next())
                .unwrap_or("")
                .to_string();
            return (addr, fp);
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("keel serve exited ({status}):\n{}", server.log());
        }
        assert!(Instant::now() < deadline, "not serving:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The CLI with no config file, no token in the environment, its pins in
/// `known` and `env` on top; stdin is not a terminal.
fn cli(known: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.args(args)
        .env("KEEL_CONFIG", "")
        .env("KEEL_KNOWN_SERVERS", known)
        .env_remove("KEEL_TOKEN")
        .env_remove("KEEL_DATA_DIR")
        .env_remove("KEEL_CA_FILE")
        .env_remove("KEEL_ACCEPT_FINGERPRINT")
        .stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fails(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "expected a failure; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn token(data_dir: &Path) -> String {
    std::fs::read_to_string(data_dir.join("token"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn the_api_speaks_https_and_the_cli_pins_its_certificate() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let known = scratch.path().join("known_servers");
    let mut server = serve(&data, &[]);
    let (addr, logged_fp) = serving(&mut server);
    let url = format!("https://{addr}");
    let key_mode = std::fs::metadata(data.join("tls/key.pem")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(key_mode.permissions().mode() & 0o777, 0o600);

    // A local operator: token and certificate from the data dir, no step.
    let local = [
        ("KEEL_SERVER", url.as_str()),
        ("KEEL_DATA_DIR", data.to_str().unwrap()),
    ];
    ok(&cli(&known, &local, &["vm", "create", "web", "--stopped"]));
    assert!(ok(&cli(&known, &local, &["vm", "list"])).contains("web"));
    assert!(!known.exists(), "a data-dir pin is not stored");

    // Plain HTTP to the HTTPS port: a plain answer saying so, at once.
    let began = Instant::now();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: keel\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
    assert!(answer.contains("https://"), "{answer:?}");
    let plain_url = format!("http://{addr}");
    let err = fails(&cli(
        &known,
        &[
            ("KEEL_SERVER", plain_url.as_str()),
            ("KEEL_DATA_DIR", data.to_str().unwrap()),
        ],
        &["vm", "list"],
    ));
    assert!(err.contains("speaks HTTPS"), "{err}");
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );

    // A remote user: the token only, no access to the data dir.
    let tok = token(&data);
    let remote = [("KEEL_SERVER", url.as_str()), ("KEEL_TOKEN", tok.as_str())];
    // First contact without a terminal: refused, the fingerprint shown.
    let err = fails(&cli(&known, &remote, &["vm", "list"]));
    assert!(err.contains("not known yet"), "{err}");
    assert!(err.contains(&logged_fp), "{logged_fp} in {err}");
    assert!(err.contains("--accept-fingerprint"), "{err}");
    assert!(!known.exists(), "nothing pinned without consent");
    // A fingerprint that is not the server's pins nothing.
    let err = fails(&cli(
        &known,
        &remote,
        &["vm", "list", "--accept-fingerprint", WRONG_PIN],
    ));
    assert!(err.contains(WRONG_PIN) && err.contains(&logged_fp), "{err}");
    assert!(!known.exists());
    // The right one pins it, and from then on no flag is needed.
    ok(&cli(
        &known,
        &remote,
        &["vm", "list", "--accept-fingerprint", &logged_fp],
    ));
    let pins = std::fs::read_to_string(&known).unwrap();
    assert!(pins.contains(&format!("{addr} {logged_fp}")), "{pins}");
    assert!(ok(&cli(&known, &remote, &["vm", "list"])).contains("web"));

    // A pin of another certificate: refused, clearly.
    std::fs::write(&known, format!("{addr} {WRONG_PIN}\n")).unwrap();
    let err = fails(&cli(&known, &remote, &["vm", "list"]));
    assert!(err.contains("refusing the keel server"), "{err}");
    assert!(err.contains(&addr), "{err}");
    assert!(err.contains(WRONG_PIN) && err.contains(&logged_fp), "{err}");
    assert!(
        err.contains(&format!("--accept-fingerprint {logged_fp}")),
        "{err}"
    );
    // The console's WebSocket verifies the same way.
    let err = fails(&cli(&known, &remote, &["vm", "console", "web"]));
    assert!(err.contains("refusing the keel server"), "{err}");
    // Re-pinned on purpose.
    ok(&cli(
        &known,
        &remote,
        &["vm", "list", "--accept-fingerprint", &logged_fp],
    ));
    assert!(!std::fs::read_to_string(&known).unwrap().contains(WRONG_PIN));

    // The certificate outlives a restart: pins stay valid.
    drop(server);
    let mut again = serve(&data, &[]);
    let (addr2, fp2) = serving(&mut again);
    assert_eq!(fp2, logged_fp);
    let url2 = format!("https://{addr2}");
    ok(&cli(
        &known,
        &[
            ("KEEL_SERVER", url2.as_str()),
            ("KEEL_DATA_DIR", data.to_str().unwrap()),
        ],
        &["vm", "get", "web"],
    ));
}

/// An rcgen-made CA and a leaf it issues for localhost and 127.0.0.1.
fn operator_pki(dir: &Path) -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "test operator CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let mut leaf =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "keel.test");
    let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p.to_str().unwrap().to_string()
    };
    (
        write("ca.pem", ca_cert.pem()),
        write("cert.pem", leaf_cert.pem()),
        write("key.pem", leaf_key.serialize_pem()),
    )
}

#[test]
fn an_operator_certificate_is_verified_against_its_ca() {
    let scratch = tempfile::tempdir().unwrap();
    let data = scratch.path().join("data");
    let known = scratch.path().join("known_servers");
    let (ca, cert, key) = operator_pki(scratch.path());
    let mut server = serve(&data, &["--tls-cert", &cert, "--tls-key", &key]);
    let (addr, _) = serving(&mut server);
    assert!(
        !data.join("tls/cert.pem").exists(),
        "no certificate generated"
    );
    let tok = token(&data);
    let port = addr.rsplit(':').next().unwrap();
    for url in [
        format!("https://{addr}"),
        format!("https://localhost:{port}"),
    ] {
        let env = [("KEEL_SERVER", url.as_str()), ("KEEL_TOKEN", tok.as_str())];
        ok(&cli(&known, &env, &["vm", "list", "--ca-file", &ca]));
        // Without the CA the server is unknown: refused.
        let err = fails(&cli(&known, &env, &["vm", "list"]));
        assert!(err.contains("not known yet"), "{err}");
    }
    // A CA that did not issue it: refused.
    let other = tempfile::tempdir().unwrap();
    let (other_ca, _, _) = operator_pki(other.path());
    let url = format!("https://{addr}");
    let env = [("KEEL_SERVER", url.as_str()), ("KEEL_TOKEN", tok.as_str())];
    let err = fails(&cli(&known, &env, &["vm", "list", "--ca-file", &other_ca]));
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // A name the certificate does not carry: refused (host names are
    // checked with --ca-file).
    let wrong_name = format!("https://[::1]:{port}");
    let err = fails(&cli(
        &known,
        &[
            ("KEEL_SERVER", wrong_name.as_str()),
            ("KEEL_TOKEN", tok.as_str()),
        ],
        &["vm", "list", "--ca-file", &ca],
    ));
    assert!(!err.is_empty());
    // Half a pair is refused, naming the missing flag.
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "serve",
            "--hypervisor",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            &cert,
        ])
        .arg("--data-dir")
        .arg(scratch.path().join("half"))
        .env("KEEL_CONFIG", "")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-key"));
}

/// The cluster's own CA issues the API certificate every control plane of
/// a cluster serves (`issue-cert --api-server`): a client with its CA
/// trusts whichever answers, by name.
#[test]
fn the_cluster_ca_issues_the_api_certificate() {
    let scratch = tempfile::tempdir().unwrap();
    let (ca_dir, out) = (scratch.path().join("ca"), scratch.path().join("api-tls"));
    let keel = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .env("KEEL_CONFIG", "")
            .output()
            .unwrap()
    };
    let (ca_arg, out_arg) = (ca_dir.to_str().unwrap(), out.to_str().unwrap());
    ok(&keel(&["cluster", "init-ca", "--ca-dir", ca_arg]));
    let issued = ok(&keel(&[
        "cluster",
        "issue-cert",
        "keel-api",
        "--api-server",
        "--ca-dir",
        ca_arg,
        "--ip",
        "127.0.0.1",
        "--dns",
        "localhost",
        "--out",
        out_arg,
    ]));
    assert!(issued.contains("--tls-cert"), "{issued}");
    // An address belongs on a server's certificate only.
    let err = fails(&keel(&[
        "cluster",
        "issue-cert",
        "n1",
        "--ca-dir",
        ca_arg,
        "--ip",
        "127.0.0.1",
    ]));
    assert!(
        err.contains("--api-server") || err.contains("--etcd-server"),
        "{err}"
    );

    let data = scratch.path().join("data");
    let known = scratch.path().join("known_servers");
    let cert = out.join("keel-api-cert.pem");
    let key = out.join("keel-api-key.pem");
    let ca = out.join("ca-cert.pem");
    let mut server = serve(
        &data,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let (addr, _) = serving(&mut server);
    let tok = token(&data);
    let port = addr.rsplit(':').next().unwrap();
    for url in [
        format!("https://{addr}"),
        format!("https://localhost:{port}"),
    ] {
        let env = [("KEEL_SERVER", url.as_str()), ("KEEL_TOKEN", tok.as_str())];
        ok(&cli(
            &known,
            &env,
            &["vm", "list", "--ca-file", ca.to_str().unwrap()],
        ));
    }
}

#[test]
fn plain_http_is_only_for_loopback_and_only_when_asked() {
    let scratch = tempfile::tempdir().unwrap();
    let known = scratch.path().join("known_servers");
    let began = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "serve",
            "--hypervisor",
            "sim",
            "--insecure-http",
            "--listen",
            "0.0.0.0:0",
        ])
        .arg("--data-dir")
        .arg(scratch.path().join("wide"))
        .env("KEEL_CONFIG", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--insecure-http") && err.contains("loopback"),
        "{err}"
    );
    assert!(began.elapsed() < Duration::from_secs(10));

    let data = scratch.path().join("data");
    let mut server = serve(&data, &["--insecure-http"]);
    let (addr, _) = serving(&mut server);
    assert!(server.log().contains("plain HTTP"), "{}", server.log());
    let url = format!("http://{addr}");
    ok(&cli(
        &known,
        &[
            ("KEEL_SERVER", url.as_str()),
            ("KEEL_DATA_DIR", data.to_str().unwrap()),
        ],
        &["vm", "list"],
    ));
}
