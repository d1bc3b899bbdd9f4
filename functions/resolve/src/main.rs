//! Resolve: turns the execution input (an RDS EventBridge event or a manual start) into the run's
//! configuration and the instances to hydrate, or a clean "skipped" with the reason.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::events::{parse_input, InputError, TriggerKind};
use pghydrate::workflow::{qualifies, Defaults, RunConfig, Target};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, Failure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Deserialize)]
struct Request {
    input: Value,
    execution: String,
}

#[derive(Serialize, Debug, PartialEq)]
struct Response {
    run: Option<RunConfig>,
    targets: Vec<Target>,
    skipped: Option<String>,
}

struct Deps {
    aws: Aws,
    defaults: Defaults,
}

/// arn:aws:lambda:REGION:ACCOUNT:function:NAME
fn account_and_region(function_arn: &str) -> (Option<String>, Option<String>) {
    let parts: Vec<&str> = function_arn.split(':').collect();
    (parts.get(4).map(|s| s.to_string()), parts.get(3).map(|s| s.to_string()))
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let (account, region) = account_and_region(&event.context.invoked_function_arn);
    let skipped = |reason: String| {
        tracing::info!(%reason, "nothing to hydrate");
        Ok(Response { run: None, targets: vec![], skipped: Some(reason) })
    };
    let trigger = match parse_input(&event.payload.input, account.as_deref(), region.as_deref()) {
        Ok(t) => t,
        Err(InputError::NotATrigger(why)) => return skipped(format!("not a hydration trigger: {why}")),
        Err(InputError::Invalid(why)) => return Err(Error::InvalidInput(why).into()),
    };
    let ids = match (&trigger.instance, &trigger.deployment) {
        (Some(i), _) => vec![i.clone()],
        (None, Some(d)) => pghydrate::aws::green_instances(&deps.aws.rds, d).await?,
        (None, None) => return Err(Error::InvalidInput("no instance and no deployment".into()).into()),
    };
    let run_config = RunConfig::new(&event.payload.execution, trigger.clone(), &deps.defaults);
    let reads = trigger.kind.reads_blocks() && !trigger.overrides.poll_only;
    let mut targets = Vec::new();
    let mut reasons = Vec::new();
    for id in ids {
        let view = pghydrate::aws::describe_instance(&deps.aws.rds, &id).await?;
        match qualifies(&view, &deps.defaults) {
            Ok(()) => targets.push(Target { instance: id, reads_blocks: reads, sessions: run_config.sessions }),
            // A manual start names its instance: a mismatch there is the user's error, not a filter.
            Err(why) if trigger.kind == TriggerKind::Manual && !why.contains("PostgreSQL") => {
                tracing::warn!(%why, "manual start overrides the instance filter")
                ;
                targets.push(Target { instance: id, reads_blocks: reads, sessions: run_config.sessions })
            }
            Err(why) => reasons.push(why),
        }
    }
    if targets.is_empty() {
        return skipped(reasons.join("; "));
    }
    tracing::info!(kind = ?trigger.kind, instances = ?targets.iter().map(|t| &t.instance).collect::<Vec<_>>(), "resolved");
    Ok(Response { run: Some(run_config), targets, skipped: None })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let defaults = Defaults::from_env(|k| std::env::var(k).ok()).map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let deps = Deps { aws: Aws::from_env().await, defaults };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn account_and_region_come_from_the_function_arn() {
        assert_eq!(
            account_and_region("arn:aws:lambda:eu-west-1:123456789012:function:pghydrate-resolve"),
            (Some("123456789012".into()), Some("eu-west-1".into()))
        );
    }
}
