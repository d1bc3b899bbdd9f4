//! Warm: reads one work item's ranges until the Lambda's deadline (minus a margin) and returns the
//! item with exactly the ranges left; the state machine calls again until `done`.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{call_options, Endpoint, ItemSummary, RunConfig, Target, WorkItem};
use pghydrate_lambda::{deadline, init_tracing, Aws, DbConfig, Failure};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Request {
    target: Target,
    run: RunConfig,
    endpoint: Endpoint,
    item: WorkItem,
}

#[derive(Serialize)]
struct Response {
    item: WorkItem,
    done: bool,
    summary: ItemSummary,
}

struct Deps {
    aws: Aws,
    db: DbConfig,
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let started = std::time::Instant::now();
    let until = deadline(&event.context);
    tracing::debug!(
        deadline_ms = event.context.deadline,
        time_left_ms = until.saturating_duration_since(std::time::Instant::now()).as_millis() as u64,
        "call started"
    );
    let Request { target, run, endpoint, mut item } = event.payload;
    let spec = deps.db.connect_spec(&deps.aws, &run, &endpoint).await?;
    let mut opts = call_options(until, deps.db.margin, item.sessions);
    opts.lock_timeout = deps.db.lock_timeout;
    opts.reconnect_for = deps.db.reconnect_for;
    opts.step_blocks = deps.db.step_blocks;
    let warmed = item.advance(&spec, &opts).await?;
    item.done.call_seconds += started.elapsed().as_secs_f64();
    let summary = item.summary();
    tracing::info!(instance = %target.instance, item = item.id, warmed_bytes = summary.warmed_bytes,
                   pending_bytes = summary.pending_bytes, calls = item.calls,
                   call_seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
                   sessions = %warmed.iter().map(|l| l.sessions.to_string()).collect::<Vec<_>>().join("->"),
                   "warm call");
    Ok(Response { done: item.done(), summary, item })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let db = DbConfig::from_env().map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let deps = Deps { aws: Aws::from_env().await, db };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}
