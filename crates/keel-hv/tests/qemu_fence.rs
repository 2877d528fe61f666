//! The fence keeper against real QEMU: a guest runs only while the node's
//! local lease is renewed, whatever happens to the driver (the agent) or to
//! the keeper itself. See `keel_hv::qemu::keeper`.

mod common;

use std::time::{Duration, Instant};

use common::{pid_alive, spec, Fixture, BOOT};
use keel_hv::qemu::keeper::{KeeperCommand, FENCED_FILE};
use keel_hv::qemu::{QemuConfig, QemuDriver};
use keel_hv::{DomainState, ExitCause, HvError, Hypervisor};

fn with_keeper(mut config: QemuConfig) -> QemuConfig {
    config.keeper = Some(KeeperCommand {
        program: env!("CARGO_BIN_EXE_keel-keeper").into(),
        args: vec![],
    });
    config
}

async fn fenced_fixture() -> Option<Fixture> {
    Fixture::with(with_keeper).await
}

/// Polls until `pid` is gone; returns how long that took.
async fn wait_gone(pid: u32, timeout: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if !pid_alive(pid) {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The agent dies (its driver is dropped, nothing renews the lease): the
/// keeper ends the guest once the lease lapses, and a new driver sees the
/// exit as Keel's kill, with the keeper's reason on file.
#[tokio::test]
async fn a_guest_is_fenced_once_nobody_renews_the_lease() {
    let Some(mut fx) = fenced_fixture().await else {
        return;
    };
    // Renewed every second for 4 s, as the agent does after each heartbeat
    // (always "now + the same window").
    const LEASE: Duration = Duration::from_secs(4);
    let renewer = {
        let hv = fx.hv().clone();
        hv.renew_fence(LEASE).await.unwrap();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                hv.renew_fence(LEASE).await.unwrap();
            }
        })
    };
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    let keeper = parent_of(pid);
    let keeper_cmd = std::fs::read_to_string(format!("/proc/{keeper}/cmdline")).unwrap();
    assert!(
        keeper_cmd.contains("keel-keeper"),
        "QEMU's parent: {keeper_cmd:?}"
    );
    // Renewals keep it running past several lease lengths.
    tokio::time::sleep(LEASE * 2).await;
    assert!(pid_alive(pid), "fenced although the lease was renewed");

    // As after `kill -9` of the agent: the last renewal stands, then lapses.
    renewer.abort();
    fx.hv().renew_fence(LEASE).await.unwrap();
    let data_dir = fx.dir.path().to_path_buf();
    drop(fx.driver.take());
    let gone = wait_gone(pid, Duration::from_secs(10)).await;
    let gone = gone.expect("QEMU still running 10 s after its 2 s lease lapsed");
    eprintln!("fenced {gone:?} after the last renewal (lease {LEASE:?})");
    assert!(
        gone >= LEASE - Duration::from_millis(500),
        "fenced early: {gone:?}"
    );
    // It exits right after reaping QEMU; allow it the moment that takes.
    assert!(
        wait_gone(keeper, Duration::from_secs(5)).await.is_some(),
        "the keeper stays after fencing"
    );

    let instance_dir = data_dir.join("instances/web-1");
    let fenced = std::fs::read_to_string(instance_dir.join(FENCED_FILE)).unwrap();
    assert!(fenced.contains("lease lapsed"), "{fenced}");
    let hv = QemuDriver::new(with_keeper(common::tcg_config(&data_dir, &fx.guest)))
        .await
        .unwrap();
    assert_eq!(
        hv.info("web-1").await.unwrap().state,
        DomainState::Exited(ExitCause::Killed)
    );
    hv.cleanup("web-1").await.unwrap();
}

