//! Discovery: the server, its databases, pg_prewarm in each, and every relation fork with storage,
//! sized exactly with pg_relation_size (never relpages). Relations are addressed by oid; names are only
//! ever data (see [`crate::sql`] for where executed SQL text may come from). Every query here runs on a
//! session whose search path is pinned to pg_catalog, so its unqualified functions and operators are
//! the system's, whatever a database's users created.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::bounded::{bounded, client_bound, Failed};
use crate::connect::ConnectionSpec;
use crate::error::{describe, Error, Result};
use crate::pattern::{glob, RelationPattern};
use crate::plan::{
    order_ranges, BlockRange, DatabaseEntry, DatabaseOutcome, Fork, ForkEntry, Plan, RelKind, ServerInfo, Skip,
    SkipReason, PLAN_FORMAT,
};
use crate::sql::prewarm_call;

/// What to plan. Patterns are validated against the server: one that matches nothing is an error.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    pub include_databases: Vec<String>,
    pub exclude_databases: Vec<String>,
    pub include: Vec<RelationPattern>,
    pub exclude: Vec<RelationPattern>,
    pub first: Vec<RelationPattern>,
    pub range_blocks: u64,
    /// Create pg_prewarm where it is missing (CREATE EXTENSION). On by default.
    pub create_extension: bool,
    /// Change nothing (the `plan` command): where pg_prewarm is missing but available, plan as if
    /// `run` will create it, and say so in the database's reason.
    pub dry_run: bool,
    /// Lock waits (each up to the session's lock_timeout) the whole plan may spend sizing relations
    /// that another session holds ACCESS EXCLUSIVE. Once they are spent, a locked relation is planned
    /// as skipped (lock_timeout) without waiting: a migration holding a thousand tables cannot stall
    /// planning for a thousand lock timeouts (in a Lambda, past its 15 minutes).
    pub lock_attempts: u32,
    /// Do not read captured hot sets (`pghydrate capture`): order as if there were none.
    pub ignore_hot_set: bool,
    /// Databases planned at once, each on a session of its own (0: [`DATABASES_AT_ONCE`]), never more
    /// than half the server's free connection slots. A restored server's catalogs are cold too: one
    /// database at a time, a server of hundreds of tenant databases waits on one cold catalog read
    /// after another (and a Plan Lambda has 15 minutes).
    pub databases_at_once: usize,
}

/// Databases planned at once by default.
pub const DATABASES_AT_ONCE: usize = 8;

/// Databases excluded unless named by an include pattern: RDS's own administrative database, which
/// customers cannot connect to.
pub const DEFAULT_EXCLUDED_DATABASES: &[&str] = &["rdsadmin"];

pub(crate) async fn connect_any(spec: &ConnectionSpec) -> Result<(crate::connect::Session, String)> {
    let first = spec.initial_database().to_string();
    match spec.connect(&first).await {
        Ok(c) => Ok((c, first)),
        Err(e @ Error::Connect { .. }) if e.to_string().contains("3D000") && first != "postgres" => {
            warn!(database = %first, "database does not exist; discovering from \"postgres\"");
            Ok((spec.connect("postgres").await?, "postgres".into()))
        }
        Err(e) => Err(e),
    }
}

/// The client-side bound of a catalog statement ([`crate::bounded`]): a half-open connection while
/// planning fails the statement instead of hanging the plan.
fn catalog_bound(spec: &ConnectionSpec) -> Duration {
    client_bound(spec.statement_timeout(), Duration::from_secs(30))
}

/// The error of a catalog statement that gave no result.
fn catalog_error(spec: &ConnectionSpec, context: impl Into<String>, f: Failed) -> Error {
    f.into_error(spec.target(), &context.into())
}

pub async fn server_info(spec: &ConnectionSpec, client: &Client) -> Result<ServerInfo> {
    let statement = client.query_one(
        "SELECT current_setting('server_version_num')::int4,
                    version(),
                    current_setting('block_size')::int8,
                    current_user::text,
                    (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user),
                    current_setting('max_connections')::int4,
                    current_setting('superuser_reserved_connections')::int4
                      + coalesce(current_setting('reserved_connections', true)::int4, 0),
                    (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'client backend')::int4,
                    current_setting('io_method', true),
                    pg_is_in_recovery()",
        &[],
    );
    let row = bounded(spec, client, catalog_bound(spec), statement).await.map_err(|f| match f {
        Failed::Server(e) if e.code().is_some() => {
            Error::Unsupported(format!("server did not answer like PostgreSQL >= 10: {}", describe(&e)))
        }
        other => catalog_error(spec, "reading server settings", other),
    })?;
    let version_num: i32 = row.get(0);
    if version_num < 100000 {
        return Err(Error::Unsupported(format!("PostgreSQL {version_num} is older than 10")));
    }
    Ok(ServerInfo {
        version_num: version_num as u32,
        version: row.get(1),
        block_size: row.get::<_, i64>(2) as u64,
        login_role: row.get(3),
        is_superuser: row.get::<_, Option<bool>>(4).unwrap_or(false),
        max_connections: row.get::<_, i32>(5) as u32,
        reserved_connections: row.get::<_, i32>(6) as u32,
        connections_in_use: row.get::<_, i32>(7) as u32,
        io_method: row.get(8),
        in_recovery: row.get(9),
    })
}

struct DbRow {
    name: String,
    allow_conn: bool,
    template: bool,
    can_connect: bool,
}

