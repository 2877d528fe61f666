//! `keel events [VM] [--actor TOKEN_NAME] [--follow]`.

use std::io::Write;

use super::output::{self, line};
use super::{encode, Client};
use crate::api::events::{EventItem, EventList};
use crate::args::{EventsArgs, OutputFormat};

/// Fixed widths, so followed events line up with the header.
const WIDTHS: [usize; 5] = [24, 20, 9, 9, 0];
const HEADER: [&str; 5] = ["TIME", "VM", "FROM", "TO", "REASON"];

pub fn run(args: EventsArgs) -> anyhow::Result<()> {
    let client = Client::from_args(&args.client)?;
    let out = args.client.output;
    let mut query = Vec::new();
    if let Some(vm) = &args.vm {
        query.push(format!("vm={}", encode(vm)));
    }
    if let Some(actor) = &args.actor {
        query.push(format!("actor={}", encode(actor)));
    }
    if args.follow {
        query.push("follow=true".to_string());
    }
    let path = if query.is_empty() {
        "/api/v1/events".to_string()
    } else {
        format!("/api/v1/events?{}", query.join("&"))
    };
    if !args.follow {
        let list: EventList = client.get_all(&path)?;
        return output::print(out, &list, || {
            let mut s = header();
            for item in &list.items {
                s.push_str(&row(item));
            }
            s
        });
    }
    if out == OutputFormat::Table {
        print!("{}", header());
    }
    client.stream_lines::<EventItem>(&path, |item| {
        let text = match out {
            OutputFormat::Table => row(&item),
            OutputFormat::Json => format!(
                "{}\n",
                output::json_terminal_safe(serde_json::to_string(&item)?)
            ),
            OutputFormat::Yaml => format!(
                "---\n{}",
                output::render(OutputFormat::Yaml, &item, String::new)?
            ),
        };
        let mut stdout = std::io::stdout().lock();
        // A closed stdout (e.g. `| head`) ends the follow quietly.
        Ok(stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
            .is_ok())
    })
}

fn header() -> String {
    line(&HEADER.map(String::from), &WIDTHS)
}

fn row(item: &EventItem) -> String {
    let e = &item.event;
    line(
        &[
            crate::timefmt::rfc3339(e.at),
            e.vm.clone(),
            format!("{:?}", e.from),
            format!("{:?}", e.to),
            e.reason.clone(),
        ],
        &WIDTHS,
    )
}
