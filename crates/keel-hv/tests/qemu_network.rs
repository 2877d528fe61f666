//! The NIC and the cloud-init seed against real QEMU and the test guest:
//! DHCP from user-mode networking (passt) and a guest port reached through
//! its published loopback port; the guest's MAC is the spec's, also after a
//! restart; a user-mode guest reaches a host outside but nothing on its
//! host's loopback, in network namespaces the test creates; a bridge tap
//! inside a network namespace the test creates; the seed read back inside
//! the guest.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{boot, spec, stop_and_cleanup, Fixture};
use keel_api::{CloudInitSpec, NetworkMode, NetworkSpec, PortForward, Protocol};
use keel_hv::guest::GuestChannel;
use keel_hv::qemu::network;
use keel_hv::Hypervisor;

const MAC: &str = "52:54:00:4b:ee:01";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn ask(ch: &mut GuestChannel, command: &str, prefix: &str) -> String {
    let answer = ch.command(command).await.unwrap();
    assert!(
        answer.starts_with(prefix),
        "{command:?} answered {answer:?}"
    );
    answer[prefix.len()..].trim().to_string()
}

/// An HTTP GET through `port`, retried briefly: passt accepts the host
/// connection at once, the guest's httpd may still be starting.
fn http_get(port: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let attempt = (|| -> std::io::Result<String> {
            let mut s = TcpStream::connect(("127.0.0.1", port))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        })();
        match attempt {
            Ok(body) if body.contains("200 OK") => return body,
            other if Instant::now() >= deadline => panic!("GET via port {port}: {other:?}"),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_mode_dhcp_published_port_and_a_stable_mac() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let port = free_port();
    let mut s = spec("web", "web-1");
    s.network = NetworkSpec {
        mac: Some(MAC.into()),
        publish: vec![PortForward {
            host_address: "127.0.0.1".into(),
            host_port: port,
            guest_port: 8080,
            protocol: Protocol::Tcp,
        }],
        ..Default::default()
    };
    let mut ch = boot(hv, &s).await;
    assert_eq!(ask(&mut ch, "mac", "MAC ").await, MAC);
    // udhcpc may try for 10 s.
    let mut ch = ch.with_timeout(Duration::from_secs(40));
    let t = Instant::now();
    let ip = ask(&mut ch, "net dhcp", "IP ").await;
    eprintln!("DHCP lease {ip} after {:?}", t.elapsed());
    assert_eq!(
        Some(ip),
        keel_hv::qemu::passt::guest_address(),
        "passt leases the host's own address"
    );
    ask(&mut ch, "serve 8080 hello-from-the-guest", "OK serve").await;
    let t = Instant::now();
    let body = http_get(port);
    eprintln!("GET through 127.0.0.1:{port} in {:?}", t.elapsed());
    assert!(body.contains("hello-from-the-guest"), "{body}");
    drop(ch);
    stop_and_cleanup(hv, "web-1").await;
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the forward outlived its instance"
    );

    // The next instance of the same VM has the same MAC.
    s.instance = "web-2".into();
    let mut ch = boot(hv, &s).await;
    assert_eq!(ask(&mut ch, "mac", "MAC ").await, MAC, "after a restart");
    drop(ch);
    stop_and_cleanup(hv, "web-2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_init_seed_is_readable_in_the_guest() {
    let Some(fx) = Fixture::new().await else {
        return;
    };
    let hv = fx.hv();
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBvQ4m8y8kJqkVv6Zl9m8oQb2F2k9eW4k2q0o1v2w3x4 tester@keel";
    let mut s = spec("ci-vm", "ci-vm-1");
    s.cloud_init = Some(CloudInitSpec {
        ssh_authorized_keys: vec![key.into()],
        user_data: None,
        instance_id: Some("i-0123456789abcdef".into()),
    });
    let mut ch = boot(hv, &s).await;
    let seed = ask(&mut ch, "seed", "SEED ").await;
    let decode = |b: &str| {
        String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b).unwrap()).unwrap()
    };
    let (meta, user) = seed.split_once(' ').expect("two files");
    let (meta, user) = (decode(meta), decode(user));
    assert_eq!(
        meta,
        "instance-id: i-0123456789abcdef\nlocal-hostname: ci-vm\n"
    );
    assert!(user.starts_with("#cloud-config\n"), "{user}");
    assert!(user.contains(&format!("\"{key}\"")), "{user}");
    drop(ch);
    stop_and_cleanup(hv, "ci-vm-1").await;
}

const ISOLATION_CHILD_ENV: &str = "KEEL_ISOLATION_CHILD";
/// The guest's host and a host "outside" it, in namespaces of the test's:
/// a veth pair from 198.18.0.1 (the node, default route via the outside)
/// to 198.18.0.2 (the outside). 198.18.0.0/15 is the benchmarking range;
/// nothing of it leaves the namespaces.
const NODE_ADDR: &str = "198.18.0.1";
const OUTSIDE_ADDR: &str = "198.18.0.2";

