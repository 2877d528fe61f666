//! A bearer token carried by a WebSocket's subprotocol list, for
//! browsers: their WebSocket API cannot set `Authorization`, and a token
//! in the URL would end up in logs and history. The web console opens the
//! console with the subprotocols `keel.console` and `keel.bearer.<token>`
//! (the way Kubernetes' API server takes a browser's token); the server
//! answers with `keel.console` alone, so the token is never sent back.
//! Only GET requests asking for a WebSocket upgrade are read this way;
//! every other request still needs the `Authorization` header.

use axum::http::{header, HeaderMap, Method};

/// The subprotocol a browser's console session asks for and gets.
pub const CONSOLE_PROTOCOL: &str = "keel.console";
/// The subprotocol that carries the token (`keel.bearer.<token>`); never
/// selected by the server.
pub const BEARER_PROTOCOL_PREFIX: &str = "keel.bearer.";

/// The token offered in `Sec-WebSocket-Protocol` of a GET that asks for
/// a WebSocket upgrade, if any.
pub fn subprotocol_token<'a>(method: &Method, headers: &'a HeaderMap) -> Option<&'a str> {
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if method != Method::GET || !upgrade {
        return None;
    }
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(BEARER_PROTOCOL_PREFIX))
        .filter(|t| !t.is_empty())
}

/// Says so in the console's entry of the OpenAPI document.
pub fn describe(doc: &mut serde_json::Value) {
    doc["paths"]["/api/v1/vms/{name}/console"]["get"]["description"] = serde_json::Value::from(
        "Browsers, which cannot set Authorization on a WebSocket, may instead offer the \
         subprotocols `keel.console` and `keel.bearer.<token>`; the server then selects \
         `keel.console`.",
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn only_a_websocket_upgrade_carries_a_token() {
        let ws = headers(&[
            ("upgrade", "websocket"),
            (
                "sec-websocket-protocol",
                "keel.console, keel.bearer.keel_ab_cd",
            ),
        ]);
        assert_eq!(subprotocol_token(&Method::GET, &ws), Some("keel_ab_cd"));
        assert_eq!(subprotocol_token(&Method::POST, &ws), None);
        let plain = headers(&[("sec-websocket-protocol", "keel.bearer.keel_ab_cd")]);
        assert_eq!(subprotocol_token(&Method::GET, &plain), None);
        let empty = headers(&[
            ("upgrade", "websocket"),
            ("sec-websocket-protocol", "keel.console, keel.bearer."),
        ]);
        assert_eq!(subprotocol_token(&Method::GET, &empty), None);
    }
}
