//! `keel token create NAME --role ROLE [--expires 30d] | list | revoke NAME|ID`.

use anyhow::bail;
use keel_api::{Clock, CreateTokenRequest};
use ureq::http::Method;

use super::output::{self, Table};
use super::{encode, Client};
use crate::api::tokens::{CreatedToken, TokenList, TokenResponse, TokenView};
use crate::args::{OutputFormat, TokenCommand, TokenVerb};
use crate::timefmt::{ago, rfc3339};

pub fn run(cmd: TokenCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    match cmd.verb {
        TokenVerb::Create {
            name,
            role,
            expires,
        } => {
            let req = CreateTokenRequest {
                name,
                role,
                expires_in_s: expires,
            };
            let created: CreatedToken = client.call(Method::POST, "/api/v1/tokens", Some(&req))?;
            if out == OutputFormat::Table {
                let t = &created.token;
                let until = t.expires.map_or_else(
                    || "never expires".to_string(),
                    |e| format!("expires {}", rfc3339(e)),
                );
                eprintln!(
                    "token {} (id {}, role {}, {until}); its secret, shown this once:",
                    t.name, t.id, t.role
                );
                println!("{}", created.secret);
                return Ok(());
            }
            output::print(out, &created, String::new)
        }
        TokenVerb::List => {
            let list: TokenList = client.get("/api/v1/tokens")?;
            let now = keel_api::SystemClock.now_ms();
            output::print(out, &list, || {
                let mut t = Table::new(&["NAME", "ID", "ROLE", "CREATED", "EXPIRES", "STATE"]);
                for item in &list.items {
                    t.row(vec![
                        item.name.clone(),
                        item.id.clone(),
                        item.role.to_string(),
                        ago(item.created, now),
                        item.expires.map_or_else(|| "never".into(), rfc3339),
                        item.state.clone(),
                    ]);
                }
                t.render()
            })
        }
        TokenVerb::Revoke { token } => {
            let id = resolve(&client, &token)?;
            let resp: TokenResponse = client.call(
                Method::DELETE,
                &format!("/api/v1/tokens/{}", encode(&id)),
                None::<&()>,
            )?;
            output::print(out, &resp, || {
                format!("token {} ({}) revoked\n", resp.token.name, resp.token.id)
            })
        }
        TokenVerb::InitFile { .. } => unreachable!("a host chore, dispatched by main"),
    }
}

/// The id of the token named `given` (an id, or the name of one live token).
fn resolve(client: &Client, given: &str) -> anyhow::Result<String> {
    let list: TokenList = client.get("/api/v1/tokens")?;
    if list.items.iter().any(|t| t.id == given) {
        return Ok(given.to_string());
    }
    let named: Vec<&TokenView> = list.items.iter().filter(|t| t.name == given).collect();
    let live: Vec<&&TokenView> = named.iter().filter(|t| t.state == "live").collect();
    match (live.as_slice(), named.as_slice()) {
        ([one], _) => Ok(one.id.clone()),
        ([], [one]) => Ok(one.id.clone()),
        ([], []) => bail!("token: no token named or with id {given:?} (see `keel token list`)"),
        _ => bail!(
            "token: several tokens are named {given:?}; give the id of one: {}",
            named
                .iter()
                .map(|t| t.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