/// A user-mode guest's way out works, and no way leads into its host's
/// loopback: QEMU's slirp used to map the gateway to 127.0.0.1, so any
/// guest read loopback-only services (etcd and the admin token in it).
/// The parent half makes the two namespaces and runs this same test again
/// inside the node's (`ip netns exec`).
#[test]
fn a_user_mode_guest_reaches_outside_but_not_its_hosts_loopback() {
    if std::env::var_os(ISOLATION_CHILD_ENV).is_some() {
        return isolation_child();
    }
    if common::guest_dir().is_none() {
        return;
    }
    assert!(
        netns_possible(),
        "the isolation test needs root and iproute2"
    );
    let id = std::process::id();
    let node = Netns(format!("keel-n{id}"));
    let outside = Netns(format!("keel-o{id}"));
    ip(&["netns", "add", &node.0]);
    ip(&["netns", "add", &outside.0]);
    let (veth_n, veth_o) = (format!("kvn{id}"), format!("kvo{id}"));
    ip(&[
        "link", "add", &veth_n, "type", "veth", "peer", "name", &veth_o,
    ]);
    ip(&["link", "set", &veth_n, "netns", &node.0]);
    ip(&["link", "set", &veth_o, "netns", &outside.0]);
    for (ns, dev, addr) in [
        (&node.0, &veth_n, NODE_ADDR),
        (&outside.0, &veth_o, OUTSIDE_ADDR),
    ] {
        ip(&["-n", ns, "link", "set", "lo", "up"]);
        ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
        ip(&["-n", ns, "link", "set", dev, "up"]);
    }
    ip(&[
        "-n",
        &node.0,
        "route",
        "add",
        "default",
        "via",
        OUTSIDE_ADDR,
    ]);
    run_inside(
        &node,
        "a_user_mode_guest_reaches_outside_but_not_its_hosts_loopback",
        (ISOLATION_CHILD_ENV, &outside.0),
    );
}

/// Answers every connection with `word` and a newline, for the test's
/// lifetime.
fn answer_with(listener: TcpListener, word: &'static str) {
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = conn.write_all(format!("{word}\n").as_bytes());
        }
    });
}

/// A listener in the namespace `ns` (a thread of ours moved there: a
/// socket stays in the namespace it was made in).
fn listen_in_namespace(ns: &str, addr: &str) -> TcpListener {
    let ns = ns.to_string();
    let addr = addr.to_string();
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        // SAFETY: setns on a namespace file we hold open; it moves only
        // this thread, which ends after binding.
        assert_eq!(unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
        TcpListener::bind(addr).unwrap()
    })
    .join()
    .unwrap()
}

fn isolation_child() {
    let outside_ns = std::env::var(ISOLATION_CHILD_ENV).unwrap();
    // What a guest must never read: a service on the host's loopback, and
    // one on all of the host's addresses.
    let secret = TcpListener::bind("127.0.0.1:0").unwrap();
    let secret_port = secret.local_addr().unwrap().port();
    answer_with(secret, "HOST-LOOPBACK-SECRET");
    let everywhere = TcpListener::bind("0.0.0.0:0").unwrap();
    let everywhere_port = everywhere.local_addr().unwrap().port();
    answer_with(everywhere, "HOST-ADDRESS-SECRET");
    // What a guest may reach: a host outside, at the secret's port too.
    answer_with(
        listen_in_namespace(&outside_ns, &format!("{OUTSIDE_ADDR}:8080")),
        "OUTSIDE",
    );
    answer_with(
        listen_in_namespace(&outside_ns, &format!("{OUTSIDE_ADDR}:{secret_port}")),
        "OUTSIDE-AT-THE-SECRETS-PORT",
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fx = Fixture::new().await.expect("guest present in the child");
        let hv = fx.hv();
        let s = spec("iso", "iso-1");
        let ch = boot(hv, &s).await;
        let mut ch = ch.with_timeout(Duration::from_secs(40));
        assert_eq!(
            ask(&mut ch, "net dhcp", "IP ").await,
            format!("{NODE_ADDR}/24"),
            "the guest has its host's address"
        );
        assert_eq!(
            ask(&mut ch, &format!("fetch {OUTSIDE_ADDR} 8080"), "").await,
            "GOT OUTSIDE",
            "the way out works"
        );
        // The gateway is the outside host itself, not the host's loopback.
        let via_gateway = ask(&mut ch, &format!("fetch {OUTSIDE_ADDR} {secret_port}"), "").await;
        assert_eq!(via_gateway, "GOT OUTSIDE-AT-THE-SECRETS-PORT");
        for (target, port) in [
            // slirp's name for the host's loopback; routed out (to the
            // outside namespace, which has no route back) and lost.
            ("10.0.2.2", secret_port),
            // The guest's own loopback and its own address.
            ("127.0.0.1", secret_port),
            (NODE_ADDR, everywhere_port),
            (NODE_ADDR, secret_port),
        ] {
            let got = ask(&mut ch, &format!("fetch {target} {port}"), "").await;
            assert!(
                got.starts_with("ERR") && !got.contains("SECRET"),
                "the guest reached {target}:{port} on its host: {got}"
            );
        }
        drop(ch);
        stop_and_cleanup(hv, "iso-1").await;
    });
}

