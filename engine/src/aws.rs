//! AWS adapters for the Lambdas: DescribeDBInstances, DescribeBlueGreenDeployments, Secrets Manager
//! credentials and S3 objects. Each turns SDK types into the engine's plain types
//! ([`crate::workflow::InstanceView`]) and SDK errors into named [`Error`]s. Secret values never appear
//! in an error or a log.

use std::collections::BTreeMap;

use aws_sdk_rds::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};

use crate::error::{Error, Result};
use crate::workflow::InstanceView;

fn aws_error<E: ProvideErrorMetadata + std::fmt::Debug>(context: &str, e: &E) -> Error {
    let code = e.code().unwrap_or("Unknown").to_string();
    let throttled = matches!(
        code.as_str(),
        "Throttling" | "ThrottlingException" | "TooManyRequestsException" | "RequestLimitExceeded" | "SlowDown"
    );
    Error::Aws { context: context.into(), reason: format!("{code}: {}", e.message().unwrap_or("")), throttled }
}

/// An SDK error as a named engine error: a request that never got an answer (no route from the VPC to
/// the endpoint, DNS, a timeout) is `AwsUnreachable` with the SDK's whole cause chain, which is retried;
/// an answer is classified by its error code.
fn sdk_error<E, R>(context: &str, e: SdkError<E, R>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    match e {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => Error::AwsUnreachable {
            context: context.into(),
            reason: format!(
                "{} (in a VPC: the function needs a route to this service, an interface endpoint or a NAT gateway)",
                DisplayErrorContext(&e)
            ),
        },
        SdkError::ServiceError(ref s) => aws_error(context, s.err()),
        other => {
            Error::Aws { context: context.into(), reason: format!("{}", DisplayErrorContext(&other)), throttled: false }
        }
    }
}

/// The instance as the workflow needs it; `Error::InstanceNotFound` when it does not exist.
pub async fn describe_instance(rds: &aws_sdk_rds::Client, id: &str) -> Result<InstanceView> {
    let out = rds.describe_db_instances().db_instance_identifier(id).send().await;
    let out = match out {
        Ok(o) => o,
        Err(SdkError::ServiceError(e)) if e.err().is_db_instance_not_found_fault() => {
            return Err(Error::InstanceNotFound(id.to_string()))
        }
        Err(e) => return Err(sdk_error("DescribeDBInstances", e)),
    };
    let db = out.db_instances().first().ok_or_else(|| Error::InstanceNotFound(id.to_string()))?;
    Ok(InstanceView {
        id: db.db_instance_identifier().unwrap_or(id).to_string(),
        arn: db.db_instance_arn().map(str::to_string),
        status: db.db_instance_status().unwrap_or("unknown").to_string(),
        engine: db.engine().unwrap_or("").to_string(),
        address: db.endpoint().and_then(|e| e.address()).map(str::to_string),
        port: db.endpoint().and_then(|e| e.port()).map(|p| p as u16),
        storage_status: db.storage_operation_status().map(str::to_string),
        storage_progress: db.storage_operation_percent_progress(),
        master_secret_arn: db.master_user_secret().and_then(|s| s.secret_arn()).map(str::to_string),
        master_username: db.master_username().map(str::to_string),
        tags: db
            .tag_list()
            .iter()
            .filter_map(|t| Some((t.key()?.to_string(), t.value().unwrap_or("").to_string())))
            .collect::<BTreeMap<_, _>>(),
    })
}

/// The green (target) instances of a Blue/Green deployment.
pub async fn green_instances(rds: &aws_sdk_rds::Client, deployment: &str) -> Result<Vec<String>> {
    let out = rds
        .describe_blue_green_deployments()
        .blue_green_deployment_identifier(deployment)
        .send()
        .await
        .map_err(|e| sdk_error("DescribeBlueGreenDeployments", e))?;
    let bgd = out
        .blue_green_deployments()
        .first()
        .ok_or_else(|| Error::InvalidInput(format!("Blue/Green deployment {deployment:?} not found")))?;
    let mut ids: Vec<String> = bgd
        .switchover_details()
        .iter()
        .filter_map(|d| d.target_member())
        .filter(|arn| arn.contains(":db:"))
        .filter_map(|arn| arn.rsplit(':').next())
        .map(str::to_string)
        .collect();
    ids.sort();
    ids.dedup();
    if ids.is_empty() {
        return Err(Error::InvalidInput(format!("Blue/Green deployment {deployment:?} names no green DB instance")));
    }
    Ok(ids)
}