/// Discovers everything and returns the plan. Connection and authentication failures on the first
/// database are errors; a database that fails later is skipped with its reason.
pub async fn make_plan(spec: &ConnectionSpec, opts: &PlanOptions) -> Result<Plan> {
    let started = Instant::now();
    if opts.range_blocks == 0 {
        return Err(Error::InvalidInput("range size must be at least 1 block".into()));
    }
    let (client, _) = connect_any(spec).await?;
    let server = server_info(spec, &client).await?;
    info!(server = %server.version, login_role = %server.login_role, superuser = server.is_superuser, "connected");
    let dbs = list_databases(spec, &client).await?;
    drop(client);
    check_database_patterns(opts, &dbs)?;

    let mut databases = Vec::new();
    let mut forks: Vec<ForkEntry> = Vec::new();
    // Per fork: Some((oid, fork)) for a shared catalog's fork (pg_authid, pg_database...).
    let mut shared_keys: Vec<Option<(u32, Fork)>> = Vec::new();
    // One budget of lock waits over every database, however many are planned at once.
    let lock_waits = AtomicU32::new(opts.lock_attempts.max(1));
    let mut stored_hot: Vec<(String, crate::hotset::StoredHotSet)> = Vec::new();
    let wanted = if opts.databases_at_once == 0 { DATABASES_AT_ONCE } else { opts.databases_at_once };
    let (at_once, note) = crate::run::effective_sessions(wanted.min(256) as u32, &server);
    if let Some(note) = note {
        info!(databases_at_once = at_once, "planning: {note}");
    }
    // `buffered` keeps the listed order: the plan is the same whatever finishes first.
    let planned: Vec<_> = futures_util::stream::iter(dbs.iter().map(|d| {
        let (lock_waits, server) = (&lock_waits, &server);
        async move {
            match database_left_out(d, opts, server) {
                Some(entry) => (entry, Vec::new(), None),
                None => plan_database(spec, d, opts, server, lock_waits).await,
            }
        }
    }))
    .buffered(at_once as usize)
    .collect()
    .await;
    for (d, (entry, listed, hot)) in dbs.iter().zip(planned) {
        databases.push(entry);
        if let Some(hot) = hot {
            stored_hot.push((d.name.clone(), hot));
        }
        for (f, shared) in listed {
            shared_keys.push(shared.then_some((f.oid, f.fork)));
            forks.push(f);
        }
    }
    let forks = read_shared_once(forks, &shared_keys);

    for p in opts.include.iter().chain(&opts.first) {
        if !forks.iter().any(|f| f.matched_by(p)) {
            // Patterns name tables; a user who names an index (or a TOAST relation) is told where it goes.
            let hint = forks
                .iter()
                .find_map(|f| {
                    let what = match f.kind {
                        RelKind::Index => "an index",
                        RelKind::ToastTable => "the TOAST table",
                        RelKind::ToastIndex => "the TOAST index",
                        _ => return None,
                    };
                    p.matches(&f.database, &f.schema, &f.name).then(|| {
                        format!(
                            "; {:?} is {what} of the table {:?}: patterns name tables, and a table's indexes and \
                             TOAST are read with it",
                            f.name, f.table
                        )
                    })
                })
                .unwrap_or_default();
            return Err(Error::InvalidInput(format!("relation pattern {:?} matches no relation{hint}", p.text)));
        }
    }

    let (spans, mut uses) = match_hot_sets(&forks, stored_hot, server.block_size);
    let (ranges, hot_ranges) = order_ranges(&forks, &opts.first, opts.range_blocks, &spans);
    let hot_set = (!uses.is_empty()).then(|| {
        count_used(&mut uses, &hot_ranges, &forks);
        crate::plan::HotSetPlan { databases: uses, ranges: hot_ranges }
    });
    if let Some(h) = &hot_set {
        info!(
            databases = h.databases.len(),
            ranges = h.ranges.len(),
            blocks = h.blocks(),
            "captured hot set read first"
        );
    }
    let plan = Plan {
        format: PLAN_FORMAT,
        created_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        server,
        range_blocks: opts.range_blocks,
        databases,
        forks,
        ranges,
        plan_seconds: started.elapsed().as_secs_f64(),
        hot_set,
    };
    info!(
        databases = plan.databases.iter().filter(|d| d.outcome == DatabaseOutcome::Planned).count(),
        forks = plan.forks.len(),
        ranges = plan.ranges.len(),
        bytes = plan.bytes(plan.planned_blocks()),
        seconds = plan.plan_seconds,
        "planned"
    );
    Ok(plan)
}

/// The databases a run selects, by name in byte order: its database patterns and the default
/// exclusions applied, templates, databases that refuse connections and those the login role may not
/// connect to left out (planning reports each of them with why). What the workflow's maintenance walks,
/// one database at a time, instead of a list carried in its state.
pub async fn selected_databases(spec: &ConnectionSpec, opts: &PlanOptions) -> Result<Vec<String>> {
    let (client, _) = connect_any(spec).await?;
    let server = server_info(spec, &client).await?;
    let dbs = list_databases(spec, &client).await?;
    let mut names: Vec<String> =
        dbs.iter().filter(|d| database_left_out(d, opts, &server).is_none()).map(|d| d.name.clone()).collect();
    names.sort();
    Ok(names)
}

async fn list_databases(spec: &ConnectionSpec, client: &Client) -> Result<Vec<DbRow>> {
    let statement = client.query(
        "SELECT datname::text, datallowconn, datistemplate,
                has_database_privilege(oid, 'CONNECT')
           FROM pg_catalog.pg_database ORDER BY datname",
        &[],
    );
    let rows = bounded(spec, client, catalog_bound(spec), statement)
        .await
        .map_err(|f| catalog_error(spec, "listing databases", f))?;
    Ok(rows
        .iter()
        .map(|r| DbRow { name: r.get(0), allow_conn: r.get(1), template: r.get(2), can_connect: r.get(3) })
        .collect())
}

/// A pattern naming a database that does not exist is a mistake the user wants to hear about before
/// anything is read.
fn check_database_patterns(opts: &PlanOptions, dbs: &[DbRow]) -> Result<()> {
    for p in &opts.include_databases {
        if !dbs.iter().any(|d| glob(p, &d.name)) {
            let names: Vec<&str> = dbs.iter().map(|d| d.name.as_str()).collect();
            return Err(Error::InvalidInput(format!(
                "database pattern {p:?} matches no database (databases: {})",
                names.join(", ")
            )));
        }
    }
    for p in opts.include.iter().chain(&opts.first).chain(&opts.exclude) {
        if !dbs.iter().any(|d| p.applies_to_database(&d.name)) {
            return Err(Error::InvalidInput(format!(
                "relation pattern {:?} names a database that does not exist",
                p.text
            )));
        }
    }
    Ok(())
}

fn skipped_database(name: &str, reason: String, counts_against_coverage: bool) -> DatabaseEntry {
    DatabaseEntry {
        name: name.into(),
        outcome: DatabaseOutcome::Skipped,
        reason: Some(reason),
        prewarm_schema: None,
        counts_against_coverage,
    }
}

