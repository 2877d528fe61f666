//! Addresses of URLs whose host is an IP address, without a lookup.
//!
//! ureq's default resolver runs every lookup on a thread of its own when
//! a timeout applies (so that it can give up on a slow DNS server), and it
//! resolves at every request, before looking for a pooled connection. The
//! clients here have timeouts and mostly talk to `https://127.0.0.1:PORT`,
//! so every request created and tore down a thread only to parse an
//! address: in `keel bench scale` that was a visible share of the client's
//! CPU, on the very cores the servers it measures run on. An IP literal
//! needs no lookup; any other host still goes to the default resolver.

use std::net::{IpAddr, SocketAddr};

use ureq::config::Config;
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

#[derive(Debug, Default)]
pub struct LiteralResolver {
    names: DefaultResolver,
}

impl Resolver for LiteralResolver {
    fn resolve(
        &self,
        uri: &Uri,
        config: &Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        match literal_address(uri) {
            Some(address) => {
                let mut addresses = self.empty();
                addresses.push(address);
                Ok(addresses)
            }
            None => self.names.resolve(uri, config, timeout),
        }
    }
}

/// The socket address of `uri` if its host is an IP address (IPv6 in
/// brackets), with the scheme's default port if it names none.
fn literal_address(uri: &Uri) -> Option<SocketAddr> {
    let host = uri.host()?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ip: IpAddr = host.parse().ok()?;
    let port = uri.port_u16().or_else(|| match uri.scheme_str()? {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    })?;
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(url: &str) -> Option<SocketAddr> {
        literal_address(&url.parse().unwrap())
    }

    #[test]
    fn ip_hosts_are_their_own_address() {
        for (url, want) in [
            ("https://127.0.0.1:7443/api/v1/vms", "127.0.0.1:7443"),
            ("https://[::1]:7443/", "[::1]:7443"),
            ("https://10.0.0.5/", "10.0.0.5:443"),
            ("http://10.0.0.5/", "10.0.0.5:80"),
        ] {
            assert_eq!(address(url), Some(want.parse().unwrap()), "{url}");
        }
    }

    #[test]
    fn names_are_left_to_the_default_resolver() {
        assert_eq!(address("https://localhost:7443/"), None);
        assert_eq!(address("https://keel.example.org/"), None);
    }

    #[test]
    fn a_literal_resolves_without_a_lookup_and_a_name_still_resolves() {
        let config = ureq::Agent::config_builder().build();
        let resolver = LiteralResolver::default();
        let uri: Uri = "https://127.0.0.1:7443/x".parse().unwrap();
        let got = resolver
            .resolve(&uri, &config, NextTimeout::default())
            .unwrap();
        let got: Vec<SocketAddr> = got.iter().copied().collect();
        assert_eq!(got, ["127.0.0.1:7443".parse().unwrap()]);
        let uri: Uri = "https://localhost:7443/x".parse().unwrap();
        let got = resolver
            .resolve(&uri, &config, NextTimeout::default())
            .unwrap();
        assert!(got.iter().all(|a| a.ip().is_loopback() && a.port() == 7443));
    }
}
