//! `keel`: parses the command line and dispatches; the work lives in the library.

use std::process::ExitCode;

use clap::Parser;
use keel::args::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => keel::serve::main(args),
        Command::Agent(args) => keel::agent::main(args),
        Command::Vm(cmd) => keel::cli::vm(cmd),
        Command::Events(args) => keel::cli::events(args),
        Command::Node(cmd) => keel::cli::node(cmd),
        Command::Snapshot(cmd) => keel::cli::snapshot(cmd),
        Command::Restore(args) => keel::cli::restore(args),
        Command::Migration(cmd) => keel::cli::migration(cmd),
        Command::Image(cmd) => keel::cli::image(cmd),
        Command::Keeper(args) => {
            use keel_hv::qemu::keeper;
            let code = keeper::run(&args.instance_dir, &keeper::FenceLease::new(args.lease))
                .unwrap_or_else(|e| {
                    eprintln!("keel keeper: {}: {e}", args.instance_dir.display());
                    1
                });
            return ExitCode::from(code.clamp(0, 255) as u8);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
