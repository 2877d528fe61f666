//! Listing domains so that one stuck domain holds up no other: the instance
//! directories say which domains exist, each one's state is read on its own
//! (several at once, each bounded by the QMP timeout), and a domain whose
//! state cannot be read is listed as unknown, with its reason. The domains
//! of one VM are found by name (`<vm>-…`, see [`crate::instance_prefix`]),
//! so looking at them asks no other VM's QEMU anything.

use std::io;

use futures_util::stream::{self, StreamExt};
use keel_api::validate_name;

use super::QemuDriver;
use crate::{instance_prefix, Cause, DomainInfo, DomainListing, HvError, UnknownDomain};

/// How many domains' states are read at once: each read may wait for a
/// QMP answer (up to the QMP timeout), so a hung one costs one slot, not
/// everyone's turn.
const LOOKS_AT_ONCE: usize = 16;

impl QemuDriver {
    /// Every domain of the node, each on its own.
    pub(super) async fn list_domains(&self) -> Result<DomainListing, HvError> {
        let names = self.instance_names(None).await?;
        let looks: Vec<_> = stream::iter(names)
            .map(|name| self.look(name, None))
            .buffered(LOOKS_AT_ONCE)
            .collect()
            .await;
        let mut listing = DomainListing::default();
        for look in looks {
            match look {
                Ok(Some(info)) => listing.domains.push(info),
                Ok(None) => {}
                Err(unknown) => listing.unknown.push(unknown),
            }
        }
        Ok(listing)
    }

    /// The domains of `vm` only; fails if one of them (or one that may be
    /// one of them) cannot be read.
    pub(super) async fn domains_of_vm(&self, vm: &str) -> Result<Vec<DomainInfo>, HvError> {
        if validate_name("vm", vm).is_err() {
            // `start` refuses such a VM name: none was ever started.
            return Ok(Vec::new());
        }
        let names = self.instance_names(Some(instance_prefix(vm))).await?;
        let looks: Vec<_> = stream::iter(names)
            .map(|name| self.look(name, Some(vm.to_string())))
            .buffered(LOOKS_AT_ONCE)
            .collect()
            .await;
        let mut domains = Vec::new();
        for look in looks {
            match look {
                Ok(Some(info)) => domains.push(info),
                Ok(None) => {}
                // Another VM whose name extends this one's ("web-1" of "web").
                Err(unknown) if unknown.vm.as_deref().is_some_and(|v| v != vm) => {}
                Err(unknown) => return Err(unknown.error),
            }
        }
        Ok(domains)
    }

    /// One domain's state. `Ok(None)`: it is not there (cleaned up since
    /// the directory was read), or, with `only_vm`, it runs another VM and
    /// was not asked anything.
    // Owned arguments: the futures are polled together (`buffered`), and
    // borrowed ones trip the `Send` bound of the trait's futures.
    async fn look(
        &self,
        instance: String,
        only_vm: Option<String>,
    ) -> Result<Option<DomainInfo>, UnknownDomain> {
        let instance = instance.as_str();
        let unknown = |vm: Option<String>, error: HvError, fenced: bool| UnknownDomain {
            instance: instance.to_string(),
            vm,
            error,
            fenced,
        };
        let domain = match self.existing(instance, "list") {
            Ok(domain) => domain,
            Err(HvError::NotFound { .. }) => return Ok(None),
            Err(error) => {
                let known = self.lock().get(instance).map(|d| (d.vm.clone(), d.fenced));
                let fenced = known.as_ref().is_none_or(|(_, fenced)| *fenced);
                return Err(unknown(known.map(|(vm, _)| vm), error, fenced));
            }
        };
        if only_vm.is_some_and(|vm| vm != domain.vm) {
            return Ok(None);
        }
        match domain.state().await {
            Ok(state) => Ok(Some(self.info_of(&domain, state))),
            Err(error) => Err(unknown(Some(domain.vm.clone()), error, domain.fenced)),
        }
    }

    /// The instance directories' names (sorted), only those starting with
    /// `prefix` if given. Read off the async threads: a slow disk delays
    /// this listing only.
    async fn instance_names(&self, prefix: Option<String>) -> Result<Vec<String>, HvError> {
        let dir = self.inner.layout.instances_dir();
        let unavailable = |reason: String, cause: Cause| HvError::Unavailable {
            instance: format!("{}*", prefix.as_deref().unwrap_or("")),
            op: "list",
            reason,
            source: Some(cause),
        };
        let wanted = prefix.clone();
        let read = tokio::task::spawn_blocking(move || -> io::Result<Vec<String>> {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(&dir)? {
                // An entry that cannot be read may be a domain: the listing
                // fails rather than leave it out.
                let name = entry?.file_name().to_string_lossy().into_owned();
                let wanted = wanted.as_deref().is_none_or(|p| name.starts_with(p));
                // Not an instance: `.staging-…` of a start under way, strays.
                if wanted && validate_name("instance", &name).is_ok() {
                    names.push(name);
                }
            }
            names.sort();
            Ok(names)
        })
        .await;
        let dir = self.inner.layout.instances_dir();
        match read {
            Ok(Ok(names)) => Ok(names),
            Ok(Err(e)) => Err(unavailable(dir.display().to_string(), Cause::new(e))),
            Err(e) => Err(unavailable(
                format!("{}: read task failed", dir.display()),
                Cause::new(e),
            )),
        }
    }
}
