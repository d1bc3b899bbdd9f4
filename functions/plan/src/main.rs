//! Plan: discovers every relation fork of every database on the instance and cuts the plan into work
//! items, reading the captured hot sets meanwhile (a head start); a few small items travel inline (at most 40 and 128 KiB), more go to S3 for a Distributed Map.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{call_options, fits_inline, plan_items, Endpoint, PlanSummary, RunConfig, Target, WorkItem};
use pghydrate::Error;
use pghydrate_lambda::{deadline, init_tracing, Aws, DbConfig, Failure};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Request {
    target: Target,
    run: RunConfig,
    endpoint: Endpoint,
}

#[derive(Serialize)]
struct S3Location {
    bucket: String,
    key: String,
}

#[derive(Serialize)]
struct Response {
    summary: PlanSummary,
    /// Inline items (empty when `distributed` is set).
    items: Vec<WorkItem>,
    distributed: Option<S3Location>,
}

struct Deps {
    aws: Aws,
    db: DbConfig,
    bucket: String,
    prefix: String,
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let until = deadline(&event.context);
    let r = event.payload;
    let spec = deps.db.connect_spec(&deps.aws, &r.run, &r.endpoint).await?;
    // A captured hot set is read while the rest is planned (a head start, ended when the plan is made,
    // or by this call's deadline less its margin); its sessions and mode are set from the server.
    let mut head = call_options(until, deps.db.margin, 1);
    head.lock_timeout = deps.db.lock_timeout;
    head.reconnect_for = deps.db.reconnect_for;
    head.step_blocks = deps.db.step_blocks;
    let (summary, items) = plan_items(&spec, &r.run, Some(&head)).await?;
    tracing::info!(instance = %r.target.instance, items = items.len(), planned_bytes = summary.planned_bytes,
                   head_start_bytes = summary.head_start.as_ref().map_or(0, |h| h.warmed_bytes), "planned");
    if fits_inline(&items) {
        return Ok(Response { summary, items, distributed: None });
    }
    let key = format!("{}{}/{}/items.json", deps.prefix, r.run.execution, r.target.instance);
    let body = serde_json::to_vec(&items).map_err(|e| Error::InvalidInput(e.to_string()))?;
    pghydrate::aws::put_json(&deps.aws.s3, &deps.bucket, &key, body).await?;
    Ok(Response { summary, items: vec![], distributed: Some(S3Location { bucket: deps.bucket.clone(), key }) })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let db = DbConfig::from_env().map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let bucket = std::env::var("PGHYDRATE_STATE_BUCKET").map_err(|_| "PGHYDRATE_STATE_BUCKET is not set")?;
    let prefix = std::env::var("PGHYDRATE_STATE_PREFIX").unwrap_or_default();
    let deps = Deps { aws: Aws::from_env().await, db, bucket, prefix };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}