/// Username and password from a Secrets Manager secret holding JSON with `username` and `password`
/// (the shape RDS uses for its managed master secrets).
pub async fn secret_credentials(sm: &aws_sdk_secretsmanager::Client, arn: &str) -> Result<(String, String)> {
    let out = sm.get_secret_value().secret_id(arn).send().await.map_err(|e| sdk_error("GetSecretValue", e))?;
    let text = out.secret_string().ok_or_else(|| Error::InvalidInput(format!("secret {arn} has no string value")))?;
    crate::workflow::credentials_from_secret(text).map_err(|why| Error::InvalidInput(format!("secret {arn}: {why}")))
}

pub async fn put_json(s3: &aws_sdk_s3::Client, bucket: &str, key: &str, body: Vec<u8>) -> Result<()> {
    s3.put_object()
        .bucket(bucket)
        .key(key)
        .content_type("application/json")
        .body(body.into())
        .send()
        .await
        .map_err(|e| sdk_error(&format!("PutObject s3://{bucket}/{key}"), e))?;
    Ok(())
}

async fn get_object(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    key: &str,
) -> Result<aws_sdk_s3::operation::get_object::GetObjectOutput> {
    s3.get_object()
        .bucket(bucket)
        .key(key)
        .send()
        .await
        .map_err(|e| sdk_error(&format!("GetObject s3://{bucket}/{key}"), e))
}

pub async fn get_bytes(s3: &aws_sdk_s3::Client, bucket: &str, key: &str) -> Result<Vec<u8>> {
    let out = get_object(s3, bucket, key).await?;
    let data = out.body.collect().await.map_err(|e| Error::Aws {
        context: format!("reading s3://{bucket}/{key}"),
        reason: e.to_string(),
        throttled: false,
    })?;
    Ok(data.into_bytes().to_vec())
}

/// Calls `f` with each non-empty line of an S3 object, read as it arrives: memory stays at one line
/// however large the object (a Distributed Map's result files in JSON Lines).
pub async fn for_each_line(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    key: &str,
    mut f: impl FnMut(&str) -> Result<()>,
) -> Result<()> {
    use tokio::io::AsyncBufReadExt;
    let out = get_object(s3, bucket, key).await?;
    let mut lines = tokio::io::BufReader::new(out.body.into_async_read()).lines();
    while let Some(line) = lines
        .next_line()
        .await
        .map_err(|e| Error::AwsUnreachable { context: format!("reading s3://{bucket}/{key}"), reason: e.to_string() })?
    {
        if !line.trim().is_empty() {
            f(&line)?;
        }
    }
    Ok(())
}

/// An execution of the workflow as `pghydrate start --wait` follows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecutionView {
    /// RUNNING, SUCCEEDED, FAILED, TIMED_OUT, ABORTED, PENDING_REDRIVE.
    pub status: String,
    pub output: Option<String>,
    pub error: Option<String>,
    pub cause: Option<String>,
}

/// An execution name that says what it hydrates: `hydrate-<instance>-<UTC time>` (at most 80 characters
/// of letters, digits, hyphens, as Step Functions requires).
pub fn execution_name(instance: &str, now: std::time::SystemTime) -> String {
    let stamp: String =
        humantime::format_rfc3339_seconds(now).to_string().chars().filter(|c| c.is_ascii_digit()).collect();
    let short: String = instance.chars().take(56).collect();
    format!("hydrate-{short}-{stamp}")
}

/// Starts an execution named `name` with `input` (already validated); returns its ARN.
pub async fn start_execution(
    sfn: &aws_sdk_sfn::Client,
    state_machine: &str,
    name: &str,
    input: &serde_json::Value,
) -> Result<String> {
    let out = sfn
        .start_execution()
        .state_machine_arn(state_machine)
        .name(name)
        .input(input.to_string())
        .send()
        .await
        .map_err(|e| sdk_error("StartExecution", e))?;
    Ok(out.execution_arn().to_string())
}

pub async fn describe_execution(sfn: &aws_sdk_sfn::Client, execution: &str) -> Result<ExecutionView> {
    let out = sfn
        .describe_execution()
        .execution_arn(execution)
        .send()
        .await
        .map_err(|e| sdk_error("DescribeExecution", e))?;
    Ok(ExecutionView {
        status: out.status().as_str().to_string(),
        output: out.output().map(str::to_string),
        error: out.error().map(str::to_string),
        cause: out.cause().map(str::to_string),
    })
}

