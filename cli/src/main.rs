//! `pghydrate`: hydrate a PostgreSQL server's storage by reading every block of every relation.
//! This binary only translates options into engine calls and results into output and exit codes.

mod progress;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use pghydrate::aws::Skipped;
use pghydrate::catalog::{make_plan, PlanOptions};
use pghydrate::error::exit;
use pghydrate::maintain::Maintenance;
use pghydrate::pattern::RelationPattern;
use pghydrate::plan::{Plan, DEFAULT_RANGE_BLOCKS};
use pghydrate::report::{self, human_bytes};
use pghydrate::run::{effective_sessions, RunOptions, RunState};
use pghydrate::warm::{Counters, Mode, ModeChoice, WarmOptions};
use pghydrate::{ConnectionSpec, Error, TlsMode};

#[derive(Parser)]
#[command(
    name = "pghydrate",
    version,
    about = "Read every block of every PostgreSQL relation, verifiably, so a restored volume is fast before traffic finds it slow"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log output (debug).
    #[arg(short, long, global = true)]
    verbose: bool,
    /// Only warnings and errors in the log.
    #[arg(short, long, global = true)]
    quiet: bool,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Plan and hydrate: read every block, then maintain, then report.
    Run {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(flatten)]
        plan: PlanArgs,
        #[command(flatten)]
        warm: WarmArgs,
        #[command(flatten)]
        timeouts: TimeoutArgs,
        #[command(flatten)]
        out: OutArgs,
    },
    /// Show what `run` would read, and what it could not, without reading or changing anything.
    Plan {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(flatten)]
        plan: PlanArgs,
        #[command(flatten)]
        timeouts: TimeoutArgs,
        /// Print the plan as JSON (the engine's serializable plan).
        #[arg(long)]
        json: bool,
        /// List every relation fork, not only the largest and the skipped ones.
        #[arg(long)]
        all: bool,
    },
    /// Store what the server keeps in shared buffers (pg_buffercache) as each database's hot set, in
    /// the table pghydrate.hot_set of that database, replacing the previous capture in one
    /// transaction. Snapshots, restores, replicas and green environments carry it; `run` and the
    /// workflow then read it first. Needs pg_buffercache in the database connected to and pg_monitor;
    /// writes nothing else. Exit 0 when every database with cached blocks was captured, 4 otherwise.
    Capture {
        #[command(flatten)]
        conn: ConnArgs,
        #[command(flatten)]
        timeouts: TimeoutArgs,
        /// Ranges kept per database at most: where there are more, the smallest gaps are merged (about
        /// 71 bytes per range on disk: 65,536 ranges are under 4.5 MiB).
        #[arg(long, default_value_t = pghydrate::hotset::DEFAULT_MAX_RANGES, value_parser = parse_max_ranges)]
        max_ranges: usize,
        /// Only databases matching this glob (repeatable). Default: all but rdsadmin.
        #[arg(long = "include-database", value_name = "GLOB")]
        include_databases: Vec<String>,
        /// Skip databases matching this glob (repeatable).
        #[arg(long = "exclude-database", value_name = "GLOB")]
        exclude_databases: Vec<String>,
        /// Capture nothing when the server has been up for less than this many minutes (its buffers
        /// then hold what the first queries and any hydration read, not yet the application's hot set;
        /// every database keeps its previous capture). For captures from cron. Default: 0.
        #[arg(long, value_name = "MINUTES", default_value_t = 0)]
        min_uptime: u32,
        /// Remove the stored hot set (its tables and the schema pghydrate) from every database instead.
        #[arg(long)]
        drop: bool,
        /// Print the capture's result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Start the deployed AWS workflow for one instance (and with --wait, follow it to the end with
    /// the same exit codes as `run`).
    Start(StartArgs),
    /// Continue a run that stopped (time limit, Ctrl-C, an unreachable database) from its continuation
    /// file. The run's sessions, mode and maintenance carry over unless given again here.
    Resume {
        /// The continuation file written by `run`.
        continuation: PathBuf,
        #[command(flatten)]
        conn: ConnArgs,
        #[command(flatten)]
        warm: ResumeArgs,
        #[command(flatten)]
        timeouts: TimeoutArgs,
        #[command(flatten)]
        out: OutArgs,
    },
}