/// Whether a database is left out before connecting to it, and why: patterns, templates, databases
/// that allow no connections, and a missing CONNECT privilege (which counts against coverage: the
/// user can fix it).
fn database_left_out(d: &DbRow, opts: &PlanOptions, server: &ServerInfo) -> Option<DatabaseEntry> {
    let included = if opts.include_databases.is_empty() {
        !DEFAULT_EXCLUDED_DATABASES.contains(&d.name.as_str())
    } else {
        opts.include_databases.iter().any(|p| glob(p, &d.name))
    };
    let excluded = |reason: String| DatabaseEntry {
        outcome: DatabaseOutcome::Excluded,
        ..skipped_database(&d.name, reason, false)
    };
    if let Some(p) = opts.exclude_databases.iter().find(|p| glob(p, &d.name)) {
        return Some(excluded(format!("excluded by pattern {p:?}")));
    }
    if !included {
        return Some(excluded("not matched by the include patterns (or excluded by default)".into()));
    }
    if d.template {
        return Some(skipped_database(&d.name, "template database".into(), false));
    }
    if !d.allow_conn {
        return Some(skipped_database(&d.name, "does not allow connections (datallowconn = false)".into(), false));
    }
    if !d.can_connect {
        let reason = format!(
            "no CONNECT privilege for {}; fix: GRANT CONNECT ON DATABASE {} TO {}",
            server.login_role,
            quote_ident(&d.name),
            quote_ident(&server.login_role)
        );
        return Some(skipped_database(&d.name, reason, true));
    }
    None
}

/// Connects to one database, makes sure pg_prewarm is there and lists its forks, each with whether it
/// is a shared catalog's. A database that cannot be connected to, checked or listed is skipped with
/// its reason; the other databases are still planned.
async fn plan_database(
    spec: &ConnectionSpec,
    d: &DbRow,
    opts: &PlanOptions,
    server: &ServerInfo,
    lock_waits: &AtomicU32,
) -> (DatabaseEntry, Vec<(ForkEntry, bool)>, Option<crate::hotset::StoredHotSet>) {
    let client = match spec.connect(&d.name).await {
        Ok(c) => c,
        Err(e) => {
            warn!(database = %d.name, error = %e, "database not connectable; skipped");
            return (skipped_database(&d.name, format!("cannot connect: {e}"), true), Vec::new(), None);
        }
    };
    let listed = async {
        let ext = ensure_extension(spec, &client, &d.name, opts, server.in_recovery).await?;
        let forks = list_forks(spec, &client, &d.name, server, lock_waits, None).await?;
        let hot = if opts.ignore_hot_set { None } else { crate::hotset::read_stored(&client, &d.name).await? };
        Ok::<_, Error>((ext, forks, hot))
    };
    let (ext, db_forks, hot) = match listed.await {
        Ok(x) => x,
        Err(e) => {
            warn!(database = %d.name, error = %e, "database could not be planned; skipped");
            return (skipped_database(&d.name, format!("could not be planned: {e}"), true), Vec::new(), None);
        }
    };
    let (entry, forks) = planned_forks(d, opts, ext, db_forks);
    (entry, forks, hot)
}

/// A database's listed forks with the plan's filters applied (relation patterns; pg_prewarm missing),
/// and its entry.
fn planned_forks(
    d: &DbRow,
    opts: &PlanOptions,
    (prewarm_schema, ext_problem, note): (Option<String>, Option<String>, Option<String>),
    db_forks: Vec<Listed>,
) -> (DatabaseEntry, Vec<(ForkEntry, bool)>) {
    let forks = db_forks
        .into_iter()
        .map(|listed| {
            let mut f = listed.entry;
            let included = opts.include.is_empty() || opts.include.iter().any(|p| f.matched_by(p));
            let excluded = opts.exclude.iter().any(|p| f.matched_by(p));
            if !included || excluded {
                f.excluded = true;
            } else if let Some(problem) = &ext_problem {
                f.planned_skip = Some(Skip {
                    reason: SkipReason::NoExtension,
                    detail: problem.clone(),
                    fix: Some("CREATE EXTENSION pg_prewarm (as a superuser or rds_superuser)".into()),
                });
            }
            (f, listed.kind_is_shared)
        })
        .collect();
    let entry = DatabaseEntry {
        name: d.name.clone(),
        outcome: if ext_problem.is_some() { DatabaseOutcome::Skipped } else { DatabaseOutcome::Planned },
        reason: ext_problem.or(note),
        prewarm_schema,
        counts_against_coverage: true,
    };
    (entry, forks)
}

/// A head start's plan: the captured hot sets' ranges alone, found without listing every relation of a
/// database (only the relations its hot set names, by oid), so that they can be read while
/// [`make_plan`] lists everything. The full plan's filters apply (database and relation patterns,
/// privileges; pg_prewarm is created where the full plan would create it), and no lock is waited for.
/// None when no database has a usable hot set, or with `--first` patterns (their tables come before
/// the hot set), or without hot sets (`ignore_hot_set`). Shared catalogs are left to the full plan.
///
/// The head start runs beside the full plan, and pghydrate takes at most half the server's free
/// connection slots in all ([`crate::run::effective_sessions`]): the full plan's sessions (databases
/// planned at once) come out of that first, and the head start gets what is left, for its own planning
/// sessions and then for its reading sessions (returned with the plan). None when nothing is left (a
/// server with few free slots): the full plan reads the hot set first, as without a head start.
pub async fn plan_hot_phase(spec: &ConnectionSpec, opts: &PlanOptions) -> Result<Option<(Plan, u32)>> {
    let started = Instant::now();
    if opts.ignore_hot_set || !opts.first.is_empty() || opts.range_blocks == 0 {
        return Ok(None);
    }
    // pg_prewarm is created here as the full plan would (`create_extension`): a database restored from a
    // source that never had it (the usual first restore) would otherwise have no head start, or one
    // only when the full plan's CREATE EXTENSION happened to come first.
    let opts = PlanOptions {
        create_extension: opts.create_extension && !opts.dry_run,
        dry_run: false,
        lock_attempts: 0,
        ..opts.clone()
    };
    let (client, _) = connect_any(spec).await?;
    let server = server_info(spec, &client).await?;
    let dbs = list_databases(spec, &client).await?;
    drop(client);
    check_database_patterns(&opts, &dbs)?;
    let lock_waits = AtomicU32::new(0);
    let wanted = if opts.databases_at_once == 0 { DATABASES_AT_ONCE } else { opts.databases_at_once };
    let (full_plan_sessions, connections) = head_start_connections(&server, wanted);
    if connections == 0 {
        info!(
            full_plan_sessions,
            "no head start: the full plan's sessions take all of the connection slots pghydrate may use"
        );
        return Ok(None);
    }
    let at_once = full_plan_sessions.min(connections);
    let planned: Vec<_> = futures_util::stream::iter(dbs.iter().map(|d| {
        let (opts, server, lock_waits) = (&opts, &server, &lock_waits);
        async move {
            if database_left_out(d, opts, server).is_some() {
                return None;
            }
            // Whatever fails here is the full plan's to report: the head start just does without.
            let client = spec.connect(&d.name).await.ok()?;
            let hot = crate::hotset::read_stored(&client, &d.name).await.ok()??;
            if hot.ignored.is_some() || hot.ranges.is_empty() {
                return None;
            }
            let ext = ensure_extension(spec, &client, &d.name, opts, server.in_recovery).await.ok()?;
            let mut oids: Vec<u32> = hot.ranges.iter().map(|r| r.relid).collect();
            oids.sort_unstable();
            oids.dedup();
            let listed = list_forks(spec, &client, &d.name, server, lock_waits, Some(&oids)).await.ok()?;
            let (entry, forks) = planned_forks(d, opts, ext, listed);
            Some((entry, forks, hot))
        }
    }))
    .buffered(at_once as usize)
    .collect()
    .await;
    let (mut databases, mut forks, mut stored) = (Vec::new(), Vec::new(), Vec::new());
    for (d, p) in dbs.iter().zip(planned) {
        let Some((entry, listed, hot)) = p else { continue };
        databases.push(entry);
        stored.push((d.name.clone(), hot));
        forks.extend(listed.into_iter().filter(|(_, shared)| !shared).map(|(f, _)| f));
    }
    let (spans, mut uses) = match_hot_sets(&forks, stored, server.block_size);
    let (_, hot_ranges) = order_ranges(&forks, &[], opts.range_blocks, &spans);
    if hot_ranges.is_empty() {
        return Ok(None);
    }
    count_used(&mut uses, &hot_ranges, &forks);
    let plan = Plan {
        format: PLAN_FORMAT,
        created_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        server,
        range_blocks: opts.range_blocks,
        databases,
        forks,
        ranges: hot_ranges.clone(),
        plan_seconds: started.elapsed().as_secs_f64(),
        hot_set: Some(crate::plan::HotSetPlan { databases: uses, ranges: hot_ranges }),
    };
    info!(
        ranges = plan.ranges.len(),
        bytes = plan.bytes(plan.planned_blocks()),
        seconds = plan.plan_seconds,
        connections,
        "head start: the captured hot set is read while the rest is planned"
    );
    Ok(Some((plan, connections)))
}