/// The exit code a finished execution stands for (the CLI's codes, see README).
/// What a succeeded execution that read nothing says (its output `{"status": "skipped", "reason",
/// "held_by"}`): the instance is being hydrated by another execution (which `start --wait` follows), or
/// there was nothing to do for it (not PostgreSQL, filtered out, a replica event on healthy storage).
#[derive(Debug, Clone, PartialEq)]
pub enum Skipped {
    HeldBy { execution_arn: String },
    NothingRead { reason: String },
}

/// The skip an ended execution reports for `instance`, if it read nothing.
pub fn skipped(v: &ExecutionView, instance: &str) -> Option<Skipped> {
    let out: serde_json::Value = serde_json::from_str(v.output.as_deref()?).ok()?;
    if v.status != "SUCCEEDED" || out.get("status").and_then(|s| s.as_str()) != Some("skipped") {
        return None;
    }
    let holder = out
        .get("held_by")
        .and_then(|h| h.as_array())
        .and_then(|held| held.iter().find(|h| h.get("instance").and_then(|i| i.as_str()) == Some(instance)));
    Some(match holder.and_then(|h| h.get("execution_arn")).and_then(|a| a.as_str()) {
        Some(arn) => Skipped::HeldBy { execution_arn: arn.to_string() },
        None => Skipped::NothingRead {
            reason: out.get("reason").and_then(|r| r.as_str()).unwrap_or("no reason given").to_string(),
        },
    })
}

/// `start --wait`'s exit code for an ended execution, as `run`'s: 0 only when every byte was read (a run
/// that was skipped read nothing: 4).
pub fn execution_exit_code(v: &ExecutionView) -> i32 {
    use crate::error::exit;
    match (v.status.as_str(), v.error.as_deref()) {
        ("SUCCEEDED", _) if skipped(v, "").is_some() => exit::INCOMPLETE,
        ("SUCCEEDED", _) => exit::COMPLETE,
        ("FAILED", Some("HydrationIncomplete")) => exit::INCOMPLETE,
        ("FAILED", Some("InvalidInput" | "InstanceNotFound")) => exit::INVALID_INPUT,
        _ => exit::INTERNAL,
    }
}

/// Who is hydrating an instance. One object per instance in the state bucket, `leases/<instance>.json`,
/// created with `If-None-Match: *`: S3's conditional writes are strongly consistent, so of two
/// executions that start at the same moment for the same instance exactly one creates it. A Blue/Green
/// run and a pipeline's run for one of its green instances take the same instance's lease and so see
/// each other (ListExecutions, used before, is eventually consistent and named the deployment, not the
/// instance).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LeaseHolder {
    /// The execution's name (`$$.Execution.Name`), which the run's report carries.
    pub execution: String,
    /// Its ARN, to ask Step Functions whether it still runs.
    pub execution_arn: String,
    /// When it took the lease (RFC 3339).
    pub since: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Lease {
    /// This execution holds the lease; `took_over` names a holder that had ended without releasing it.
    Acquired { took_over: Option<String> },
    /// A running execution holds it.
    HeldBy(LeaseHolder),
}

pub fn lease_key(instance: &str) -> String {
    format!("leases/{instance}.json")
}

fn precondition_failed<R>(e: &SdkError<aws_sdk_s3::operation::put_object::PutObjectError, R>) -> bool {
    matches!(e, SdkError::ServiceError(s) if matches!(s.err().code(), Some("PreconditionFailed" | "ConditionalRequestConflict")))
}

/// The lease object and its ETag, or None when there is none.
async fn read_lease(s3: &aws_sdk_s3::Client, bucket: &str, key: &str) -> Result<Option<(Vec<u8>, String)>> {
    let out = match s3.get_object().bucket(bucket).key(key).send().await {
        Ok(o) => o,
        Err(SdkError::ServiceError(e)) if e.err().is_no_such_key() => return Ok(None),
        Err(e) => return Err(sdk_error(&format!("GetObject s3://{bucket}/{key}"), e)),
    };
    let etag = out.e_tag().unwrap_or_default().to_string();
    let data = out.body.collect().await.map_err(|e| Error::AwsUnreachable {
        context: format!("reading s3://{bucket}/{key}"),
        reason: e.to_string(),
    })?;
    Ok(Some((data.into_bytes().to_vec(), etag)))
}

/// Whether the execution is RUNNING; None when Step Functions says it does not exist.
async fn execution_running(sfn: &aws_sdk_sfn::Client, arn: &str) -> Result<Option<bool>> {
    match sfn.describe_execution().execution_arn(arn).send().await {
        Ok(o) => Ok(Some(o.status().as_str() == "RUNNING")),
        Err(SdkError::ServiceError(e)) if e.err().is_execution_does_not_exist() => Ok(None),
        Err(e) => Err(sdk_error("DescribeExecution", e)),
    }
}

