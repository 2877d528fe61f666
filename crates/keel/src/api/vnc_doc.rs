//! The OpenAPI description of the graphical console (`api::vnc`): its
//! route and `spec.boot.graphics`. A file of its own because the document
//! is read by the role table that the handler's door imports, and a
//! description inside the handler's file would close that loop.

/// Adds the route and `spec.boot.graphics` to the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    use serde_json::json;
    let error = |description: &str| json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let mut responses = json!({"101": {"description": "Switching to the WebSocket (subprotocol binary when asked)"}});
    for (code, why) in [
        ("400", "Not a WebSocket upgrade (`upgrade`)"),
        ("401", "Missing, wrong, expired or revoked bearer token"),
        ("403", "The token's role is not operator or admin"),
        ("404", "No such VM"),
        ("409", "No graphical console (`spec.boot.graphics`), no instance, or the instance has none (`status.instance`)"),
        ("429", "The token's console sessions are all in use"),
        ("501", "The VM runs on another node whose agent serves no consoles (`status.instance.node`)"),
        ("502", "The agent of the VM's node did not answer"),
        ("503", "Store unavailable"),
    ] {
        responses[code] = error(why);
    }
    doc["paths"]["/api/v1/vms/{name}/vnc"] = json!({"get": {
        "summary": "Attach to the graphical console (spec.boot.graphics vnc): a WebSocket carrying the raw RFB stream of the instance's VNC server in binary messages, as websockify does for noVNC; counts as a console session of the token; for a VM on another node passed on to that node's agent like the serial console. Browsers, which cannot set Authorization on a WebSocket, may instead offer the subprotocols `binary` and `keel.bearer.<token>` (the web console's Screen does); the server then selects `binary`",
        "operationId": "attachVnc",
        "parameters": [{"name": "name", "in": "path", "required": true, "schema": {"$ref": "#/components/schemas/Name"}}],
        "responses": responses
    }});
}
