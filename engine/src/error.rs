//! The engine's error type. Each kind has a fixed name (the contract with the Lambda error names that
//! the state machine's Retry/Catch match) and a fixed CLI exit code.

use tokio_postgres::error::SqlState;

/// Exit codes of the `pghydrate` command. Documented in the README; never renumber.
pub mod exit {
    /// Every byte of every planned relation fork was read.
    pub const COMPLETE: i32 = 0;
    /// An unexpected internal failure.
    pub const INTERNAL: i32 = 1;
    /// Bad input: an invalid option value, a pattern that matches nothing, a malformed file.
    pub const INVALID_INPUT: i32 = 2;
    /// The server could not be reached, refused the login, or TLS could not be set up.
    pub const CONNECTION: i32 = 3;
    /// The run finished but coverage is below 100%: the report lists every skipped fork with its reason.
    pub const INCOMPLETE: i32 = 4;
    /// The time limit was reached; the continuation file holds exactly the work left.
    pub const STOPPED_AT_DEADLINE: i32 = 5;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Input that can never succeed as given (options, patterns, files).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// The server is unreachable or the connection broke before any work could start.
    #[error("cannot connect to {target}: {reason}")]
    Connect {
        target: String,
        reason: String,
        #[source]
        source: Option<tokio_postgres::Error>,
    },

    /// The server refused the credentials.
    #[error("authentication failed for {target}: {reason}")]
    Authentication {
        target: String,
        reason: String,
        #[source]
        source: Option<tokio_postgres::Error>,
    },

    /// TLS was required (or verification asked for) and could not be established.
    #[error("TLS failure for {target}: {reason}")]
    Tls { target: String, reason: String },

    /// The server answered but is not a PostgreSQL this tool supports.
    #[error("unsupported server: {0}")]
    Unsupported(String),

    /// A catalog or planning query failed.
    #[error("{context}: {source}")]
    Query {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },

    /// An AWS API call failed (`throttled`: retry later).
    #[error("{context}: {reason}")]
    Aws { context: String, reason: String, throttled: bool },

    /// An AWS API endpoint could not be reached or did not answer in time (no route from the VPC, DNS,
    /// a timeout): retried, and the reason carries the cause the SDK gave.
    #[error("{context}: the AWS endpoint did not answer: {reason}")]
    AwsUnreachable { context: String, reason: String },

    /// The DB instance does not exist (or is not visible to this account and region).
    #[error("DB instance {0:?} not found")]
    InstanceNotFound(String),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Stable error name (used as the Lambda error type; never change one).
    pub fn name(&self) -> &'static str {
        match self {
            Error::InvalidInput(_) => "InvalidInput",
            Error::Connect { .. } => "ConnectionFailed",
            Error::Authentication { .. } => "AuthenticationFailed",
            Error::Tls { .. } => "TlsFailed",
            Error::Unsupported(_) => "UnsupportedServer",
            Error::Query { .. } => "QueryFailed",
            Error::Io { .. } => "IoFailed",
            Error::Aws { throttled: true, .. } => "AwsThrottled",
            Error::Aws { .. } => "AwsFailed",
            Error::AwsUnreachable { .. } => "AwsUnreachable",
            Error::InstanceNotFound(_) => "InstanceNotFound",
        }
    }

    /// Whether trying again later can succeed (the state machine retries these).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Connect { .. } | Error::Aws { throttled: true, .. } | Error::AwsUnreachable { .. })
            || matches!(self, Error::Query { source, .. } if is_connection_error(source))
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Error::InvalidInput(_) | Error::Unsupported(_) => exit::INVALID_INPUT,
            Error::Connect { .. } | Error::Authentication { .. } | Error::Tls { .. } => exit::CONNECTION,
            Error::Query { source, .. } if is_connection_error(source) => exit::CONNECTION,
            Error::InstanceNotFound(_) => exit::INVALID_INPUT,
            Error::Aws { .. } | Error::AwsUnreachable { .. } => exit::CONNECTION,
            Error::Query { .. } | Error::Io { .. } => exit::INTERNAL,
        }
    }

    pub fn query(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Error::Query { context: context.into(), source }
    }
}

/// True when the error means the session is gone (server restart, kill, network), so the work can be
/// retried on a new connection.
pub fn is_connection_error(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(code) = e.code() {
        let c = code.code();
        return c.starts_with("08") // connection exception
            || *code == SqlState::ADMIN_SHUTDOWN
            || *code == SqlState::CRASH_SHUTDOWN
            || *code == SqlState::CANNOT_CONNECT_NOW
            || *code == SqlState::TOO_MANY_CONNECTIONS
            || *code == SqlState::IDLE_SESSION_TIMEOUT;
    }
    // No SQLSTATE and not a server error: an I/O failure on the socket.
    e.as_db_error().is_none()
}

/// The one-line text of a PostgreSQL error, without the crate's "db error:" prefix noise.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(inner) = src {
                let t = inner.to_string();
                if !s.contains(&t) {
                    s.push_str(": ");
                    s.push_str(&t);
                }
                src = inner.source();
            }
            s
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
