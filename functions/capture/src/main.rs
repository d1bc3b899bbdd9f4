//! Capture: the scheduled hot-set capture of chosen source instances (the stack's CaptureInstances,
//! off when empty). An EventBridge schedule invokes it with a Scheduled Event; it then invokes itself
//! once per instance, asynchronously (`{"instance": ID}`), so that each instance's capture has a whole
//! call of its own: capturing every instance in turn in one call could outlast Lambda's 900 s.
//!
//! An instance's call captures what its shared buffers hold into each of its databases
//! ([`pghydrate::hotset::capture`]), hottest database first, until the call's deadline, unless the
//! buffers cannot be the application's hot set yet; then it captures nothing, keeps the previous
//! capture, and says why (a skip is not a failure):
//! - the instance is not available (stopped, modifying, rebooting...);
//! - its storage is still initializing (a restored instance: its buffers hold what lazy loading and
//!   hydration fetched);
//! - a hydration run holds its lease (its reads fill the buffers);
//! - the server has been up for less than PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES (default 60).
//!
//! Only instances listed in PGHYDRATE_CAPTURE_INSTANCES are captured: a request naming another one is
//! refused before any AWS call (whoever may invoke the function cannot point it at other databases).
//! A database not captured (no pg_buffercache, no CREATE privilege, a schema pghydrate someone else
//! owns, out of time) fails the call with CaptureIncomplete, so Lambda's Errors metric shows it.

use std::time::Duration;

use lambda_runtime::{run, service_fn, Diagnostic, LambdaEvent};
use pghydrate::events::Credentials;
use pghydrate::hotset::{CaptureOptions, CaptureReport};
use pghydrate::workflow::{ready_state, storage_state, Endpoint};
use pghydrate::Error;
use pghydrate_lambda::{deadline, init_tracing, Aws, DbConfig, Failure};
use serde::Serialize;
use serde_json::Value;

/// The function's configuration, from its environment (the SAM template sets it).
#[derive(Debug, Clone, PartialEq)]
struct Config {
    /// DB instance identifiers, lower-case, in the order given.
    instances: Vec<String>,
    min_uptime: Duration,
    credentials: Credentials,
    /// The state bucket, where each instance's hydration lease lives.
    bucket: String,
}

/// A DB instance identifier ([`pghydrate::events::valid_instance_id`]), in lower case as RDS stores it.
fn instance_identifier(s: &str) -> Result<String, String> {
    let id = s.trim().to_ascii_lowercase();
    if pghydrate::events::valid_instance_id(&id) {
        Ok(id)
    } else {
        Err(format!("{s:?} is not a DB instance identifier (letters, digits and hyphens, starting with a letter)"))
    }
}

impl Config {
    fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Config, Error> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let list = get("PGHYDRATE_CAPTURE_INSTANCES").ok_or_else(|| {
            Error::InvalidInput(
                "PGHYDRATE_CAPTURE_INSTANCES is empty: name the source instances to capture (the stack's \
                 CaptureInstances)"
                    .into(),
            )
        })?;
        let mut instances = Vec::new();
        for part in list.split(',') {
            let id = instance_identifier(part)
                .map_err(|why| Error::InvalidInput(format!("PGHYDRATE_CAPTURE_INSTANCES: {why}")))?;
            if !instances.contains(&id) {
                instances.push(id);
            }
        }
        let min_uptime = match get("PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES") {
            None => Duration::from_secs(3600),
            Some(v) => v.trim().parse::<u64>().map(|m| Duration::from_secs(m * 60)).map_err(|_| {
                Error::InvalidInput(format!("PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES={v:?} is not a number of minutes"))
            })?,
        };
        let credentials = Credentials::deployment_default(get("PGHYDRATE_SECRET_ARN"));
        let bucket = get("PGHYDRATE_STATE_BUCKET")
            .ok_or_else(|| Error::InvalidInput("PGHYDRATE_STATE_BUCKET is not set".into()))?;
        Ok(Config { instances, min_uptime, credentials, bucket })
    }
}

/// What the function was asked to do.
#[derive(Debug, PartialEq)]
enum Request {
    /// The schedule fired: one asynchronous call per configured instance.
    Scheduled,
    /// Capture this instance.
    Instance(String),
}

fn parse_request(v: &Value) -> Result<Request, Error> {
    if v.get("source").and_then(Value::as_str) == Some("aws.events")
        && v.get("detail-type").and_then(Value::as_str) == Some("Scheduled Event")
    {
        return Ok(Request::Scheduled);
    }
    match v.as_object() {
        Some(o) if o.len() == 1 && o.contains_key("instance") => match o["instance"].as_str() {
            Some(s) => instance_identifier(s).map(Request::Instance).map_err(Error::InvalidInput),
            None => Err(Error::InvalidInput("\"instance\" must be a string".into())),
        },
        _ => Err(Error::InvalidInput(
            "expected an EventBridge Scheduled Event or {\"instance\": \"<db-instance-id>\"} and nothing else".into(),
        )),
    }
}