/// An agent restarted within the lease re-adopts the guest, which never
/// stopped: same boot, still counting.
#[tokio::test]
async fn an_agent_back_within_the_lease_readopts_without_a_reboot() {
    let Some(mut fx) = fenced_fixture().await else {
        return;
    };
    // Room for a slow TCG boot; then the agent's last renewal, which cuts
    // the lease back (the keeper takes the file as written): the new
    // driver must be back within those 5 s.
    fx.hv().renew_fence(Duration::from_secs(120)).await.unwrap();
    let mut ch = fx.boot("web", "web-1").await;
    let before = ch.ticks().await.unwrap();
    drop(ch);
    fx.hv().renew_fence(Duration::from_secs(5)).await.unwrap();
    let data_dir = fx.dir.path().to_path_buf();
    drop(fx.driver.take());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let hv = QemuDriver::new(with_keeper(common::tcg_config(&data_dir, &fx.guest)))
        .await
        .unwrap();
    hv.renew_fence(Duration::from_secs(30)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(hv.info("web-1").await.unwrap().state, DomainState::Running);
    let mut ch = keel_hv::guest::GuestChannel::connect(hv.command_socket("web-1"))
        .await
        .unwrap();
    ch.sync(BOOT).await.unwrap();
    let after = ch.ticks().await.unwrap();
    assert_eq!(after.boot_id, before.boot_id, "the guest rebooted");
    assert!(after.ticks > before.ticks);
    common::stop_and_cleanup(&hv, "web-1").await;
    fx.driver = Some(hv);
}

/// The keeper is QEMU's lifeline: if it dies, however, QEMU dies with it
/// (no guest can outlive the thing that would fence it).
#[tokio::test]
async fn killing_the_keeper_ends_its_qemu() {
    let Some(fx) = fenced_fixture().await else {
        return;
    };
    fx.hv().renew_fence(Duration::from_secs(60)).await.unwrap();
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    let keeper = parent_of(pid);
    // SAFETY: kill(2) on the keeper this test's driver started.
    assert_eq!(unsafe { libc::kill(keeper as i32, libc::SIGKILL) }, 0);
    assert!(
        wait_gone(pid, Duration::from_secs(5)).await.is_some(),
        "QEMU outlived its keeper"
    );
    let state = fx
        .wait_for("web-1", Duration::from_secs(5), DomainState::is_exited)
        .await;
    assert!(state.is_exited(), "{state:?}");
}

/// Neither the keeper nor its QEMU holds any capability, though this test
/// (root) holds them all: a guest that breaks out of QEMU finds no
/// privilege there (the units' ambient CAP_NET_ADMIN used to reach QEMU).
#[tokio::test]
async fn the_keeper_and_its_qemu_run_without_capabilities() {
    let Some(fx) = fenced_fixture().await else {
        return;
    };
    fx.hv().renew_fence(Duration::from_secs(60)).await.unwrap();
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    let keeper = parent_of(pid);
    for (what, pid) in [("QEMU", pid), ("keeper", keeper)] {
        let [inh, prm, eff, bnd, amb] = keel_hv::unprivileged::capabilities_of(pid).unwrap();
        assert_eq!(
            (inh, prm, eff, amb),
            (0, 0, 0, 0),
            "{what} (pid {pid}) holds capabilities"
        );
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(bnd, 0, "{what} (pid {pid}) could regain capabilities");
        }
    }
}

/// Under a lapsed lease nothing starts, and nothing is left behind.
#[tokio::test]
async fn nothing_starts_under_a_lapsed_lease() {
    let Some(fx) = fenced_fixture().await else {
        return;
    };
    fx.hv().renew_fence(Duration::ZERO).await.unwrap();
    let err = fx.hv().start(&spec("web", "web-1")).await.unwrap_err();
    assert!(
        matches!(&err, HvError::Failed { reason, .. } if reason.contains("lease")),
        "{err:?}"
    );
    assert!(fx.hv().info("web-1").await.unwrap_err().is_not_found());
    assert!(fx.hv().list().await.unwrap().is_empty());
}