/// How long an execution that Step Functions says does not exist still counts as its lease's holder.
/// DescribeExecution is eventually consistent: an execution that started a moment ago can be unknown
/// to it for a while; an execution older than this is really gone (history expired, machine replaced).
pub const UNKNOWN_HOLDER_GRACE: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Whether a lease's holder still holds it: it runs, or Step Functions does not know it yet and the
/// lease is younger than [`UNKNOWN_HOLDER_GRACE`]. A `since` that does not parse counts as old.
pub fn holder_holds(running: Option<bool>, since: &str, now: std::time::SystemTime) -> bool {
    match running {
        Some(r) => r,
        None => humantime::parse_rfc3339_weak(since.trim_end_matches('Z'))
            .ok()
            .and_then(|t| now.duration_since(t).ok().or(Some(std::time::Duration::ZERO)))
            .is_some_and(|age| age < UNKNOWN_HOLDER_GRACE),
    }
}

/// Takes the instance's lease for `me`: created if there is none; kept if `me` already holds it (a
/// retried Resolve); taken over, with `If-Match` on the holder's version, when its holder no longer
/// runs (aborted, timed out, failed before releasing it; see [`holder_holds`]) or the object is not a
/// lease.
pub async fn acquire_lease(
    s3: &aws_sdk_s3::Client,
    sfn: &aws_sdk_sfn::Client,
    bucket: &str,
    instance: &str,
    me: &LeaseHolder,
) -> Result<Lease> {
    let key = lease_key(instance);
    let body = serde_json::to_vec(me).map_err(|e| Error::InvalidInput(e.to_string()))?;
    // None: create; Some(etag): replace exactly that version.
    let mut replace: Option<String> = None;
    let mut took_over = None;
    for _ in 0..5 {
        let put = s3.put_object().bucket(bucket).key(&key).content_type("application/json").body(body.clone().into());
        let put = match &replace {
            None => put.if_none_match("*"),
            Some(etag) => put.if_match(etag),
        };
        match put.send().await {
            Ok(_) => return Ok(Lease::Acquired { took_over }),
            Err(e) if precondition_failed(&e) => {}
            Err(e) => return Err(sdk_error(&format!("PutObject s3://{bucket}/{key}"), e)),
        }
        let Some((data, etag)) = read_lease(s3, bucket, &key).await? else {
            replace = None; // released in between: create it
            continue;
        };
        match serde_json::from_slice::<LeaseHolder>(&data) {
            Ok(h) if h.execution == me.execution => return Ok(Lease::Acquired { took_over: None }),
            Ok(h) if holds_now(sfn, &h).await? => return Ok(Lease::HeldBy(h)),
            Ok(h) => took_over = Some(h.execution),
            Err(_) => took_over = Some(format!("an unreadable lease object {key}")),
        }
        replace = Some(etag);
    }
    Err(Error::Aws {
        context: format!("lease s3://{bucket}/{key}"),
        reason: "changed hands five times while being taken; trying again later".into(),
        throttled: true,
    })
}

/// The execution that holds the instance's lease now (see [`holder_holds`]), if any: a hydration
/// run in progress, whose reads are what the instance's buffers hold.
pub async fn lease_holder(
    s3: &aws_sdk_s3::Client,
    sfn: &aws_sdk_sfn::Client,
    bucket: &str,
    instance: &str,
) -> Result<Option<String>> {
    let Some((data, _)) = read_lease(s3, bucket, &lease_key(instance)).await? else { return Ok(None) };
    let Ok(h) = serde_json::from_slice::<LeaseHolder>(&data) else { return Ok(None) };
    Ok(holds_now(sfn, &h).await?.then_some(h.execution))
}

/// Whether `h` holds its lease now ([`holder_holds`], asking Step Functions whether it runs).
async fn holds_now(sfn: &aws_sdk_sfn::Client, h: &LeaseHolder) -> Result<bool> {
    let running = execution_running(sfn, &h.execution_arn).await?;
    Ok(holder_holds(running, &h.since, std::time::SystemTime::now()))
}

