//! Simulated guest resets: a reboot inside the same domain, as QEMU's
//! `-action reboot=reset` makes it. The domain stays `Running` (QEMU's
//! run state does not change); its guest boots again (console banner and
//! agent back `boot_ms` + `agent_ready_ms` after the reset) and
//! `DomainInfo::resets` counts it.

use keel_api::Millis;

use super::{sim_failed, SimDomain, SimHypervisor};
use crate::{DomainEvent, DomainEventKind, HvError};

impl SimDomain {
    /// When the guest's current boot began: its start, or its last reset.
    pub(super) fn booting_since(&self) -> Millis {
        self.guest.last_reset_at.unwrap_or(self.started_at)
    }

    /// Whether the guest can be reset now: its process runs the guest
    /// (not exited, not a migration target still receiving).
    fn resettable(&self) -> bool {
        self.executing() && self.state == crate::DomainState::Running
    }

    fn reset(&mut self, console_so_far: Vec<u8>, now: Millis) {
        self.guest.resets += 1;
        self.guest.last_reset_at = Some(now);
        self.guest.console_before_reset = console_so_far;
        self.guest.console_extra.clear();
        // A freeze does not outlive the OS that held it.
        self.guest.frozen = false;
    }
}

impl SimHypervisor {
    /// The guest reboots by itself now (`reboot` inside it). `false` if it
    /// is not running.
    pub fn guest_reset(&self, instance: &str) -> bool {
        self.reset_now(instance, "guest reboot").is_ok()
    }

    /// The guest's agent accepts a reboot request and the guest does not
    /// reboot (a hung shutdown inside it): only a hypervisor reset ends it.
    pub fn ignore_reboot(&self, instance: &str) {
        if let Some(d) = self.lock().domains.get_mut(instance) {
            d.guest.ignores_reboot = true;
        }
    }

    /// Guest resets so far (also after the domain exited), `None` if unknown.
    pub fn resets(&self, instance: &str) -> Option<u32> {
        self.lock().domains.get(instance).map(|d| d.guest.resets)
    }

    fn reset_now(&self, instance: &str, why: &str) -> Result<(), HvError> {
        let now = self.clock.now_ms();
        let vm = {
            let mut s = self.lock();
            let so_far = s.console(instance, now)?;
            let d = s.domain_mut(instance)?;
            if !d.resettable() {
                return Err(sim_failed(
                    instance,
                    "reset",
                    format!("the guest is not running ({:?})", d.state),
                ));
            }
            d.reset(so_far, now);
            let vm = d.spec.vm.clone();
            s.log.push(format!("t={now}: {why}: reset {instance}"));
            vm
        };
        // A hint, as QEMU's monitor gives one for a RESET event.
        let _ = self
            .events
            .send(DomainEvent::new(&vm, instance, DomainEventKind::Reset));
        Ok(())
    }

    pub(super) async fn reboot_through_agent(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        let now = self.clock.now_ms();
        {
            let mut s = self.lock();
            let agent_ready_ms = s.config.boot_ms + s.config.agent_ready_ms;
            let d = s.domain_mut(instance)?;
            if let Some(why) = d.agent_silence(now, agent_ready_ms) {
                return Err(sim_failed(instance, "reboot through the guest agent", why));
            }
            if d.guest.ignores_reboot {
                s.log
                    .push(format!("t={now}: guest-shutdown reboot {instance} ignored"));
                return Ok(());
            }
        }
        self.reset_now(instance, "guest-shutdown reboot")
    }

    pub(super) async fn reset_by_hypervisor(&self, instance: &str) -> Result<(), HvError> {
        self.hang_point(instance).await;
        {
            let mut s = self.lock();
            s.monitor_answers(instance, "reset")?;
        }
        self.reset_now(instance, "system_reset")
    }
}
