//! A cluster member the fault tests kill, pause and restart: its command
//! line is kept so that it can be started again as it was.

use std::net::TcpListener;
use std::time::Instant;

use super::Keel;

/// What a process is doing now.
pub enum Health {
    Up,
    /// Killed; restarted at this instant.
    Dead(Instant),
    /// SIGSTOPped; continued at this instant.
    Paused(Instant),
}

pub struct Member {
    pub name: String,
    pub args: Vec<String>,
    pub proc: Option<Keel>,
    pub health: Health,
}

impl Member {
    pub fn new(name: &str, args: Vec<String>) -> Member {
        Member {
            name: name.into(),
            args,
            proc: None,
            health: Health::Up,
        }
    }

    pub fn start(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.proc = Some(Keel::spawn(&self.name, &args));
        self.health = Health::Up;
    }

    pub fn signal(&self, sig: libc::c_int) {
        if let Some(p) = &self.proc {
            // SAFETY: kill(2) on a child this test spawned.
            unsafe { libc::kill(p.child.id() as i32, sig) };
        }
    }
}

/// Every member's log, for a failure message.
pub fn members_logs(members: &[Member]) -> String {
    members
        .iter()
        .filter_map(|m| m.proc.as_ref().map(Keel::log))
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A number from the environment (a seed, a duration in seconds), else
/// `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
