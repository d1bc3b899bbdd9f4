//! The engine's error type. Each kind has a fixed name (the contract with the Lambda error names that
//! the state machine's Retry/Catch match) and a fixed CLI exit code.

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

    /// The SQLSTATE the server gave, where there is one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Connect { source: Some(e), .. }
            | Error::Authentication { source: Some(e), .. }
            | Error::Query { source: e, .. } => e.code().map(|c| c.code()),
            _ => None,
        }
    }

    pub fn query(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Error::Query { context: context.into(), source }
    }
}

/// True when the error means the session is gone (server restart, kill, network), so the work can be
/// retried on a new connection.
pub fn is_connection_error(e: &tokio_postgres::Error) -> bool {
    disposition_of(e) == Disposition::SessionLost
}

/// What a worker does after a statement failed. One decision per cause, each with its own budget
/// ([`crate::warm`]): a range that lost its connection four times is not thereby closer to being
/// skipped for a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The session is gone (restart, kill, network, failover): reconnect and retry the range.
    SessionLost,
    /// The database no longer exists (dropped during the run): its work vanished with it.
    DatabaseGone,
    /// Someone holds a conflicting lock (or a deadlock was broken): come back to the range later.
    LockBusy,
    /// The server is short of a resource (memory, connections, disk): back off and retry later.
    ServerBusy,
    /// statement_timeout cancelled the statement: the range is too long for one statement.
    Canceled,
    /// Another role created an overload of pg_prewarm beside the extension's: nothing can run.
    AmbiguousFunction,
    /// The login role may not read the relation.
    Privilege,
    /// Anything else: look at whether the relation was dropped or shrank, else report the error.
    Examine,
}

/// Classifies a failed statement by its SQLSTATE and error kind. `sqlstate` is None for errors that
/// did not come from the server; `closed` says whether the driver knows the connection is closed.
/// Pure, so that the whole table is unit-tested ([`tests::the_disposition_table`]).
pub fn disposition(sqlstate: Option<&str>, closed: bool) -> Disposition {
    if closed {
        return Disposition::SessionLost;
    }
    let Some(code) = sqlstate else {
        // Not a server error: an I/O failure on the socket, a broken TLS stream, a protocol error.
        return Disposition::SessionLost;
    };
    match code {
        "3D000" => Disposition::DatabaseGone, // invalid_catalog_name: database does not exist
        "55P03" | "40P01" => Disposition::LockBusy, // lock_not_available, deadlock_detected
        "57014" => Disposition::Canceled,     // query_canceled
        "42725" => Disposition::AmbiguousFunction,
        "42501" => Disposition::Privilege, // insufficient_privilege
        // admin_shutdown, crash_shutdown, cannot_connect_now, idle_session_timeout,
        // idle_in_transaction_session_timeout: the server ended the session.
        "57P01" | "57P02" | "57P03" | "57P05" | "25P03" => Disposition::SessionLost,
        "53300" => Disposition::SessionLost, // too_many_connections: a new session, later
        c if c.starts_with("08") => Disposition::SessionLost, // connection_exception
        c if c.starts_with("53") => Disposition::ServerBusy, // out of memory, disk full, ...
        "40001" => Disposition::LockBusy,    // serialization_failure: transient, retry later
        _ => Disposition::Examine,
    }
}

/// [`disposition`] of a driver error.
pub fn disposition_of(e: &tokio_postgres::Error) -> Disposition {
    disposition(e.code().map(|c| c.code()), e.is_closed())
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

#[cfg(test)]
mod tests {
    use super::*;
    use Disposition::*;

    #[test]
    fn the_disposition_table() {
        let table: &[(Option<&str>, bool, Disposition)] = &[
            (None, false, SessionLost),           // socket error, TLS error, no answer
            (Some("42P01"), true, SessionLost),   // whatever the code, a closed connection is lost
            (Some("08006"), false, SessionLost),  // connection_failure
            (Some("08P01"), false, SessionLost),  // protocol_violation
            (Some("57P01"), false, SessionLost),  // admin_shutdown (pg_terminate_backend, restart)
            (Some("57P02"), false, SessionLost),  // crash_shutdown
            (Some("57P03"), false, SessionLost),  // cannot_connect_now (starting up, recovery)
            (Some("57P05"), false, SessionLost),  // idle_session_timeout
            (Some("25P03"), false, SessionLost),  // idle_in_transaction_session_timeout
            (Some("53300"), false, SessionLost),  // too_many_connections
            (Some("3D000"), false, DatabaseGone), // database dropped
            (Some("55P03"), false, LockBusy),     // lock_not_available (lock_timeout)
            (Some("40P01"), false, LockBusy),     // deadlock_detected
            (Some("40001"), false, LockBusy),     // serialization_failure
            (Some("53200"), false, ServerBusy),   // out_of_memory
            (Some("53100"), false, ServerBusy),   // disk_full
            (Some("57014"), false, Canceled),     // statement_timeout
            (Some("42725"), false, AmbiguousFunction),
            (Some("42501"), false, Privilege),
            (Some("XX000"), false, Examine), // "could not open relation with OID": dropped?
            (Some("58P01"), false, Examine), // undefined_file: rewritten or dropped?
            (Some("XX001"), false, Examine), // data_corrupted: reported with its message
            (Some("22023"), false, Examine), // invalid_parameter_value (block out of range)
            (Some("42883"), false, Examine), // undefined_function
        ];
        for (code, closed, want) in table {
            assert_eq!(disposition(*code, *closed), *want, "{code:?} closed={closed}");
        }
    }
}