#[derive(Args)]
struct StartArgs {
    /// The DB instance identifier to hydrate.
    #[arg(long)]
    instance: String,
    /// The pghydrate state machine (the stack's StateMachineArn output).
    #[arg(long, env = "PGHYDRATE_STATE_MACHINE_ARN")]
    state_machine_arn: String,
    /// Follow the execution until it ends.
    #[arg(long)]
    wait: bool,
    /// Seconds between status checks with --wait.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    poll_interval: Duration,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    sessions: Option<u32>,
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    #[arg(long, value_enum)]
    maintenance: Option<MaintenanceArg>,
    #[arg(long = "include-database", value_name = "GLOB")]
    include_databases: Vec<String>,
    #[arg(long = "exclude-database", value_name = "GLOB")]
    exclude_databases: Vec<String>,
    #[arg(long, value_name = "PATTERN")]
    include: Vec<String>,
    #[arg(long, value_name = "PATTERN")]
    exclude: Vec<String>,
    #[arg(long, value_name = "PATTERN")]
    first: Vec<String>,
    /// Connect with this Secrets Manager secret instead of the configured default.
    #[arg(long, conflicts_with = "iam_user")]
    secret_arn: Option<String>,
    /// Connect as this user with IAM database authentication.
    #[arg(long)]
    iam_user: Option<String>,
    /// Only wait for storage initialization; read no blocks.
    #[arg(long)]
    poll_only: bool,
}

#[derive(Args)]
struct ConnArgs {
    /// postgresql://user@host:port/dbname?sslmode=... or "host=... user=...". Unset parts come from
    /// PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT.
    connection: Option<String>,
    /// TLS mode, overriding sslmode: disable, prefer, require, verify-ca, verify-full.
    #[arg(long, value_parser = parse_tls)]
    tls: Option<TlsMode>,
    /// CA bundle (PEM) for verify-ca / verify-full, overriding sslrootcert.
    #[arg(long)]
    ca_file: Option<PathBuf>,
}

#[derive(Args)]
struct PlanArgs {
    /// Only databases matching this glob (repeatable). Default: all but rdsadmin.
    #[arg(long = "include-database", value_name = "GLOB")]
    include_databases: Vec<String>,
    /// Skip databases matching this glob (repeatable).
    #[arg(long = "exclude-database", value_name = "GLOB")]
    exclude_databases: Vec<String>,
    /// Only tables matching [database:]schema.table globs (repeatable); indexes and TOAST follow their table.
    #[arg(long, value_name = "PATTERN", value_parser = parse_pattern)]
    include: Vec<RelationPattern>,
    /// Skip tables matching [database:]schema.table globs (repeatable).
    #[arg(long, value_name = "PATTERN", value_parser = parse_pattern)]
    exclude: Vec<RelationPattern>,
    /// Read tables matching these patterns first, in the order given (repeatable).
    #[arg(long, value_name = "PATTERN", value_parser = parse_pattern)]
    first: Vec<RelationPattern>,
    /// Blocks per range, the unit of work (8192 blocks = 64 MiB at 8 KiB).
    #[arg(long, default_value_t = DEFAULT_RANGE_BLOCKS, value_parser = clap::value_parser!(u64).range(1..))]
    range_blocks: u64,
    /// Do not CREATE EXTENSION pg_prewarm where it is missing (those databases are then skipped).
    #[arg(long)]
    no_create_extension: bool,
    /// Ignore hot sets stored by `pghydrate capture` (by default their ranges are read first, after the
    /// --first tables: by 8 MiB region, the most heat per block first, each in block order).
    #[arg(long)]
    no_hot_set: bool,
    /// Databases planned at once, a session each (never more than half the server's free connection
    /// slots): a restored server's catalogs are cold, and a server of many databases plans in a
    /// fraction of the time one at a time takes.
    #[arg(long, value_name = "N", default_value_t = pghydrate::catalog::DATABASES_AT_ONCE,
          value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u64).range(1..=256), |n| n as usize))]
    databases_at_once: usize,
}

/// `--sessions`: `auto`, or a number of sessions that read throughout.
#[derive(Clone, Copy, Debug, PartialEq)]
enum SessionsArg {
    Auto,
    Fixed(u32),
}

fn parse_max_ranges(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=10_000_000).contains(&n) => Ok(n),
        _ => Err("expected a number of ranges from 1 to 10000000".into()),
    }
}

