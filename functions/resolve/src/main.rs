//! Resolve: turns the execution input (an RDS EventBridge event or a manual start) into the run's
//! configuration and the instances to hydrate, or a clean "skipped" with the reason.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::events::{parse_input, InputError, TriggerKind};
use pghydrate::workflow::{owner_elsewhere, qualifies, Defaults, RunConfig, Running, Target};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, Failure};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Deserialize)]
struct Request {
    input: Value,
    execution: String,
    /// $$.Execution.Id and $$.Execution.StartTime: to find other runs for the same instance.
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
}

struct Deps {
    aws: Aws,
    sfn: aws_sdk_sfn::Client,
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
                tracing::warn!(%why, "manual start overrides the instance filter");
                targets.push(Target { instance: id, reads_blocks: reads, sessions: run_config.sessions })
            }
            Err(why) => reasons.push(why),
        }
    }
    if let (Some(arn), Some(started)) = (&event.payload.execution_arn, &event.payload.started) {
        let others = running_executions(&deps.sfn, arn, account.as_deref(), region.as_deref()).await?;
        // Every execution must see the same start times: take our own from the same listing when it is
        // there (the context's StartTime may be formatted with another precision).
        let started_ms = match others.iter().find(|o| o.name == event.payload.execution) {
            Some(o) => o.started_ms,
            None => pghydrate_lambda::epoch_ms(started)?,
        };
        let me = Running { name: event.payload.execution.clone(), started_ms, subjects: ids_of(&trigger, &targets) };
        targets.retain(|t| {
            let subject = trigger.deployment.clone().unwrap_or_else(|| t.instance.clone());
            match owner_elsewhere(&me, &others, &subject) {
                Some(owner) => {
                    reasons.push(format!("{subject} is already being hydrated by execution {owner}"));
                    false
                }
                None => true,
            }
        });
    }
    if targets.is_empty() {
        return skipped(reasons.join("; "));
    }
    tracing::info!(kind = ?trigger.kind, instances = ?targets.iter().map(|t| &t.instance).collect::<Vec<_>>(), "resolved");
    Ok(Response { run: Some(run_config), targets, skipped: None })
}

/// What an execution hydrates: the Blue/Green deployment, else its instances.
fn ids_of(trigger: &pghydrate::events::Trigger, targets: &[Target]) -> Vec<String> {
    match &trigger.deployment {
        Some(d) => vec![d.clone()],
        None => targets.iter().map(|t| t.instance.clone()).collect(),
    }
}

/// The state machine's other running executions and what their inputs name. Inputs that do not
/// parse name nothing (they will fail on their own).
async fn running_executions(
    sfn: &aws_sdk_sfn::Client,
    execution_arn: &str,
    account: Option<&str>,
    region: Option<&str>,
) -> Result<Vec<Running>, Error> {
    use aws_sdk_sfn::types::ExecutionStatus;
    let aws_err =
        |ctx: &str, e: String| Error::Aws { context: ctx.into(), reason: e.clone(), throttled: e.contains("Throttl") };
    // arn:aws:states:REGION:ACCOUNT:execution:MACHINE:NAME -> arn:aws:states:REGION:ACCOUNT:stateMachine:MACHINE
    let parts: Vec<&str> = execution_arn.split(':').collect();
    if parts.len() < 8 || parts[5] != "execution" {
        return Err(Error::InvalidInput(format!("execution_arn {execution_arn:?} is not an execution ARN")));
    }
    let machine = format!("{}:stateMachine:{}", parts[..5].join(":"), parts[6]);
    let mut out = Vec::new();
    let mut pages = sfn
        .list_executions()
        .state_machine_arn(&machine)
        .status_filter(ExecutionStatus::Running)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item =
            item.map_err(|e| aws_err("ListExecutions", format!("{}", aws_sdk_sfn::error::DisplayErrorContext(e))))?;
        let described = sfn
            .describe_execution()
            .execution_arn(item.execution_arn())
            .send()
            .await
            .map_err(|e| aws_err("DescribeExecution", format!("{}", aws_sdk_sfn::error::DisplayErrorContext(e))))?;
        let input: Value = described.input().and_then(|i| serde_json::from_str(i).ok()).unwrap_or(Value::Null);
        let subjects = match parse_input(&input, account, region) {
            Ok(t) => t.deployment.or(t.instance).into_iter().collect(),
            Err(_) => vec![],
        };
        let started_ms = described.start_date().to_millis().unwrap_or(i64::MAX).max(0) as u64;
        out.push(Running { name: item.name().to_string(), started_ms, subjects });
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let defaults = Defaults::from_env(|k| std::env::var(k).ok()).map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let aws = Aws::from_env().await;
    let deps = Deps { sfn: aws_sdk_sfn::Client::new(&aws.sdk), aws, defaults };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lambda_runtime::Context;

    fn deps() -> Deps {
        let aws = Aws::offline("us-east-1", "http://127.0.0.1:9");
        Deps { sfn: aws_sdk_sfn::Client::new(&aws.sdk), aws, defaults: Defaults::from_env(|_| None).unwrap() }
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
