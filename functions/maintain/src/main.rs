//! Maintain: ANALYZE / VACUUM ANALYZE table by table until the Lambda's deadline; the state machine
//! calls again until `done`. What travels between calls is a cursor (the next table, by database name
//! and oid), not the list of tables or databases left, so the state stays a few hundred bytes with
//! 100,000 tables or thousands of databases. Each call lists the run's databases (its database
//! patterns, one catalog query), and then the tables of one database at a time, from the cursor's on.
//! A statement that cannot finish within one whole call is reported skipped, with the statement to run
//! from a host, and the run goes on. A database whose tables cannot be listed is reported once, when
//! the walk reaches it.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::maintain::{maintain, targets, MaintainOptions, Maintenance, MaintenanceTarget};
use pghydrate::pattern::RelationPattern;
use pghydrate::workflow::{Endpoint, RunConfig, Target, LISTED_SKIPS};
use pghydrate_lambda::{deadline, init_tracing, Aws, DbConfig, Failure};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Request {
    target: Target,
    run: RunConfig,
    endpoint: Endpoint,
    /// None on the first call; then what the previous call returned.
    state: Option<Response>,
}

#[derive(Serialize, Deserialize, Default)]
struct Response {
    done: bool,
    /// The next table to maintain (None: start from the first).
    state: Option<Cursor>,
    summary: Summary,
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
struct Cursor {
    database: String,
    oid: u32,
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct Summary {
    done: usize,
    /// The first LISTED_SKIPS tables skipped, with why.
    skipped: Vec<String>,
    #[serde(default)]
    skipped_count: usize,
}

impl Summary {
    fn skip(&mut self, line: String) {
        self.skipped_count += 1;
        if self.skipped.len() < LISTED_SKIPS {
            self.skipped.push(line);
        }
    }
}

/// The databases from the cursor's on, in name order (a cursor naming a database dropped since goes on
/// with the next name).
fn databases_from<'a>(databases: &'a [String], cursor: Option<&Cursor>) -> &'a [String] {
    match cursor {
        None => databases,
        Some(c) => &databases[databases.partition_point(|d| d.as_str() < c.database.as_str())..],
    }
}

/// One database's targets from the cursor on, by oid (the cursor's oid counts only in its database).
fn from_cursor(mut targets: Vec<MaintenanceTarget>, database: &str, cursor: Option<&Cursor>) -> Vec<MaintenanceTarget> {
    targets.sort_by_key(|t| t.oid);
    match cursor {
        Some(c) if c.database == database => targets.into_iter().filter(|t| t.oid >= c.oid).collect(),
        _ => targets,
    }
}

