//! Readiness of a running instance's guest: probed on the instance's node,
//! decided by a pure function.
//!
//! Probes (the guest agent, the console log) run inside the look that
//! starts them for at most [`PROBE_BUDGET`]; one still waiting then moves
//! to a task of its own and its result is taken at a later look, so a hung
//! guest agent never holds up the other VMs (the driver bounds each agent
//! call as well).
//!
//! A guest whose readiness is a console text is also watched by the driver
//! (`Hypervisor::watch_console`): when the text shows, the driver marks the
//! instance's slot as shown and announces it, and the look that follows
//! probes at once instead of at the next interval. The probe stays the
//! truth and the interval its safety net.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_api::{
    Clock, GuestAddress, Instance, InstanceReadiness, Millis, Phase, Readiness, VirtualMachine,
};
use keel_hv::{GuestInfo, Hypervisor};

/// How long a look waits for a probe it started.
pub const PROBE_BUDGET: Duration = Duration::from_millis(200);

/// The agent's answer in a probe that did not ask it: a guest whose
/// readiness is a console text is not ready until the text shows, and a
/// silent agent would hold each look for the agent's timeout (2 s on
/// QEMU) before the console is read.
pub const AGENT_NOT_ASKED: &str = "not asked until the console shows the readiness text";

/// What one probe saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    pub at: Millis,
    /// The agent's answer; `Err` if the instance could not be asked.
    pub agent: Result<GuestInfo, String>,
    /// Whether the console showed the readiness text (`None`: not looked).
    pub console: Option<Result<bool, String>>,
}

#[derive(Debug, Default)]
struct Slot {
    in_flight: bool,
    started_at: Millis,
    /// The driver saw the console show the readiness text since the last
    /// probe began: the next look probes whatever the interval says.
    shown: bool,
    last: Option<Probe>,
}

/// Probe results per instance, and the probes in flight.
pub struct GuestProbes {
    hv: Arc<dyn Hypervisor>,
    clock: Arc<dyn Clock>,
    slots: Arc<Mutex<BTreeMap<String, Slot>>>,
    /// Between probes while the guest is not ready yet.
    pub interval_ms: Millis,
    /// Between probes once it is (addresses may change).
    pub ready_interval_ms: Millis,
}

impl GuestProbes {
    pub fn new(hv: Arc<dyn Hypervisor>, clock: Arc<dyn Clock>) -> Self {
        Self {
            hv,
            clock,
            slots: Default::default(),
            interval_ms: 1_000,
            ready_interval_ms: 30_000,
        }
    }

    /// The latest probe of `inst`, starting a new one if due (and waiting
    /// for it up to [`PROBE_BUDGET`]).
    pub async fn latest(&self, vm: &VirtualMachine, inst: &Instance) -> Option<Probe> {
        let now = self.clock.now_ms();
        let ready = inst
            .readiness
            .as_ref()
            .is_some_and(|r| r.ready_at.is_some());
        let interval = if ready {
            self.ready_interval_ms
        } else {
            self.interval_ms
        };
        let start = {
            let mut slots = self.slots.lock().expect("probe slots");
            // Only instances still recorded keep a slot.
            let slot = slots.entry(inst.id.clone()).or_default();
            // Once ready, a probe that left the agent out is followed by
            // one that asks it (its addresses) at once.
            let due = slot.shown
                || slot.last.as_ref().is_none_or(|p| {
                    stale(inst, p)
                        || now >= p.at.saturating_add(interval)
                        || (ready && agent_not_asked(p))
                });
            if !slot.in_flight && due {
                slot.in_flight = true;
                slot.started_at = now;
                slot.shown = false;
                true
            } else {
                false
            }
        };
        if let (Readiness::Console(text), false) = (&vm.spec.readiness, ready) {
            let slots = self.slots.clone();
            let id = inst.id.clone();
            self.hv.watch_console(
                &inst.id,
                text,
                Box::new(move || {
                    if let Some(slot) = slots.lock().expect("probe slots").get_mut(&id) {
                        slot.shown = true;
                    }
                }),
            );
        }
        if start {
            let hv = self.hv.clone();
            let clock = self.clock.clone();
            let slots = self.slots.clone();
            let id = inst.id.clone();
            let text = match &vm.spec.readiness {
                Readiness::Console(text) => Some(text.clone()),
                _ => None,
            };
            let mut probe = Box::pin(async move {
                // A console read tells of the log as it was when the look
                // began: a probe that began before a reset is stale
                // however long the agent then takes to answer.
                let begun = clock.now_ms();
                // The console first: reading a log is quick, asking a
                // silent agent is not.
                let console = match &text {
                    Some(t) => Some(
                        hv.console_contains(&id, t)
                            .await
                            .map_err(|e| crate::error_chain(&e)),
                    ),
                    None => None,
                };
                let agent = if text.is_some() && !ready {
                    Err(AGENT_NOT_ASKED.to_string())
                } else {
                    hv.guest_info(&id).await.map_err(|e| crate::error_chain(&e))
                };
                let at = if console.is_some() {
                    begun
                } else {
                    clock.now_ms()
                };
                let probe = Probe { at, agent, console };
                let mut slots = slots.lock().expect("probe slots");
                let slot = slots.entry(id).or_default();
                slot.in_flight = false;
                slot.last = Some(probe);
            });
            // The probe runs inline first: most answer at once (the sim
            // always, QEMU's console read and a live agent within
            // milliseconds), and a task of their own cost every look a
            // hand-off to another thread and back, the bulk of an idle
            // node's CPU. Only a probe still waiting after the budget is
            // moved to a task of its own, to finish without holding up the
            // look.
            if tokio::time::timeout(PROBE_BUDGET, &mut probe)
                .await
                .is_err()
            {
                tokio::spawn(probe);
            }
        }
        self.slots
            .lock()
            .expect("probe slots")
            .get(&inst.id)
            .and_then(|s| s.last.clone())
    }

