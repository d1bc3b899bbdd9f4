//! Maintain: ANALYZE / VACUUM ANALYZE table by table until the Lambda's deadline, returning the tables
//! left; the state machine calls again until `done`.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::maintain::{maintain, targets, MaintainOptions, Maintenance, MaintenanceTarget};
use pghydrate::pattern::RelationPattern;
use pghydrate::report::DatabaseReport;
use pghydrate::workflow::{Endpoint, RunConfig, Target};
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
    /// Tables still to maintain (None: not listed yet).
    state: Option<Vec<MaintenanceTarget>>,
    summary: Summary,
}

#[derive(Serialize, Deserialize, Default, Clone)]
struct Summary {
    done: usize,
    skipped: Vec<String>,
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
    let mut summary = r.state.as_ref().map(|s| s.summary.clone()).unwrap_or_default();
    let todo = match r.state.and_then(|s| s.state) {
        Some(t) => t,
        None => {
            let exclude: Vec<RelationPattern> =
                r.run.exclude.iter().filter_map(|p| RelationPattern::parse(p).ok()).collect();
            let databases: Vec<String> =
                r.databases.iter().filter(|d| d.outcome == "planned").map(|d| d.name.clone()).collect();
            targets(&spec, &databases, |db, qualified| {
                let (schema, table) = qualified.split_once('.').unwrap_or(("", qualified));
                exclude.iter().any(|p| p.matches(db, schema, table))
            })
            .await?
        }
    };
    let opts = MaintainOptions {
        action,
        statement_timeout: std::time::Duration::from_secs(840),
        lock_timeout: deps.db.lock_timeout,
        deadline: Some(until),
        margin: deps.db.margin,
    };
    let (results, left) = maintain(&spec, todo, &opts).await;
    for m in results {
        if m.outcome == "done" {
            summary.done += 1;
        } else {
            summary.skipped.push(format!("{}: {}: {}", m.database, m.table, m.reason.unwrap_or_default()));
        }
    }
    tracing::info!(instance = %r.target.instance, done = summary.done, skipped = summary.skipped.len(), left = left.len(), "maintenance call");
    Ok(Response { done: left.is_empty(), state: Some(left), summary })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let db = DbConfig::from_env().map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let deps = Deps { aws: Aws::from_env().await, db };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}
