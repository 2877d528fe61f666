//! Who may call what: every route of the API with the role it needs
//! (admin ⊇ operator ⊇ viewer), checked by the API's door
//! (`require_token`) before any handler runs.
//!
//! - viewer: reads (VMs, snapshots, images, nodes, events, migrations,
//!   metrics, this document);
//! - operator: powers VMs (start, stop, restart, reboot), takes
//!   snapshots, live-migrates, and the console and its log (the console
//!   is interactive power over the guest, its log that session's text);
//! - admin: what creates, changes or destroys: VMs (create, clone, spec, disks, delete,
//!   import; and export, which carries all of a VM's data away),
//!   restoring and deleting snapshots (both discard disk contents), images,
//!   nodes (cordon, uncordon, drain, freeze), tokens.
//!
//! A route missing here needs admin (the safe default), and the tests
//! hold this table, the OpenAPI document and the router to each other, so
//! a new route without a role fails them.

use axum::http::Method;
use keel_api::Role;

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token (liveness only).
    Open,
    /// A token of at least this role.
    Needs(Role),
}

use Access::{Needs, Open};
use Role::{Admin, Operator, Viewer};

/// `(method, route as routed, access)`.
pub const ROUTE_ROLES: &[(&str, &str, Access)] = &[
    ("GET", "/healthz", Open),
    ("GET", "/metrics", Needs(Viewer)),
    ("GET", "/api/v1/openapi.json", Needs(Viewer)),
    ("GET", "/api/v1/vms", Needs(Viewer)),
    ("POST", "/api/v1/vms", Needs(Admin)),
    ("GET", "/api/v1/vms/{name}", Needs(Viewer)),
    ("GET", "/api/v1/vm-stats", Needs(Viewer)),
    ("DELETE", "/api/v1/vms/{name}", Needs(Admin)),
    ("PUT", "/api/v1/vms/{name}/spec", Needs(Admin)),
    ("POST", "/api/v1/vms/{name}/start", Needs(Operator)),
    ("POST", "/api/v1/vms/{name}/stop", Needs(Operator)),
    ("POST", "/api/v1/vms/{name}/restart", Needs(Operator)),
    ("POST", "/api/v1/vms/{name}/reboot", Needs(Operator)),
    ("POST", "/api/v1/vms/{name}/disks", Needs(Admin)),
    ("DELETE", "/api/v1/vms/{name}/disks/{disk}", Needs(Admin)),
    (
        "POST",
        "/api/v1/vms/{name}/disks/{disk}/resize",
        Needs(Admin),
    ),
    ("POST", "/api/v1/vms/{name}/restore", Needs(Admin)),
    ("POST", "/api/v1/vms/{name}/clone", Needs(Admin)),
    // An export carries all of the VM's data off the cluster; an import
    // creates a VM.
    ("GET", "/api/v1/vms/{name}/export", Needs(Admin)),
    ("PUT", "/api/v1/vms/{name}/import", Needs(Admin)),
    ("POST", "/api/v1/vms/{name}/migrate", Needs(Operator)),
    ("GET", "/api/v1/vms/{name}/console", Needs(Operator)),
    ("GET", "/api/v1/vms/{name}/console/log", Needs(Operator)),
    ("GET", "/api/v1/vms/{name}/vnc", Needs(Operator)),
    ("GET", "/api/v1/vms/{name}/snapshots", Needs(Viewer)),
    ("POST", "/api/v1/vms/{name}/snapshots", Needs(Operator)),
    ("GET", "/api/v1/vms/{name}/snapshots/{snap}", Needs(Viewer)),
    (
        "DELETE",
        "/api/v1/vms/{name}/snapshots/{snap}",
        Needs(Admin),
    ),
    ("GET", "/api/v1/images", Needs(Viewer)),
    ("GET", "/api/v1/images/{name}", Needs(Viewer)),
    ("PUT", "/api/v1/images/{name}", Needs(Admin)),
    ("DELETE", "/api/v1/images/{name}", Needs(Admin)),
    ("GET", "/api/v1/images/{name}/import-url", Needs(Viewer)),
    ("POST", "/api/v1/images/{name}/import-url", Needs(Admin)),
    ("GET", "/api/v1/events", Needs(Viewer)),
    ("GET", "/api/v1/migrations", Needs(Viewer)),
    ("GET", "/api/v1/nodes", Needs(Viewer)),
    ("GET", "/api/v1/nodes/{name}", Needs(Viewer)),
    ("POST", "/api/v1/nodes/{name}/cordon", Needs(Admin)),
    ("POST", "/api/v1/nodes/{name}/uncordon", Needs(Admin)),
    ("POST", "/api/v1/nodes/{name}/drain", Needs(Admin)),
    ("POST", "/api/v1/nodes/{name}/freeze", Needs(Admin)),
    ("POST", "/api/v1/nodes/{name}/labels", Needs(Admin)),
    ("GET", "/api/v1/tokens", Needs(Admin)),
    ("POST", "/api/v1/tokens", Needs(Admin)),
    ("DELETE", "/api/v1/tokens/{id}", Needs(Admin)),
    ("GET", "/api/v1/whoami", Needs(Viewer)),
];

