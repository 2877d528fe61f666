//! Scoped API tokens against a real in-process server: roles from the
//! OpenAPI document, revocation, expiry, the audit trail, the token file
//! of an old data dir, no secret in the store, the per-token rate.

mod common;

use common::TestServer;
use serde_json::{json, Value};

/// A token made through the API by the server's admin token: its secret.
fn create_token(server: &TestServer, name: &str, role: &str) -> (String, String) {
    let r = server.send(
        "POST",
        "/api/v1/tokens",
        &json!({"name": name, "role": role}).to_string(),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let v = r.json();
    (
        v["token"]["id"].as_str().unwrap().to_string(),
        v["secret"].as_str().unwrap().to_string(),
    )
}

/// Every (METHOD, path) of the OpenAPI document but GET, with the
/// parameters filled in.
fn mutating_routes(server: &TestServer) -> Vec<(String, String)> {
    let doc = server.get("/api/v1/openapi.json").json();
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["post", "put", "delete", "patch"].contains(&method.as_str()) {
                let path = path
                    .replace("{name}", "web")
                    .replace("{snap}", "s1")
                    .replace("{disk}", "data")
                    .replace("{id}", "nope");
                routes.push((method.to_uppercase(), path));
            }
        }
    }
    assert!(routes.len() >= 15, "{routes:?}");
    routes
}

fn status(server: &TestServer, method: &str, path: &str, token: &str) -> (u16, String) {
    let r = server.request(method, path, Some(token), Some(b"{}"), &[]);
    (r.status, r.text)
}

/// A viewer is refused every mutating route of the OpenAPI document, an
/// operator the admin ones but not the power verbs, and each of these
/// requests is in the audit trail under its token's name, with resource
/// and outcome; `?actor=` picks one token's requests.
#[test]
fn roles_gate_every_mutating_route_and_each_request_is_audited() {
    let server = TestServer::start();
    let (_, viewer) = create_token(&server, "alice", "viewer");
    let (_, operator) = create_token(&server, "bob", "operator");
    let routes = mutating_routes(&server);
    for (method, path) in &routes {
        let (code, text) = status(&server, method, path, &viewer);
        assert_eq!(code, 403, "viewer {method} {path}: {text}");
        assert!(text.contains("needs"), "{text}");
    }
    assert_eq!(status(&server, "GET", "/api/v1/vms", &viewer).0, 200);
    for verb in ["start", "stop", "restart", "reboot"] {
        let (code, text) = status(
            &server,
            "POST",
            &format!("/api/v1/vms/web/{verb}"),
            &operator,
        );
        assert_ne!(code, 403, "operator may {verb}: {text}");
    }
    for (method, path) in [
        ("POST", "/api/v1/vms"),
        ("DELETE", "/api/v1/vms/web"),
        ("PUT", "/api/v1/images/web"),
        ("POST", "/api/v1/nodes/web/drain"),
        ("POST", "/api/v1/tokens"),
    ] {
        let (code, text) = status(&server, method, path, &operator);
        assert_eq!(code, 403, "operator {method} {path}: {text}");
    }

    let trail = server.get("/api/v1/events?actor=alice").json();
    let items = trail["items"].as_array().unwrap();
    assert_eq!(items.len(), routes.len(), "{trail}");
    let stop = items
        .iter()
        .find(|i| i["audit"]["path"] == "/api/v1/vms/web/stop")
        .unwrap_or_else(|| panic!("no audit of the stop: {trail}"));
    assert_eq!(stop["audit"]["actor"], "alice");
    assert_eq!(stop["audit"]["resource"], "vm/web");
    assert_eq!(stop["audit"]["method"], "POST");
    assert_eq!(stop["audit"]["status"], 403);
    let bobs = server.get("/api/v1/events?actor=bob").json();
    assert!(bobs["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["audit"]["actor"] == "bob"));
    assert!(!bobs["items"].as_array().unwrap().is_empty());
}

/// A VM's create and its audit event are one store write: the event is
/// at the VM's revision, says 201, and is the request's only one; a
/// refused create is still audited by the door, with its status.
#[test]
fn a_vm_create_and_its_audit_event_are_one_write() {
    let server = TestServer::start();
    let (_, admin) = create_token(&server, "carol", "admin");
    let body = json!({"name": "web", "spec": common::small_spec()}).to_string();
    let create = || {
        server.request(
            "POST",
            "/api/v1/vms",
            Some(&admin),
            Some(body.as_bytes()),
            &[],
        )
    };
    let r = create();
    assert_eq!(r.status, 201, "{}", r.text);
    let revision = r.json()["revision"].as_u64().unwrap();
    let again = create();
    assert_eq!(again.status, 409, "{}", again.text);
    let trail = server.get("/api/v1/events?actor=carol").json();
    let creates: Vec<&Value> = trail["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["audit"]["path"] == "/api/v1/vms")
        .collect();
    assert_eq!(creates.len(), 2, "one audit event per request: {trail}");
    assert_eq!(creates[0]["audit"]["status"], 201, "{trail}");
    assert_eq!(
        creates[0]["revision"], revision,
        "the audit event is written with the VM: {trail}"
    );
    assert_eq!(creates[1]["audit"]["status"], 409, "{trail}");
}

/// A revoked token is refused at once; an expired one with "token
/// expired"; the token file (an old data dir's only token) is an admin
/// token; the store holds no secret.
#[test]
fn revoked_and_expired_tokens_are_refused_and_no_secret_is_stored() {
    let server = TestServer::start();
    let (id, ci) = create_token(&server, "ci", "viewer");
    assert_eq!(status(&server, "GET", "/api/v1/vms", &ci).0, 200);
    let r = server.send("DELETE", &format!("/api/v1/tokens/{id}"), "");
    assert_eq!(r.status, 200, "{}", r.text);
    let (code, text) = status(&server, "GET", "/api/v1/vms", &ci);
    assert_eq!(code, 401, "{text}");
    assert!(text.contains("token revoked"), "{text}");

    let secret = "an-expired-secret";
    server.put_raw(
        "/tokens/old",
        &json!({
            "id": "old", "name": "old", "role": "admin", "created": 1,
            "expires": 2, "hash": keel::token_book::hash_secret(secret),
        }),
    );
    let (code, text) = status(&server, "GET", "/api/v1/vms", &format!("keel_old_{secret}"));
    assert_eq!(code, 401, "{text}");
    assert!(text.contains("token expired"), "{text}");

    // The token file's bare secret is an admin token.
    let list = server.get("/api/v1/tokens").json();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("token-file-")),
        "{names:?}"
    );
    for entry in server.raw_entries("/") {
        let text = String::from_utf8_lossy(&entry.value);
        assert!(
            !text.contains(&server.token) && !text.contains(ci.rsplit('_').next().unwrap()),
            "{} holds a secret: {text}",
            entry.key
        );
    }
    let _: Value = list;
}

/// Beyond its rate a token gets 429 naming the limit.
#[test]
fn a_token_beyond_its_rate_gets_429_naming_the_limit() {
    let server = TestServer::start_with(|c| c.token_limits.requests_per_second = 2);
    let refused = (0..50)
        .map(|_| server.get("/api/v1/vms"))
        .find(|r| r.status != 200)
        .expect("the rate is bounded");
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert!(
        refused.text.contains("max-requests-per-token"),
        "{}",
        refused.text
    );
}
