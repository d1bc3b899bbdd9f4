//! Report, in two phases. Per instance (inside the PerInstance Map): what the instance's branch
//! carried becomes one bounded report (a few KiB whatever the database's size: lists of skips are cut
//! at LISTED_SKIPS with their count). For the run: the instances' reports become one stable JSON
//! summary (the state machine's output, which pipelines gate on), and CloudWatch metrics for bytes
//! warmed and coverage in embedded metric format.

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::workflow::{DatabaseCounts, HeadStartSummary, ItemSummary, PlanSummary, RunConfig, LISTED_SKIPS};
use pghydrate::Error;
use pghydrate_lambda::{init_tracing, Aws, Failure};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(untagged)]
enum Request {
    /// The end of one instance's branch: InstanceDone's or InstanceFailed's output.
    Instance { instance: Value },
    /// The end of the run: every instance's report.
    Run { run: Box<RunConfig>, instances: Vec<InstanceReport> },
}

#[derive(Serialize)]
#[serde(untagged)]
enum Response {
    Instance(Box<InstanceReport>),
    Run(Summary),
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
    /// The first LISTED_SKIPS skips (forks, databases), with why.
    skipped: Vec<String>,
    /// How many skips there were in all.
    #[serde(default)]
    skipped_count: usize,
    /// Databases whose blocks should have been read and were not (no CONNECT privilege, cannot
    /// connect...): listed first in `skipped`; the instance is not complete while there is one.
    #[serde(default, skip_serializing_if = "is_zero")]
    missed_databases: usize,
    /// Databases planned, skipped and excluded (none on the storage-only path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    databases: Option<DatabaseCounts>,
    maintenance: Value,
    storage: Value,
    /// What the Plan call read of the captured hot sets while it planned (counted in warmed_bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_start: Option<HeadStartSummary>,
    /// The warm phase's Lambda calls: how many, how long in all (what Lambda bills), and how they
    /// were sized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    warm: Option<WarmCalls>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Value>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct WarmCalls {
    /// Successful Warm calls over every item.
    calls: u32,
    /// Their durations added up, seconds.
    call_seconds: f64,
    /// Calls at once (the Map's MaxConcurrency) and the most sessions per call.
    calls_at_once: u32,
    sessions_per_call: u32,
    /// Why fewer sessions than asked for, if so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Summary {
    /// "complete" (every instance hydrated to 100% and storage initialized or watched to its limit),
    /// else "incomplete".
    status: String,
    execution: String,
    trigger: String,
    /// Warmed bytes over live bytes of every hydrated instance; 0 when any instance failed (its bytes
    /// are unknown, so nothing can be claimed) or when instances were to be hydrated and no byte was.
    coverage: f64,
    total_bytes: u64,
    warmed_bytes: u64,
    instances: Vec<InstanceReport>,
}

/// One child's result as the ResultWriter wrote it: its output itself (Transformation COMPACT, what the
/// definition asks for), or AWS's default shape, metadata with the output as a JSON string (NONE, and
/// always for a failed child).
fn child_result(v: Value, key: &str) -> Result<ChildResult, Error> {
    let bad = |e: serde_json::Error| Error::InvalidInput(format!("map result in {key}: {e}"));
    match v.get("Status").and_then(Value::as_str) {
        Some("SUCCEEDED") => {
            let output = v.get("Output").and_then(Value::as_str).unwrap_or("null");
            Ok(ChildResult::Done(serde_json::from_str(output).map_err(bad)?))
        }
        Some(status) => Ok(ChildResult::Failed(format!(
            "a warm call's child execution ended {status}: {} {}",
            v.get("Error").and_then(Value::as_str).unwrap_or(""),
            v.get("Cause").and_then(Value::as_str).unwrap_or("")
        ))),
        None => Ok(ChildResult::Done(serde_json::from_value(v).map_err(bad)?)),
    }
}

enum ChildResult {
    Done(ItemSummary),
    Failed(String),
}

