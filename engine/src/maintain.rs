//! Maintenance after warming: ANALYZE (default), VACUUM ANALYZE, or nothing, table by table, under the
//! same statement/lock timeouts and deadline rule as warming.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_postgres::error::SqlState;
use tracing::{info, warn};

use crate::connect::ConnectionSpec;
use crate::error::{describe, is_connection_error, Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Maintenance {
    None,
    Analyze,
    VacuumAnalyze,
}

/// One table to maintain. `qualified` is quoted by the server (format('%I.%I')), never by us.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MaintenanceTarget {
    pub database: String,
    pub table: String,
    pub oid: u32,
    qualified: String,
    partitioned: bool,
    allowed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MaintenanceResult {
    pub database: String,
    pub table: String,
    pub action: String,
    /// "done" or "skipped".
    pub outcome: String,
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
}

/// Lists the tables to maintain: tables, partitions, partitioned tables and materialized views of
/// `databases` that are not in system schemas and for which `excluded(database, schema.table)` is false.
pub async fn targets(
    spec: &ConnectionSpec,
    databases: &[String],
    excluded: impl Fn(&str, &str) -> bool,
) -> Result<Vec<MaintenanceTarget>> {
    let mut out = Vec::new();
    for db in databases {
        let client = match spec.connect(db).await {
            Ok(c) => c,
            Err(e) => {
                warn!(database = %db, error = %e, "cannot list tables to maintain");
                continue;
            }
        };
        let version: i32 = client
            .query_one("SELECT current_setting('server_version_num')::int4", &[])
            .await
            .map_err(|e| Error::query("reading server_version_num", e))?
            .get(0);
        let sql = targets_sql(version >= 170000);
        let rows = client.query(&sql, &[]).await.map_err(|e| Error::query("listing tables to maintain", e))?;
        for r in rows {
            let oid: u32 = r.get(0);
            let table: String = r.get(1);
            if excluded(db, &table) {
                continue;
            }
            out.push(MaintenanceTarget {
                database: db.clone(),
                table,
                oid,
                qualified: r.get(2),
                partitioned: r.get(3),
                allowed: r.get(4),
            });
        }
    }
    Ok(out)
}

fn targets_sql(has_maintain_privilege: bool) -> String {
    let maintain_priv = if has_maintain_privilege {
        "pg_catalog.has_table_privilege(c.oid, 'MAINTAIN')"
    } else {
        "(pg_catalog.pg_has_role(c.relowner, 'USAGE') OR pg_catalog.pg_has_role(d.datdba, 'USAGE')
          OR (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user))"
    };
    format!(
        "SELECT c.oid, (n.nspname || '.' || c.relname)::text, format('%I.%I', n.nspname, c.relname),
                c.relkind = 'p', {maintain_priv}
           FROM pg_catalog.pg_class c
           JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
           JOIN pg_catalog.pg_database d ON d.datname = current_database()
          WHERE c.relkind IN ('r', 'p', 'm') AND c.relpersistence <> 't'
            AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_toast%'
          ORDER BY c.oid"
    )
}

/// Maintains `targets` in order, one session per database. Returns results and the targets left when
/// the deadline came.
pub async fn maintain(
    spec: &ConnectionSpec,
    targets: Vec<MaintenanceTarget>,
    opts: &MaintainOptions,
) -> (Vec<MaintenanceResult>, Vec<MaintenanceTarget>) {
    let mut results = Vec::new();
    let mut pending: std::collections::VecDeque<MaintenanceTarget> = targets.into();
    let mut session: Option<(String, tokio_postgres::Client)> = None;
    let action_name = |t: &MaintenanceTarget| match (opts.action, t.partitioned) {
        (Maintenance::VacuumAnalyze, false) => "VACUUM ANALYZE",
        _ => "ANALYZE",
    };
    while let Some(t) = pending.pop_front() {
        let left = opts.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if left.is_some_and(|l| l <= opts.margin) {
            pending.push_front(t);
            break;
        }
        let action = action_name(&t).to_string();
        let done = |outcome: &str, reason: Option<String>, seconds: f64| MaintenanceResult {
            database: t.database.clone(),
            table: t.table.clone(),
            action: action.clone(),
            outcome: outcome.into(),
            reason,
            seconds,
        };
        if !t.allowed {
            results.push(done("skipped", Some("only the owner (or MAINTAIN privilege) may do this".into()), 0.0));
            continue;
        }
        if session.as_ref().is_none_or(|(db, _)| db != &t.database) {
            session = match spec.connect(&t.database).await {
                Ok(c) => Some((t.database.clone(), c)),
                Err(e) => {
                    results.push(done("skipped", Some(format!("cannot connect: {e}")), 0.0));
                    None
                }
            };
            if session.is_none() {
                continue;
            }
        }
        let client = &session.as_ref().unwrap().1;
        let mut timeout = opts.statement_timeout;
        if let Some(l) = left {
            timeout = timeout.min(l.saturating_sub(opts.margin / 2)).max(Duration::from_millis(100));
        }
        let started = Instant::now();
        let set = client
            .query_one(
                "SELECT pg_catalog.set_config('statement_timeout', $1, false), pg_catalog.set_config('lock_timeout', $2, false)",
                &[&format!("{}ms", timeout.as_millis()), &format!("{}ms", opts.lock_timeout.as_millis().max(1))],
            )
            .await;
        let res = match set {
            Ok(_) => client.batch_execute(&format!("{action} {}", t.qualified)).await,
            Err(e) => Err(e),
        };
        let secs = started.elapsed().as_secs_f64();
        match res {
            Ok(()) => {
                tracing::debug!(database = %t.database, table = %t.table, action = %action, seconds = secs, "maintained");
                results.push(done("done", None, secs));
            }
            Err(e) if is_connection_error(&e) => {
                session = None;
                results.push(done("skipped", Some(format!("session lost: {}", describe(&e))), secs));
            }
            Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) && left.is_some() => {
                pending.push_front(t);
                break;
            }
            Err(e) => {
                warn!(database = %t.database, table = %t.table, error = %describe(&e), "maintenance skipped");
                results.push(done("skipped", Some(describe(&e)), secs));
            }
        }
    }
    let done = results.iter().filter(|r| r.outcome == "done").count();
    info!(done, skipped = results.len() - done, left = pending.len(), "maintenance");
    (results, pending.into())
}
