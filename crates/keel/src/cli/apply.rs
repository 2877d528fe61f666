//! `keel apply -f FILE`: makes the VMs a file describes exist as
//! described. A VM missing is created; one whose spec differs gets the
//! file's spec by compare-and-swap on the revision read (a conflict with
//! another writer is reported, never overwritten); with `--prune` the VMs
//! the file does not name are deleted (never without it); `--dry-run`
//! prints what would change and changes nothing.
//!
//! The file is YAML or JSON (JSON is YAML), one or several documents,
//! each a VM (`name` and `spec`), a list of them, or what `keel vm get -o
//! yaml` and `keel vm list -o yaml` print (their server-kept parts, status
//! and revision, are ignored), so a VM's own output applies unchanged.
//! The spec is read as strictly as the API reads it: an unknown field is
//! refused, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;

use anyhow::{bail, Context};
use keel_api::{VirtualMachine, VmSpec};
use serde::Deserialize;
use serde_json::Value;
use ureq::http::Method;

use super::{encode, ApiFailure, Client};
use crate::api::vms::{CreateVmRequest, ReplaceSpecRequest, VmList, VmResponse};
use crate::args::ApplyArgs;

/// One VM as the file describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Wanted {
    pub name: String,
    pub spec: VmSpec,
}

/// What applying one VM comes to.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Create,
    /// The spec's changed fields, each `path: before -> after`.
    Update {
        revision: u64,
        diff: Vec<String>,
    },
    Unchanged,
    /// `--prune`: a VM the file does not name.
    Delete {
        revision: u64,
    },
}

pub fn run(args: ApplyArgs) -> anyhow::Result<()> {
    let client = Client::from_args(&args.client)?;
    let text = read_source(&args.file)?;
    let wanted = parse(&text).with_context(|| format!("{}", args.file.display()))?;
    let current = client.get_all::<VmList>("/api/v1/vms")?;
    let plan = plan(&wanted, &current.items, args.prune);
    let mut failures = 0;
    for (name, change) in &plan {
        let outcome = match change {
            Change::Unchanged => Ok(format!("{name}: unchanged")),
            Change::Create => {
                let spec = &wanted
                    .iter()
                    .find(|w| &w.name == name)
                    .expect("planned")
                    .spec;
                if args.dry_run {
                    Ok(format!("{name}: would be created"))
                } else {
                    create(&client, name, spec).map(|()| format!("{name}: created"))
                }
            }
            Change::Update { revision, diff } => {
                let spec = &wanted
                    .iter()
                    .find(|w| &w.name == name)
                    .expect("planned")
                    .spec;
                let done = if args.dry_run {
                    Ok(())
                } else {
                    update(&client, name, spec, *revision)
                };
                done.map(|()| {
                    let head = if args.dry_run {
                        format!("{name}: would be updated")
                    } else {
                        format!("{name}: updated")
                    };
                    std::iter::once(head)
                        .chain(diff.iter().map(|d| format!("  {d}")))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
            }
            Change::Delete { revision } => {
                let done = if args.dry_run {
                    Ok(())
                } else {
                    delete(&client, name, *revision)
                };
                done.map(|()| {
                    format!(
                        "{name}: {}deleted (--prune: not in the file)",
                        if args.dry_run { "would be " } else { "" }
                    )
                })
            }
        };
        match outcome {
            Ok(line) => println!("{line}"),
            Err(err) => {
                failures += 1;
                eprintln!("{name}: {err:#}");
            }
        }
    }
    if failures > 0 {
        bail!("{failures} of {} VMs not applied", plan.len());
    }
    Ok(())
}

fn read_source(file: &std::path::Path) -> anyhow::Result<String> {
    if file.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading stdin")?;
        return Ok(text);
    }
    std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
}

/// The VMs `text` describes, in order; a name given twice is refused.
pub fn parse(text: &str) -> anyhow::Result<Vec<Wanted>> {
    let mut wanted: Vec<Wanted> = Vec::new();
    for (doc_index, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .with_context(|| format!("document {}: not YAML or JSON", doc_index + 1))?;
        let mut vms = Vec::new();
        collect(&value, &format!("document {}", doc_index + 1), &mut vms)?;
        for vm in vms {
            if wanted.iter().any(|w| w.name == vm.name) {
                bail!("VM {} is described twice [field: name]", vm.name);
            }
            wanted.push(vm);
        }
    }
    if wanted.is_empty() {
        bail!("no VM described (expected a VM, a list of VMs or an `items` list)");
    }
    Ok(wanted)
}

/// The VMs of one value: a list, an `items` list (`vm list -o yaml`), a
/// `vm` with its `revision` (`vm get -o yaml`), or a VM.
fn collect(value: &Value, at: &str, out: &mut Vec<Wanted>) -> anyhow::Result<()> {
    match value {
        Value::Null => Ok(()),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                collect(item, &format!("{at}[{i}]"), out)?;
            }
            Ok(())
        }
        Value::Object(map) if map.contains_key("items") => {
            only_fields(map, &["items", "revision", "continue"], at)?;
            collect(&map["items"], &format!("{at}.items"), out)
        }
        Value::Object(map) if map.contains_key("vm") => {
            only_fields(map, &["vm", "revision"], at)?;
            collect(&map["vm"], &format!("{at}.vm"), out)
        }
        Value::Object(map) => {
            // What the server keeps (and `vm get` prints) is not the user's
            // to set: ignored, so its output applies unchanged.
            only_fields(
                map,
                &[
                    "name",
                    "spec",
                    "uid",
                    "generation",
                    "status",
                    "power_intent",
                    "deletion_requested_at",
                    "restore",
                    "migrate",
                    "reboot_generation",
                ],
                at,
            )?;
            let (Some(name), Some(spec)) = (map.get("name"), map.get("spec")) else {
                bail!("{at}: a VM needs `name` and `spec` [field: {at}]");
            };
            let body = serde_json::to_vec(&serde_json::json!({"name": name, "spec": spec}))?;
            let req: CreateVmRequest = crate::api::parse_json(&body).map_err(|e| {
                let field = e.field().unwrap_or("spec");
                anyhow::anyhow!(
                    "{at}: {} [field: {field}]",
                    e.message().replace("invalid JSON body: ", "")
                )
            })?;
            out.push(Wanted {
                name: req.name,
                spec: req.spec,
            });
            Ok(())
        }
        other => bail!("{at}: expected a VM (an object with name and spec), found {other}"),
    }
}

