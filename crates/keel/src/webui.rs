//! The web console: a page and its assets, served by `keel serve` on the
//! API's own port (same TLS), embedded in the binary so that nothing is
//! fetched from anywhere else. The files hold no data and need no token;
//! everything the page shows comes from the API, with the token the user
//! signs in with, kept in the tab's `sessionStorage`.
//!
//! Plain HTML, CSS and JavaScript modules (`crates/keel/web/`), no
//! bundler: the only browser dependencies are xterm.js for the serial
//! console and noVNC for the graphical one, installed from npm with their
//! lockfile by `scripts/setup` (`npm ci` in `crates/keel/web`); `build.rs`
//! says so when they are missing.

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// One file of the console: where it is served, what it is.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../web/index.html"),
    },
    Asset {
        path: "/ui/app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/app.js"),
    },
    Asset {
        path: "/ui/style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../web/style.css"),
    },
    Asset {
        path: "/ui/xterm.mjs",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../web/node_modules/@xterm/xterm/lib/xterm.mjs"),
    },
    Asset {
        path: "/ui/xterm.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../web/node_modules/@xterm/xterm/css/xterm.css"),
    },
];

/// noVNC's ES modules (`core/`, `vendor/pako/`) under `/ui/novnc/`, as
/// they lie in its npm package, so that their relative imports resolve;
/// the table is written by `build.rs`.
const NOVNC_MODULES: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/novnc_assets.rs"));

/// Scripts only from this server; inline styles are allowed because
/// xterm.js sizes its rows with a style element of its own.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self'; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The routes of the console's files, merged beside the API's router
/// (outside its token check: they hold no data).
pub fn router() -> Router {
    let router = ASSETS.iter().fold(Router::new(), |router, asset| {
        router.route(
            asset.path,
            get(move || async move { serve(asset.content_type, asset.body) }),
        )
    });
    NOVNC_MODULES.iter().fold(router, |router, &(path, body)| {
        router.route(
            path,
            get(move || async move { serve("text/javascript; charset=utf-8", body) }),
        )
    })
}

/// The paths served, for the tests and the README.
pub fn paths() -> impl Iterator<Item = &'static str> {
    ASSETS
        .iter()
        .map(|a| a.path)
        .chain(NOVNC_MODULES.iter().map(|&(path, _)| path))
}

fn serve(content_type: &'static str, body: &'static [u8]) -> Response {
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        // A new binary's page is picked up at the next load.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (
            HeaderName::from_static("x-frame-options"),
            HeaderValue::from_static("DENY"),
        ),
    ];
    (headers, body).into_response()
}
