//! Maintenance after warming: ANALYZE (default), VACUUM ANALYZE, or nothing, table by table, under the
//! same statement/lock timeouts and deadline rule as warming.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::bounded::{bounded, bounded_or_stopped, client_bound, stop_asked, Failed};
use crate::connect::ConnectionSpec;
use crate::error::{Disposition, Error};
use crate::sql::maintenance_statement;

/// What maintenance follows warming. Read from the CLI, a trigger's overrides, the deployment's defaults
/// and continuations; anything else is refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", try_from = "String")]
pub enum Maintenance {
    None,
    Analyze,
    VacuumAnalyze,
}

/// One table to maintain: its oid, and its name as a label for the report. The statement is built by
/// the server from the oid when it runs ([`crate::sql`]); nothing here is ever SQL.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MaintenanceTarget {
    pub database: String,
    pub table: String,
    pub oid: u32,
    /// How many times a deadline cut this table's statement short. The first cut puts it back (the
    /// next call starts with it, with its whole window); the second reports it, with the statement to
    /// run from a host: a statement longer than any call is never retried forever.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cut: u32,
    /// A partition whose partitioned ancestor is maintained too: that ANALYZE recurses into it, so
    /// the partition gets VACUUM only (or nothing, when the action is ANALYZE: it is not a target).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vacuum_only: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The tables to maintain, and the databases whose tables could not be listed (with why): reported,
/// never silently left out.
#[derive(Debug, Default)]
pub struct Targets {
    pub targets: Vec<MaintenanceTarget>,
    pub unlisted: Vec<MaintenanceResult>,
}

/// What became of one maintenance statement.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MaintenanceOutcome {
    Done,
    /// Not run or not finished; the result's reason says why (and, when cut, the statement to run).
    Skipped,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MaintenanceResult {
    pub database: String,
    pub table: String,
    pub action: String,
    pub outcome: MaintenanceOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub seconds: f64,
}

#[derive(Debug, Clone)]
pub struct MaintainOptions {
    pub action: Maintenance,
    pub statement_timeout: Duration,
    pub lock_timeout: Duration,
    pub deadline: Option<Instant>,
    pub margin: Duration,
    /// Set to stop: no new statement starts (Ctrl-C, SIGTERM).
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// Lists the tables to maintain: tables, partitions, partitioned tables and materialized views of
/// `databases` that are not in system schemas and for which `excluded(database, schema, table)` is
/// false. A database whose tables cannot be listed is reported in `unlisted`.
pub async fn targets(
    spec: &ConnectionSpec,
    databases: &[String],
    action: Maintenance,
    excluded: impl Fn(&str, &str, &str) -> bool,
) -> Targets {
    let mut out = Targets::default();
    for db in databases {
        let listed = async {
            let client = spec.connect(db).await?;
            let bound = client_bound(spec.statement_timeout(), Duration::from_secs(30));
            let version = client.query_one("SELECT current_setting('server_version_num')::int4", &[]);
            let version: i32 = bounded(spec, &client, bound, version)
                .await
                .map_err(|f| f.into_error(format!("database {db:?}"), "reading the server version"))?
                .get(0);
            let ancestors = if version >= 120000 {
                "CASE WHEN c.relispartition THEN (SELECT pg_catalog.array_agg(a.relid::oid)
                   FROM pg_catalog.pg_partition_ancestors(c.oid) a WHERE a.relid::oid <> c.oid) END"
            } else {
                "NULL::oid[]"
            };
            let sql = format!(
                "SELECT c.oid, n.nspname::text, c.relname::text, {ancestors}, c.relkind = 'p'
                   FROM pg_catalog.pg_class c
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.relkind IN ('r', 'p', 'm') AND c.relpersistence <> 't'
                    AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_toast%'
                  ORDER BY c.oid"
            );
            let list = client.query(&sql, &[]);
            bounded(spec, &client, bound, list)
                .await
                .map_err(|f| f.into_error(format!("database {db:?}"), "listing the tables to maintain"))
        };
        match listed.await {
            Ok(rows) => {
                let partitioned: std::collections::HashSet<u32> =
                    rows.iter().filter(|r| r.get::<_, bool>(4)).map(|r| r.get::<_, u32>(0)).collect();
                let rows: Vec<(u32, String, String, Vec<u32>)> = rows
                    .iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2), r.get::<_, Option<Vec<u32>>>(3).unwrap_or_default()))
                    .collect();
                // A partition follows its partitioned ancestors: excluding `orders` excludes its partitions.
                let names: std::collections::HashMap<u32, (&str, &str)> =
                    rows.iter().map(|(o, s, n, _)| (*o, (s.as_str(), n.as_str()))).collect();
                let is_excluded = |schema: &str, name: &str, ancestors: &[u32]| {
                    excluded(db, schema, name)
                        || ancestors.iter().filter_map(|a| names.get(a)).any(|(s, n)| excluded(db, s, n))
                };
                let mut listed = Vec::new();
                for (oid, schema, name, ancestors) in &rows {
                    if !is_excluded(schema, name, ancestors) {
                        listed.push((*oid, format!("{schema}.{name}"), ancestors.clone()));
                    }
                }
                // ANALYZE of a partitioned table recurses into its partitions: a partition whose
                // ancestor is maintained is not analyzed again on its own.
                let maintained: std::collections::HashSet<u32> = listed.iter().map(|(o, _, _)| *o).collect();
                for (oid, table, ancestors) in listed {
                    let covered = ancestors.iter().any(|a| maintained.contains(a));
                    // A covered partition has nothing left to do but VACUUM, and a covered
                    // partitioned table (no storage of its own) nothing at all.
                    if covered && (action != Maintenance::VacuumAnalyze || partitioned.contains(&oid)) {
                        continue;
                    }
                    out.targets.push(MaintenanceTarget {
                        database: db.clone(),
                        table,
                        oid,
                        cut: 0,
                        vacuum_only: covered,
                    });
                }
            }
            Err(e) => {
                warn!(database = %db, error = %e, "cannot list the tables to maintain");
                out.unlisted.push(MaintenanceResult {
                    database: db.clone(),
                    table: "(every table)".into(),
                    action: action.statement().into(),
                    outcome: MaintenanceOutcome::Skipped,
                    reason: Some(format!("cannot list the tables: {e}")),
                    seconds: 0.0,
                });
            }
        }
    }
    out
}