fn parse_sessions(s: &str) -> Result<SessionsArg, String> {
    if s == "auto" {
        return Ok(SessionsArg::Auto);
    }
    match s.parse::<u32>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(SessionsArg::Fixed(n)),
        _ => Err("expected auto or a number of sessions from 1 to 1024".into()),
    }
}

/// The sessions a state reads with, and whether they adapt: `auto` climbs from 16 (adaptive::START) up to
/// `max_sessions` while throughput grows; a number is fixed. Either way at most half the server's
/// free connection slots.
fn sessions_of(arg: SessionsArg, max_sessions: u32, server: &pghydrate::plan::ServerInfo) -> (u32, bool) {
    let (requested, adaptive) = match arg {
        SessionsArg::Auto => (max_sessions, true),
        SessionsArg::Fixed(n) => (n, false),
    };
    let (n, warning) = effective_sessions(requested, server);
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    (n, adaptive)
}

#[derive(Args)]
struct WarmArgs {
    /// Reading sessions: auto (start at 16, add sessions while the throughput they deliver grows, up
    /// to --max-sessions, and settle where it stops), or a fixed number. Either way at most half the
    /// server's free connection slots.
    #[arg(long, default_value = "auto", value_parser = parse_sessions)]
    sessions: SessionsArg,
    /// Ceiling of --sessions auto.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_sessions: u32,
    /// Blocks one statement reads at most: a longer planned range is read in steps of this many,
    /// each of which any session may take (docs/tuning.md).
    #[arg(long, default_value_t = pghydrate::warm::DEFAULT_STEP_BLOCKS, value_parser = clap::value_parser!(u64).range(1..))]
    step_blocks: u64,
    /// pg_prewarm mode. auto: buffer on 17, and on 18 with io_method io_uring or sync; read elsewhere
    /// (measured: docs/benchmark.md). prefetch only asks the kernel and is not verified.
    #[arg(long, value_enum, default_value = "auto")]
    mode: ModeArg,
    /// After warming: analyze, vacuum-analyze or none.
    #[arg(long, value_enum, default_value = "analyze")]
    maintenance: MaintenanceArg,
    #[command(flatten)]
    limits: LimitArgs,
}

/// Time limits, for `run` and again for each `resume`.
#[derive(Args)]
struct LimitArgs {
    /// Stop after this long (e.g. 14m): no range starts when less than --margin is left, and the
    /// work left is written to the continuation file.
    #[arg(long, value_parser = parse_duration)]
    time_limit: Option<Duration>,
    /// Safety margin before the time limit.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    margin: Duration,
    /// How long a lost session keeps reconnecting before its database is declared unreachable.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    reconnect_for: Duration,
    /// Upper bound of one ANALYZE / VACUUM statement.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    maintenance_timeout: Duration,
}

/// `resume`'s options: those of `run` that may change between calls. Unset, each keeps the value the
/// run started with (the continuation's).
#[derive(Args)]
struct ResumeArgs {
    /// Reading sessions, auto or a number (default: the run's).
    #[arg(long, value_parser = parse_sessions)]
    sessions: Option<SessionsArg>,
    /// Ceiling of --sessions auto (default: the run's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_sessions: Option<u32>,
    /// pg_prewarm mode (default: the run's).
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// After warming: analyze, vacuum-analyze or none (default: the run's).
    #[arg(long, value_enum)]
    maintenance: Option<MaintenanceArg>,
    #[command(flatten)]
    limits: LimitArgs,
}

#[derive(Args)]
struct TimeoutArgs {
    /// Upper bound of one pg_prewarm call.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    statement_timeout: Duration,
    /// Wait at most this long for a lock; a locked relation is retried later.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lock_timeout: Duration,
    /// Lock waits per range before it is skipped. Planning waits for locks at most this many times in
    /// all (`plan`; `run` waits once, and tries what a lock kept from it again after warming).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    lock_attempts: u32,
}

#[derive(Args)]
struct OutArgs {
    /// Write the full JSON report here.
    #[arg(long, value_name = "PATH")]
    report: Option<PathBuf>,
    /// Where to write the continuation when the time limit stops the run (default:
    /// pghydrate-continuation.json for run, the file resumed from for resume).
    #[arg(long = "continuation", value_name = "PATH")]
    save_continuation: Option<PathBuf>,
    /// Progress display: auto (a bar on a terminal, lines otherwise), bar, lines, none.
    #[arg(long, value_enum, default_value = "auto")]
    progress: progress::Style,
    /// Seconds between progress lines.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    progress_interval: Duration,
}

