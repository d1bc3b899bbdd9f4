//! Report: one stable JSON summary of the execution (the state machine's output, which pipelines gate
//! on), and CloudWatch metrics for bytes warmed and coverage in embedded metric format.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{ItemSummary, PlanSummary, RunConfig};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, Failure};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Deserialize)]
struct Request {
    run: RunConfig,
    instances: Vec<Value>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct InstanceReport {
    instance: String,
    /// "hydrated", "storage_only" or "failed".
    outcome: String,
    coverage: f64,
    total_bytes: u64,
    warmed_bytes: u64,
    vanished_bytes: u64,
    skipped_bytes: u64,
    skipped: Vec<String>,
    maintenance: Value,
    storage: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Value>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Summary {
    /// "complete" (every instance hydrated to 100% and storage initialized or watched to its limit),
    /// else "incomplete".
    status: String,
    execution: String,
    trigger: String,
    coverage: f64,
    total_bytes: u64,
    warmed_bytes: u64,
    instances: Vec<InstanceReport>,
}

/// Item summaries from an inline Map (an array) or from a Distributed Map's result files in S3.
async fn item_summaries(aws: &Aws, warmed: &Value) -> Result<Vec<ItemSummary>, Error> {
    if let Some(list) = warmed.as_array() {
        return serde_json::from_value(Value::Array(list.clone()))
            .map_err(|e| Error::InvalidInput(format!("warm results: {e}")));
    }
    let Some(details) = warmed.get("distributed_results") else {
        return Ok(vec![]);
    };
    let bucket = details["Bucket"].as_str().unwrap_or_default();
    let manifest_key = details["Key"].as_str().unwrap_or_default();
    let manifest: Value = serde_json::from_slice(&pghydrate::aws::get_bytes(&aws.s3, bucket, manifest_key).await?)
        .map_err(|e| Error::InvalidInput(format!("map manifest: {e}")))?;
    let mut out = Vec::new();
    for file in manifest["ResultFiles"]["SUCCEEDED"].as_array().into_iter().flatten() {
        let key = file["Key"].as_str().unwrap_or_default();
        let results: Vec<Value> = serde_json::from_slice(&pghydrate::aws::get_bytes(&aws.s3, bucket, key).await?)
            .map_err(|e| Error::InvalidInput(format!("map results {key}: {e}")))?;
        for r in results {
            let output: ItemSummary = serde_json::from_str(r["Output"].as_str().unwrap_or("null"))
                .map_err(|e| Error::InvalidInput(format!("map result in {key}: {e}")))?;
            out.push(output);
        }
    }
    Ok(out)
}

async fn instance_report(aws: &Aws, v: &Value) -> Result<InstanceReport, Error> {
    let instance = v["instance"].as_str().unwrap_or("?").to_string();
    if v["outcome"] == "failed" {
        return Ok(InstanceReport {
            instance,
            outcome: "failed".into(),
            coverage: 0.0,
            total_bytes: 0,
            warmed_bytes: 0,
            vanished_bytes: 0,
            skipped_bytes: 0,
            skipped: vec![],
            maintenance: Value::Null,
            storage: Value::Null,
            error: Some(v["error"].clone()),
        });
    }
    let plan: Option<PlanSummary> = serde_json::from_value(v["plan"]["summary"].clone()).ok();
    let items = item_summaries(aws, &v["warmed"]).await?;
    let warmed: u64 = items.iter().map(|i| i.warmed_bytes).sum();
    let vanished: u64 = items.iter().map(|i| i.vanished_bytes).sum();
    let skipped_run: u64 = items.iter().map(|i| i.skipped_bytes + i.pending_bytes).sum();
    let (total, planned_skip, mut skipped) = match &plan {
        Some(p) => (p.total_bytes, p.planned_skip_bytes, p.planned_skips.clone()),
        None => (0, 0, vec![]),
    };
    skipped.extend(items.iter().flat_map(|i| i.skipped.iter().map(|s| format!("{}: {s}", i.database))));
    let live = total.saturating_sub(vanished);
    let coverage = if live == 0 { 1.0 } else { warmed as f64 / live as f64 };
    let outcome = if plan.is_some() { "hydrated" } else { "storage_only" };
    Ok(InstanceReport {
        instance,
        outcome: outcome.into(),
        coverage: if plan.is_some() { coverage } else { 1.0 },
        total_bytes: total,
        warmed_bytes: warmed,
        vanished_bytes: vanished,
        skipped_bytes: skipped_run + planned_skip,
        skipped,
        maintenance: v["maintained"]["summary"].clone(),
        storage: v["storage"].clone(),
        error: None,
    })
}

async fn handler(aws: &Aws, event: LambdaEvent<Request>) -> Result<Summary, Failure> {
    let r = event.payload;
    let mut instances = Vec::new();
    for v in &r.instances {
        instances.push(instance_report(aws, v).await?);
    }
    let total: u64 = instances.iter().map(|i| i.total_bytes).sum();
    let warmed: u64 = instances.iter().map(|i| i.warmed_bytes).sum();
    let vanished: u64 = instances.iter().map(|i| i.vanished_bytes).sum();
    let live = total.saturating_sub(vanished);
    let complete = instances.iter().all(|i| i.outcome != "failed" && i.coverage >= 1.0);
    for i in &instances {
        // CloudWatch embedded metric format: one line per instance becomes two metrics.
        println!(
            "{}",
            json!({
                "_aws": {"Timestamp": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
                         "CloudWatchMetrics": [{"Namespace": "pghydrate", "Dimensions": [["Instance"]],
                             "Metrics": [{"Name": "WarmedBytes", "Unit": "Bytes"}, {"Name": "Coverage", "Unit": "None"}]}]},
                "Instance": i.instance, "WarmedBytes": i.warmed_bytes, "Coverage": i.coverage
            })
        );
    }
    Ok(Summary {
        status: if complete { "complete" } else { "incomplete" }.into(),
        execution: r.run.execution.clone(),
        trigger: serde_json::to_value(r.run.trigger.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        coverage: if live == 0 { 1.0 } else { warmed as f64 / live as f64 },
        total_bytes: total,
        warmed_bytes: warmed,
        instances,
    })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let aws = Aws::from_env().await;
    run(service_fn(|e| async { handler(&aws, e).await.map_err(Diagnostic::from) })).await
}