/// Item summaries from an inline Map (an array) or from a Distributed Map's result files in S3, read a
/// line at a time (JSON Lines), so that the memory used does not grow with the number of work items;
/// failed children are returned as reasons.
async fn item_summaries(aws: &Aws, warmed: &Value) -> Result<(Vec<ItemSummary>, Vec<String>), Error> {
    if let Some(list) = warmed.as_array() {
        let items = serde_json::from_value(Value::Array(list.clone()))
            .map_err(|e| Error::InvalidInput(format!("warm results: {e}")))?;
        return Ok((items, vec![]));
    }
    let Some(details) = warmed.get("distributed_results") else {
        return Ok((vec![], vec![]));
    };
    let bucket = details["Bucket"].as_str().unwrap_or_default();
    let manifest_key = details["Key"].as_str().unwrap_or_default();
    let manifest: Value = serde_json::from_slice(&pghydrate::aws::get_bytes(&aws.s3, bucket, manifest_key).await?)
        .map_err(|e| Error::InvalidInput(format!("map manifest: {e}")))?;
    let mut items = Vec::new();
    let mut failed = Vec::new();
    for status in ["SUCCEEDED", "FAILED", "PENDING"] {
        for file in manifest["ResultFiles"][status].as_array().into_iter().flatten() {
            let key = file["Key"].as_str().unwrap_or_default();
            pghydrate::aws::for_each_line(&aws.s3, bucket, key, |line| {
                let v: Value =
                    serde_json::from_str(line).map_err(|e| Error::InvalidInput(format!("map results {key}: {e}")))?;
                // OutputType JSON: the whole file is one array.
                let entries = match v {
                    Value::Array(list) => list,
                    one => vec![one],
                };
                for entry in entries {
                    match child_result(entry, key)? {
                        ChildResult::Done(item) => items.push(item),
                        ChildResult::Failed(why) => failed.push(why),
                    }
                }
                Ok(())
            })
            .await?;
        }
    }
    Ok((items, failed))
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
            skipped_count: 0,
            missed_databases: 0,
            databases: None,
            maintenance: Value::Null,
            storage: Value::Null,
            head_start: None,
            warm: None,
            error: Some(v["error"].clone()),
        });
    }
    // Null on the storage-only path (no plan, no maintenance).
    let plan: Option<PlanSummary> = serde_json::from_value(v["plan"]["summary"].clone()).ok();
    let (items, failed_children) = item_summaries(aws, &v["warmed"]).await?;
    // What the Plan call's head start read is in no item: it counts here.
    let head_start = plan.as_ref().and_then(|p| p.head_start.clone());
    let warmed: u64 =
        items.iter().map(|i| i.warmed_bytes).sum::<u64>() + head_start.as_ref().map_or(0, |h| h.warmed_bytes);
    let vanished: u64 = items.iter().map(|i| i.vanished_bytes).sum();
    let skipped_run: u64 = items.iter().map(|i| i.skipped_bytes + i.pending_bytes).sum();
    // Relations locked while planning are in no plan total: the items that tried them again add them.
    let added: u64 = items.iter().map(|i| i.added_bytes).sum();
    let (total, planned_skip, mut skipped, mut skipped_count) = match &plan {
        Some(p) => {
            // Databases that could not be planned come first: nothing of theirs was read.
            let mut listed: Vec<String> = p
                .databases
                .iter()
                .filter(|d| d.outcome == pghydrate::plan::DatabaseOutcome::Skipped)
                .map(|d| format!("database {}: {}", d.name, d.reason.as_deref().unwrap_or("skipped")))
                .collect();
            listed.extend(p.planned_skips.iter().cloned());
            (p.total_bytes + added, p.planned_skip_bytes, listed, p.planned_skip_count + p.database_counts.skipped)
        }
        None => (0, 0, vec![], 0),
    };
    let missed_databases = plan.as_ref().map_or(0, |p| p.database_counts.missed);
    for i in &items {
        skipped_count += i.skipped_forks.max(i.skipped.len());
        skipped.extend(i.skipped.iter().map(|s| format!("{}: {s}", i.database)));
    }
    skipped_count += failed_children.len();
    skipped.extend(failed_children);
    skipped.truncate(LISTED_SKIPS);
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
        skipped_count,
        missed_databases,
        databases: plan.as_ref().map(|p| p.database_counts),
        maintenance: v["maintained"]["summary"].clone(),
        storage: v["storage"].clone(),
        head_start,
        warm: plan.as_ref().map(|p| WarmCalls {
            calls: items.iter().map(|i| i.calls).sum(),
            call_seconds: (items.iter().map(|i| i.call_seconds).sum::<f64>() * 10.0).round() / 10.0,
            calls_at_once: p.calls,
            sessions_per_call: p.sessions_per_call,
            note: p.sessions_note.clone(),
        }),
        error: None,
    })
}

