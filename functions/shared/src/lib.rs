//! What every pghydrate Lambda shares: JSON tracing, engine errors as named Lambda errors (the names
//! the state machine's Retry/Catch match), AWS clients built once, typed configuration read once, and
//! database connections whose credentials never leave the function.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lambda_runtime::{Context, Diagnostic};
use pghydrate::events::Credentials;
use pghydrate::workflow::{endpoint_spec, Endpoint, RunConfig};
use pghydrate::{ConnectionSpec, Error, TlsMode};

/// An engine error on its way out of a handler: its name becomes the Lambda error type.
#[derive(Debug)]
pub struct Failure(pub Error);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(e)
    }
}

impl From<Failure> for Diagnostic {
    fn from(f: Failure) -> Diagnostic {
        tracing::error!(error_type = f.0.name(), error = %f.0, "failed");
        Diagnostic { error_type: f.0.name().to_string(), error_message: f.0.to_string() }
    }
}

/// JSON logs (CloudWatch), level from RUST_LOG (default info).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(false)
        .with_current_span(false)
        .without_time()
        .init();
}

/// The AWS clients the functions use, built once per container.
#[derive(Clone)]
pub struct Aws {
    pub sdk: aws_config::SdkConfig,
    pub rds: aws_sdk_rds::Client,
    pub secrets: aws_sdk_secretsmanager::Client,
    pub s3: aws_sdk_s3::Client,
}

impl Aws {
    pub async fn from_env() -> Aws {
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        Aws::from_config(&config)
    }

    /// Clients for a fixed region and endpoint, without credentials lookups (handler unit tests, where
    /// the paths under test make no call; any call that happens fails fast).
    pub fn offline(region: &'static str, endpoint: &str) -> Aws {
        let config = aws_config::SdkConfig::builder()
            .region(aws_config::Region::from_static(region))
            .endpoint_url(endpoint)
            .behavior_version(aws_config::BehaviorVersion::latest())
            .build();
        Aws::from_config(&config)
    }

    fn from_config(config: &aws_config::SdkConfig) -> Aws {
        Aws {
            sdk: config.clone(),
            rds: aws_sdk_rds::Client::new(config),
            secrets: aws_sdk_secretsmanager::Client::new(config),
            s3: aws_sdk_s3::Client::new(config),
        }
    }
}

/// How the database-facing functions connect, from their environment:
/// PGHYDRATE_TLS (default verify-full), PGHYDRATE_CA_BUNDLE (the RDS CA bundle, PEM),
/// PGHYDRATE_MARGIN_SECONDS (stop this long before the Lambda deadline, default 60),
/// PGHYDRATE_LOCK_TIMEOUT_SECONDS (default 5), PGHYDRATE_RECONNECT_SECONDS (how long a Warm call
/// keeps reconnecting to a database it lost before it fails with ConnectionFailed, which the state
/// machine retries with backoff; default 120), PGHYDRATE_STEP_BLOCKS (blocks per statement, default
/// `pghydrate::warm::DEFAULT_STEP_BLOCKS`).
#[derive(Debug, Clone)]
pub struct DbConfig {
    pub tls: TlsMode,
    pub ca_file: Option<PathBuf>,
    pub margin: Duration,
    pub lock_timeout: Duration,
    pub reconnect_for: Duration,
    pub step_blocks: u64,
}

impl DbConfig {
    pub fn from_env() -> Result<DbConfig, Error> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let secs = |k: &str, d: u64| -> Result<Duration, Error> {
            match var(k) {
                None => Ok(Duration::from_secs(d)),
                Some(v) => v
                    .parse::<u64>()
                    .map(Duration::from_secs)
                    .map_err(|_| Error::InvalidInput(format!("{k}={v:?} is not a number of seconds"))),
            }
        };
        let tls: TlsMode = var("PGHYDRATE_TLS").as_deref().unwrap_or("verify-full").parse()?;
        if tls == TlsMode::Disable || tls == TlsMode::Prefer || tls == TlsMode::Require {
            tracing::warn!(
                tls = tls.as_str(),
                "PGHYDRATE_TLS is weaker than verify-full: the server's certificate is not checked"
            );
        }
        Ok(DbConfig {
            tls,
            ca_file: var("PGHYDRATE_CA_BUNDLE").map(PathBuf::from),
            margin: secs("PGHYDRATE_MARGIN_SECONDS", 60)?,
            lock_timeout: secs("PGHYDRATE_LOCK_TIMEOUT_SECONDS", 5)?,
            reconnect_for: secs("PGHYDRATE_RECONNECT_SECONDS", 120)?,
            step_blocks: match var("PGHYDRATE_STEP_BLOCKS") {
                None => pghydrate::warm::DEFAULT_STEP_BLOCKS,
                Some(v) => v.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    Error::InvalidInput(format!("PGHYDRATE_STEP_BLOCKS={v:?} is not a positive number of blocks"))
                })?,
            },
        })
    }

    /// Credentials from the run's source, then a connection spec to the endpoint.
    pub async fn connect_spec(&self, aws: &Aws, run: &RunConfig, endpoint: &Endpoint) -> Result<ConnectionSpec, Error> {
        self.connect_spec_as(aws, &run.credentials, endpoint, format!("pghydrate {}", run.execution)).await
    }

    /// Credentials from `credentials`, then a connection spec to the endpoint whose sessions show
    /// `application_name` in pg_stat_activity.
    pub async fn connect_spec_as(
        &self,
        aws: &Aws,
        credentials: &Credentials,
        endpoint: &Endpoint,
        application_name: String,
    ) -> Result<ConnectionSpec, Error> {
        let arn = match credentials {
            Credentials::Secret { arn } => arn.clone(),
            Credentials::ManagedSecret => endpoint.master_secret_arn.clone().ok_or_else(|| {
                Error::InvalidInput(
                    "the instance has no RDS-managed master secret (Blue/Green deployments do not support them, so \
                     green instances never have one): deploy the stack with SecretArn, or start the run with \
                     credentials {\"type\": \"secret\", \"arn\": ...} or {\"type\": \"iam\", \"user\": ...}"
                        .into(),
                )
            })?,
            Credentials::Iam { user } => {
                if self.tls == TlsMode::Disable {
                    return Err(Error::InvalidInput("IAM database authentication needs TLS (PGHYDRATE_TLS)".into()));
                }
                let token = iam_token(aws, endpoint, user).await?;
                return Ok(endpoint_spec(endpoint, user, &token, self.tls, self.ca_file.clone())?
                    .with_timeouts(self.lock_timeout, Duration::from_secs(300))
                    .with_application_name(application_name));
            }
        };
        let (user, password) = pghydrate::aws::secret_credentials(&aws.secrets, &arn).await?;
        Ok(endpoint_spec(endpoint, &user, &password, self.tls, self.ca_file.clone())?
            .with_timeouts(self.lock_timeout, Duration::from_secs(300))
            .with_application_name(application_name))
    }
}