/// What a request needs: its route's row; a method or path the table
/// does not have needs admin (the router then answers 404 or 405, and a
/// route someone forgot to add here is closed rather than open).
pub fn access_for(method: &Method, path: &str) -> Access {
    // HEAD is answered by the GET route.
    let method = if method == Method::HEAD {
        "GET"
    } else {
        method.as_str()
    };
    ROUTE_ROLES
        .iter()
        .find(|(m, route, _)| *m == method && matches(route, path))
        .map_or(Needs(Admin), |(_, _, access)| *access)
}

/// Whether `path` is an instance of `route` (`{…}` matches one segment).
pub fn matches(route: &str, path: &str) -> bool {
    let mut r = route.split('/');
    let mut p = path.split('/');
    loop {
        match (r.next(), p.next()) {
            (None, None) => return true,
            (Some(rs), Some(ps)) => {
                let param = rs.starts_with('{') && rs.ends_with('}');
                if !(param && !ps.is_empty() || rs == ps) {
                    return false;
                }
            }
            _ => return false,
        }
    }
}

/// Whether a request with `method` changes something (and is audited).
pub fn is_mutating(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn table() -> BTreeSet<(String, String)> {
        ROUTE_ROLES
            .iter()
            .map(|(m, r, _)| (m.to_string(), r.to_string()))
            .collect()
    }

    /// Every (method, path) of the OpenAPI document has a row, and every
    /// row is documented.
    #[test]
    fn the_table_and_the_openapi_document_list_the_same_routes() {
        let doc = crate::api::openapi::spec();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                    documented.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        let table = table();
        let missing: Vec<_> = documented.difference(&table).collect();
        assert!(
            missing.is_empty(),
            "documented routes without a role: {missing:?}"
        );
        let undocumented: Vec<_> = table.difference(&documented).collect();
        assert!(
            undocumented.is_empty(),
            "rows for undocumented routes: {undocumented:?}"
        );
    }

    /// Every route the routers serve (read from their source, where a
    /// new route is added) has a row.
    #[test]
    fn every_routed_endpoint_has_a_role() {
        let table = table();
        for (file, source) in [
            ("api/mod.rs", include_str!("mod.rs")),
            ("agent_console.rs", include_str!("../agent_console.rs")),
        ] {
            let routes = routes_in(source);
            assert!(routes.len() >= 2, "no routes found in {file}");
            for (method, path) in routes {
                assert!(
                    table.contains(&(method.clone(), path.clone())),
                    "{file} routes {method} {path}, which has no role in api/roles.rs ROUTE_ROLES"
                );
            }
        }
    }

    /// `(METHOD, path)` of each `.route("path", get(..).post(..))`.
    fn routes_in(source: &str) -> Vec<(String, String)> {
        let mut found = Vec::new();
        for chunk in source.split(".route(").skip(1) {
            let Some(path) = chunk.split('"').nth(1) else {
                continue;
            };
            // The route's methods are named before the next route, the
            // router's fallback or the end of the function.
            let body = chunk.split(".fallback(").next().unwrap_or(chunk);
            let body = body.split("\n}").next().unwrap_or(body);
            for method in ["get", "post", "put", "delete", "patch"] {
                if names_method(body, method) {
                    found.push((method.to_uppercase(), path.to_string()));
                }
            }
        }
        found
    }

    /// Whether `body` calls the method router `method(` (not `x_get(` or `a::get(`).
    fn names_method(body: &str, method: &str) -> bool {
        body.match_indices(&format!("{method}(")).any(|(i, _)| {
            i == 0 || {
                let before = body.as_bytes()[i - 1];
                !(before.is_ascii_alphanumeric() || before == b'_' || before == b':')
            }
        })
    }

    #[test]
    fn paths_match_their_routes() {
        assert!(matches("/api/v1/vms/{name}", "/api/v1/vms/web"));
        assert!(!matches("/api/v1/vms/{name}", "/api/v1/vms/"));
        assert!(!matches("/api/v1/vms/{name}", "/api/v1/vms/web/start"));
        assert_eq!(
            access_for(&Method::POST, "/api/v1/vms/web/start"),
            Needs(Operator)
        );
        assert_eq!(access_for(&Method::HEAD, "/api/v1/vms"), Needs(Viewer));
        assert_eq!(access_for(&Method::GET, "/healthz"), Open);
        // Not in the table: admin only.
        assert_eq!(access_for(&Method::POST, "/healthz"), Needs(Admin));
        assert_eq!(access_for(&Method::GET, "/api/v1/nope"), Needs(Admin));
        assert_eq!(access_for(&Method::POST, "/api/v1/vms"), Needs(Admin));
    }
}