struct Deps {
    aws: Aws,
    db: DbConfig,
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let until = deadline(&event.context);
    let r = event.payload;
    let action = match r.run.maintenance {
        Maintenance::None => return Ok(Response { done: true, ..Response::default() }),
        action => action,
    };
    let spec = deps.db.connect_spec(&deps.aws, &r.run, &r.endpoint).await?;
    let started = std::time::Instant::now();
    let previous = r.state.unwrap_or_default();
    let mut summary = previous.summary;
    let options = r.run.plan_options(1)?;
    let exclude: &[RelationPattern] = &options.exclude;
    let databases = pghydrate::catalog::selected_databases(&spec, &options).await?;
    let cursor = previous.state;
    let opts = MaintainOptions {
        action,
        statement_timeout: std::time::Duration::from_secs(840),
        lock_timeout: deps.db.lock_timeout,
        deadline: Some(until),
        margin: deps.db.margin,
        stop: None,
    };
    let mut progressed = false;
    let mut next: Option<Cursor> = None;
    for db in databases_from(&databases, cursor.as_ref()) {
        if until.saturating_duration_since(std::time::Instant::now()) <= deps.db.margin {
            next = Some(Cursor { database: db.clone(), oid: 0 });
            break;
        }
        let listed = targets(&spec, std::slice::from_ref(db), action, |db, schema, table| {
            exclude.iter().any(|p| p.matches(db, schema, table))
        })
        .await;
        // Reported when the walk reaches the database: a later call's cursor is past it.
        for m in &listed.unlisted {
            summary.skip(format!("{}: {}", m.database, m.reason.clone().unwrap_or_default()));
        }
        let todo = from_cursor(listed.targets, db, cursor.as_ref());
        let first = todo.first().cloned();
        let (results, mut left) = maintain(&spec, todo, &opts).await;
        progressed |= !results.is_empty() || !listed.unlisted.is_empty();
        for m in results {
            if m.outcome == pghydrate::maintain::MaintenanceOutcome::Done {
                summary.done += 1;
            } else {
                summary.skip(format!("{}: {}: {}", m.database, m.table, m.reason.unwrap_or_default()));
            }
        }
        // A whole call spent on one statement that the deadline then cancelled: the next call would do
        // the same, forever. Reported, with what to run from a host without a deadline.
        if !progressed && started.elapsed() > deps.db.margin && left.first() == first.as_ref() {
            if let Some(t) = left.first().cloned() {
                tracing::warn!(database = %t.database, table = %t.table, "maintenance statement longer than a call; skipped");
                summary.skip(format!(
                    "{}: {}: did not finish within one Lambda call; run {} from a host (psql -d {})",
                    t.database,
                    t.table,
                    action.statement(),
                    t.database
                ));
                left.remove(0);
                progressed = true;
            }
        }
        if let Some(t) = left.first() {
            next = Some(Cursor { database: t.database.clone(), oid: t.oid });
            break;
        }
    }
    tracing::info!(
        instance = %r.target.instance,
        databases = databases.len(),
        done = summary.done,
        skipped = summary.skipped_count,
        next = ?next,
        "maintenance call"
    );
    Ok(Response { done: next.is_none(), state: next, summary })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let db = DbConfig::from_env().map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let deps = Deps { aws: Aws::from_env().await, db };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(db: &str, oid: u32) -> MaintenanceTarget {
        MaintenanceTarget { database: db.into(), table: format!("public.t{oid}"), oid, cut: 0, vacuum_only: false }
    }

    /// Each call continues exactly where the previous one stopped: in name order of the databases,
    /// then by oid, whatever order the listing came in; a database or table dropped meanwhile is
    /// passed over, not a reason to start again.
    #[test]
    fn the_cursor_continues_exactly_where_the_last_call_stopped() {
        let dbs: Vec<String> = ["a", "b", "tenant_1", "tenant_2"].map(String::from).to_vec();
        let at = |db: &str, oid| Cursor { database: db.into(), oid };
        assert_eq!(databases_from(&dbs, None), &dbs[..]);
        assert_eq!(databases_from(&dbs, Some(&at("b", 9))), &dbs[1..]);
        // "tenant_0" was dropped since the last call: the walk goes on with the next name.
        assert_eq!(databases_from(&dbs, Some(&at("tenant_0", 0))), &dbs[2..]);
        assert!(databases_from(&dbs, Some(&at("zz", 0))).is_empty());

        let listed = vec![t("b", 9), t("b", 3), t("b", 12)];
        let oids = |v: Vec<MaintenanceTarget>| v.iter().map(|x| x.oid).collect::<Vec<_>>();
        assert_eq!(oids(from_cursor(listed.clone(), "b", None)), [3, 9, 12]);
        assert_eq!(oids(from_cursor(listed.clone(), "b", Some(&at("b", 9)))), [9, 12]);
        // The table the cursor names was dropped meanwhile: the next one follows.
        assert_eq!(oids(from_cursor(listed.clone(), "b", Some(&at("b", 10)))), [12]);
        // The cursor's oid belongs to its own database only.
        assert_eq!(oids(from_cursor(listed, "b", Some(&at("a", 10)))), [3, 9, 12]);
    }
}