#[derive(Clone, Copy, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
enum ModeArg {
    Auto,
    Read,
    Buffer,
    Prefetch,
}

#[derive(Clone, Copy, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
enum MaintenanceArg {
    Analyze,
    VacuumAnalyze,
    None,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 30s, 5m, 1h30m)"))
}

fn parse_tls(s: &str) -> Result<TlsMode, String> {
    s.parse().map_err(|e: Error| e.to_string())
}

fn parse_pattern(s: &str) -> Result<RelationPattern, String> {
    RelationPattern::parse(s).map_err(|e| e.to_string())
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind::*;
            if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
                e.exit();
            }
            // One line: what is wrong. `--help` has the rest.
            let text = e.render().to_string();
            let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid arguments");
            eprintln!("pghydrate: {}", line.trim_start_matches("error: "));
            std::process::exit(exit::INVALID_INPUT);
        }
    };
    init_logging(&cli);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let code = runtime.block_on(async {
        match execute(cli.command).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("pghydrate: {e}");
                e.exit_code()
            }
        }
    });
    std::process::exit(code);
}

fn init_logging(cli: &Cli) {
    let default = if cli.verbose {
        "pghydrate=debug,warn"
    } else if cli.quiet {
        "warn"
    } else {
        "pghydrate=info,warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("PGHYDRATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.with_target(false).init(),
    }
}

fn spec_of(conn: &ConnArgs, t: &TimeoutArgs) -> pghydrate::Result<ConnectionSpec> {
    let spec = ConnectionSpec::parse(conn.connection.as_deref(), |k| std::env::var(k).ok())?
        .with_timeouts(t.lock_timeout, t.statement_timeout);
    let spec = match conn.tls {
        Some(mode) => spec.with_tls(mode, conn.ca_file.clone()),
        None => {
            let mode = spec.tls_mode();
            spec.with_tls(mode, conn.ca_file.clone())
        }
    };
    match spec.tls_mode() {
        _ if spec.is_local_socket() => {}
        TlsMode::Disable => {
            tracing::warn!(
                "TLS is disabled (sslmode=disable): the sessions, including the password exchange, are not encrypted"
            )
        }
        TlsMode::Prefer | TlsMode::Require => tracing::warn!(
            "sslmode={}: the server's certificate is not checked (verify-full, the default, checks it)",
            spec.tls_mode().as_str()
        ),
        TlsMode::VerifyCa | TlsMode::VerifyFull => {}
    }
    Ok(spec)
}

fn plan_options(p: &PlanArgs, t: &TimeoutArgs, dry_run: bool) -> PlanOptions {
    PlanOptions {
        include_databases: p.include_databases.clone(),
        exclude_databases: p.exclude_databases.clone(),
        include: p.include.clone(),
        exclude: p.exclude.clone(),
        first: p.first.clone(),
        range_blocks: p.range_blocks,
        create_extension: !p.no_create_extension,
        dry_run,
        // `run` tries a relation locked while planning once more after warming (RunState::advance):
        // one try while planning is enough there.
        lock_attempts: if dry_run { t.lock_attempts } else { 1 },
        ignore_hot_set: p.no_hot_set,
        databases_at_once: p.databases_at_once,
    }
}

/// Options for advancing a state; its sessions, mode and adaptivity come from the state itself.
fn run_options(maintenance: Maintenance, l: &LimitArgs, t: &TimeoutArgs, started: Instant) -> RunOptions {
    RunOptions {
        warm: WarmOptions {
            mode: Mode::Read, // replaced by the state's resolved mode
            statement_timeout: t.statement_timeout,
            lock_timeout: t.lock_timeout,
            lock_attempts: t.lock_attempts,
            deadline: l.time_limit.map(|t| started + t),
            margin: l.margin,
            reconnect_for: l.reconnect_for,
            stop: Some(Arc::new(std::sync::atomic::AtomicBool::new(false))),
            ..WarmOptions::default()
        },
        maintenance,
        maintenance_timeout: l.maintenance_timeout,
    }
}

fn check_time_limit(limit: Option<Duration>, margin: Duration) -> pghydrate::Result<()> {
    match limit {
        Some(t) if t <= margin => Err(Error::InvalidInput(format!(
            "--time-limit {} must be longer than --margin {}",
            humantime::format_duration(t),
            humantime::format_duration(margin)
        ))),
        _ => Ok(()),
    }
}