/// (the full plan's sessions, the most connections a head start may hold beside them): pghydrate takes
/// at most half the server's free slots in all, and the full plan's `databases_at_once` come first.
pub fn head_start_connections(server: &ServerInfo, databases_at_once: usize) -> (u32, u32) {
    let (full_plan, _) = crate::run::effective_sessions(databases_at_once.min(256) as u32, server);
    let (budget, _) = crate::run::effective_sessions(u32::MAX, server);
    (full_plan, budget.saturating_sub(full_plan))
}

/// What the hot phase reads, per database: its ranges counted into each database's `used` (a span may
/// have been clipped, or read whole as a `--first` table).
fn count_used(uses: &mut [crate::hotset::HotSetUse], hot_ranges: &[BlockRange], forks: &[ForkEntry]) {
    for r in hot_ranges {
        let db = &forks[r.fork as usize].database;
        if let Some(u) = uses.iter_mut().find(|u| &u.database == db) {
            u.used += 1;
        }
    }
}

/// Matches each database's stored hot ranges to the plan's forks: a range whose relation is gone, was
/// rewritten (its filenode changed), lies wholly past the fork's end now or belongs to a fork the plan
/// does not read is counted and left out. Returns the spans to read first and, per database, what
/// was left out (`used` is left to the caller, which counts the hot phase's ranges after ordering).
fn match_hot_sets(
    forks: &[ForkEntry],
    stored: Vec<(String, crate::hotset::StoredHotSet)>,
    block_size: u64,
) -> (Vec<crate::plan::HotSpan>, Vec<crate::hotset::HotSetUse>) {
    let align = (crate::hotset::FETCH_BYTES / block_size.max(1)).max(1);
    let index: std::collections::HashMap<(&str, u32, Fork), usize> =
        forks.iter().enumerate().map(|(i, f)| ((f.database.as_str(), f.oid, f.fork), i)).collect();
    let mut spans = Vec::new();
    let mut uses = Vec::new();
    for (db, hot) in stored {
        let mut u = crate::hotset::HotSetUse {
            database: db.clone(),
            captured_at: hot.captured_at.clone(),
            stored: hot.ranges.len(),
            ignored: hot.ignored.clone(),
            ..Default::default()
        };
        let mut matched = 0;
        for r in &hot.ranges {
            let Some(now) = r.filenode_now else {
                u.dropped += 1;
                continue;
            };
            if now != r.filenode {
                u.rewritten += 1;
                continue;
            }
            let found = r.fork.and_then(|fork| index.get(&(db.as_str(), r.relid, fork)));
            let Some(&i) = found else {
                u.not_planned += 1;
                continue;
            };
            let f = &forks[i];
            if f.excluded || f.planned_skip.is_some() || r.first < 0 || r.last < r.first {
                u.not_planned += 1;
                continue;
            }
            if r.first as u64 >= f.blocks {
                u.truncated += 1;
                continue;
            }
            matched += 1;
            // Whole snapshot blocks: the first read of any block fetches its whole 512 KiB, so the
            // rest of it costs nothing more now, and the plan gets far fewer, larger ranges.
            let (first, last) = crate::hotset::aligned(r.first as u64, r.last as u64, align);
            spans.push(crate::plan::HotSpan { fork: i as u32, first, last, heat: r.heat });
        }
        info!(database = %db, captured_at = ?u.captured_at, stored = u.stored, matched, dropped = u.dropped,
              rewritten = u.rewritten, truncated = u.truncated, not_planned = u.not_planned, "captured hot set");
        uses.push(u);
    }
    (spans, uses)
}

/// Shared catalogs (pg_authid, pg_database, ...) appear in every database and are read once: from the
/// first database that can read them (pg_prewarm installed, not excluded, not refused), else listed
/// once from the first database, with its reason. Deciding this after every database is listed means
/// a first database without pg_prewarm no longer leaves them unread when another could read them.
fn read_shared_once(forks: Vec<ForkEntry>, shared_keys: &[Option<(u32, Fork)>]) -> Vec<ForkEntry> {
    let readable = |f: &ForkEntry| !f.excluded && f.planned_skip.is_none();
    let mut chosen: std::collections::HashMap<(u32, Fork), usize> = std::collections::HashMap::new();
    for (i, (f, key)) in forks.iter().zip(shared_keys).enumerate() {
        if let Some(key) = key {
            match chosen.get(key) {
                Some(&j) if readable(&forks[j]) || !readable(f) => {}
                _ => {
                    chosen.insert(*key, i);
                }
            }
        }
    }
    forks
        .into_iter()
        .zip(shared_keys)
        .enumerate()
        .filter(|(i, (_, key))| key.is_none_or(|k| chosen.get(&k) == Some(i)))
        .map(|(_, (f, _))| f)
        .collect()
}

