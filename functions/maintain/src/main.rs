//! Maintain: ANALYZE / VACUUM ANALYZE table by table until the Lambda's deadline; the state machine
//! calls again until `done`. What travels between calls is a cursor (the next table, by database and
//! oid), not the list of tables left, so the state stays a few hundred bytes at 100,000 tables; each
//! call lists the tables again (one catalog query per database). A statement that cannot finish within
//! one whole call is reported skipped, with the statement to run from a host, and the run goes on.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::maintain::{maintain, targets, MaintainOptions, Maintenance, MaintenanceTarget};
use pghydrate::pattern::RelationPattern;
use pghydrate::report::DatabaseReport;
use pghydrate::workflow::{Endpoint, RunConfig, Target, LISTED_SKIPS};
use pghydrate_lambda::{deadline, init_tracing, Aws, DbConfig, Failure};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Request {
    target: Target,
    run: RunConfig,
    endpoint: Endpoint,
    databases: Vec<DatabaseReport>,
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

/// The targets from `cursor` on, in the order of `databases` and then by oid.
fn from_cursor(
    mut targets: Vec<MaintenanceTarget>,
    databases: &[String],
    cursor: Option<&Cursor>,
) -> Vec<MaintenanceTarget> {
    let rank = |db: &str| databases.iter().position(|d| d == db).unwrap_or(usize::MAX);
    targets.sort_by_key(|t| (rank(&t.database), t.oid));
    match cursor {
        None => targets,
        Some(c) => {
            let at = (rank(&c.database), c.oid);
            targets.into_iter().filter(|t| (rank(&t.database), t.oid) >= at).collect()
        }
    }
}

struct Deps {
    aws: Aws,
    db: DbConfig,
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let until = deadline(&event.context);
    let r = event.payload;
    let action = match r.run.maintenance.as_str() {
        "none" => return Ok(Response { done: true, ..Response::default() }),
        "vacuum-analyze" => Maintenance::VacuumAnalyze,
        _ => Maintenance::Analyze,
    };
    let spec = deps.db.connect_spec(&deps.aws, &r.run, &r.endpoint).await?;
    let started = std::time::Instant::now();
    let previous = r.state.unwrap_or_default();
    let mut summary = previous.summary;
    let exclude: Vec<RelationPattern> = r.run.exclude.iter().filter_map(|p| RelationPattern::parse(p).ok()).collect();
    let databases: Vec<String> = r
        .databases
        .iter()
        .filter(|d| d.outcome == pghydrate::plan::DatabaseOutcome::Planned)
        .map(|d| d.name.clone())
        .collect();
    let listed =
        targets(&spec, &databases, action, |db, schema, table| exclude.iter().any(|p| p.matches(db, schema, table)))
            .await;
    // A database whose tables cannot be listed is reported once, on the first call (later calls
    // continue from a cursor past it).
    if previous.state.is_none() {
        for m in &listed.unlisted {
            summary.skip(format!("{}: {}", m.database, m.reason.clone().unwrap_or_default()));
        }
    }
    let todo = from_cursor(listed.targets, &databases, previous.state.as_ref());
    let first = todo.first().cloned();
    let opts = MaintainOptions {
        action,
        statement_timeout: std::time::Duration::from_secs(840),
        lock_timeout: deps.db.lock_timeout,
        deadline: Some(until),
        margin: deps.db.margin,
        stop: None,
    };
    let (results, mut left) = maintain(&spec, todo, &opts).await;
    let progressed = !results.is_empty();
    for m in results {
        if m.outcome == pghydrate::maintain::MaintenanceOutcome::Done {
            summary.done += 1;
        } else {
            summary.skip(format!("{}: {}: {}", m.database, m.table, m.reason.unwrap_or_default()));
        }
    }
    // A whole call spent on one statement that the deadline then cancelled: the next call would do the
    // same, forever. Reported, with what to run from a host without a deadline.
    if !progressed && started.elapsed() > deps.db.margin && left.first() == first.as_ref() {
        if let Some(t) = left.first().cloned() {
            tracing::warn!(database = %t.database, table = %t.table, "maintenance statement longer than a call; skipped");
            summary.skip(format!(
                "{}: {}: did not finish within one Lambda call; run {} from a host (psql -d {})",
                t.database,
                t.table,
                if action == Maintenance::VacuumAnalyze { "VACUUM ANALYZE" } else { "ANALYZE" },
                t.database
            ));
            left.remove(0);
        }
    }
    tracing::info!(instance = %r.target.instance, done = summary.done, skipped = summary.skipped_count, left = left.len(), "maintenance call");
    let state = left.first().map(|t| Cursor { database: t.database.clone(), oid: t.oid });
    Ok(Response { done: left.is_empty(), state, summary })
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

    /// Each call continues exactly where the previous one stopped, in the order of the databases
    /// and then by oid, whatever order the listing came in.
    #[test]
    fn the_cursor_continues_exactly_where_the_last_call_stopped() {
        let dbs = vec!["b".to_string(), "a".to_string()];
        let listed = vec![t("a", 5), t("b", 9), t("a", 1), t("b", 3)];
        let all = from_cursor(listed.clone(), &dbs, None);
        assert_eq!(
            all.iter().map(|x| (x.database.as_str(), x.oid)).collect::<Vec<_>>(),
            [("b", 3), ("b", 9), ("a", 1), ("a", 5)]
        );
        let rest = from_cursor(listed.clone(), &dbs, Some(&Cursor { database: "b".into(), oid: 9 }));
        assert_eq!(rest.iter().map(|x| x.oid).collect::<Vec<_>>(), [9, 1, 5]);
        // The table the cursor names was dropped meanwhile: the next one follows.
        let rest = from_cursor(listed, &dbs, Some(&Cursor { database: "a".into(), oid: 2 }));
        assert_eq!(rest.iter().map(|x| x.oid).collect::<Vec<_>>(), [5]);
    }
}