fn mode_of(m: ModeArg, server: &pghydrate::plan::ServerInfo) -> Mode {
    match m {
        ModeArg::Auto => ModeChoice::Auto,
        ModeArg::Read => ModeChoice::Read,
        ModeArg::Buffer => ModeChoice::Buffer,
        ModeArg::Prefetch => ModeChoice::Prefetch,
    }
    .resolve(server)
}

fn maintenance_of(m: MaintenanceArg) -> Maintenance {
    match m {
        MaintenanceArg::Analyze => Maintenance::Analyze,
        MaintenanceArg::VacuumAnalyze => Maintenance::VacuumAnalyze,
        MaintenanceArg::None => Maintenance::None,
    }
}

async fn execute(command: Command) -> pghydrate::Result<i32> {
    let started = Instant::now();
    match command {
        Command::Plan { conn, plan, timeouts, json, all } => {
            let spec = spec_of(&conn, &timeouts)?;
            let plan = make_plan(&spec, &plan_options(&plan, &timeouts, true)).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan).expect("plan serializes"));
            } else {
                print!("{}", plan_table(&plan, all));
            }
            Ok(exit::COMPLETE)
        }
        Command::Run { conn, plan, warm, timeouts, out } => {
            let spec = spec_of(&conn, &timeouts)?;
            check_time_limit(warm.limits.time_limit, warm.limits.margin)?;
            let mut opts = run_options(maintenance_of(warm.maintenance), &warm.limits, &timeouts, started);
            opts.warm.step_blocks = warm.step_blocks;
            // From here on, a signal stops the run with a continuation (after planning, if it comes
            // during planning: then the continuation holds the whole plan).
            opts.warm.stop.clone().map(watch_signals);
            // The captured hot set is read while the rest is planned (a head start); what it read
            // is not read again.
            let (plan, head) = pghydrate::run::plan_with_head_start(
                &spec,
                &plan_options(&plan, &timeouts, false),
                &opts.warm,
                |server| {
                    let (sessions, adaptive) = sessions_of(warm.sessions, warm.max_sessions, server);
                    (mode_of(warm.mode, server), (sessions / 2).max(1), adaptive)
                },
            )
            .await?;
            let mode = mode_of(warm.mode, &plan.server);
            let (sessions, adaptive) = sessions_of(warm.sessions, warm.max_sessions, &plan.server);
            let mut state = RunState::new(plan, mode, sessions, opts.maintenance);
            state.adaptive = adaptive;
            if let Some(head) = head {
                state.absorb_head_start(head);
                // The rest starts where the head start's sessions ended, not back at the start level.
                if adaptive {
                    opts.warm.start_sessions = state.levels.last().map(|l| l.sessions as u32);
                }
            }
            drive(&spec, &mut state, &opts, &out, Path::new("pghydrate-continuation.json")).await
        }
        Command::Start(args) => start(args).await,
        Command::Capture {
            conn,
            timeouts,
            max_ranges,
            include_databases,
            exclude_databases,
            min_uptime,
            drop,
            json,
        } => {
            let spec = spec_of(&conn, &timeouts)?;
            if drop {
                let mut failed = false;
                for (db, result) in pghydrate::hotset::drop_capture(&spec).await? {
                    match result {
                        Ok(true) => println!("{db}: hot set dropped"),
                        Ok(false) => println!("{db}: no hot set"),
                        Err(e) => {
                            failed = true;
                            println!("{db}: NOT dropped: {e}");
                        }
                    }
                }
                return Ok(if failed { exit::INCOMPLETE } else { exit::COMPLETE });
            }
            let opts = pghydrate::hotset::CaptureOptions {
                max_ranges,
                include_databases,
                exclude_databases,
                min_uptime: (min_uptime > 0).then(|| std::time::Duration::from_secs(u64::from(min_uptime) * 60)),
                deadline: None,
            };
            let captured = pghydrate::hotset::capture(&spec, &opts).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&captured).expect("capture report serializes"));
            } else {
                print!("{}", captured.summary());
            }
            Ok(if captured.complete() { exit::COMPLETE } else { exit::INCOMPLETE })
        }
        Command::Resume { continuation, conn, warm, timeouts, out } => {
            let spec = spec_of(&conn, &timeouts)?;
            let text = std::fs::read_to_string(&continuation).map_err(|e| Error::Io {
                context: format!("reading continuation {}", continuation.display()),
                source: e,
            })?;
            let mut state = RunState::from_json(&text)?;
            check_time_limit(warm.limits.time_limit, warm.limits.margin)?;
            let arg = match (warm.sessions, warm.max_sessions) {
                (Some(a), _) => Some(a),
                (None, Some(_)) if state.adaptive => Some(SessionsArg::Auto),
                (None, Some(_)) => {
                    return Err(Error::InvalidInput(
                        "--max-sessions: this run reads with a fixed number of sessions; give --sessions auto too"
                            .into(),
                    ))
                }
                (None, None) => None,
            };
            if let Some(arg) = arg {
                let ceiling = warm.max_sessions.unwrap_or(if state.adaptive { state.sessions } else { 64 });
                (state.sessions, state.adaptive) = sessions_of(arg, ceiling, &state.plan.server);
            }
            if let Some(m) = warm.mode {
                state.mode = mode_of(m, &state.plan.server);
            }
            if let Some(m) = warm.maintenance {
                let m = maintenance_of(m);
                if m != state.maintenance {
                    if state.maintenance_pending.is_some() {
                        return Err(Error::InvalidInput(format!(
                            "--maintenance {}: this run's maintenance ({}) has already started; resume without --maintenance",
                            m.statement(),
                            state.maintenance.statement()
                        )));
                    }
                    state.maintenance = m;
                }
            }
            let opts = run_options(state.maintenance, &warm.limits, &timeouts, started);
            opts.warm.stop.clone().map(watch_signals);
            tracing::info!(
                sessions = state.sessions,
                adaptive = state.adaptive,
                mode = state.mode.as_str(),
                maintenance = state.maintenance.statement(),
                "resuming with"
            );
            tracing::info!(
                ranges_left = state.pending.len(),
                bytes_left = state.pending.iter().map(|r| state.plan.bytes(r.blocks())).sum::<u64>(),
                "resuming"
            );
            drive(&spec, &mut state, &opts, &out, &continuation).await
        }
    }
}