/// Gives the instance's lease back if `execution` holds it (a lease taken over by another run is left
/// alone). Returns whether one was released.
pub async fn release_lease(s3: &aws_sdk_s3::Client, bucket: &str, instance: &str, execution: &str) -> Result<bool> {
    let key = lease_key(instance);
    let Some((data, etag)) = read_lease(s3, bucket, &key).await? else { return Ok(false) };
    match serde_json::from_slice::<LeaseHolder>(&data) {
        Ok(h) if h.execution == execution => {}
        _ => return Ok(false),
    }
    match s3.delete_object().bucket(bucket).key(&key).if_match(etag).send().await {
        Ok(_) => Ok(true),
        Err(SdkError::ServiceError(e)) if matches!(e.err().code(), Some("PreconditionFailed")) => Ok(false),
        Err(e) => Err(sdk_error(&format!("DeleteObject s3://{bucket}/{key}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lease_is_held_while_its_execution_runs_or_is_not_known_yet() {
        let now = humantime::parse_rfc3339("2026-12-03T12:00:00Z").unwrap();
        let ago = |s: u64| humantime::format_rfc3339_millis(now - Duration::from_secs(s)).to_string();
        assert!(holder_holds(Some(true), &ago(86_400), now), "running: held, however old");
        assert!(!holder_holds(Some(false), &ago(1), now), "ended: free, however young");
        assert!(holder_holds(None, &ago(5), now), "unknown a moment after it started: not visible yet");
        assert!(holder_holds(None, &ago(14 * 60), now));
        assert!(!holder_holds(None, &ago(16 * 60), now), "unknown long after: gone");
        assert!(!holder_holds(None, "not a time", now));
        let future = humantime::format_rfc3339(now + Duration::from_secs(30)).to_string();
        assert!(holder_holds(None, &future, now), "a clock a little ahead is young, not old");
    }

    /// A start that lost to another run follows that run; one skipped for any other reason read
    /// nothing, and says so in its exit code (0 is "every byte read").
    #[test]
    fn a_skipped_execution_names_the_run_to_follow_or_exits_as_nothing_read() {
        let ended = |status: &str, output: serde_json::Value| ExecutionView {
            status: status.into(),
            output: Some(output.to_string()),
            error: None,
            cause: None,
        };
        let held = ended(
            "SUCCEEDED",
            serde_json::json!({"status": "skipped", "reason": "db1 is already being hydrated",
            "held_by": [{"instance": "db1", "execution": "e1", "execution_arn": "arn:e1"}]}),
        );
        assert_eq!(skipped(&held, "db1"), Some(Skipped::HeldBy { execution_arn: "arn:e1".into() }));
        assert_eq!(
            skipped(&held, "db2"),
            Some(Skipped::NothingRead { reason: "db1 is already being hydrated".into() })
        );
        assert_eq!(execution_exit_code(&held), crate::error::exit::INCOMPLETE);
        let filtered =
            ended("SUCCEEDED", serde_json::json!({"status": "skipped", "reason": "db1 runs \"mysql\"", "held_by": []}));
        assert!(matches!(skipped(&filtered, "db1"), Some(Skipped::NothingRead { reason }) if reason.contains("mysql")));
        assert_eq!(execution_exit_code(&filtered), crate::error::exit::INCOMPLETE);
        let hydrated = ended("SUCCEEDED", serde_json::json!({"status": "complete", "coverage": 1.0}));
        assert_eq!(skipped(&hydrated, "db1"), None);
        assert_eq!(execution_exit_code(&hydrated), crate::error::exit::COMPLETE);
    }

    /// In a VPC without a route to RDS the SDK never gets an answer: the error is named, retried, and
    /// carries the SDK's cause (it used to be "Unknown: " with nothing after it).
    #[tokio::test]
    async fn an_endpoint_that_does_not_answer_is_unreachable_with_its_cause() {
        let config = aws_sdk_rds::Config::builder()
            .region(aws_sdk_rds::config::Region::from_static("us-east-1"))
            .endpoint_url("http://127.0.0.1:9")
            .credentials_provider(aws_sdk_rds::config::Credentials::new("a", "b", None, None, "test"))
            .retry_config(aws_sdk_rds::config::retry::RetryConfig::disabled())
            .behavior_version(aws_sdk_rds::config::BehaviorVersion::latest())
            .build();
        let e = describe_instance(&aws_sdk_rds::Client::from_conf(config), "db1").await.unwrap_err();
        assert_eq!(e.name(), "AwsUnreachable", "{e}");
        assert!(e.is_retryable());
        let text = e.to_string();
        assert!(text.starts_with("DescribeDBInstances: the AWS endpoint did not answer: "), "{text}");
        assert!(text.contains("refused") || text.contains("connect"), "the cause is kept: {text}");
    }

    #[test]
    fn leases_are_one_object_per_instance() {
        assert_eq!(lease_key("orders-green-abc123"), "leases/orders-green-abc123.json");
    }
}