/// Root, `ip` and a kernel with bridges: a bridge test inside a namespace.
fn netns_possible() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
        && std::path::Path::new("/dev/net/tun").exists()
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes the namespace (and with it the bridge and veths) on drop.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Runs `test` of this binary again inside `ns` (`ip netns exec`), with
/// `child` set in its environment so that it runs its namespaced half,
/// and fails unless that half passed.
fn run_inside(ns: &Netns, test: &str, child: (&str, &str)) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(&exe)
        .args(["--exact", test, "--nocapture"])
        .env(child.0, child.1)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("--- inside {} ---\n{text}", ns.0);
    assert!(out.status.success(), "the namespaced half failed");
    assert!(text.contains("1 passed"), "the namespaced half ran nothing");
}

const CHILD_ENV: &str = "KEEL_NETNS_CHILD";
const BRIDGE: &str = "kbr0";

/// The parent half creates a namespace with a bridge and a veth pair (one
/// end on the bridge, the other with 192.168.77.1/24), then runs this
/// same test again inside it (`ip netns exec`), so every frame stays in
/// the namespace. The child half boots a guest on the bridge.
#[test]
fn bridge_tap_in_a_network_namespace() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return bridge_child();
    }
    if common::guest_dir().is_none() {
        return;
    }
    assert!(
        netns_possible(),
        "the bridge test needs root, iproute2 and /dev/net/tun"
    );
    let ns = Netns(format!("keel-t{}", std::process::id()));
    ip(&["netns", "add", &ns.0]);
    let inns = |args: &[&str]| {
        let mut all = vec!["-n", ns.0.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    };
    inns(&["link", "set", "lo", "up"]);
    inns(&["link", "add", BRIDGE, "type", "bridge"]);
    inns(&[
        "link", "add", "veth-h", "type", "veth", "peer", "name", "veth-b",
    ]);
    inns(&["link", "set", "veth-b", "master", BRIDGE]);
    inns(&["addr", "add", "192.168.77.1/24", "dev", "veth-h"]);
    for dev in [BRIDGE, "veth-b", "veth-h"] {
        inns(&["link", "set", dev, "up"]);
    }
    run_inside(&ns, "bridge_tap_in_a_network_namespace", (CHILD_ENV, "1"));
}

fn bridge_child() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fx = Fixture::new().await.expect("guest present in the child");
        let hv = fx.hv();

        // A bridge that is not there fails the start, naming it, and
        // leaves no tap and no instance behind.
        let mut missing = spec("br-vm", "br-vm-1");
        missing.network = NetworkSpec {
            mac: Some(MAC.into()),
            mode: NetworkMode::Bridge,
            bridge: Some("kbr-nope".into()),
            publish: vec![],
        };
        // The cause (the missing bridge) is the error's source, as a user
        // reads it through the chain.
        let err = keel_hv::cause::with_causes(&hv.start(&missing).await.unwrap_err());
        assert!(err.contains("bridge kbr-nope not found"), "{err}");
        assert!(!network::tap_exists("br-vm-1"));
        assert!(hv.info("br-vm-1").await.unwrap_err().is_not_found());

        let mut s = spec("br-vm", "br-vm-2");
        s.network = NetworkSpec {
            bridge: Some(BRIDGE.into()),
            ..missing.network.clone()
        };
        let mut ch = boot(hv, &s).await;
        let tap = network::tap_name("br-vm-2");
        assert!(network::tap_exists("br-vm-2"), "tap {tap} made");
        let master = std::fs::read_link(format!("/sys/class/net/{tap}/master")).unwrap();
        assert!(master.ends_with(BRIDGE), "{tap} on {}", master.display());
        assert_eq!(ask(&mut ch, "mac", "MAC ").await, MAC);
        assert_eq!(
            ask(&mut ch, "net addr 192.168.77.2/24", "IP ").await,
            "192.168.77.2/24"
        );
        let t = Instant::now();
        let ping = Command::new("busybox")
            .args(["ping", "-c", "3", "-W", "10", "192.168.77.2"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&ping.stdout);
        eprintln!("ping from the namespace ({:?}):\n{text}", t.elapsed());
        assert!(ping.status.success(), "no answer from the guest: {text}");
        drop(ch);
        stop_and_cleanup(hv, "br-vm-2").await;
        assert!(
            !network::tap_exists("br-vm-2"),
            "tap {tap} still there after cleanup"
        );
    });
}