/// Advances the state; writes the report, and the continuation (to `--continuation`, else
/// `default_continuation`) when work is left; removes `default_continuation` when a resumed run is done.
/// The manual input the workflow takes (README: "Manual start"), checked here with the same parser
/// the Resolve Lambda uses, so that bad input fails before anything starts.
fn start_input(a: &StartArgs) -> pghydrate::Result<serde_json::Value> {
    let mut input = serde_json::json!({ "instance": a.instance });
    let o = input.as_object_mut().unwrap();
    if let Some(s) = a.sessions {
        o.insert("sessions".into(), s.into());
    }
    if let Some(m) = a.mode {
        o.insert("mode".into(), serde_json::to_value(m).unwrap());
    }
    if let Some(m) = a.maintenance {
        o.insert("maintenance".into(), serde_json::to_value(m).unwrap());
    }
    for (k, v) in [
        ("include_databases", &a.include_databases),
        ("exclude_databases", &a.exclude_databases),
        ("include", &a.include),
        ("exclude", &a.exclude),
        ("first", &a.first),
    ] {
        if !v.is_empty() {
            o.insert(k.into(), serde_json::to_value(v).unwrap());
        }
    }
    if let Some(arn) = &a.secret_arn {
        o.insert("credentials".into(), serde_json::json!({"type": "secret", "arn": arn}));
    }
    if let Some(user) = &a.iam_user {
        o.insert("credentials".into(), serde_json::json!({"type": "iam", "user": user}));
    }
    if a.poll_only {
        o.insert("poll_only".into(), true.into());
    }
    pghydrate::events::parse_input(&input, None, None).map_err(|e| Error::InvalidInput(e.to_string()))?;
    Ok(input)
}