/// Returns the schema pg_prewarm's extension lives in (a label: the call itself is resolved again on
/// the server by every warming session), or why it is not available, and a note for a dry run that
/// plans as if `run` will create it.
async fn ensure_extension(
    spec: &ConnectionSpec,
    client: &Client,
    db: &str,
    opts: &PlanOptions,
    standby: bool,
) -> Result<(Option<String>, Option<String>, Option<String>)> {
    let bound = catalog_bound(spec);
    // The schema of the extension's own pg_prewarm function, if it is there now.
    let prewarm_schema = || async {
        let found = bounded(spec, client, bound, prewarm_call(client)).await;
        Ok::<_, Error>(found.map_err(|f| catalog_error(spec, "finding pg_prewarm", f))?.map(|(schema, _)| schema))
    };
    if let Some(schema) = prewarm_schema().await? {
        return Ok((Some(schema), None, None));
    }
    let statement = client.query_opt(
        "SELECT n.nspname::text FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
          WHERE e.extname = 'pg_prewarm'",
        &[],
    );
    if let Some(row) =
        bounded(spec, client, bound, statement).await.map_err(|f| catalog_error(spec, "finding pg_prewarm", f))?
    {
        let schema: String = row.get(0);
        // Created by another session between the two lookups (the head start and the full plan, or two
        // runs, planning the same database at once): its function is there now.
        if let Some(schema) = prewarm_schema().await? {
            return Ok((Some(schema), None, None));
        }
        return Ok((
            None,
            Some(format!(
                "the pg_prewarm extension in schema {schema:?} has no member function pg_prewarm(regclass, text, text, \
                 bigint, bigint): update it (ALTER EXTENSION pg_prewarm UPDATE)"
            )),
            None,
        ));
    }
    let statement = client.query_opt("SELECT 1 FROM pg_catalog.pg_available_extensions WHERE name = 'pg_prewarm'", &[]);
    let available = bounded(spec, client, bound, statement)
        .await
        .map_err(|f| catalog_error(spec, "looking for pg_prewarm", f))?
        .is_some();
    if !available {
        return Ok((None, Some("pg_prewarm is not installed on the server (contrib package missing)".into()), None));
    }
    if standby {
        return Ok((
            None,
            Some(
                "pg_prewarm is not installed, and this server is a standby (in recovery), where nothing can be \
                 created: CREATE EXTENSION pg_prewarm on its primary (it replicates), then run again"
                    .into(),
            ),
            None,
        ));
    }
    if !opts.create_extension {
        return Ok((None, Some("pg_prewarm is not installed (and --no-create-extension was given)".into()), None));
    }
    if opts.dry_run {
        return Ok((None, None, Some("pg_prewarm missing: run will CREATE EXTENSION pg_prewarm SCHEMA public".into())));
    }
    // In `public`, named: with the search path pinned to pg_catalog, the default would be pg_catalog.
    // A same-signature function planted there beforehand makes this fail (PostgreSQL refuses to adopt
    // it into the extension), and the database is skipped with that reason.
    let create = client.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm SCHEMA public");
    match bounded(spec, client, bound, create).await {
        Ok(()) => {
            info!(database = %db, "created extension pg_prewarm in schema public");
            match prewarm_schema().await? {
                Some(schema) => Ok((Some(schema), None, None)),
                None => Ok((None, Some("pg_prewarm was created but its function is not there".into()), None)),
            }
        }
        Err(Failed::Server(e)) => {
            // Another session may have created it at the same time (the head start and the full plan
            // plan the same database at once, or two runs): its CREATE won, ours failed on the
            // catalog's unique name. The extension's own function is what counts.
            if let Some(schema) = prewarm_schema().await? {
                info!(database = %db, schema = %schema, error = %describe(&e),
                      "pg_prewarm was created by another session at the same time");
                return Ok((Some(schema), None, None));
            }
            warn!(database = %db, error = %describe(&e), "pg_prewarm missing and not creatable");
            Ok((None, Some(format!("pg_prewarm is not installed and could not be created: {}", describe(&e))), None))
        }
        Err(f) => Err(catalog_error(spec, "creating pg_prewarm", f)),
    }
}

struct Listed {
    entry: ForkEntry,
    kind_is_shared: bool,
}

/// The fix to propose when the server refused a read that the plan expected to work.
/// `pg_read_all_data` exists from PostgreSQL 14 on; a work item of the workflow carries no server
/// version (0), so both are said.
pub fn read_all_data_fix(server: &ServerInfo) -> String {
    let role = if server.login_role.is_empty() { "<login role>".to_string() } else { quote_ident(&server.login_role) };
    match server.major() {
        0 => format!("GRANT pg_read_all_data TO {role} (PostgreSQL 14 and later; before 14, GRANT SELECT on the table)"),
        m if m < 14 => format!("GRANT SELECT on the table TO {role}, or run as a superuser (pg_read_all_data exists from PostgreSQL 14 on)"),
        _ => format!("GRANT pg_read_all_data TO {role}"),
    }
}

