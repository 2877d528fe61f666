//! `--wait`: follows a VM until the requested change is done, printing a
//! progress line on stderr whenever its phase or instance changes. The
//! VM's watch first ([`follow`]), the poll if that stream cannot be had or
//! breaks.

pub mod follow;

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use anyhow::bail;
use keel_api::{Phase, PowerState, VirtualMachine};

use super::{encode, Client};
use crate::api::vms::VmResponse;

/// Between two reads when the watch is not to be had.
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Goal {
    /// Running, from a spec at least this generation.
    Running { generation: u64 },
    /// Stopped with no instance left, from a spec at least this generation.
    Stopped { generation: u64 },
    /// A different instance than `old_instance` is Running.
    Restarted {
        old_instance: Option<String>,
        restart_generation: u64,
    },
    /// The same instance's guest has reset since the request
    /// (`reboot_generation`), and is ready again.
    Rebooted {
        instance: Option<String>,
        resets_before: u32,
        reboot_generation: u64,
    },
    /// The restore is done and the VM is back in the power state it ends
    /// in (`VirtualMachine::power_after_restore`, the controller's rule):
    /// Running with an instance (booted: the intent is cleared), or
    /// Stopped with none.
    Restored { power: PowerState },
    /// The record is gone.
    Gone,
}

impl Goal {
    fn reached(&self, vm: &VirtualMachine) -> bool {
        let s = &vm.status;
        match self {
            Goal::Running { generation } => {
                s.phase == Phase::Running
                    && s.observed_generation >= *generation
                    && vm.ready_since().is_some()
            }
            Goal::Stopped { generation } => {
                s.phase == Phase::Stopped
                    && s.instance.is_none()
                    && s.observed_generation >= *generation
            }
            Goal::Restarted {
                old_instance,
                restart_generation,
            } => {
                s.phase == Phase::Running
                    && s.observed_restart_generation >= *restart_generation
                    && s.instance.as_ref().map(|i| &i.id) != old_instance.as_ref()
                    && vm.ready_since().is_some()
            }
            Goal::Rebooted {
                instance,
                resets_before,
                reboot_generation,
            } => {
                let inst = s.instance.as_ref();
                s.phase == Phase::Running
                    && s.observed_reboot_generation >= *reboot_generation
                    && inst.map(|i| &i.id) == instance.as_ref()
                    && inst.is_some_and(|i| i.resets > *resets_before && i.reboot.is_none())
                    && vm.ready_since().is_some()
            }
            Goal::Restored { power } => vm.restored_to(*power),
            Goal::Gone => false,
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Goal::Running { .. } => "be Running and ready",
            Goal::Stopped { .. } => "be Stopped",
            Goal::Restarted { .. } => "run a new instance and be ready",
            Goal::Rebooted { .. } => "reboot its guest and be ready again",
            Goal::Restored {
                power: PowerState::Running,
            } => "be restored and Running",
            Goal::Restored {
                power: PowerState::Stopped,
            } => "be restored and Stopped",
            Goal::Gone => "be deleted",
        }
    }
}

/// The VM once `goal` holds (`None` for [`Goal::Gone`]).
pub fn until(
    client: &Client,
    name: &str,
    goal: &Goal,
    timeout: Duration,
) -> anyhow::Result<Option<VmResponse>> {
    let deadline = Instant::now() + timeout;
    let mut waiter = Waiter {
        name,
        goal,
        timeout,
        last_seen: None,
    };
    let states = follow::states(client, name);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let current = match states.recv_timeout(left) {
            Ok(follow::Seen::Vm(resp)) => Some(*resp),
            Ok(follow::Seen::Gone) => None,
            Ok(follow::Seen::Broke(why)) => {
                tracing::debug!("--wait: the watch of VM {name} broke ({why}); polling instead");
                break;
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                // One last read: the goal may hold just now, and the
                // message says where the VM is.
                let current = client.get_opt::<VmResponse>(&vm_path(name))?;
                match waiter.see(current)? {
                    Step::Done(done) => return Ok(done),
                    Step::Pending(resp) => return Err(waiter.timed_out(&resp)),
                }
            }
        };
        if let Step::Done(done) = waiter.see(current)? {
            return Ok(done);
        }
    }
    loop {
        let current = client.get_opt::<VmResponse>(&vm_path(name))?;
        match waiter.see(current)? {
            Step::Done(done) => return Ok(done),
            Step::Pending(resp) if Instant::now() >= deadline => {
                return Err(waiter.timed_out(&resp))
            }
            Step::Pending(_) => std::thread::sleep(POLL),
        }
    }
}

fn vm_path(name: &str) -> String {
    format!("/api/v1/vms/{}", encode(name))
}

/// Where a wait is after one state of the VM.
enum Step {
    /// The goal holds: the VM (`None` once deleted, for [`Goal::Gone`]).
    Done(Option<VmResponse>),
    Pending(VmResponse),
}

/// One wait's goal and the progress it printed.
struct Waiter<'a> {
    name: &'a str,
    goal: &'a Goal,
    timeout: Duration,
    last_seen: Option<String>,
}