async fn start(a: StartArgs) -> pghydrate::Result<i32> {
    let input = start_input(&a)?;
    let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let sfn = aws_sdk_sfn::Client::new(&config);
    let name = pghydrate::aws::execution_name(&a.instance, std::time::SystemTime::now());
    let execution = pghydrate::aws::start_execution(&sfn, &a.state_machine_arn, &name, &input).await?;
    eprintln!("pghydrate: started {execution}");
    if !a.wait {
        println!("{execution}");
        return Ok(exit::COMPLETE);
    }
    let mut execution = execution;
    loop {
        let v = wait_until_ended(&sfn, &execution, a.poll_interval).await?;
        match pghydrate::aws::skipped(&v, &a.instance) {
            // Started while another run hydrates the instance: that run's outcome is this start's.
            Some(Skipped::HeldBy { execution_arn }) if execution_arn != execution => {
                eprintln!("pghydrate: {} is already being hydrated by {execution_arn}: following that run", a.instance);
                execution = execution_arn;
                continue;
            }
            Some(Skipped::NothingRead { reason }) => eprintln!("pghydrate: nothing was read: {reason}"),
            _ => {}
        }
        if let Some(out) = &v.output {
            println!("{out}");
        }
        if let Some(e) = &v.error {
            eprintln!("pghydrate: execution {} with {e}: {}", v.status, v.cause.as_deref().unwrap_or(""));
        }
        return Ok(pghydrate::aws::execution_exit_code(&v));
    }
}

/// The execution once it is no longer running, checked every `interval`.
async fn wait_until_ended(
    sfn: &aws_sdk_sfn::Client,
    execution: &str,
    interval: Duration,
) -> pghydrate::Result<pghydrate::aws::ExecutionView> {
    loop {
        let v = pghydrate::aws::describe_execution(sfn, execution).await?;
        if v.status != "RUNNING" {
            return Ok(v);
        }
        eprintln!("pghydrate: {execution} is running");
        tokio::time::sleep(interval).await;
    }
}

async fn drive(
    spec: &ConnectionSpec,
    state: &mut RunState,
    opts: &RunOptions,
    out: &OutArgs,
    default_continuation: &Path,
) -> pghydrate::Result<i32> {
    let counters = Arc::new(Counters::default());
    let already: u64 = state.outcomes.iter().map(|o| state.plan.bytes(o.range.blocks())).sum();
    let display = progress::start(out.progress, out.progress_interval, counters.clone(), already);
    let result = state.advance(spec, opts, counters).await;
    display.finish().await;
    if opts.warm.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) {
        state.interrupted = Some("a signal (Ctrl-C or SIGTERM)".into());
    }

    // The report and the continuation are written whatever happened: an error in maintenance after a
    // long warm must not throw away what the warm did.
    let report = report::build(state);
    if let Some(path) = &out.report {
        write_json(path, &report)?;
        tracing::info!(path = %path.display(), "report written");
    }
    let continuation = out.save_continuation.as_deref().unwrap_or(default_continuation);
    if !state.finished() {
        write_json(continuation, state)?;
        let why = if !state.unreachable.is_empty() {
            format!(
                "database{} {} could not be reached",
                if state.unreachable.len() > 1 { "s" } else { "" },
                state.unreachable.keys().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(", ")
            )
        } else if state.interrupted.is_some() {
            "stopped by a signal".to_string()
        } else if result.is_err() {
            "stopped by an error".to_string()
        } else {
            "time limit reached".to_string()
        };
        eprintln!(
            "pghydrate: {why}; {} left. Continue with: pghydrate resume {} [CONNECTION]",
            human_bytes(report.pending_bytes),
            continuation.display()
        );
    } else if state.calls > 1 && default_continuation.exists() {
        // The continuation this run resumed from is done with.
        let _ = std::fs::remove_file(default_continuation);
    }
    result?;
    println!("{}", report.summary());
    Ok(report.exit_code)
}

/// On the first SIGINT (Ctrl-C) or SIGTERM, sets `stop`: no new range or maintenance statement
/// starts, the statements in flight are cancelled on the server, and the run writes its report and
/// continuation (exit 5). A second signal ends the process at once (exit 130).
fn watch_signals(stop: Arc<std::sync::atomic::AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            tracing::warn!("cannot watch for SIGINT/SIGTERM: a signal will end the run without a continuation");
            return;
        };
        let mut seen = 0;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            seen += 1;
            if seen > 1 {
                eprintln!("pghydrate: {name} again: exiting now, without a continuation");
                std::process::exit(130);
            }
            eprintln!("pghydrate: {name}: stopping; cancelling the statements in flight and writing the continuation (again to exit at once)");
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    })
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> pghydrate::Result<()> {
    let text = serde_json::to_string_pretty(value).expect("serializes");
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| Error::Io { context: format!("writing {}", path.display()), source: e })
}