async fn list_forks(
    spec: &ConnectionSpec,
    client: &Client,
    db: &str,
    server: &ServerInfo,
    lock_waits: &AtomicU32,
    only: Option<&[u32]>,
) -> Result<Vec<Listed>> {
    // pg_prewarm's privilege check is SELECT on the relation. For an index, current minor releases
    // (seen on 15.18, 16.15, 17.11, 18.6) check the index's table instead; older minors checked the
    // index itself, whose missing ACL makes it owner-only. The plan predicts the current rule; at run
    // time a refusal falls back to acting as the owner, or is reported as `permission`.
    // TOAST tables have no ACL: owner-only (and so are their indexes, whose table is the TOAST table).
    let set_priv = if server.major() >= 16 { "SET" } else { "MEMBER" };
    // pg_read_all_data exists from PostgreSQL 14 on; before, only a superuser reads what one owns.
    let superuser_owned_fix = if server.major() >= 14 {
        "format('GRANT pg_read_all_data TO %I', current_user)"
    } else {
        "'run pghydrate as a superuser (pg_read_all_data exists from PostgreSQL 14 on)'"
    };
    // A partition's ancestors up to the root (PostgreSQL 12+: pg_partition_ancestors), so that a pattern
    // naming a partitioned table matches its partitions. Before 12, partitions match by their own name.
    let ancestors = |column: &str| {
        if server.major() >= 12 {
            format!(
                "CASE WHEN coalesce(owner_tbl.relispartition, b.relispartition) THEN
                   (SELECT pg_catalog.array_agg({column} ORDER BY a.n)
                      FROM pg_catalog.pg_partition_ancestors(coalesce(owner_tbl.oid, b.oid)) WITH ORDINALITY a(relid, n)
                      JOIN pg_catalog.pg_class ac ON ac.oid = a.relid::oid
                      JOIN pg_catalog.pg_namespace an ON an.oid = ac.relnamespace
                     WHERE a.relid::oid <> coalesce(owner_tbl.oid, b.oid)) END"
            )
        } else {
            "NULL::text[]".to_string()
        }
    };
    let (ancestor_schemas, ancestor_names) = (ancestors("an.nspname::text"), ancestors("ac.relname::text"));
    let sql = format!(
        "WITH rels AS (
           SELECT c.oid, c.relnamespace, c.relname, c.relkind, c.relisshared, c.relowner, c.relpages,
                  i.indrelid,
                  CASE WHEN c.relkind = 'i' THEN i.indrelid ELSE c.oid END AS base_oid
             FROM pg_catalog.pg_class c
             LEFT JOIN pg_catalog.pg_index i ON i.indexrelid = c.oid
            WHERE c.relkind IN ('r', 'i', 't', 'm', 'S') AND c.relpersistence <> 't'
              AND ($2::pg_catalog.oid[] IS NULL OR c.oid = ANY($2::pg_catalog.oid[]))
         )
         SELECT r.oid AS oid, rn.nspname::text AS schema, r.relname::text AS name, r.relkind::text AS relkind,
                r.relisshared AS shared,
                pg_catalog.pg_get_userbyid(r.relowner)::text AS owner,
                (tn.nspname || '.' || coalesce(owner_tbl.relname, b.relname))::text AS table_label,
                b.relkind::text AS base_kind,
                CASE WHEN r.oid = ANY($1) THEN NULL ELSE coalesce(pg_catalog.pg_relation_size(r.oid, 'main'), 0) END AS size_main,
                CASE WHEN r.oid = ANY($1) THEN NULL ELSE coalesce(pg_catalog.pg_relation_size(r.oid, 'fsm'), 0) END AS size_fsm,
                CASE WHEN r.oid = ANY($1) THEN NULL ELSE coalesce(pg_catalog.pg_relation_size(r.oid, 'vm'), 0) END AS size_vm,
                CASE WHEN r.oid = ANY($1) THEN NULL ELSE coalesce(pg_catalog.pg_relation_size(r.oid, 'init'), 0) END AS size_init,
                pg_catalog.has_table_privilege(r.oid, 'SELECT')
                  OR (r.relkind = 'i' AND pg_catalog.has_table_privilege(r.indrelid, 'SELECT')) AS readable,
                pg_catalog.pg_has_role(r.relowner, '{set_priv}') AS owner_settable,
                (SELECT rolsuper FROM pg_catalog.pg_roles WHERE oid = r.relowner) AS owner_is_super,
                CASE WHEN r.relkind IN ('r', 'm', 'S')
                       THEN format('GRANT SELECT ON %I.%I TO %I', rn.nspname, r.relname, current_user)
                     WHEN r.relkind = 'i' AND b.relkind <> 't'
                       THEN format('GRANT SELECT ON %I.%I TO %I', bn.nspname, b.relname, current_user)
                     WHEN (SELECT rolsuper FROM pg_catalog.pg_roles WHERE oid = r.relowner)
                       THEN {superuser_owned_fix}
                     ELSE format('GRANT %I TO %I', pg_catalog.pg_get_userbyid(r.relowner), current_user) END AS fix,
                r.relpages::int8 AS relpages,
                tn.nspname::text AS table_schema,
                {ancestor_schemas} AS ancestor_schemas,
                {ancestor_names} AS ancestor_names
           FROM rels r
           JOIN pg_catalog.pg_namespace rn ON rn.oid = r.relnamespace
           JOIN pg_catalog.pg_class b ON b.oid = r.base_oid
           JOIN pg_catalog.pg_namespace bn ON bn.oid = b.relnamespace
           LEFT JOIN pg_catalog.pg_class owner_tbl ON b.relkind = 't' AND owner_tbl.reltoastrelid = b.oid
           JOIN pg_catalog.pg_namespace tn ON tn.oid = coalesce(owner_tbl.relnamespace, b.relnamespace)
          ORDER BY r.oid"
    );
    // pg_relation_size takes an AccessShareLock: relations that another session holds (or waits for)
    // ACCESS EXCLUSIVE are sized one by one below, so that one DDL cannot stall the whole plan.
    let mut rows = None;
    for attempt in 1..=3 {
        let statement = client.query_one(
            "SELECT coalesce(array_agg(DISTINCT relation), '{}') FROM pg_catalog.pg_locks
              WHERE locktype = 'relation' AND mode = 'AccessExclusiveLock' AND relation IS NOT NULL
                AND database IN (0, (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()))",
            &[],
        );
        let locked: Vec<u32> = bounded(spec, client, catalog_bound(spec), statement)
            .await
            .map_err(|f| catalog_error(spec, "reading pg_locks", f))?
            .get(0);
        let only: Option<Vec<u32>> = only.map(<[u32]>::to_vec);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&locked, &only];
        match bounded(spec, client, catalog_bound(spec), client.query(&sql, &params)).await {
            Ok(r) => {
                rows = Some(r);
                break;
            }
            Err(Failed::Server(e))
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) && attempt < 3 =>
            {
                warn!(database = %db, "a relation was locked while sizing; sizing again");
            }
            Err(f) => return Err(catalog_error(spec, format!("listing relations of database {db:?}"), f)),
        }
    }
    let rows = rows.expect("sized or returned");
    let bs = server.block_size as i64;
    let mut out = Vec::with_capacity(rows.len() * 2);
    for row in rows {
        let oid: u32 = row.get("oid");
        let schema: String = row.get("schema");
        let relkind: String = row.get("relkind");
        let shared: bool = row.get("shared");
        let base_kind: String = row.get("base_kind");
        let kind = match (relkind.as_str(), base_kind.as_str()) {
            ("r", _) => RelKind::Table,
            ("t", _) => RelKind::ToastTable,
            ("i", "t") => RelKind::ToastIndex,
            ("i", _) => RelKind::Index,
            ("m", _) => RelKind::MaterializedView,
            _ => RelKind::Sequence,
        };
        // has_table_privilege answers NULL for a relation that this statement's snapshot lists but that
        // was dropped (committed) before the row was computed: a migration during planning.
        let readable: Option<bool> = row.get("readable");
        let owner_settable: bool = row.get::<_, Option<bool>>("owner_settable").unwrap_or(false);
        let owner_is_super: bool = row.get::<_, Option<bool>>("owner_is_super").unwrap_or(false);
        let owner: String = row.get("owner");
        let (as_role, planned_skip) = if readable.is_none() {
            info!(database = %db, oid, "relation dropped while it was being listed");
            let detail = "dropped while the plan listed it".to_string();
            (None, Some(Skip { reason: SkipReason::Dropped, detail, fix: None }))
        } else if server.is_superuser || readable == Some(true) {
            (None, None)
        } else if owner_settable && !owner_is_super {
            (Some(owner.clone()), None)
        } else {
            let fix: String = row.get("fix");
            (
                None,
                Some(Skip {
                    reason: SkipReason::Permission,
                    detail: format!(
                        "{} may not read it (pg_prewarm needs SELECT on it{}) and cannot act as its owner {}",
                        server.login_role,
                        match kind {
                            RelKind::Index => ", or on its table",
                            RelKind::ToastTable | RelKind::ToastIndex => ": TOAST relations are owner-only",
                            _ => "",
                        },
                        owner
                    ),
                    fix: Some(fix),
                }),
            )
        };
        let table_schema: String = row.get("table_schema");
        let partition_of: Vec<[String; 2]> = {
            let schemas: Vec<String> = row.get::<_, Option<Vec<String>>>("ancestor_schemas").unwrap_or_default();
            let names: Vec<String> = row.get::<_, Option<Vec<String>>>("ancestor_names").unwrap_or_default();
            schemas.into_iter().zip(names).map(|(s, n)| [s, n]).collect()
        };
        let mut sizes: [Option<i64>; 4] =
            [row.get("size_main"), row.get("size_fsm"), row.get("size_vm"), row.get("size_init")];
        let mut planned_skip = planned_skip;
        if sizes[0].is_none() && readable.is_some() {
            match size_locked(spec, client, oid, lock_waits).await? {
                Some(s) => sizes = s.map(Some),
                None => {
                    let estimate: i64 = row.get("relpages");
                    sizes = [Some(estimate.max(0) * bs), Some(0), Some(0), Some(0)];
                    planned_skip = Some(Skip {
                        reason: SkipReason::LockTimeout,
                        detail: format!(
                            "held ACCESS EXCLUSIVE by another session throughout planning, and tried once more \
                             after warming; size unknown, about {estimate} blocks by relpages"
                        ),
                        fix: Some("run again once the lock is released".into()),
                    });
                }
            }
        }
        for (i, fork) in Fork::ALL.into_iter().enumerate() {
            let bytes: i64 = sizes[i].unwrap_or(0);
            if fork != Fork::Main && bytes == 0 {
                continue;
            }
            out.push(Listed {
                kind_is_shared: shared,
                entry: ForkEntry {
                    database: db.to_string(),
                    schema: schema.clone(),
                    name: row.get("name"),
                    oid,
                    kind,
                    fork,
                    blocks: (bytes / bs) as u64,
                    table: row.get("table_label"),
                    owner: owner.clone(),
                    as_role: as_role.clone(),
                    owner_settable: owner_settable && !owner_is_super,
                    planned_skip: planned_skip.clone(),
                    excluded: false,
                    table_schema: Some(table_schema.clone()).filter(|t| *t != schema),
                    partition_of: partition_of.clone(),
                },
            });
        }
    }
    Ok(out)
}