#[derive(Serialize, Debug, Default, PartialEq)]
struct Response {
    /// Scheduled: the instances a call was started for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    dispatched: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    instance: Option<String>,
    /// "captured" or "skipped" (a call that captured only some databases fails instead).
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<CaptureReport>,
}

struct Deps {
    aws: Aws,
    sfn: aws_sdk_sfn::Client,
    lambda: aws_sdk_lambda::Client,
    db: DbConfig,
    config: Config,
}

fn skipped(instance: &str, reason: String) -> Response {
    tracing::info!(%instance, %reason, "hot set not captured");
    Response { instance: Some(instance.into()), outcome: Some("skipped"), reason: Some(reason), ..Response::default() }
}

async fn dispatch(deps: &Deps, function: &str) -> Result<Response, Diagnostic> {
    let mut dispatched = Vec::new();
    let mut failed = Vec::new();
    for id in &deps.config.instances {
        let payload = serde_json::to_vec(&serde_json::json!({ "instance": id })).expect("serializes");
        let sent = deps
            .lambda
            .invoke()
            .function_name(function)
            .invocation_type(aws_sdk_lambda::types::InvocationType::Event)
            .payload(aws_sdk_lambda::primitives::Blob::new(payload))
            .send()
            .await;
        match sent {
            Ok(_) => dispatched.push(id.clone()),
            Err(e) => {
                let e = aws_sdk_lambda::error::DisplayErrorContext(e);
                tracing::error!(instance = %id, error = %e, "could not start the instance's capture");
                failed.push(format!("{id}: {e}"));
            }
        }
    }
    tracing::info!(?dispatched, failed = failed.len(), "capture calls started");
    if !failed.is_empty() {
        return Err(Diagnostic {
            error_type: "AwsError".into(),
            error_message: format!("could not start the capture of {}", failed.join("; ")),
        });
    }
    Ok(Response { dispatched, ..Response::default() })
}

/// An engine error as the Lambda error it is named after.
fn fail(e: Error) -> Diagnostic {
    Diagnostic::from(Failure(e))
}

async fn capture_instance(deps: &Deps, id: &str, until: std::time::Instant) -> Result<Response, Diagnostic> {
    let view = pghydrate::aws::describe_instance(&deps.aws.rds, id).await.map_err(fail)?;
    if view.engine != "postgres" {
        return Err(fail(Error::InvalidInput(format!(
            "{id} runs {:?}, not PostgreSQL: remove it from CaptureInstances",
            view.engine
        ))));
    }
    let (ready, why) = ready_state(&view);
    if ready != "available" {
        return Ok(skipped(id, format!("{why}: its buffers are not the application's")));
    }
    let (storage, why, _) = storage_state(&view);
    if storage == "initializing" {
        return Ok(skipped(
            id,
            format!("{why}: a restored instance's buffers hold what lazy loading and hydration fetched, not yet the application's hot set"),
        ));
    }
    if let Some(run) =
        pghydrate::aws::lease_holder(&deps.aws.s3, &deps.sfn, &deps.config.bucket, id).await.map_err(fail)?
    {
        return Ok(skipped(id, format!("hydration run {run} is reading {id}: its buffers hold what the run read")));
    }
    let (Some(address), Some(port)) = (view.address.clone(), view.port) else {
        return Ok(skipped(id, format!("{id} has no endpoint yet")));
    };
    let endpoint = Endpoint { address, port, master_secret_arn: view.master_secret_arn.clone() };
    let spec = deps
        .db
        .connect_spec_as(&deps.aws, &deps.config.credentials, &endpoint, "pghydrate capture".into())
        .await
        .map_err(fail)?;
    let opts = CaptureOptions {
        min_uptime: Some(deps.config.min_uptime).filter(|m| !m.is_zero()),
        deadline: Some(until.checked_sub(deps.db.margin).unwrap_or(until)),
        ..CaptureOptions::default()
    };
    let report = pghydrate::hotset::capture(&spec, &opts).await.map_err(fail)?;
    for line in report.summary().lines() {
        tracing::info!(instance = %id, "{line}");
    }
    if let Some(why) = report.skipped.clone() {
        return Ok(Response { report: Some(report), ..skipped(id, why) });
    }
    if !report.complete() {
        let missed: Vec<String> =
            report.databases.iter().filter_map(|d| d.error.as_ref().map(|e| format!("{}: {e}", d.database))).collect();
        let message = format!(
            "{id}: {} of {} databases not captured (each keeps its previous capture): {}",
            missed.len(),
            report.databases.len(),
            missed.join("; ")
        );
        // Named apart from the engine's errors: the capture ran, and some databases were left.
        tracing::error!(instance = %id, error = %message, "capture incomplete");
        return Err(Diagnostic { error_type: "CaptureIncomplete".into(), error_message: message });
    }
    let captured = report.databases.len();
    tracing::info!(instance = %id, databases = captured, seconds = report.seconds, "hot set captured");
    Ok(Response {
        instance: Some(id.into()),
        outcome: Some("captured"),
        reason: Some(format!("{captured} database(s) captured")),
        report: Some(report),
        ..Response::default()
    })
}

