//! `keel image import|list|get|delete`; an import from a URL is
//! `image_url`'s.

use anyhow::Context;
use ureq::http::Method;

use super::image_url;
use super::output::{self, fields, Table};
use super::{encode, Client};
use crate::api::images::{ImageList, ImageResponse};
use crate::args::{ImageCommand, ImageVerb, ImportArgs};
use crate::timefmt::rfc3339;

pub fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    let client = Client::from_args(&cmd.client)?;
    let out = cmd.client.output;
    match cmd.verb {
        ImageVerb::Import(args) => {
            let resp = import(&client, &args)?;
            output::print(out, &resp, || {
                format!(
                    "image {} imported: {} {}, {} bytes, sha256 {}\n",
                    resp.image.name,
                    resp.image.kind,
                    resp.image.format,
                    resp.image.size_bytes,
                    resp.image.sha256
                )
            })
        }
        ImageVerb::List => {
            let resp: ImageList = client.get_all("/api/v1/images")?;
            output::print(out, &resp, || {
                let mut t = Table::new(&[
                    "NAME", "KIND", "FORMAT", "SIZE", "VIRTUAL", "SHA256", "CREATED",
                ]);
                for item in &resp.items {
                    let i = &item.image;
                    t.row(vec![
                        i.name.clone(),
                        i.kind.to_string(),
                        i.format.to_string(),
                        mib(i.size_bytes),
                        mib(i.virtual_size_bytes),
                        i.sha256[..i.sha256.len().min(12)].to_string(),
                        rfc3339(i.created_at),
                    ]);
                }
                t.render()
            })
        }
        ImageVerb::Get { name } => {
            let resp: ImageResponse = client.get(&path(&name))?;
            output::print(out, &resp, || {
                let i = &resp.image;
                fields(&[
                    ("name", i.name.clone()),
                    ("kind", i.kind.to_string()),
                    ("format", i.format.to_string()),
                    ("size", format!("{} bytes", i.size_bytes)),
                    ("virtual size", format!("{} bytes", i.virtual_size_bytes)),
                    ("sha256", i.sha256.clone()),
                    ("created", rfc3339(i.created_at)),
                ])
            })
        }
        ImageVerb::Delete { name } => {
            let resp: ImageResponse = client.call(Method::DELETE, &path(&name), None::<&()>)?;
            output::print(out, &resp, || {
                format!("image {} deleted\n", resp.image.name)
            })
        }
    }
}

fn path(name: &str) -> String {
    format!("/api/v1/images/{}", encode(name))
}

fn mib(bytes: u64) -> String {
    format!("{}Mi", bytes.div_ceil(1 << 20))
}

fn import(client: &Client, args: &ImportArgs) -> anyhow::Result<ImageResponse> {
    if image_url::is_url(&args.source) {
        return image_url::import(client, args);
    }
    if args.sha256.is_some() || args.sha512.is_some() {
        anyhow::bail!(
            "--sha256/--sha512 check a download: they apply to a URL (http:// or https://), \
             not to the file {}; compare `sha256sum {}` yourself",
            args.source,
            args.source
        );
    }
    let file_path = std::path::Path::new(&args.source);
    let file = std::fs::File::open(file_path)
        .with_context(|| format!("opening {}", file_path.display()))?;
    if !file.metadata()?.is_file() {
        anyhow::bail!("{} is not a regular file", file_path.display());
    }
    // Before sending a whole file for nothing (the server decides).
    if client
        .get_opt::<ImageResponse>(&path(&args.name))?
        .is_some()
    {
        anyhow::bail!(
            "image {} already exists (keel image delete {} first, or import under another name)",
            args.name,
            args.name
        );
    }
    client.upload(
        &format!("{}?kind={}", path(&args.name), args.kind),
        file,
        &args.source,
    )
}