struct Deps {
    aws: Aws,
    /// The state bucket, where each instance's lease lives.
    bucket: String,
}

/// The instance's branch has ended: its lease goes back first, so that a later restore of the same
/// instance is not turned away while this run only writes its summary. A lease that cannot be given
/// back is not an error of the hydration: the next run takes it over once this execution has ended.
async fn release(deps: &Deps, v: &Value) {
    let (Some(instance), Some(execution)) = (v["instance"].as_str(), v["execution"].as_str()) else { return };
    match pghydrate::aws::release_lease(&deps.aws.s3, &deps.bucket, instance, execution).await {
        Ok(true) => tracing::info!(%instance, "lease released"),
        Ok(false) => tracing::warn!(%instance, "no lease of this execution to release (taken over, or never taken)"),
        Err(e) => tracing::warn!(%instance, error = %e, "the lease could not be released; the next run takes it over"),
    }
}

async fn handler(deps: &Deps, event: LambdaEvent<Request>) -> Result<Response, Failure> {
    let aws = &deps.aws;
    match event.payload {
        Request::Instance { instance } => {
            release(deps, &instance).await;
            Ok(Response::Instance(Box::new(instance_report(aws, &instance).await?)))
        }
        Request::Run { run, instances } => Ok(Response::Run(summary(&run, instances))),
    }
}