/// A renewal may shorten the lease (an agent back from a planned restart
/// cuts a freeze's long lease back to the normal window before the
/// cluster counts the normal lease again): the keeper goes by the file as
/// written, and fences at the shorter deadline.
#[tokio::test]
async fn a_shortened_lease_fences_at_the_shorter_deadline() {
    let Some(fx) = fenced_fixture().await else {
        return;
    };
    fx.hv().renew_fence(Duration::from_secs(300)).await.unwrap();
    fx.boot("web", "web-1").await;
    let pid = fx.hv().pid("web-1").unwrap();
    fx.hv().renew_fence(Duration::from_secs(1)).await.unwrap();
    let gone = wait_gone(pid, Duration::from_secs(10)).await;
    assert!(
        gone.is_some_and(|d| d >= Duration::from_millis(500)),
        "not fenced at the shortened deadline: {gone:?}"
    );
}

/// Only a fenced guest depends on the lease. Two guests of one node, one
/// launched fenced and one not (`DomainSpec::fenced`: HA off, or disks no
/// other node sees); the agent dies and the lease lapses. The keeper ends
/// the fenced one; the unfenced one is plain QEMU, no keeper's child,
/// still running well past the lapse, a lapsed lease does not keep it
/// from starting either, and a new driver re-adopts it (same pid) and
/// leaves it out of what self-fencing kills.
#[tokio::test]
async fn an_unfenced_guest_outlives_a_lapsed_lease() {
    let Some(mut fx) = fenced_fixture().await else {
        return;
    };
    fx.hv().renew_fence(Duration::from_secs(120)).await.unwrap();
    let unfenced = keel_hv::DomainSpec {
        fenced: false,
        ..spec("hafree", "hafree-1")
    };
    common::boot(fx.hv(), &unfenced).await;
    fx.boot("hakept", "hakept-1").await;
    let free_pid = fx.hv().pid("hafree-1").unwrap();
    let kept_pid = fx.hv().pid("hakept-1").unwrap();
    let parent_cmd = std::fs::read_to_string(format!("/proc/{}/cmdline", parent_of(free_pid)))
        .unwrap_or_default();
    assert!(
        !parent_cmd.contains("keel-keeper"),
        "an unfenced QEMU under a keeper: {parent_cmd:?}"
    );

    // As after `kill -9` of the agent: the last renewal stands, then lapses.
    const LEASE: Duration = Duration::from_secs(2);
    fx.hv().renew_fence(LEASE).await.unwrap();
    let data_dir = fx.dir.path().to_path_buf();
    drop(fx.driver.take());
    let gone = wait_gone(kept_pid, Duration::from_secs(10)).await;
    assert!(gone.is_some(), "the fenced QEMU outlived its lease");
    // Well past the lapse: the unfenced one still runs.
    tokio::time::sleep(LEASE * 2).await;
    assert!(pid_alive(free_pid), "the unfenced QEMU was killed");

    let hv = QemuDriver::new(with_keeper(common::tcg_config(&data_dir, &fx.guest)))
        .await
        .unwrap();
    // Under the lapsed lease an unfenced guest still starts (nothing
    // could start it anywhere else); a fenced one does not.
    assert!(hv.start(&spec("hakept", "hakept-2")).await.is_err());
    let info = hv.info("hafree-1").await.unwrap();
    assert_eq!(info.state, DomainState::Running);
    assert_eq!(info.pid, Some(free_pid), "re-adopted the same QEMU");
    assert!(!info.fenced);
    let listing = hv.list().await.unwrap();
    let to_fence: Vec<&str> = listing.fenced_instances().collect();
    assert!(!to_fence.contains(&"hafree-1"), "{to_fence:?}");
    // Another VM's unfenced guest starts under the lapsed lease.
    let other = keel_hv::DomainSpec {
        vm: "haother".into(),
        instance: "haother-1".into(),
        ..unfenced.clone()
    };
    hv.start(&other).await.unwrap();
    hv.kill("haother-1").await.unwrap();
    common::wait_for(
        &hv,
        "haother-1",
        Duration::from_secs(10),
        DomainState::is_exited,
    )
    .await;
    hv.cleanup("haother-1").await.unwrap();
    common::stop_and_cleanup(&hv, "hafree-1").await;
    fx.driver = Some(hv);
}