/// An IAM database authentication token for `user` at `endpoint`, signed locally (no network call;
/// valid 15 minutes, longer than any Lambda invocation). It is a password: never logged.
async fn iam_token(aws: &Aws, endpoint: &Endpoint, user: &str) -> Result<String, Error> {
    use aws_sdk_rds::auth_token::{AuthTokenGenerator, Config};
    let region =
        aws.sdk.region().cloned().ok_or_else(|| Error::InvalidInput("no AWS region for IAM authentication".into()))?;
    let config = Config::builder()
        .hostname(&endpoint.address)
        .port(endpoint.port as u64)
        .username(user)
        .region(region)
        .build()
        .map_err(|e| Error::InvalidInput(format!("IAM token configuration: {e}")))?;
    let token = AuthTokenGenerator::new(config).auth_token(&aws.sdk).await.map_err(|e| Error::Aws {
        context: "signing an IAM database token".into(),
        reason: e.to_string(),
        throttled: false,
    })?;
    Ok(token.as_str().to_string())
}

/// The instant this invocation must have returned by. Lambda's Context::deadline is milliseconds since
/// the epoch; an emulator (`cargo lambda watch`) sends the timeout itself (e.g. 600000), so a value
/// before the year 2000 is read as milliseconds from now. PGHYDRATE_CALL_SECONDS, when set, caps the
/// call's working time further (shorter calls checkpoint more often; tests use it to force many calls).
pub fn deadline(ctx: &Context) -> Instant {
    const YEAR_2000_MS: u64 = 946_684_800_000;
    let now = Instant::now();
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let left_ms = if ctx.deadline < YEAR_2000_MS { ctx.deadline } else { ctx.deadline.saturating_sub(now_ms) };
    let mut until = now + Duration::from_millis(left_ms);
    if let Some(cap) = std::env::var("PGHYDRATE_CALL_SECONDS").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        until = until.min(now + Duration::from_secs(cap));
    }
    until
}

fn parse_time(rfc3339: &str) -> Result<SystemTime, Error> {
    humantime::parse_rfc3339_weak(rfc3339.trim_end_matches('Z'))
        .map_err(|e| Error::InvalidInput(format!("started: {rfc3339:?} is not an RFC 3339 time: {e}")))
}

/// Minutes since an RFC 3339 time such as `$$.Execution.StartTime`.
pub fn minutes_since(rfc3339: &str) -> Result<f64, Error> {
    Ok(SystemTime::now().duration_since(parse_time(rfc3339)?).unwrap_or_default().as_secs_f64() / 60.0)
}

/// Milliseconds since the epoch of an RFC 3339 time.
pub fn epoch_ms(rfc3339: &str) -> Result<u64, Error> {
    Ok(parse_time(rfc3339)?.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn deadlines_from_lambda_and_from_the_emulator() {
        let mut ctx = lambda_runtime::Context::default();
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        ctx.deadline = now_ms + 300_000; // Lambda: epoch ms
        let left = super::deadline(&ctx).saturating_duration_since(std::time::Instant::now()).as_secs();
        assert!((298..=300).contains(&left), "{left}");
        ctx.deadline = 600_000; // cargo lambda watch: the timeout itself
        let left = super::deadline(&ctx).saturating_duration_since(std::time::Instant::now()).as_secs();
        assert!((598..=600).contains(&left), "{left}");
    }

    #[test]
    fn step_functions_times_parse() {
        assert_eq!(super::epoch_ms("2026-11-30T09:14:08.123Z").unwrap(), 1_796_030_048_123);
        assert_eq!(super::epoch_ms("2026-11-30T09:14:08Z").unwrap(), 1_796_030_048_000);
        assert!(super::epoch_ms("yesterday").is_err());
    }
}