/// Sizes one relation's four forks, each attempt waiting up to lock_timeout and spending one of
/// `lock_waits`. None: still locked, or no wait left (then nothing is tried).
async fn size_locked(
    spec: &ConnectionSpec,
    client: &Client,
    oid: u32,
    lock_waits: &AtomicU32,
) -> Result<Option<[i64; 4]>> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&oid];
    while lock_waits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| w.checked_sub(1)).is_ok() {
        let statement = client.query_one(
            "SELECT coalesce(pg_catalog.pg_relation_size($1::pg_catalog.oid::pg_catalog.regclass, 'main'), 0),
                        coalesce(pg_catalog.pg_relation_size($1::pg_catalog.oid::pg_catalog.regclass, 'fsm'), 0),
                        coalesce(pg_catalog.pg_relation_size($1::pg_catalog.oid::pg_catalog.regclass, 'vm'), 0),
                        coalesce(pg_catalog.pg_relation_size($1::pg_catalog.oid::pg_catalog.regclass, 'init'), 0)",
            &params,
        );
        match bounded(spec, client, catalog_bound(spec), statement).await {
            Ok(r) => return Ok(Some([r.get(0), r.get(1), r.get(2), r.get(3)])),
            Err(Failed::Server(e)) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                info!(oid, waits_left = lock_waits.load(Ordering::Relaxed), "relation locked while planning");
            }
            Err(f) => return Err(catalog_error(spec, format!("sizing relation {oid}"), f)),
        }
    }
    Ok(None)
}

/// Sizes again the relations held ACCESS EXCLUSIVE throughout planning (planned as skipped,
/// `lock_timeout`), one session per database and one try each under the session's lock_timeout. Each
/// that can be sized now is planned: its main fork gets its real size, its other forks are added, and
/// their ranges are appended to the plan and returned, to be read. The others stay skipped.
pub async fn plan_locked_again(spec: &ConnectionSpec, plan: &mut Plan) -> Vec<BlockRange> {
    let locked: Vec<usize> = (0..plan.forks.len())
        .filter(|&i| {
            let f = &plan.forks[i];
            !f.excluded
                && f.fork == Fork::Main
                && f.planned_skip.as_ref().is_some_and(|s| s.reason == SkipReason::LockTimeout)
        })
        .collect();
    let mut databases: Vec<&str> = locked.iter().map(|&i| plan.forks[i].database.as_str()).collect();
    databases.dedup();
    let databases: Vec<String> = databases.into_iter().map(str::to_string).collect();
    let bs = plan.server.block_size as i64;
    let mut added = Vec::new();
    for db in databases {
        let client = match spec.connect(&db).await {
            Ok(c) => c,
            Err(e) => {
                warn!(database = %db, error = %e, "cannot size the relations that were locked while planning");
                continue;
            }
        };
        let here: Vec<usize> = locked.iter().copied().filter(|&i| plan.forks[i].database == db).collect();
        for i in here {
            let oid = plan.forks[i].oid;
            let sizes = match size_locked(spec, &client, oid, &AtomicU32::new(1)).await {
                Ok(Some(sizes)) => sizes,
                Ok(None) => {
                    info!(database = %db, relation = %plan.forks[i].name, "still locked after warming; stays skipped");
                    continue;
                }
                Err(e) => {
                    warn!(database = %db, relation = %plan.forks[i].name, error = %e, "cannot size a relation locked while planning");
                    continue;
                }
            };
            for (k, fork) in Fork::ALL.into_iter().enumerate() {
                let blocks = (sizes[k].max(0) / bs) as u64;
                let index = if fork == Fork::Main {
                    plan.forks[i].blocks = blocks;
                    plan.forks[i].planned_skip = None;
                    i
                } else if blocks > 0 {
                    plan.forks.push(ForkEntry { fork, blocks, ..plan.forks[i].clone() });
                    plan.forks.len() - 1
                } else {
                    continue;
                };
                for (first, last) in crate::plan::split_blocks(blocks, plan.range_blocks) {
                    added.push(BlockRange { fork: index as u32, first, last });
                }
            }
            info!(database = %db, relation = %plan.forks[i].name, "locked while planning; sized now and planned");
        }
    }
    plan.ranges.extend(added.iter().copied());
    added
}

