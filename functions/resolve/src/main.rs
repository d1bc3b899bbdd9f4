//! Resolve: turns the execution input (an RDS EventBridge event or a manual start) into the run's
//! configuration and the instances to hydrate, or a clean "skipped" with the reason.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::aws::{acquire_lease, Lease, LeaseHolder};
use pghydrate::events::{parse_input, InputError, TriggerKind};
use pghydrate::workflow::{qualifies, trigger_applies, Defaults, RunConfig, Target};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, Failure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Deserialize)]
struct Request {
    input: Value,
    execution: String,
    /// $$.Execution.Id and $$.Execution.StartTime: recorded in each instance's lease, so that a later
    /// execution can ask whether this one still runs.
    #[serde(default)]
    execution_arn: Option<String>,
    #[serde(default)]
    started: Option<String>,
}

#[derive(Serialize, Debug, PartialEq)]
struct Response {
    run: Option<RunConfig>,
    targets: Vec<Target>,
    skipped: Option<String>,
    /// The runs already hydrating instances this one would have: a pipeline's start that lost to the
    /// EventBridge-started run follows that run (`pghydrate start --wait`) instead of gating on nothing.
    held_by: Vec<HeldBy>,
}

/// An instance and the execution that holds its lease.
#[derive(Serialize, Debug, PartialEq)]
struct HeldBy {
    instance: String,
    execution: String,
    execution_arn: String,
}

struct Deps {
    aws: Aws,
    sfn: aws_sdk_sfn::Client,
    defaults: Defaults,
    /// The state bucket, where each instance's lease lives.
    bucket: String,
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
        Ok(Response { run: None, targets: vec![], skipped: Some(reason), held_by: vec![] })
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
    let mut held_by = Vec::new();
    for id in ids {
        let view = pghydrate::aws::describe_instance(&deps.aws.rds, &id).await?;
        match qualifies(&view, &deps.defaults).and_then(|()| trigger_applies(trigger.kind, &view)) {
            Ok(()) => targets.push(Target { instance: id, reads_blocks: reads, sessions: run_config.sessions }),
            // A manual start names its instance: a mismatch there is the user's error, not a filter.
            Err(why) if trigger.kind == TriggerKind::Manual && !why.contains("PostgreSQL") => {
                tracing::warn!(%why, "manual start overrides the instance filter");
                targets.push(Target { instance: id, reads_blocks: reads, sessions: run_config.sessions })
            }
            Err(why) => reasons.push(why),
        }
    }
    // One execution per instance: each target's lease, taken with a conditional write (see
    // pghydrate::aws::acquire_lease). Without an execution ARN (a direct invoke) nothing is leased.
    if let (Some(arn), Some(started)) = (&event.payload.execution_arn, &event.payload.started) {
        let me = LeaseHolder {
            execution: event.payload.execution.clone(),
            execution_arn: arn.clone(),
            since: started.clone(),
        };
        let mut kept = Vec::new();
        for t in targets {
            match acquire_lease(&deps.aws.s3, &deps.sfn, &deps.bucket, &t.instance, &me).await? {
                Lease::Acquired { took_over } => {
                    if let Some(stale) = took_over {
                        tracing::warn!(instance = %t.instance, previous = %stale, "took over a lease its execution left behind");
                    }
                    kept.push(t)
                }
                Lease::HeldBy(owner) => {
                    reasons.push(format!("{} is already being hydrated by execution {}", t.instance, owner.execution));
                    held_by.push(HeldBy {
                        instance: t.instance,
                        execution: owner.execution,
                        execution_arn: owner.execution_arn,
                    });
                }
            }
        }
        targets = kept;
    }
    if targets.is_empty() {
        let reason = reasons.join("; ");
        tracing::info!(%reason, "nothing to hydrate");
        return Ok(Response { run: None, targets, skipped: Some(reason), held_by });
    }
    tracing::info!(kind = ?trigger.kind, instances = ?targets.iter().map(|t| &t.instance).collect::<Vec<_>>(), "resolved");
    Ok(Response { run: Some(run_config), targets, skipped: None, held_by })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let defaults = Defaults::from_env(|k| std::env::var(k).ok()).map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let aws = Aws::from_env().await;
    let bucket = std::env::var("PGHYDRATE_STATE_BUCKET").map_err(|_| "PGHYDRATE_STATE_BUCKET is not set")?;
    let deps = Deps { sfn: aws_sdk_sfn::Client::new(&aws.sdk), aws, defaults, bucket };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lambda_runtime::Context;

    fn deps() -> Deps {
        let aws = Aws::offline("us-east-1", "http://127.0.0.1:9");
        Deps {
            sfn: aws_sdk_sfn::Client::new(&aws.sdk),
            aws,
            defaults: Defaults::from_env(|_| None).unwrap(),
            bucket: "unused".into(),
        }
    }

    fn event(input: Value) -> LambdaEvent<Request> {
        let mut ctx = Context::default();
        ctx.invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:pghydrate-resolve".into();
        LambdaEvent::new(Request { input, execution: "exec-1".into(), execution_arn: None, started: None }, ctx)
    }

    fn fixture(name: &str) -> Value {
        let path = format!("{}/../../tests/fixtures/events/{name}.json", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    #[tokio::test]
    async fn an_rds_event_that_is_not_a_trigger_ends_cleanly() {
        let out = handler(&deps(), event(fixture("failover-0049"))).await.unwrap();
        assert_eq!(out.targets, vec![]);
        assert!(out.skipped.unwrap().contains("RDS-EVENT-0049"));
    }

    #[tokio::test]
    async fn malformed_and_foreign_input_fails_with_invalid_input() {
        let mut foreign = fixture("snapshot-restore-0043");
        foreign["account"] = serde_json::json!("999999999999");
        foreign["detail"]["SourceArn"] = serde_json::json!("arn:aws:rds:us-east-1:999999999999:db:orders-restored");
        for input in [foreign, serde_json::json!({"instance": "db1", "sesions": 2}), serde_json::json!("text")] {
            let err = handler(&deps(), event(input.clone())).await.unwrap_err();
            let d = Diagnostic::from(err);
            assert_eq!(d.error_type, "InvalidInput", "{input}");
        }
    }

    #[test]
    fn account_and_region_come_from_the_function_arn() {
        assert_eq!(
            account_and_region("arn:aws:lambda:eu-west-1:123456789012:function:pghydrate-resolve"),
            (Some("123456789012".into()), Some("eu-west-1".into()))
        );
    }
}