fn summary(run: &RunConfig, instances: Vec<InstanceReport>) -> Summary {
    let total: u64 = instances.iter().map(|i| i.total_bytes).sum();
    let warmed: u64 = instances.iter().map(|i| i.warmed_bytes).sum();
    let vanished: u64 = instances.iter().map(|i| i.vanished_bytes).sum();
    let live = total.saturating_sub(vanished);
    let any_failed = instances.iter().any(|i| i.outcome == "failed");
    let complete =
        !instances.is_empty() && !any_failed && instances.iter().all(|i| i.coverage >= 1.0 && i.missed_databases == 0);
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
    let coverage = if any_failed || instances.is_empty() {
        0.0
    } else if live == 0 {
        1.0 // nothing there to read: every byte planned vanished, or only storage was watched
    } else {
        warmed as f64 / live as f64
    };
    Summary {
        status: if complete { "complete" } else { "incomplete" }.into(),
        execution: run.execution.clone(),
        trigger: serde_json::to_value(run.trigger.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        coverage,
        total_bytes: total,
        warmed_bytes: warmed,
        instances,
    }
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let bucket = std::env::var("PGHYDRATE_STATE_BUCKET").map_err(|_| "PGHYDRATE_STATE_BUCKET is not set")?;
    let deps = Deps { aws: Aws::from_env().await, bucket };
    run(service_fn(|e| async { handler(&deps, e).await.map_err(Diagnostic::from) })).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(outcome: &str, total: u64, warmed: u64) -> InstanceReport {
        InstanceReport {
            instance: "db1".into(),
            outcome: outcome.into(),
            coverage: if total == 0 { 1.0 } else { warmed as f64 / total as f64 },
            total_bytes: total,
            warmed_bytes: warmed,
            vanished_bytes: 0,
            skipped_bytes: total - warmed,
            skipped: vec![],
            skipped_count: 0,
            missed_databases: 0,
            databases: None,
            maintenance: Value::Null,
            storage: Value::Null,
            head_start: None,
            warm: None,
            error: None,
        }
    }

    fn run() -> RunConfig {
        let trigger = pghydrate::events::parse_input(&json!({"instance": "db1"}), None, None).unwrap();
        RunConfig::new("exec", trigger, &pghydrate::workflow::Defaults::from_env(|_| None).unwrap())
    }

    #[test]
    fn child_results_are_read_in_every_shape_aws_writes() {
        let summary = json!({"id": 3, "database": "app", "warmed_bytes": 8192, "vanished_bytes": 0,
                             "skipped_bytes": 0, "pending_bytes": 0, "calls": 1, "skipped": []});
        // COMPACT: the output itself.
        let ChildResult::Done(a) = child_result(summary.clone(), "k").unwrap() else { panic!() };
        // NONE: metadata, Input and Output as JSON strings.
        let none = json!({"Status": "SUCCEEDED", "Input": "{\"item\": {}}", "Output": summary.to_string(),
                          "ExecutionArn": "arn", "Name": "00000003"});
        let ChildResult::Done(b) = child_result(none, "k").unwrap() else { panic!() };
        assert_eq!((a.id, a.warmed_bytes), (3, 8192));
        assert_eq!(a, b);
        let failed = json!({"Status": "FAILED", "Error": "States.Timeout", "Cause": "took too long"});
        let ChildResult::Failed(why) = child_result(failed, "k").unwrap() else { panic!() };
        assert!(why.contains("FAILED") && why.contains("States.Timeout"), "{why}");
        assert!(child_result(json!({"not": "a summary"}), "k").is_err(), "a malformed result is an error, not a zero");
    }

    /// A pipeline gates on the top-level coverage: it must never read 1.0 when an instance failed or
    /// when there was nothing to report.
    #[test]
    fn coverage_is_never_full_when_an_instance_failed_or_none_was_hydrated() {
        let failed = InstanceReport { coverage: 0.0, ..instance("failed", 0, 0) };
        let s = summary(&run(), vec![failed]);
        assert_eq!((s.status.as_str(), s.coverage), ("incomplete", 0.0));
        let s = summary(
            &run(),
            vec![instance("hydrated", 100, 100), InstanceReport { coverage: 0.0, ..instance("failed", 0, 0) }],
        );
        assert_eq!((s.status.as_str(), s.coverage), ("incomplete", 0.0));
        let s = summary(&run(), vec![]);
        assert_eq!((s.status.as_str(), s.coverage), ("incomplete", 0.0));
        let s = summary(&run(), vec![instance("hydrated", 100, 0)]);
        assert_eq!((s.status.as_str(), s.coverage), ("incomplete", 0.0));
        let s = summary(&run(), vec![instance("hydrated", 100, 100), instance("storage_only", 0, 0)]);
        assert_eq!((s.status.as_str(), s.coverage), ("complete", 1.0));
        // Every planned block read, but a database could not be planned (no CONNECT privilege):
        // its blocks were never counted, so the run is not complete.
        let missed = InstanceReport { missed_databases: 1, ..instance("hydrated", 100, 100) };
        let s = summary(&run(), vec![missed]);
        assert_eq!(s.status, "incomplete");
    }

    /// The blocks the Plan call's head start read are in no item: the instance's warmed bytes count
    /// them, so that a run whose hot set was read while planning still reports every byte.
    #[tokio::test]
    async fn a_head_starts_bytes_count_as_warmed() {
        let aws = Aws::from_env().await;
        let plan = json!({"server_version": "18.1", "mode": "buffer", "databases": [], "forks": 3,
                          "total_bytes": 10 * 8192, "planned_bytes": 10 * 8192, "planned_skips": [],
                          "planned_skip_count": 0, "planned_skip_bytes": 0, "items": 1,
                          "head_start": {"warmed_bytes": 4 * 8192, "seconds": 0.5, "hot_bytes_left": 0}});
        let item = json!({"id": 0, "database": "app", "warmed_bytes": 6 * 8192, "vanished_bytes": 0,
                          "skipped_bytes": 0, "pending_bytes": 0, "calls": 1, "skipped": []});
        let branch = json!({"instance": "db1", "plan": {"summary": plan}, "warmed": [item],
                            "maintained": {"summary": null}, "storage": null});
        let r = instance_report(&aws, &branch).await.unwrap();
        assert_eq!((r.warmed_bytes, r.coverage), (10 * 8192, 1.0), "{r:?}");
        assert_eq!(r.head_start.as_ref().map(|h| h.warmed_bytes), Some(4 * 8192));
        // Without it, the same items cover six tenths.
        let mut branch = branch;
        branch["plan"]["summary"].as_object_mut().unwrap().remove("head_start");
        let r = instance_report(&aws, &branch).await.unwrap();
        assert_eq!(r.warmed_bytes, 6 * 8192);
        assert!((r.coverage - 0.6).abs() < 1e-9, "{r:?}");
    }
}