/// Client-side identifier quoting, used only for text shown to people (never for executed SQL).
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(db: &str, oid: u32, skipped: bool) -> ForkEntry {
        ForkEntry {
            database: db.into(),
            schema: "pg_catalog".into(),
            name: format!("shared{oid}"),
            oid,
            kind: RelKind::Table,
            fork: Fork::Main,
            blocks: 1,
            table: format!("pg_catalog.shared{oid}"),
            owner: "postgres".into(),
            as_role: None,
            owner_settable: false,
            planned_skip: skipped.then(|| Skip { reason: SkipReason::NoExtension, detail: String::new(), fix: None }),
            excluded: false,
            table_schema: None,
            partition_of: Vec::new(),
        }
    }

    /// The head start and the full plan together hold no more than pghydrate's half of the free
    /// connection slots: planning's sessions first, the head start what is left, or none.
    #[test]
    fn a_head_start_holds_only_what_planning_leaves_of_half_the_free_slots() {
        let server = |max: u32, in_use: u32| ServerInfo {
            max_connections: max,
            reserved_connections: 3,
            connections_in_use: in_use,
            ..ServerInfo::example()
        };
        // 97 free: 48 for pghydrate, 8 planning, 40 for the head start.
        assert_eq!(head_start_connections(&server(100, 0), DATABASES_AT_ONCE), (8, 40));
        // 16 free: 8 for pghydrate, all planning's: no head start.
        assert_eq!(head_start_connections(&server(20, 1), DATABASES_AT_ONCE), (8, 0));
        // 22 free: 11, 8 planning, 3 left.
        assert_eq!(head_start_connections(&server(25, 0), DATABASES_AT_ONCE), (8, 3));
        // A nearly full server: pghydrate takes one slot, planning's.
        assert_eq!(head_start_connections(&server(10, 7), DATABASES_AT_ONCE), (1, 0));
        for (max, in_use, at_once) in [(100, 0, 8), (20, 1, 8), (25, 0, 2), (10, 7, 8), (500, 100, 64)] {
            let s = server(max, in_use);
            let (planning, head) = head_start_connections(&s, at_once);
            let free = max - 3 - in_use;
            assert!(planning + head <= (free / 2).max(1), "{max} {in_use} {at_once}: {planning} + {head}");
        }
    }

    #[test]
    fn shared_catalogs_are_read_from_the_first_database_that_can_read_them() {
        // a: no pg_prewarm (skipped); b: can read; c: can read too.
        let forks = vec![shared("a", 1260, true), shared("b", 1260, false), shared("c", 1260, false)];
        let keys = vec![Some((1260, Fork::Main)); 3];
        let kept = read_shared_once(forks, &keys);
        assert_eq!(kept.iter().map(|f| f.database.as_str()).collect::<Vec<_>>(), ["b"]);
        // Nobody can read it: listed once, from the first database, with its reason.
        let kept = read_shared_once(vec![shared("a", 1, true), shared("b", 1, true)], &[Some((1, Fork::Main)); 2]);
        assert_eq!(kept.iter().map(|f| f.database.as_str()).collect::<Vec<_>>(), ["a"]);
        // Not shared: every database keeps its own.
        let kept = read_shared_once(vec![shared("a", 5, false), shared("b", 5, false)], &[None, None]);
        assert_eq!(kept.len(), 2);
    }

    #[test]
    fn databases_are_left_out_before_connecting_only_for_a_stated_reason() {
        let server = ServerInfo::example();
        let db = |name: &str| DbRow { name: name.into(), allow_conn: true, template: false, can_connect: true };
        let verdict = |d: &DbRow, opts: &PlanOptions| {
            database_left_out(d, opts, &server).map(|e| (e.outcome, e.counts_against_coverage, e.reason.unwrap()))
        };
        let all = PlanOptions::default();
        assert_eq!(verdict(&db("app"), &all), None);
        let (outcome, counts, _) = verdict(&db("rdsadmin"), &all).unwrap();
        assert_eq!((outcome, counts), (DatabaseOutcome::Excluded, false));
        let named = PlanOptions { include_databases: vec!["rds*".into()], ..Default::default() };
        assert_eq!(verdict(&db("rdsadmin"), &named), None, "an include pattern brings back a default exclusion");
        let (outcome, _, why) = verdict(&db("app"), &named).unwrap();
        assert_eq!(outcome, DatabaseOutcome::Excluded, "{why}");
        let excluded = PlanOptions { exclude_databases: vec!["a*".into()], ..Default::default() };
        let (outcome, _, why) = verdict(&db("app"), &excluded).unwrap();
        assert_eq!((outcome, why.as_str()), (DatabaseOutcome::Excluded, "excluded by pattern \"a*\""));
        let template = DbRow { template: true, ..db("template1") };
        assert_eq!(verdict(&template, &all).map(|v| (v.0, v.1)), Some((DatabaseOutcome::Skipped, false)));
        let closed = DbRow { allow_conn: false, ..db("closed") };
        assert_eq!(verdict(&closed, &all).map(|v| (v.0, v.1)), Some((DatabaseOutcome::Skipped, false)));
        // No CONNECT: the user can fix it, so it counts against coverage and the fix is named.
        let refused = DbRow { can_connect: false, ..db("my db") };
        let (outcome, counts, why) = verdict(&refused, &all).unwrap();
        assert_eq!((outcome, counts), (DatabaseOutcome::Skipped, true));
        assert!(why.ends_with("GRANT CONNECT ON DATABASE \"my db\" TO \"hydrator\""), "{why}");
    }
}