fn only_fields(
    map: &serde_json::Map<String, Value>,
    known: &[&str],
    at: &str,
) -> anyhow::Result<()> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(unknown) => bail!(
            "{at}: unknown field `{unknown}`, expected one of {} [field: {unknown}]",
            known.join(", ")
        ),
        None => Ok(()),
    }
}

/// What to do for each VM, by name: the file's VMs, and with `prune` the
/// server's VMs the file does not name (those already being deleted are
/// left alone).
pub fn plan(wanted: &[Wanted], current: &[VmResponse], prune: bool) -> Vec<(String, Change)> {
    let by_name: BTreeMap<&str, &VmResponse> =
        current.iter().map(|r| (r.vm.name.as_str(), r)).collect();
    let mut plan: Vec<(String, Change)> = wanted
        .iter()
        .map(|w| {
            let change = match by_name.get(w.name.as_str()) {
                None => Change::Create,
                Some(now) => {
                    let diff = diff(&now.vm.spec, &as_stored(&w.spec, &now.vm));
                    if diff.is_empty() {
                        Change::Unchanged
                    } else {
                        Change::Update {
                            revision: now.revision,
                            diff,
                        }
                    }
                }
            };
            (w.name.clone(), change)
        })
        .collect();
    if prune {
        let named: BTreeSet<&str> = wanted.iter().map(|w| w.name.as_str()).collect();
        for r in current {
            if !named.contains(r.vm.name.as_str()) && r.vm.deletion_requested_at.is_none() {
                plan.push((
                    r.vm.name.clone(),
                    Change::Delete {
                        revision: r.revision,
                    },
                ));
            }
        }
    }
    plan
}

/// The spec the server would store for `wanted` over `vm` (what
/// `VirtualMachine::replace_spec` keeps of the old one: its MAC, its
/// cloud-init instance-id, its restart count, and the size it gave a disk
/// made from an image whose size the file leaves out).
fn as_stored(wanted: &VmSpec, vm: &VirtualMachine) -> VmSpec {
    let mut spec = wanted.clone();
    spec.restart_generation = spec.restart_generation.max(vm.spec.restart_generation);
    spec.inherit_identity(&vm.spec, vm.mac());
    for disk in spec.disks.iter_mut().filter(|d| d.size_mib == 0) {
        if let Some(old) = vm
            .spec
            .disks
            .iter()
            .find(|o| o.name == disk.name && o.image == disk.image)
        {
            disk.size_mib = old.size_mib;
        }
    }
    spec
}

