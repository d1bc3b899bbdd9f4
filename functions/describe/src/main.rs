//! Describe: one look at an instance. Phase "ready": is it available (and where to connect)?
//! Phase "storage": has storage initialization finished (StorageOperationStatus absent)?

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{ready_state, storage_state, Endpoint};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, minutes_since, Aws, Failure};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Request {
    phase: String,
    instance: String,
    /// The execution's start ($$.Execution.StartTime) and how long this phase may take.
    started: String,
    limit_minutes: f64,
}

#[derive(Serialize)]
struct Response {
    state: String,
    detail: String,
    progress: Option<i32>,
    endpoint: Option<Endpoint>,
}

async fn handler(aws: &Aws, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let r = event.payload;
    let view = pghydrate::aws::describe_instance(&aws.rds, &r.instance).await?;
    let elapsed = minutes_since(&r.started)?;
    let endpoint = view.address.clone().zip(view.port).map(|(address, port)| Endpoint {
        address,
        port,
        master_secret_arn: view.master_secret_arn.clone(),
    });
    let (state, detail, progress) = match r.phase.as_str() {
        "ready" => {
            let (s, d) = ready_state(&view);
            if s == "waiting" && elapsed > r.limit_minutes {
                ("failed", format!("{d} after {:.0} minutes (limit {})", elapsed, r.limit_minutes), None)
            } else {
                (s, d, None)
            }
        }
        "storage" => {
            let (s, d, p) = storage_state(&view);
            if s == "initializing" && elapsed > r.limit_minutes {
                ("timed_out", format!("{d}; stopped watching after {:.0} minutes", elapsed), p)
            } else {
                (s, d, p)
            }
        }
        other => return Err(Error::InvalidInput(format!("phase {other:?} is not ready or storage")).into()),
    };
    tracing::info!(instance = %r.instance, phase = %r.phase, state, progress, %detail, "described");
    Ok(Response { state: state.into(), detail, progress, endpoint })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let aws = Aws::from_env().await;
    run(service_fn(|e| async { handler(&aws, e).await.map_err(Diagnostic::from) })).await
}