async fn handler(deps: &Deps, event: LambdaEvent<Value>) -> Result<Response, Diagnostic> {
    let until = deadline(&event.context);
    match parse_request(&event.payload).map_err(fail)? {
        Request::Scheduled => {
            // Lambda names the running function in AWS_LAMBDA_FUNCTION_NAME (emulators too; their
            // invoked ARN is not always a real one).
            let function = std::env::var("AWS_LAMBDA_FUNCTION_NAME")
                .ok()
                .filter(|n| !n.is_empty())
                .or_else(|| Some(event.context.invoked_function_arn.clone()).filter(|a| a.starts_with("arn:")))
                .ok_or_else(|| fail(Error::InvalidInput("no function name to invoke".into())))?;
            dispatch(deps, &function).await
        }
        Request::Instance(id) => {
            if !deps.config.instances.contains(&id) {
                return Err(fail(Error::InvalidInput(format!(
                    "{id} is not one of the instances this stack captures (CaptureInstances: {})",
                    deps.config.instances.join(", ")
                ))));
            }
            capture_instance(deps, &id, until).await
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    init_tracing();
    let config = Config::from_env(|k| std::env::var(k).ok()).map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let db = DbConfig::from_env().map_err(|e| Box::new(e) as lambda_runtime::Error)?;
    let aws = Aws::from_env().await;
    let deps = Deps {
        sfn: aws_sdk_sfn::Client::new(&aws.sdk),
        lambda: aws_sdk_lambda::Client::new(&aws.sdk),
        aws,
        db,
        config,
    };
    run(service_fn(|e| handler(&deps, e))).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lambda_runtime::Context;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: std::collections::HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_instance_list_is_checked_and_lower_cased() {
        let c = Config::from_env(env(&[
            ("PGHYDRATE_CAPTURE_INSTANCES", " Orders-Primary ,billing,orders-primary"),
            ("PGHYDRATE_STATE_BUCKET", "b"),
        ]))
        .unwrap();
        assert_eq!(c.instances, vec!["orders-primary", "billing"]);
        assert_eq!(c.min_uptime, Duration::from_secs(3600), "default: an hour");
        assert_eq!(c.credentials, Credentials::ManagedSecret);
        for bad in ["", "orders,", "1orders", "orders_primary", "a--b", "x-"] {
            let e = Config::from_env(env(&[("PGHYDRATE_CAPTURE_INSTANCES", bad), ("PGHYDRATE_STATE_BUCKET", "b")]));
            assert!(matches!(e, Err(Error::InvalidInput(_))), "{bad:?}: {e:?}");
        }
        let e = Config::from_env(env(&[
            ("PGHYDRATE_CAPTURE_INSTANCES", "a"),
            ("PGHYDRATE_STATE_BUCKET", "b"),
            ("PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES", "an hour"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES"), "{e}");
    }

    #[test]
    fn requests_are_a_schedule_or_one_instance_and_nothing_else() {
        let scheduled = serde_json::json!({"version": "0", "source": "aws.events", "detail-type": "Scheduled Event",
                                           "resources": ["arn:aws:events:us-east-1:1:rule/x"], "detail": {}});
        assert_eq!(parse_request(&scheduled).unwrap(), Request::Scheduled);
        assert_eq!(
            parse_request(&serde_json::json!({"instance": "Orders"})).unwrap(),
            Request::Instance("orders".into())
        );
        for bad in [
            serde_json::json!({"instance": "orders", "database": "x"}),
            serde_json::json!({"instance": 3}),
            serde_json::json!({"instance": "a;b"}),
            serde_json::json!({"source": "aws.rds", "detail-type": "Scheduled Event"}),
            serde_json::json!("orders"),
        ] {
            assert!(matches!(parse_request(&bad), Err(Error::InvalidInput(_))), "{bad}");
        }
    }

    /// A call naming an instance outside CaptureInstances is refused before any AWS call (the
    /// clients here point at a closed port: any call would fail with another error).
    #[tokio::test]
    async fn an_instance_not_listed_is_refused() {
        let aws = Aws::offline("us-east-1", "http://127.0.0.1:9");
        let deps = Deps {
            sfn: aws_sdk_sfn::Client::new(&aws.sdk),
            lambda: aws_sdk_lambda::Client::new(&aws.sdk),
            aws,
            db: DbConfig::from_env().unwrap(),
            config: Config::from_env(env(&[
                ("PGHYDRATE_CAPTURE_INSTANCES", "orders"),
                ("PGHYDRATE_STATE_BUCKET", "b"),
            ]))
            .unwrap(),
        };
        let e = handler(&deps, LambdaEvent::new(serde_json::json!({"instance": "billing"}), Context::default()))
            .await
            .unwrap_err();
        assert_eq!(e.error_type, "InvalidInput");
        assert!(e.error_message.contains("not one of the instances"), "{}", e.error_message);
    }
}