    /// Forgets instances no longer recorded for `vm` (keeps `current`).
    /// Looks only at the names that start like `vm`'s instances: it runs
    /// on every reconcile, and a scan of every slot made each one cost as
    /// much as the node has VMs.
    pub fn forget_others(&self, vm: &str, current: Option<&str>) {
        let prefix = format!("{vm}-");
        let mut slots = self.slots.lock().expect("probe slots");
        let stale: Vec<String> = slots
            .range::<str, _>((
                std::ops::Bound::Included(prefix.as_str()),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(id, _)| id.starts_with(&prefix))
            .filter(|(id, s)| {
                Some(id.as_str()) != current
                    && !s.in_flight
                    && id[prefix.len()..].bytes().all(|b| b.is_ascii_digit())
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            slots.remove(&id);
        }
    }
}

fn agent_not_asked(probe: &Probe) -> bool {
    probe.agent.as_ref().err().map(String::as_str) == Some(AGENT_NOT_ASKED)
}

/// A probe finished no later than the guest's last reset seen: it
/// describes the boot before.
fn stale(inst: &Instance, probe: &Probe) -> bool {
    inst.last_reset_at.is_some_and(|reset| probe.at <= reset)
}

/// The instance's readiness after `probe`, for a VM whose instance is
/// alive and about to be recorded in `phase`. Pure: same inputs, same
/// answer. Once ready, an instance stays ready (a guest agent restarting
/// inside a running guest does not make the VM un-ready); its addresses
/// follow the latest answer.
pub fn next_readiness(
    vm: &VirtualMachine,
    inst: &Instance,
    phase: Phase,
    probe: Option<&Probe>,
    now: Millis,
) -> InstanceReadiness {
    let mut r = inst.readiness.clone().unwrap_or_default();
    let probe = probe.filter(|p| !stale(inst, p));
    if let Some(Ok(info)) = probe.map(|p| &p.agent) {
        r.agent = info.agent.is_answering();
        if r.agent {
            r.addresses = addresses(info);
            r.hostname = info.hostname.clone();
            r.agent_note = info.note.clone();
        }
    }
    if r.ready_at.is_some() {
        r.reason = None;
        return bound(r);
    }
    if phase != Phase::Running {
        r.reason = Some(format!("instance {} is {phase:?}", inst.id));
        return r;
    }
    let not_probed = || format!("guest of instance {} not probed yet", inst.id);
    match &vm.spec.readiness {
        Readiness::None => {
            r.ready_at = Some(inst.running_since.unwrap_or(now));
        }
        Readiness::Agent => match probe.map(|p| (&p.agent, p.at)) {
            Some((Ok(info), at)) if info.agent.is_answering() => r.ready_at = Some(at),
            Some((Ok(info), _)) => {
                r.reason = Some(match &info.agent {
                    keel_hv::AgentState::Silent { reason } => {
                        format!("guest agent not answering: {reason}")
                    }
                    keel_hv::AgentState::Answering { .. } => unreachable!("matched above"),
                })
            }
            Some((Err(e), _)) => r.reason = Some(format!("cannot ask the guest agent: {e}")),
            None => r.reason = Some(not_probed()),
        },
        Readiness::Console(text) => match probe.map(|p| (&p.console, p.at)) {
            Some((Some(Ok(true)), at)) => r.ready_at = Some(at),
            Some((Some(Ok(false)), _)) => {
                r.reason = Some(format!("console has not shown {text:?} yet"))
            }
            Some((Some(Err(e)), _)) => r.reason = Some(format!("cannot read the console: {e}")),
            Some((None, _)) | None => r.reason = Some(not_probed()),
        },
    }
    if r.ready_at.is_some() {
        r.reason = None;
    }
    bound(r)
}

/// The readiness as it may be stored: the driver bounds what a guest said
/// already, but the record's size must not depend on every driver doing so.
fn bound(mut r: InstanceReadiness) -> InstanceReadiness {
    use keel_api::readiness::{MAX_GUEST_ADDRESSES, MAX_HOSTNAME, MAX_INTERFACE_NAME, MAX_REASON};
    use keel_api::untrusted::bounded;
    r.addresses.truncate(MAX_GUEST_ADDRESSES);
    for a in &mut r.addresses {
        a.interface = bounded(&a.interface, MAX_INTERFACE_NAME).into_owned();
    }
    for text in [&mut r.reason, &mut r.agent_note].into_iter().flatten() {
        *text = bounded(text, MAX_REASON).into_owned();
    }
    if let Some(h) = &mut r.hostname {
        *h = bounded(h, MAX_HOSTNAME).into_owned();
    }
    r
}

/// Non-loopback addresses, as `address/prefix`.
fn addresses(info: &GuestInfo) -> Vec<GuestAddress> {
    info.ips
        .iter()
        .filter(|ip| !ip.address.is_loopback())
        .map(|ip| GuestAddress {
            interface: ip.interface.clone(),
            address: format!("{}/{}", ip.address, ip.prefix),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{RunPolicy, VmSpec};
    use keel_hv::{AgentState, GuestIp};

    /// Only the VM's own earlier instances go: not the current one, not
    /// one in flight, and not those of VMs whose names merely start alike.
    #[test]
    fn forget_others_drops_only_this_vms_earlier_instances() {
        let clock: Arc<dyn Clock> = Arc::new(keel_api::ManualClock::new(0));
        let hv = Arc::new(keel_hv::sim::SimHypervisor::new(
            clock.clone(),
            1,
            Default::default(),
        ));
        let probes = GuestProbes::new(hv, clock);
        for id in ["a-1", "a-2", "a-3", "a-b-4", "ab-5", "b-6"] {
            probes
                .slots
                .lock()
                .unwrap()
                .insert(id.into(), Slot::default());
        }
        probes
            .slots
            .lock()
            .unwrap()
            .get_mut("a-3")
            .unwrap()
            .in_flight = true;
        probes.forget_others("a", Some("a-2"));
        let left: Vec<String> = probes.slots.lock().unwrap().keys().cloned().collect();
        assert_eq!(left, ["a-2", "a-3", "a-b-4", "ab-5", "b-6"]);
        probes.forget_others("a", None);
        let left: Vec<String> = probes.slots.lock().unwrap().keys().cloned().collect();
        assert_eq!(left, ["a-3", "a-b-4", "ab-5", "b-6"]);
    }

    fn vm(readiness: Readiness) -> (VirtualMachine, Instance) {
        let vm = VirtualMachine::new(
            "web",
            VmSpec {
                disks: vec![],
                run_policy: RunPolicy::Manual,
                readiness,
                ..keel_testkit::spec::vm_spec()
            },
        );
        let inst = Instance {
            running_since: Some(100),
            ..Instance::new("web-1", "local", 50)
        };
        (vm, inst)
    }

    fn answering(at: Millis) -> Probe {
        Probe {
            at,
            agent: Ok(GuestInfo {
                agent: AgentState::Answering { version: None },
                ips: vec![
                    GuestIp {
                        interface: "lo".into(),
                        address: [127, 0, 0, 1].into(),
                        prefix: 8,
                    },
                    GuestIp {
                        interface: "eth0".into(),
                        address: [10, 0, 2, 15].into(),
                        prefix: 24,
                    },
                ],
                hostname: Some("web".into()),
                note: None,
            }),
            console: None,
        }
    }

    /// After a reset the guest boots again: an answer from before it (a
    /// probe that finished no later than the reset was seen) is not taken
    /// for the new boot's.
    #[test]
    fn a_probe_from_before_a_reset_does_not_make_the_new_boot_ready() {
        let (v, inst) = vm(Readiness::Agent);
        let inst = Instance {
            resets: 1,
            last_reset_at: Some(1_000),
            readiness: Some(InstanceReadiness::default()),
            ..inst
        };
        let r = next_readiness(&v, &inst, Phase::Running, Some(&answering(900)), 1_010);
        assert_eq!(r.ready_at, None, "{r:?}");
        assert!(!r.agent);
        let r = next_readiness(&v, &inst, Phase::Running, Some(&answering(1_500)), 1_510);
        assert_eq!(r.ready_at, Some(1_500));
    }

    #[test]
    fn agent_readiness_waits_for_an_answer_and_reports_addresses() {
        let (v, inst) = vm(Readiness::Agent);
        let silent = Probe {
            at: 200,
            agent: Ok(GuestInfo::silent("no answer within 2s")),
            console: None,
        };
        let r = next_readiness(&v, &inst, Phase::Running, Some(&silent), 210);
        assert_eq!(r.ready_at, None);
        assert!(r.reason.unwrap().contains("no answer within 2s"));
        let r = next_readiness(&v, &inst, Phase::Running, Some(&answering(300)), 310);
        assert_eq!(r.ready_at, Some(300));
        assert_eq!(r.reason, None);
        assert!(r.agent);
        assert_eq!(
            r.addresses,
            [GuestAddress {
                interface: "eth0".into(),
                address: "10.0.2.15/24".into()
            }]
        );
        // Stays ready when the agent later goes silent.
        let inst = Instance {
            readiness: Some(r),
            ..inst
        };
        let r = next_readiness(&v, &inst, Phase::Running, Some(&silent), 400);
        assert_eq!(r.ready_at, Some(300));
        assert!(!r.agent);
    }

    #[test]
    fn console_and_none_readiness() {
        let (v, inst) = vm(Readiness::Console("KEEL-GUEST-READY".into()));
        let seen = |yes| Probe {
            at: 500,
            agent: Ok(GuestInfo::silent("none")),
            console: Some(Ok(yes)),
        };
        let r = next_readiness(&v, &inst, Phase::Running, Some(&seen(false)), 510);
        assert!(r.reason.unwrap().contains("KEEL-GUEST-READY"));
        let r = next_readiness(&v, &inst, Phase::Running, Some(&seen(true)), 510);
        assert_eq!(r.ready_at, Some(500));
        // Not while it is still starting.
        let r = next_readiness(&v, &inst, Phase::Starting, Some(&seen(true)), 510);
        assert_eq!(r.ready_at, None);

        let (v, inst) = vm(Readiness::None);
        let r = next_readiness(&v, &inst, Phase::Running, None, 510);
        assert_eq!(r.ready_at, Some(100), "ready since it ran");
    }

    /// A guest ready by its console is ready at the first look that sees
    /// the text, even while its agent is silent (here: its calls hang);
    /// once ready, the next look asks the agent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn console_readiness_does_not_wait_for_a_silent_agent() {
        let clock = keel_api::ManualClock::new(0);
        let hv = Arc::new(keel_hv::sim::SimHypervisor::new(
            Arc::new(clock.clone()),
            1,
            Default::default(),
        ));
        hv.start(&keel_hv::DomainSpec::bare("web", "web-1", 1, 128))
            .await
            .unwrap();
        clock.advance(60_000);
        hv.hang_calls("web-1");
        let probes = GuestProbes::new(hv.clone(), Arc::new(clock.clone()));
        let (v, mut inst) = vm(Readiness::Console("KEEL-GUEST-READY".into()));
        let probe = probes
            .latest(&v, &inst)
            .await
            .expect("a probe within its budget");
        assert_eq!(probe.console, Some(Ok(true)), "{probe:?}");
        assert!(agent_not_asked(&probe), "{probe:?}");
        let r = next_readiness(&v, &inst, Phase::Running, Some(&probe), clock.now_ms());
        assert_eq!(r.ready_at, Some(probe.at));

        // Ready: the next look asks the agent (which hangs here, so the
        // probe stays in flight past the look's budget).
        inst.readiness = Some(r);
        probes.latest(&v, &inst).await;
        assert!(probes.slots.lock().unwrap()["web-1"].in_flight);
        hv.release_calls("web-1");
        // The probe left its look past the budget and goes on in a task
        // of its own: once the agent answers, its result is there for the
        // next look.
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let in_flight = probes.slots.lock().unwrap()["web-1"].in_flight;
                if !in_flight {
                    break;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the probe finishes once the agent answers");
        let last = probes.slots.lock().unwrap()["web-1"].last.clone();
        assert!(
            last.as_ref().is_some_and(|p| !agent_not_asked(p)),
            "{last:?}"
        );
    }
}