impl Waiter<'_> {
    /// Takes the VM's current state (`None`: there is none).
    fn see(&mut self, current: Option<VmResponse>) -> anyhow::Result<Step> {
        let name = self.name;
        let Some(resp) = current else {
            if *self.goal == Goal::Gone {
                eprintln!("{name}: deleted");
                return Ok(Step::Done(None));
            }
            bail!(
                "VM {name} was deleted while waiting for it to {}",
                self.goal.describe()
            );
        };
        let progress = progress_line(name, &resp.vm);
        if self.last_seen.as_ref() != Some(&progress) {
            eprintln!("{}", keel_api::untrusted::terminal_safe(&progress));
            self.last_seen = Some(progress);
        }
        if self.goal.reached(&resp.vm) {
            return Ok(Step::Done(Some(resp)));
        }
        Ok(Step::Pending(resp))
    }

    fn timed_out(&self, resp: &VmResponse) -> anyhow::Error {
        let not_ready = resp
            .vm
            .status
            .instance
            .as_ref()
            .and_then(|i| i.readiness.as_ref())
            .and_then(|r| r.reason.as_ref())
            .map(|r| format!("; not ready: {r}"))
            .unwrap_or_default();
        anyhow::anyhow!(
            "timed out after {}s waiting for VM {} to {} (it is {:?}{not_ready})",
            self.timeout.as_secs(),
            self.name,
            self.goal.describe(),
            resp.vm.status.phase
        )
    }
}

fn progress_line(name: &str, vm: &VirtualMachine) -> String {
    let s = &vm.status;
    let mut line = format!("{name}: {:?}", s.phase);
    if let Some(inst) = &s.instance {
        line.push_str(&format!(" (instance {})", inst.id));
        if s.phase == Phase::Running {
            match (
                vm.ready_since(),
                inst.readiness.as_ref().and_then(|r| r.reason.as_ref()),
            ) {
                (Some(_), _) => line.push_str(" ready"),
                (None, Some(why)) => line.push_str(&format!(" not ready: {why}")),
                (None, None) => line.push_str(" not ready"),
            }
        }
    }
    if let Some(r) = &vm.restore {
        line.push_str(&format!(" [restoring from snapshot {}]", r.snapshot));
    } else if let Some(intent) = &vm.power_intent {
        line.push_str(&format!(" [returning to {:?}]", intent.power));
    }
    if let Some(msg) = &s.message {
        line.push_str(&format!(": {msg}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_api::{Instance, VmSpec};

    fn vm(phase: Phase, instance: Option<&str>) -> VirtualMachine {
        let spec: VmSpec = serde_json::from_str(r#"{"cpus":1,"memory_mib":64}"#).unwrap();
        let mut vm = VirtualMachine::new("web", spec);
        vm.status.phase = phase;
        vm.status.observed_generation = 1;
        vm.status.instance = instance.map(|id| Instance {
            running_since: Some(1),
            ..Instance::new(id, "n", 1)
        });
        vm
    }

    #[test]
    fn goals() {
        let restarted = Goal::Restarted {
            old_instance: Some("web-1".into()),
            restart_generation: 0,
        };
        assert!(!restarted.reached(&vm(Phase::Running, Some("web-1"))));
        assert!(restarted.reached(&vm(Phase::Running, Some("web-2"))));
        assert!(!Goal::Running { generation: 2 }.reached(&vm(Phase::Running, Some("web-1"))));
        assert!(Goal::Running { generation: 1 }.reached(&vm(Phase::Running, Some("web-1"))));
        assert!(!Goal::Stopped { generation: 1 }.reached(&vm(Phase::Stopped, Some("web-1"))));
        // Running is not enough when the guest must be up.
        let mut waiting = vm(Phase::Running, Some("web-2"));
        waiting.spec.readiness = keel_api::Readiness::Agent;
        assert!(!Goal::Running { generation: 1 }.reached(&waiting));
        assert!(!restarted.reached(&waiting));
        waiting.status.instance.as_mut().unwrap().readiness = Some(keel_api::InstanceReadiness {
            ready_at: Some(5),
            ..Default::default()
        });
        assert!(Goal::Running { generation: 1 }.reached(&waiting));
        assert!(restarted.reached(&waiting));
        assert!(Goal::Stopped { generation: 1 }.reached(&vm(Phase::Stopped, None)));
    }

    #[test]
    fn restored_needs_restore_and_intent_cleared() {
        let running = Goal::Restored {
            power: PowerState::Running,
        };
        let stopped = Goal::Restored {
            power: PowerState::Stopped,
        };
        let mut v = vm(Phase::Running, Some("web-2"));
        assert!(running.reached(&v));
        assert!(!stopped.reached(&v));
        v.power_intent = Some(keel_api::PowerIntent {
            power: PowerState::Running,
            reason: "restore".into(),
            recorded_at: 1,
        });
        assert!(!running.reached(&v), "not booted long enough yet");
        assert!(progress_line("web", &v).contains("returning to Running"));
        v.power_intent = None;
        v.restore = Some(keel_api::RestoreRequest {
            snapshot: "s".into(),
            requested_at: 1,
        });
        assert!(!running.reached(&v));
        assert!(stopped.reached(&vm(Phase::Stopped, None)));
        assert!(!stopped.reached(&vm(Phase::Stopped, Some("web-1"))));
    }
}
