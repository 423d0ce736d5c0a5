//! The `usher` command line: parse arguments, run a subcommand, map its error
//! to an exit code. Everything else lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

/// usher shares one service's capacity fairly among many clients, with
/// Doorman-compatible capacity leases.
#[derive(Debug, Parser)]
#[command(name = "usher", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a Doorman-compatible capacity server (gRPC `doorman.Capacity`).
    Server(usher::server::ServerArgs),
    /// Simulate a capacity server tree in virtual time and report utilisation, overshoot,
    /// convergence and fairness.
    Sim(usher::sim::SimArgs),
    /// Run the sidecar: route, pace and admit outbound HTTP within capacity.
    Proxy(usher::proxy::ProxyArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    if let Command::Sim(args) = cli.command {
        // Virtual time: no runtime, no signals.
        return match usher::sim::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("usher: {e}");
                ExitCode::from(e.exit_code())
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("usher: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(shutdown_on_signal(shutdown.clone()));
        match cli.command {
            Command::Server(args) => usher::server::run(args, shutdown).await,
            Command::Sim(_) => unreachable!("handled before the runtime starts"),
            Command::Proxy(args) => usher::proxy::run(args, shutdown).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("usher: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Logs go to stderr; `USHER_LOG` (or `RUST_LOG`) sets the filter, default `info`.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("USHER_LOG")
        .ok()
        .and_then(|s| EnvFilter::try_new(s).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

/// Cancels `token` on SIGTERM or SIGINT.
async fn shutdown_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        return;
    };
    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = which, "shutting down");
    token.cancel();
}