fn plan_table(plan: &Plan, all: bool) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let bs = plan.server.block_size;
    let _ = writeln!(
        s,
        "server: {} (as {})",
        plan.server.version.split(" on ").next().unwrap_or(""),
        plan.server.login_role
    );
    let _ = writeln!(s, "{:<24} {:>8} {:>8} {:>10} {:>8}  note", "database", "forks", "ranges", "size", "skipped");
    for d in &plan.databases {
        let forks: Vec<_> = plan.forks.iter().filter(|f| f.database == d.name && !f.excluded).collect();
        let ranges = plan.ranges.iter().filter(|r| plan.fork(r).database == d.name).count();
        let bytes: u64 = forks.iter().map(|f| f.blocks * bs).sum();
        let skipped = forks.iter().filter(|f| f.planned_skip.is_some()).count();
        let _ = writeln!(
            s,
            "{:<24} {:>8} {:>8} {:>10} {:>8}  {}",
            d.name,
            forks.len(),
            ranges,
            human_bytes(bytes),
            skipped,
            d.reason.as_deref().unwrap_or(d.outcome.as_str())
        );
    }
    let total: u64 = plan.planned_blocks() * bs;
    let _ = writeln!(
        s,
        "to read: {} in {} ranges of up to {} blocks",
        human_bytes(total),
        plan.ranges.len(),
        plan.range_blocks
    );
    if let Some(h) = &plan.hot_set {
        let _ =
            writeln!(s, "captured hot set, read first: {} in {} ranges", human_bytes(h.blocks() * bs), h.ranges.len());
        for d in &h.databases {
            let _ = writeln!(s, "  {}", d.describe());
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<16} {:<40} {:<18} {:<5} {:>10} {:>10}  action",
        "database", "relation", "kind", "fork", "blocks", "size"
    );
    let mut rows: Vec<_> = plan.forks.iter().filter(|f| !f.excluded).collect();
    rows.sort_by_key(|f| std::cmp::Reverse(f.blocks));
    let shown = rows.iter().enumerate().filter(|(i, f)| all || *i < 25 || f.planned_skip.is_some()).map(|(_, f)| *f);
    let mut n = 0;
    for f in shown {
        n += 1;
        let action = match (&f.planned_skip, &f.as_role) {
            (Some(sk), _) => {
                format!("skip: {}{}", sk.detail, sk.fix.as_deref().map(|x| format!("; fix: {x}")).unwrap_or_default())
            }
            (None, Some(r)) => format!("read as owner {r}"),
            (None, None) => "read".into(),
        };
        let kind = serde_json::to_value(f.kind).unwrap().as_str().unwrap_or("").to_string();
        let _ = writeln!(
            s,
            "{:<16} {:<40} {:<18} {:<5} {:>10} {:>10}  {}",
            f.database,
            format!("{}.{}", f.schema, f.name),
            kind,
            f.fork.as_str(),
            f.blocks,
            human_bytes(f.blocks * bs),
            action
        );
    }
    if n < rows.len() {
        let _ = writeln!(s, "... {} more forks (--all lists every fork, --json gives the whole plan)", rows.len() - n);
    }
    s
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn options_are_consistent() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn start_builds_the_documented_manual_input() {
        use clap::Parser;
        let cli = super::Cli::try_parse_from([
            "pghydrate",
            "start",
            "--instance",
            "green-1",
            "--state-machine-arn",
            "arn:aws:states:us-east-1:123456789012:stateMachine:pghydrate-hydrate",
            "--sessions",
            "4",
            "--mode",
            "buffer",
            "--maintenance",
            "vacuum-analyze",
            "--first",
            "public.orders",
            "--iam-user",
            "hydrator",
        ])
        .unwrap();
        let super::Command::Start(args) = cli.command else { panic!("not start") };
        let input = super::start_input(&args).unwrap();
        assert_eq!(
            input,
            serde_json::json!({"instance": "green-1", "sessions": 4, "mode": "buffer", "maintenance": "vacuum-analyze",
                               "first": ["public.orders"], "credentials": {"type": "iam", "user": "hydrator"}})
        );
        let bad = super::Cli::try_parse_from(["pghydrate", "start", "--instance", "1-bad", "--state-machine-arn", "x"])
            .unwrap();
        let super::Command::Start(args) = bad.command else { panic!("not start") };
        assert!(super::start_input(&args).unwrap_err().to_string().contains("instance:"));
        let name = pghydrate::aws::execution_name(
            &"a".repeat(63),
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_796_030_048),
        );
        assert_eq!(name, format!("hydrate-{}-20261130091408", "a".repeat(56)));
        assert!(name.len() <= 80);
    }
}
