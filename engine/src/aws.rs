//! AWS adapters for the Lambdas: DescribeDBInstances, DescribeBlueGreenDeployments, Secrets Manager
//! credentials and S3 objects. Each turns SDK types into the engine's plain types
//! ([`crate::workflow::InstanceView`]) and SDK errors into named [`Error`]s. Secret values never appear
//! in an error or a log.

use std::collections::BTreeMap;

use aws_sdk_rds::error::ProvideErrorMetadata;

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

/// The instance as the workflow needs it; `Error::InstanceNotFound` when it does not exist.
pub async fn describe_instance(rds: &aws_sdk_rds::Client, id: &str) -> Result<InstanceView> {
    let out = rds.describe_db_instances().db_instance_identifier(id).send().await;
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            let service = e.into_service_error();
            if service.is_db_instance_not_found_fault() {
                return Err(Error::InstanceNotFound(id.to_string()));
            }
            return Err(aws_error("DescribeDBInstances", &service));
        }
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
        .map_err(|e| aws_error("DescribeBlueGreenDeployments", &e.into_service_error()))?;
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
    let out = sm
        .get_secret_value()
        .secret_id(arn)
        .send()
        .await
        .map_err(|e| aws_error("GetSecretValue", &e.into_service_error()))?;
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
        .map_err(|e| aws_error(&format!("PutObject s3://{bucket}/{key}"), &e.into_service_error()))?;
    Ok(())
}

pub async fn get_bytes(s3: &aws_sdk_s3::Client, bucket: &str, key: &str) -> Result<Vec<u8>> {
    let out = s3
        .get_object()
        .bucket(bucket)
        .key(key)
        .send()
        .await
        .map_err(|e| aws_error(&format!("GetObject s3://{bucket}/{key}"), &e.into_service_error()))?;
    let data = out.body.collect().await.map_err(|e| Error::Aws {
        context: format!("reading s3://{bucket}/{key}"),
        reason: e.to_string(),
        throttled: false,
    })?;
    Ok(data.into_bytes().to_vec())
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
        .map_err(|e| aws_error("StartExecution", &e.into_service_error()))?;
    Ok(out.execution_arn().to_string())
}

pub async fn describe_execution(sfn: &aws_sdk_sfn::Client, execution: &str) -> Result<ExecutionView> {
    let out = sfn
        .describe_execution()
        .execution_arn(execution)
        .send()
        .await
        .map_err(|e| aws_error("DescribeExecution", &e.into_service_error()))?;
    Ok(ExecutionView {
        status: out.status().as_str().to_string(),
        output: out.output().map(str::to_string),
        error: out.error().map(str::to_string),
        cause: out.cause().map(str::to_string),
    })
}

/// The exit code a finished execution stands for (the CLI's codes, see README).
pub fn execution_exit_code(v: &ExecutionView) -> i32 {
    use crate::error::exit;
    match (v.status.as_str(), v.error.as_deref()) {
        ("SUCCEEDED", _) => exit::COMPLETE,
        ("FAILED", Some("HydrationIncomplete")) => exit::INCOMPLETE,
        ("FAILED", Some("InvalidInput" | "InstanceNotFound")) => exit::INVALID_INPUT,
        _ => exit::INTERNAL,
    }
}
