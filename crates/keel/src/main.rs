//! `keel`: parses the command line and dispatches; the work lives in the library.

// Production code handles its errors; `unwrap` is for tests (which
// compile this crate with cfg(test)), `expect` states an invariant.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use keel::args::{Cli, Command};

/// mimalloc rather than glibc's malloc: with 50 simulated nodes' watches
/// and indexes in one `keel serve`, glibc's arenas (`_int_malloc`,
/// `malloc_consolidate`, `free`) were a fifth of the server's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Before parsing: the file fills in KEEL_* variables the environment
    // lacks, so flags > environment > file > defaults.
    if let Err(err) = keel::config_file::apply(&Cli::command()) {
        eprintln!("error: {err:#}");
        return ExitCode::from(2);
    }
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
        Command::Doctor(args) => keel::doctor::main(args),
        Command::Token(cmd) => match cmd.verb {
            keel::args::TokenVerb::InitFile {
                file,
                group,
                rotate,
            } => keel::host_tools::token_file(&file, group.as_deref(), rotate),
            _ => keel::cli::token(cmd),
        },
        Command::Completions { shell } => {
            keel::host_tools::completions(shell, &mut Cli::command(), &mut std::io::stdout())
        }
        Command::Man { dir } => keel::host_tools::man_pages(Cli::command(), &dir),
        Command::Image(cmd) => keel::cli::image(cmd),
        Command::Apply(args) => keel::cli::apply(args),
        Command::Bench(cmd) => match cmd.verb {
            keel::args::BenchVerb::Scale(args) => keel::bench_scale::main(args),
            keel::args::BenchVerb::Start(args) => keel::bench_start::main(args),
        },
        Command::Cluster(cmd) => keel::migration_setup::cluster(cmd),
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
            // It may quote the server, which may quote a guest.
            let text = format!("{err:#}");
            eprintln!(
                "error: {}",
                keel_api::untrusted::terminal_safe_log(text.as_bytes())
            );
            ExitCode::FAILURE
        }
    }
}
