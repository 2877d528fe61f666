//! `keel vm ...`.

use std::time::Duration;

use keel_api::{BootSpec, DiskSpec, PowerState, VirtualMachine, VmSpec, ROOT_DISK};
use ureq::http::Method;

use super::output::{self, fields, Table};
use super::wait::{self, Goal};
use super::{encode, Client};
use crate::api::vms::{CreateVmRequest, VmList, VmResponse};
use crate::args::{CreateArgs, LogsArgs, OutputFormat, PowerArgs, VmCommand, VmVerb};

pub fn run(cmd: VmCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    match cmd.verb {
        VmVerb::Create(args) => create(&client, out, args),
        VmVerb::List => list(&client, out),
        VmVerb::Get { name } => get(&client, out, &name),
        VmVerb::Start(args) => power(&client, out, args, "start"),
        VmVerb::Stop(args) => power(&client, out, args, "stop"),
        VmVerb::Restart(args) => power(&client, out, args, "restart"),
        VmVerb::Reboot(args) => power(&client, out, args, "reboot"),
        VmVerb::Delete(args) => delete(&client, out, args),
        VmVerb::Logs(args) => logs(&client, args),
        VmVerb::Console { name } => super::console::run(&client, &name),
        VmVerb::Migrate(args) => super::vm_migrate::run(&client, out, args),
        VmVerb::Clone(args) => super::vm_clone::run(&client, out, args),
        VmVerb::Export(args) => super::vm_export::export(&client, args),
        VmVerb::Import(args) => super::vm_export::import(&client, out, args),
        VmVerb::Disk(verb) => super::vm_disk::run(&client, out, verb),
        VmVerb::Cdrom(args) => super::vm_cdrom::run(&client, out, args),
        VmVerb::Top(args) => super::vm_top::run(&client, out, args),
    }
}

/// The log as it is for a pipe or `--raw`; on a terminal, with the guest's
/// escape sequences shown instead of obeyed (lines stay lines).
fn logs(client: &Client, args: LogsArgs) -> anyhow::Result<()> {
    use std::io::{IsTerminal, Write};
    let mut path = format!("/api/v1/vms/{}/console/log", encode(&args.name));
    if let Some(n) = args.tail {
        path.push_str(&format!("?tail={n}"));
    }
    let bytes = client.get_bytes(&path)?;
    let mut stdout = std::io::stdout().lock();
    let bytes = log_for_output(bytes, stdout.is_terminal(), args.raw);
    stdout.write_all(&bytes)?;
    stdout.flush()?;
    Ok(())
}

/// What `vm logs` writes of `log`: escaped only for a terminal, and not
/// with `--raw`.
pub fn log_for_output(log: Vec<u8>, terminal: bool, raw: bool) -> Vec<u8> {
    if terminal && !raw {
        keel_api::untrusted::terminal_safe_log(&log).into_bytes()
    } else {
        log
    }
}

/// The spec the flags describe (reading the files they name). Validation
/// is the server's: its errors name the field.
pub fn spec_from_args(args: &CreateArgs) -> anyhow::Result<VmSpec> {
    Ok(VmSpec {
        cpus: args.cpus,
        memory_mib: args.memory,
        disks: args
            .image
            .iter()
            .map(|image| DiskSpec {
                name: ROOT_DISK.into(),
                // 0: the server makes it the image's virtual size.
                size_mib: args.disk_size.unwrap_or(0),
                image: Some(image.clone()),
            })
            .chain(args.disks.iter().cloned())
            .collect(),
        boot: BootSpec {
            cdrom: args.cdrom.clone(),
            first: args.boot_first,
            graphics: args.graphics,
            kernel: args.kernel.clone(),
            initrd: args.initrd.clone(),
            cmdline: args.cmdline.clone(),
            firmware: super::vm_firmware::firmware(args.firmware, args.secure_boot)?,
        },
        run_policy: args.policy.unwrap_or_default(),
        power: if args.stopped {
            PowerState::Stopped
        } else {
            PowerState::Running
        },
        restart_generation: 0,
        stop_grace_period_s: args.grace,
        node: None,
        readiness: args.readiness.clone().unwrap_or_default(),
        network: args.net.network(),
        cloud_init: args.net.cloud_init()?,
        ha: match (args.ha, args.no_ha) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        },
        cpu_model: args.cpu_model.clone(),
        tpm: args.tpm.then(keel_api::TpmSpec::default),
        placement: args.placement.rules(),
    })
}

