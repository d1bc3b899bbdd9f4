//! Maintenance after warming: ANALYZE (default), VACUUM ANALYZE, or nothing, table by table, under the
//! same statement/lock timeouts and deadline rule as warming.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_postgres::error::SqlState;
use tracing::{info, warn};

use crate::connect::ConnectionSpec;
use crate::error::{describe, is_connection_error, Error, Result};
use crate::sql::maintenance_statement;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
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
        let rows = client
            .query(
                "SELECT c.oid, (n.nspname || '.' || c.relname)::text
                   FROM pg_catalog.pg_class c
                   JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.relkind IN ('r', 'p', 'm') AND c.relpersistence <> 't'
                    AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_toast%'
                  ORDER BY c.oid",
                &[],
            )
            .await
            .map_err(|e| Error::query("listing tables to maintain", e))?;
        for r in rows {
            let oid: u32 = r.get(0);
            let table: String = r.get(1);
            if excluded(db, &table) {
                continue;
            }
            out.push(MaintenanceTarget { database: db.clone(), table, oid });
        }
    }
    Ok(out)
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
    // (database, session, server_version_num, in recovery)
    let mut session: Option<(String, tokio_postgres::Client, i32, bool)> = None;
    let vacuum = opts.action == Maintenance::VacuumAnalyze;
    while let Some(t) = pending.pop_front() {
        let left = opts.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if left.is_some_and(|l| l <= opts.margin) {
            pending.push_front(t);
            break;
        }
        let result = |action: &str, outcome: &str, reason: Option<String>, seconds: f64| MaintenanceResult {
            database: t.database.clone(),
            table: t.table.clone(),
            action: action.into(),
            outcome: outcome.into(),
            reason,
            seconds,
        };
        let planned_action = if vacuum { "VACUUM ANALYZE" } else { "ANALYZE" };
        if session.as_ref().is_none_or(|(db, _, _, _)| db != &t.database) {
            session = None;
            let opened = async {
                let client = spec.connect(&t.database).await?;
                let row = client
                    .query_one("SELECT current_setting('server_version_num')::int4, pg_is_in_recovery()", &[])
                    .await
                    .map_err(|e| Error::query("reading server_version_num", e))?;
                Ok::<_, Error>((t.database.clone(), client, row.get(0), row.get(1)))
            };
            match opened.await {
                Ok(s) => session = Some(s),
                Err(e) => {
                    results.push(result(planned_action, "skipped", Some(format!("cannot connect: {e}")), 0.0));
                    continue;
                }
            }
        }
        let (_, client, version, standby) = session.as_ref().unwrap();
        if *standby {
            results.push(result(
                planned_action,
                "skipped",
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
        // The statement is built by the server from the oid, now; the target's name is only a label.
        let res = async {
            client
                .query_one(
                    "SELECT pg_catalog.set_config('statement_timeout', $1, false), pg_catalog.set_config('lock_timeout', $2, false)",
                    &[&format!("{}ms", timeout.as_millis()), &format!("{}ms", opts.lock_timeout.as_millis().max(1))],
                )
                .await?;
            let Some(st) = maintenance_statement(client, t.oid, vacuum, *version).await? else {
                return Ok((planned_action, Some("dropped during the run (no such table any more)".to_string())));
            };
            if !st.allowed {
                return Ok((st.action, Some("only the owner (or MAINTAIN privilege) may do this".to_string())));
            }
            client.batch_execute(st.sql.as_str()).await?;
            Ok((st.action, None))
        }
        .await;
        let secs = started.elapsed().as_secs_f64();
        match res {
            Ok((action, None)) => {
                tracing::debug!(database = %t.database, table = %t.table, action, seconds = secs, "maintained");
                results.push(result(action, "done", None, secs));
            }
            Ok((action, Some(reason))) => results.push(result(action, "skipped", Some(reason), secs)),
            Err(e) if is_connection_error(&e) => {
                session = None;
                results.push(result(planned_action, "skipped", Some(format!("session lost: {}", describe(&e))), secs));
            }
            Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) && left.is_some() => {
                pending.push_front(t);
                break;
            }
            Err(e) => {
                warn!(database = %t.database, table = %t.table, error = %describe(&e), "maintenance skipped");
                results.push(result(planned_action, "skipped", Some(describe(&e)), secs));
            }
        }
    }
    let done = results.iter().filter(|r| r.outcome == "done").count();
    info!(done, skipped = results.len() - done, left = pending.len(), "maintenance");
    (results, pending.into())
}