/// The fields of `after` that differ from `before`, as `spec.PATH: old ->
/// new` lines (a field only one side has shows `-` on the other).
pub fn diff(before: &VmSpec, after: &VmSpec) -> Vec<String> {
    let (mut old, mut new) = (BTreeMap::new(), BTreeMap::new());
    flatten(
        &serde_json::to_value(before).unwrap_or(Value::Null),
        "spec",
        &mut old,
    );
    flatten(
        &serde_json::to_value(after).unwrap_or(Value::Null),
        "spec",
        &mut new,
    );
    let paths: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    paths
        .into_iter()
        .filter(|p| old.get(*p) != new.get(*p))
        .map(|p| {
            let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "-".into());
            format!("{p}: {} -> {}", show(old.get(p)), show(new.get(p)))
        })
        .collect()
}

fn flatten(value: &Value, path: &str, out: &mut BTreeMap<String, String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                flatten(v, &format!("{path}.{k}"), out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, v) in items.iter().enumerate() {
                flatten(v, &format!("{path}[{i}]"), out);
            }
        }
        Value::Null => {}
        other => {
            out.insert(path.to_string(), other.to_string());
        }
    }
}

fn create(client: &Client, name: &str, spec: &VmSpec) -> anyhow::Result<()> {
    let req = CreateVmRequest {
        name: name.to_string(),
        spec: spec.clone(),
    };
    let _: VmResponse = client.call(Method::POST, "/api/v1/vms", Some(&req))?;
    Ok(())
}

fn update(client: &Client, name: &str, spec: &VmSpec, revision: u64) -> anyhow::Result<()> {
    let req = ReplaceSpecRequest {
        spec: spec.clone(),
        revision: Some(revision),
    };
    let path = format!("/api/v1/vms/{}/spec", encode(name));
    match client.call::<VmResponse, _>(Method::PUT, &path, Some(&req)) {
        Ok(_) => Ok(()),
        Err(e) if is_conflict(&e) => Err(e.context(format!(
            "conflict: changed since it was read at revision {revision}; not overwritten, apply again"
        ))),
        Err(e) => Err(e),
    }
}

fn delete(client: &Client, name: &str, revision: u64) -> anyhow::Result<()> {
    let path = format!("/api/v1/vms/{}?revision={revision}", encode(name));
    match client.call::<VmResponse, _>(Method::DELETE, &path, None::<&()>) {
        Ok(_) => Ok(()),
        Err(e) if is_conflict(&e) => Err(e.context(format!(
            "conflict: changed since it was read at revision {revision}; not deleted"
        ))),
        Err(e) => Err(e),
    }
}

fn is_conflict(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ApiFailure>()
        .is_some_and(|f| f.status == 409)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_refused_naming_them() {
        let err = parse("name: web\nspec: {cpus: 1, memory_mib: 64, colour: red}\n").unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("[field: spec.colour]"), "{text}");
        let err = parse("name: web\nsize: 3\nspec: {cpus: 1, memory_mib: 64}\n").unwrap_err();
        assert!(format!("{err:#}").contains("[field: size]"), "{err:#}");
        let err = parse("- name: a\n  spec: {cpus: 1, memory_mib: 64}\n- name: a\n  spec: {cpus: 2, memory_mib: 64}\n")
            .unwrap_err();
        assert!(format!("{err:#}").contains("described twice"), "{err:#}");
    }

    #[test]
    fn one_vm_lists_documents_and_json_parse_alike() {
        let yaml = "name: a\nspec: {cpus: 1, memory_mib: 64}\n---\n- name: b\n  spec: {cpus: 2, memory_mib: 128}\n";
        let names: Vec<String> = parse(yaml).unwrap().into_iter().map(|w| w.name).collect();
        assert_eq!(names, ["a", "b"]);
        let json = r#"{"items": [{"revision": 4, "vm": {"name": "c", "uid": "u", "spec": {"cpus": 1, "memory_mib": 64}, "status": {"phase": "Running"}}}], "revision": 9}"#;
        assert_eq!(parse(json).unwrap()[0].name, "c");
    }
}