fn create(client: &Client, out: OutputFormat, args: CreateArgs) -> anyhow::Result<()> {
    let req = CreateVmRequest {
        name: args.name.clone(),
        spec: spec_from_args(&args)?,
    };
    let resp: VmResponse = client.call(Method::POST, "/api/v1/vms", Some(&req))?;
    if args.wait {
        let goal = Goal::Running {
            generation: resp.vm.generation,
        };
        let done = wait::until(client, &args.name, &goal, Duration::from_secs(args.timeout))?
            .expect("only Gone yields no VM");
        return output::print(out, &done, || {
            format!(
                "vm {} created: {}\n",
                done.vm.name,
                readiness_summary(&done.vm)
            )
        });
    }
    output::print(out, &resp, || {
        format!("vm {} created (revision {})\n", resp.vm.name, resp.revision)
    })
}

fn list(client: &Client, out: OutputFormat) -> anyhow::Result<()> {
    let resp: VmList = client.get_all("/api/v1/vms")?;
    output::print(out, &resp, || {
        let mut t = Table::new(&[
            "NAME", "PHASE", "READY", "POWER", "POLICY", "CPUS", "MEMORY", "INSTANCE", "NODE",
            "RESTART", "REASON",
        ]);
        for item in &resp.items {
            let vm = &item.vm;
            let inst = vm.status.instance.as_ref();
            t.row(vec![
                vm.name.clone(),
                format!("{:?}", vm.status.phase),
                if vm.ready_since().is_some() {
                    "yes"
                } else {
                    "no"
                }
                .into(),
                format!("{:?}", vm.spec.power),
                format!("{:?}", vm.spec.run_policy),
                vm.spec.cpus.to_string(),
                format!("{}Mi", vm.spec.memory_mib),
                inst.map(|i| i.id.clone()).unwrap_or_else(|| "-".into()),
                inst.map(|i| i.node.clone()).unwrap_or_else(|| "-".into()),
                restart_column(vm),
                vm.status.message.clone().unwrap_or_else(|| "-".into()),
            ]);
        }
        t.render()
    })
}

fn get(client: &Client, out: OutputFormat, name: &str) -> anyhow::Result<()> {
    let resp: VmResponse = client.get(&format!("/api/v1/vms/{}", encode(name)))?;
    output::print(out, &resp, || describe(&resp))
}

