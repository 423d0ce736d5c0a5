//! The `usher` command line: parse arguments, run a subcommand, map its error
//! to an exit code. Everything else lives in the library.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use usher_core::error::RunError;

/// usher shares one service's capacity fairly among many clients, with
/// Doorman-compatible capacity leases.
#[derive(Debug, Parser)]
#[command(name = "usher", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text (coloured only on a terminal, and not with NO_COLOR set) or as one
    /// JSON object per line.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "USHER_LOG_FORMAT")]
    log_format: LogFormat,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A tour on loopback: a capacity server and three sidecars sharing one resource, live.
    Demo(usher::demo::DemoArgs),
    /// Run a Doorman-compatible capacity server (gRPC `doorman.Capacity`).
    Server(Box<cli::ServerArgs>),
    /// Simulate a capacity server tree in virtual time and report utilisation, overshoot,
    /// convergence and fairness.
    Sim(usher::sim::SimArgs),
    /// Report what access logs show was admitted against the capacity in force, per resource id.
    Audit(usher::audit::AuditArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) or, with `man`,
    /// the man page, generated from these very definitions.
    Completions {
        /// bash, zsh, fish, elvish, powershell, or man.
        #[arg(value_name = "SHELL")]
        shell: String,
    },
    /// Validate routes files, resources files and sim scenarios; print every error with
    /// file:line:column. Exits 0 when all are valid, 64 when not.
    Check(usher::check::CheckArgs),
    /// Run the sidecar: route, pace and admit outbound HTTP within capacity.
    Proxy(cli::ProxyArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // `--help` and `--version` print and succeed; a usage error exits 64
        // (EX_USAGE), as an invalid configuration does, not clap's 2.
        Err(e) => {
            let _ = e.print();
            return match e.use_stderr() {
                true => ExitCode::from(64),
                false => ExitCode::SUCCESS,
            };
        }
    };
    // The demo's sidecars would drown its live table in their info logs.
    init_logging(if matches!(cli.command, Command::Demo(_)) { "warn" } else { "info" }, cli.log_format);
    if matches!(cli.command, Command::Sim(_) | Command::Check(_) | Command::Audit(_)) {
        end_on_broken_pipe();
    }
    let result = match cli.command {
        // Virtual time and plain validation need no runtime and no signals.
        Command::Sim(args) => usher::sim::run(args),
        Command::Check(args) => usher::check::run(args),
        Command::Audit(args) => usher::audit::run(args),
        Command::Completions { shell } => completions(&shell),
        Command::Server(args) => serve(|shutdown| usher_server::run((*args).into(), shutdown)),
        Command::Proxy(args) => serve(|shutdown| usher_proxy::run(args.into(), shutdown)),
        Command::Demo(args) => serve(|shutdown| usher::demo::run(args, shutdown)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("usher: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `sim`, `check` and `audit` print a report and exit, and open no socket: a
/// reader that stops early (`usher check f.yaml | head -1`) ends them as it
/// ends `cat`, by SIGPIPE, instead of a panic in `println!`. (Rust ignores
/// SIGPIPE by default; the long-lived roles keep it ignored, as a peer's
/// closed socket must not end them.)
fn end_on_broken_pipe() {
    // SAFETY: `signal` only sets SIGPIPE's disposition back to the default,
    // before any thread is started.
    #[allow(unsafe_code, reason = "signal is a C call")]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes a completion script or the man page to stdout.
fn completions(shell: &str) -> Result<(), RunError> {
    use clap::CommandFactory;
    use std::io::Write;
    let mut cmd = Cli::command();
    let mut buf = Vec::new();
    if shell == "man" {
        clap_mangen::Man::new(cmd)
            .render(&mut buf)
            .map_err(|e| RunError::Other(format!("cannot render the man page: {e}")))?;
    } else {
        let sh: clap_complete::Shell = shell.parse().map_err(|_| {
            RunError::Usage(format!("unknown shell `{shell}`: use bash, zsh, fish, elvish, powershell or man"))
        })?;
        clap_complete::generate(sh, &mut cmd, "usher", &mut buf);
    }
    // A reader that stops early (`| head`) is not an error.
    match std::io::stdout().write_all(&buf) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(RunError::Other(format!("cannot write: {e}"))),
        _ => Ok(()),
    }
}

/// Runtime size for the long-lived roles; unset, tokio's default (one worker per CPU this
/// process may use, affinity and cgroup quota included).
const THREADS_ENV: &str = "USHER_THREADS";

/// The runtime for a long-lived role: `USHER_THREADS=1` runs a current-thread runtime (every
/// task on the thread that polls the sockets), `USHER_THREADS=N` a multi-threaded one with N
/// workers. benches/RESULTS.md compares a current-thread runtime with a one-worker
/// multi-threaded one on a pinned core: no difference beyond the noise, so the default stays.
fn runtime() -> Result<tokio::runtime::Runtime, RunError> {
    let threads = match std::env::var(THREADS_ENV) {
        Ok(v) => Some(
            v.trim()
                .parse::<std::num::NonZeroUsize>()
                .map_err(|_| RunError::Usage(format!("{THREADS_ENV} must be a whole number ≥ 1, not {v:?}")))?,
        ),
        Err(_) => None,
    };
    let mut builder = match threads.map(|n| n.get()) {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all().build().map_err(|e| RunError::Other(format!("cannot start the runtime: {e}")))
}

/// Runs a long-lived role until SIGTERM or SIGINT.
fn serve<F, Fut>(role: F) -> Result<(), RunError>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<(), RunError>>,
{
    let runtime = runtime()?;
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(async move {
            let shutdown = CancellationToken::new();
            tokio::spawn(shutdown_on_signal(shutdown.clone()));
            if std::process::id() == 1 {
                tokio::spawn(reap_orphans());
            }
            role(shutdown).await
        })
    }));
    match ran {
        Ok(result) => result,
        Err(_) => {
            // A thread of its own (the lease client's) stops on the shutdown
            // token; a role that panicked never cancelled it, and dropping
            // the runtime would wait for that thread for ever.
            runtime.shutdown_timeout(std::time::Duration::from_secs(2));
            Err(RunError::Other("a task panicked (see the message above); usher stopped".into()))
        }
    }
}

/// Logs go to stderr; `USHER_LOG` (or `RUST_LOG`) sets the filter, else `default`.
/// Text is coloured only when stderr is a terminal and `NO_COLOR` is unset,
/// so a log written to a file or a pipe carries no escape codes.
/// A line that cannot be written is dropped ([`LogWriter`]).
fn init_logging(default: &str, format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("USHER_LOG")
        .ok()
        .and_then(|s| EnvFilter::try_new(s).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(|| LogWriter);
    match format {
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(false).init(),
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            logs.with_ansi(colour).init()
        }
    }
}

/// stderr for the log. When stderr cannot be written (the reader of its pipe
/// went away: a log shipper restarted, a parent that read only the first
/// line), the line is dropped and usher goes on serving. tracing-subscriber
/// would otherwise report the failure with `eprintln!`, which panics on the
/// same closed stderr and takes the process down.
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// As a container's PID 1 (the image has no init), usher inherits every
/// orphaned process in the container (what `kubectl exec` left running):
/// it reaps them when they exit, as an init would, so no zombie stays.
/// usher starts no child processes of its own in these roles.
async fn reap_orphans() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut exited) = signal(SignalKind::child()) else {
        tracing::warn!("running as PID 1 but cannot watch SIGCHLD: orphaned processes will stay as zombies");
        return;
    };
    while exited.recv().await.is_some() {
        loop {
            let mut status = 0;
            // SAFETY: waitpid only writes the exit status into `status`, a
            // local; WNOHANG makes it return at once when no child has exited.
            #[allow(unsafe_code, reason = "waitpid is a C call; its one out-parameter is the local above")]
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            tracing::debug!(pid, status, "reaped an orphaned process");
        }
    }
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
