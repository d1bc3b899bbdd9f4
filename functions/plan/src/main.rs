//! Plan: discovers every relation fork of every database on the instance and cuts the plan into work
//! items; a few small items travel inline (at most 40 and 128 KiB), more go to S3 for a Distributed Map.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{fits_inline, plan_items, Endpoint, PlanSummary, RunConfig, Target, WorkItem};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, DbConfig, Failure};
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
    let r = event.payload;
    let spec = deps.db.connect_spec(&deps.aws, &r.run, &r.endpoint).await?;
    let (summary, items) = plan_items(&spec, &r.run).await?;
    tracing::info!(instance = %r.target.instance, items = items.len(), planned_bytes = summary.planned_bytes, "planned");
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