impl std::str::FromStr for Maintenance {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "analyze" => Ok(Maintenance::Analyze),
            "vacuum-analyze" => Ok(Maintenance::VacuumAnalyze),
            "none" => Ok(Maintenance::None),
            _ => Err(format!(
                "maintenance: {:?} is not one of analyze, vacuum-analyze, none",
                s.chars().take(80).collect::<String>()
            )),
        }
    }
}

impl TryFrom<String> for Maintenance {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl Maintenance {
    /// The statement's name, for reports.
    pub fn statement(self) -> &'static str {
        match self {
            Maintenance::VacuumAnalyze => "VACUUM ANALYZE",
            Maintenance::Analyze => "ANALYZE",
            Maintenance::None => "none",
        }
    }
}

/// Maintains `targets` in order, one session per database. Returns results and the targets left when
/// the deadline came (or a stop was asked).
pub async fn maintain(
    spec: &ConnectionSpec,
    targets: Vec<MaintenanceTarget>,
    opts: &MaintainOptions,
) -> (Vec<MaintenanceResult>, Vec<MaintenanceTarget>) {
    let mut results = Vec::new();
    let mut pending: std::collections::VecDeque<MaintenanceTarget> = targets.into();
    // (database, session, server_version_num, in recovery)
    let mut session: Option<(String, crate::connect::Session, i32, bool)> = None;
    let vacuum = opts.action == Maintenance::VacuumAnalyze;
    let stopped = || opts.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed));
    while let Some(mut t) = pending.pop_front() {
        let left = opts.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if left.is_some_and(|l| l <= opts.margin) || stopped() {
            pending.push_front(t);
            break;
        }
        let result =
            |action: &str, outcome: MaintenanceOutcome, reason: Option<String>, seconds: f64| MaintenanceResult {
                database: t.database.clone(),
                table: t.table.clone(),
                action: action.into(),
                outcome,
                reason,
                seconds,
            };
        let planned_action = opts.action.statement();
        if session.as_ref().is_none_or(|(db, _, _, _)| db != &t.database) {
            session = None;
            let opened = async {
                let client = spec.connect(&t.database).await?;
                let look =
                    client.query_one("SELECT current_setting('server_version_num')::int4, pg_is_in_recovery()", &[]);
                let row = bounded(spec, &client, client_bound(spec.connect_timeout(), opts.margin), look)
                    .await
                    .map_err(|f| f.into_error(format!("database {:?}", t.database), "opening a session"))?;
                Ok::<_, Error>((t.database.clone(), client, row.get(0), row.get(1)))
            };
            // A stop does not wait for a connect to a server that does not answer.
            let opened = tokio::select! {
                r = opened => Some(r),
                _ = stop_asked(opts.stop.as_deref()) => None,
            };
            let Some(opened) = opened else {
                pending.push_front(t);
                break;
            };
            match opened {
                Ok(s) => session = Some(s),
                Err(e) => {
                    results.push(result(
                        planned_action,
                        MaintenanceOutcome::Skipped,
                        Some(format!("cannot connect: {e}")),
                        0.0,
                    ));
                    continue;
                }
            }
        }
        let (_, client, version, standby) = session.as_ref().unwrap();
        if *standby {
            results.push(result(
                planned_action,
                MaintenanceOutcome::Skipped,
                Some(
                    "the server is a standby (in recovery), where nothing can be written: maintain the primary, \
                     and its statistics replicate"
                        .into(),
                ),
                0.0,
            ));
            continue;
        }
        let mut timeout = opts.statement_timeout;
        if let Some(l) = left {
            timeout = timeout.min(l.saturating_sub(opts.margin / 2)).max(Duration::from_millis(100));
        }
        let started = Instant::now();
        let quick = client_bound(spec.connect_timeout(), opts.margin);
        // The statement is built by the server from the oid, now; the target's name is only a label.
        let mut statement: Option<String> = None;
        let res = async {
            let (st_ms, lock_ms) = (format!("{}ms", timeout.as_millis()), format!("{}ms", opts.lock_timeout.as_millis().max(1)));
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&st_ms, &lock_ms];
            let set = client.query_one(
                "SELECT pg_catalog.set_config('statement_timeout', $1, false), pg_catalog.set_config('lock_timeout', $2, false)",
                &params,
            );
            bounded(spec, client, quick, set).await?;
            let built = bounded(spec, client, quick, maintenance_statement(client, t.oid, vacuum, t.vacuum_only, *version)).await?;
            let Some(st) = built else {
                return Ok((planned_action, Some("dropped during the run (no such table any more)".to_string())));
            };
            if !st.allowed {
                return Ok((st.action, Some("only the owner (or MAINTAIN privilege) may do this".to_string())));
            }
            statement = Some(st.sql.as_str().to_string());
            let limit = client_bound(timeout, opts.margin);
            bounded_or_stopped(spec, client, limit, opts.stop.as_deref(), client.batch_execute(st.sql.as_str())).await?;
            Ok::<_, Failed>((st.action, None))
        }
        .await;
        let secs = started.elapsed().as_secs_f64();
        match res {
            Ok((action, None)) => {
                tracing::debug!(database = %t.database, table = %t.table, action, seconds = secs, "maintained");
                results.push(result(action, MaintenanceOutcome::Done, None, secs));
            }
            Ok((action, Some(reason))) => results.push(result(action, MaintenanceOutcome::Skipped, Some(reason), secs)),
            Err(Failed::Stopped) => {
                pending.push_front(t);
                break;
            }
            Err(f) if f.disposition() == Disposition::SessionLost => {
                session = None;
                results.push(result(
                    planned_action,
                    MaintenanceOutcome::Skipped,
                    Some(format!("session lost: {}", f.describe())),
                    secs,
                ));
            }
            Err(f) if f.disposition() == Disposition::Canceled && timeout < opts.statement_timeout => {
                // Cut by the deadline, not by its own timeout.
                t.cut += 1;
                if t.cut >= 2 {
                    let st = statement.unwrap_or_else(|| format!("{planned_action} {}", t.table));
                    warn!(database = %t.database, table = %t.table, "maintenance statement longer than a call; reported");
                    results.push(result(
                        planned_action,
                        MaintenanceOutcome::Skipped,
                        Some(format!(
                            "did not finish within the time left in two calls ({:.0} s in the last); run it from a host \
                             without a time limit: {st} (in database {:?})",
                            secs, t.database
                        )),
                        secs,
                    ));
                    continue;
                }
                info!(database = %t.database, table = %t.table, "the deadline cut a maintenance statement; the next call starts with it");
                pending.push_front(t);
                break;
            }
            Err(f) => {
                warn!(database = %t.database, table = %t.table, error = %f.describe(), "maintenance skipped");
                results.push(result(planned_action, MaintenanceOutcome::Skipped, Some(f.describe()), secs));
            }
        }
    }
    let done = results.iter().filter(|r| r.outcome == MaintenanceOutcome::Done).count();
    info!(done, skipped = results.len() - done, left = pending.len(), "maintenance");
    (results, pending.into())
}