fn describe(resp: &VmResponse) -> String {
    let vm: &VirtualMachine = &resp.vm;
    let s = &vm.status;
    let t = crate::timefmt::rfc3339;
    let mut pairs = vec![
        ("name", vm.name.clone()),
        ("phase", format!("{:?}", s.phase)),
        ("power", format!("{:?}", vm.spec.power)),
        ("policy", format!("{:?}", vm.spec.run_policy)),
        ("cpus", vm.spec.cpus.to_string()),
        ("memory", format!("{} MiB", vm.spec.memory_mib)),
        (
            "disks",
            if vm.spec.disks.is_empty() {
                "-".into()
            } else {
                vm.spec
                    .disks
                    .iter()
                    .map(|d| match &d.image {
                        Some(image) => {
                            format!("{} ({} MiB, from image {image})", d.name, d.size_mib)
                        }
                        None => format!("{} ({} MiB)", d.name, d.size_mib),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
        ("grace", format!("{}s", vm.spec.stop_grace_period_s)),
        ("readiness", vm.spec.readiness.to_string()),
    ];
    pairs.push(super::vm_ha::describe(vm));
    pairs.extend(super::net::describe(vm));
    pairs.extend(super::placement::describe(vm));
    pairs.extend(super::vm_migrate::describe(vm));
    for (k, v) in [
        ("kernel", &vm.spec.boot.kernel),
        ("initrd", &vm.spec.boot.initrd),
        ("cmdline", &vm.spec.boot.cmdline),
    ] {
        if let Some(v) = v {
            pairs.push((k, v.clone()));
        }
    }
    pairs.extend(super::vm_cdrom::describe(vm));
    if let Some(firmware) = vm.spec.boot.firmware {
        pairs.push(("firmware", firmware.name().into()));
    }
    if let Some(tpm) = super::vm_firmware::tpm_summary(vm) {
        pairs.push(("tpm", tpm));
    }
    match &s.instance {
        Some(i) => {
            pairs.push(("instance", format!("{} on node {}", i.id, i.node)));
            pairs.push(("created", t(i.created_at)));
            if let Some(since) = i.running_since {
                pairs.push(("running since", t(since)));
            }
            pairs.push(("ready", readiness_summary(vm)));
            if i.resets > 0 {
                let last = i.last_reset_at.map(|at| format!(", last {}", t(at)));
                pairs.push((
                    "guest resets",
                    format!("{}{}", i.resets, last.unwrap_or_default()),
                ));
            }
            if let Some(r) = &i.reboot {
                pairs.push((
                    "reboot",
                    match r.reset_sent_at {
                        Some(at) => format!("reset by the hypervisor at {}", t(at)),
                        None => format!(
                            "asked of the guest at {}; reset at {} if it has not rebooted",
                            t(r.requested_at),
                            t(r.fallback_at)
                        ),
                    },
                ));
            }
            if let Some(r) = &i.readiness {
                pairs.push((
                    "guest agent",
                    if r.agent {
                        "answering"
                    } else {
                        "not answering"
                    }
                    .into(),
                ));
                if !r.addresses.is_empty() {
                    pairs.push((
                        "addresses",
                        r.addresses
                            .iter()
                            .map(|a| format!("{} ({})", a.address, a.interface))
                            .collect::<Vec<_>>()
                            .join(", "),
                    ));
                }
                if let Some(h) = &r.hostname {
                    pairs.push(("hostname", h.clone()));
                }
                if let Some(note) = &r.agent_note {
                    pairs.push(("agent note", note.clone()));
                }
            }
        }
        None => pairs.push(("instance", "-".into())),
    }
    if let Some(d) = &s.drained_from {
        pairs.push((
            "drained from",
            format!(
                "node {} (`keel node uncordon {} --return` brings it back)",
                d.node, d.node
            ),
        ));
    }
    if !s.restart_required.is_empty() {
        pairs.push(("restart required", s.restart_required.join(", ")));
    }
    if let Some(hw) = &s.hardware {
        pairs.push((
            "hardware",
            format!("machine {}, CPU {}", hw.machine, hw.cpu_model),
        ));
    }
    if let Some(exit) = &s.last_exit {
        pairs.push((
            "last exit",
            format!(
                "{} {:?} at {}{}",
                exit.instance,
                exit.kind,
                t(exit.at),
                if exit.requested { " (requested)" } else { "" }
            ),
        ));
        if let Some(reason) = &exit.reason {
            pairs.push(("exit reason", reason.clone()));
        }
    }
    if let Some(at) = vm.deletion_requested_at {
        pairs.push(("deletion requested", t(at)));
    }
    if let Some(msg) = &s.message {
        pairs.push(("message", msg.clone()));
    }
    pairs.push((
        "generation",
        format!("{} (observed {})", vm.generation, s.observed_generation),
    ));
    pairs.push(("revision", resp.revision.to_string()));
    fields(&pairs)
}

/// `vm list`'s RESTART: the fields a restart would apply (`cpus,memory`),
/// or `-`.
fn restart_column(vm: &VirtualMachine) -> String {
    if vm.status.restart_required.is_empty() {
        "-".into()
    } else {
        vm.status.restart_required.join(",")
    }
}

/// `yes, since …` or `no: <why>`.
fn readiness_summary(vm: &VirtualMachine) -> String {
    if let Some(at) = vm.ready_since() {
        return format!("yes, since {}", crate::timefmt::rfc3339(at));
    }
    let why = vm
        .status
        .instance
        .as_ref()
        .and_then(|i| i.readiness.as_ref())
        .and_then(|r| r.reason.clone())
        .unwrap_or_else(|| format!("VM is {:?}", vm.status.phase));
    format!("no: {why}")
}

fn power(client: &Client, out: OutputFormat, args: PowerArgs, verb: &str) -> anyhow::Result<()> {
    let path = format!("/api/v1/vms/{}/{verb}", encode(&args.name));
    let resp: VmResponse = client.call(Method::POST, &path, None::<&()>)?;
    if !args.wait {
        return output::print(out, &resp, || {
            format!(
                "{}: {verb} requested (revision {})\n",
                args.name, resp.revision
            )
        });
    }
    let goal = match verb {
        "start" => Goal::Running {
            generation: resp.vm.generation,
        },
        "stop" => Goal::Stopped {
            generation: resp.vm.generation,
        },
        "reboot" => Goal::Rebooted {
            instance: resp.vm.status.instance.as_ref().map(|i| i.id.clone()),
            resets_before: resp.vm.status.instance.as_ref().map_or(0, |i| i.resets),
            reboot_generation: resp.vm.reboot_generation,
        },
        _ => Goal::Restarted {
            old_instance: resp.vm.status.instance.as_ref().map(|i| i.id.clone()),
            restart_generation: resp.vm.spec.restart_generation,
        },
    };
    let done = wait::until(client, &args.name, &goal, Duration::from_secs(args.timeout))?
        .expect("only Gone yields no VM");
    output::print(out, &done, || {
        let phase = format!("{:?}", done.vm.status.phase);
        match &done.vm.status.instance {
            Some(i) => format!("{}: {phase} (instance {})\n", args.name, i.id),
            None => format!("{}: {phase}\n", args.name),
        }
    })
}

fn delete(client: &Client, out: OutputFormat, args: PowerArgs) -> anyhow::Result<()> {
    let path = format!("/api/v1/vms/{}", encode(&args.name));
    let resp: VmResponse = client.call(Method::DELETE, &path, None::<&()>)?;
    if args.wait {
        wait::until(
            client,
            &args.name,
            &Goal::Gone,
            Duration::from_secs(args.timeout),
        )?;
    }
    output::print(out, &resp, || {
        if args.wait {
            format!("{}: deleted\n", args.name)
        } else {
            format!(
                "{}: deletion requested (revision {})\n",
                args.name, resp.revision
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record stored before guest text was escaped on the way in still
    /// prints nothing that drives a terminal.
    #[test]
    fn describe_escapes_what_an_old_record_kept_of_a_guest() {
        let pwned = "\x1b]0;pwned\x07\x1b[2J";
        let resp: VmResponse = serde_json::from_value(serde_json::json!({
            "revision": 7,
            "vm": {"name": "web", "generation": 1,
                "spec": {"cpus": 1, "memory_mib": 64},
                "status": {"phase": "Running", "instance": {
                    "id": "web-1", "node": "n1", "created_at": 1,
                    "readiness": {"agent": true, "hostname": format!("web{pwned}"),
                        "reason": format!("agent said {pwned}"),
                        "agent_note": format!("note {pwned}\u{202e}"),
                        "addresses": [{"interface": format!("eth0{pwned}"),
                            "address": "10.0.2.15/24"}]}}}}
        }))
        .unwrap();
        let text = describe(&resp);
        assert!(
            !text
                .chars()
                .any(|c| c != '\n' && keel_api::untrusted::is_unsafe_char(c)),
            "{text:?}"
        );
        assert!(text.contains("web\\x1b]0;pwned\\x07\\x1b[2J"), "{text}");
        assert!(text.contains("(eth0\\x1b]0;pwned"), "{text}");
        assert!(
            text.contains("note \\x1b]0;pwned\\x07\\x1b[2J\\u{202e}"),
            "{text}"
        );
    }

    #[test]
    fn logs_are_escaped_only_for_a_terminal_without_raw() {
        let log = b"ok\r\n\x1b[2Jx\n".to_vec();
        assert_eq!(log_for_output(log.clone(), false, false), log);
        assert_eq!(log_for_output(log.clone(), true, true), log);
        assert_eq!(log_for_output(log, true, false), b"ok\r\n\\x1b[2Jx\n");
    }
}
