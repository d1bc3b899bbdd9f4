//! Statements under a client-side bound. The server's statement_timeout bounds a statement only while
//! the connection works: on a half-open connection (a failover, a dropped NAT entry, a partition) the
//! cancel never arrives, and without a bound of its own the client would wait for the kernel's
//! keepalive, two hours by default. Every statement of a warm or maintenance session runs through
//! [`bounded`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_postgres::Client;

use crate::connect::ConnectionSpec;
use crate::error::{describe, disposition_of, Disposition};

/// Why a statement gave no result.
pub enum Failed {
    /// The server (or the driver) reported an error.
    Server(tokio_postgres::Error),
    /// No answer within the client-side bound: the connection may be half-open (a failover, a dropped
    /// NAT entry, a partition), where the server's own statement_timeout can never arrive. The
    /// statement was cancelled on the server and the session is treated as lost.
    NoAnswer(Duration),
    /// A stop was asked (Ctrl-C, SIGTERM): the statement was cancelled on the server, and its work
    /// is pending.
    Stopped,
}

impl Failed {
    pub fn disposition(&self) -> Disposition {
        match self {
            Failed::Server(e) => disposition_of(e),
            Failed::NoAnswer(_) | Failed::Stopped => Disposition::SessionLost,
        }
    }

    /// The error of a statement that gave no result, `context` saying what it was for. A server error
    /// that does not mean the session is gone stays a query error; a lost session, no answer or a
    /// stop is a connection failure of `target` (ConnectionFailed, which the workflow retries).
    pub fn into_error(self, target: String, context: &str) -> crate::error::Error {
        match self {
            Failed::Server(e) if disposition_of(&e) != Disposition::SessionLost => {
                crate::error::Error::query(context, e)
            }
            other => crate::error::Error::Connect {
                target,
                reason: format!("{context}: {}", other.describe()),
                source: None,
            },
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Failed::Server(e) => describe(e),
            Failed::NoAnswer(d) => {
                format!("no answer from the server within {:.1} s (the connection may be half-open)", d.as_secs_f64())
            }
            Failed::Stopped => "stopped (a signal)".into(),
        }
    }
}

/// The client-side bound of a statement that the server bounds by `statement_timeout`: a little more,
/// so that the server's cancel normally arrives first.
pub fn client_bound(statement_timeout: Duration, margin: Duration) -> Duration {
    statement_timeout + (margin / 4).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// Runs one statement of `client` under a client-side bound. When the bound runs out, the statement
/// is cancelled on the server (in the background; the cancel request has its own bound) and the
/// caller must drop the session.
pub async fn bounded<T>(
    spec: &ConnectionSpec,
    client: &Client,
    limit: Duration,
    statement: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> std::result::Result<T, Failed> {
    match tokio::time::timeout(limit, statement).await {
        Ok(r) => r.map_err(Failed::Server),
        Err(_) => {
            spec.cancel_in_background(client.cancel_token());
            Err(Failed::NoAnswer(limit))
        }
    }
}

/// [`bounded`], and also cancelled (on the server too) as soon as `stop` is set.
pub async fn bounded_or_stopped<T>(
    spec: &ConnectionSpec,
    client: &Client,
    limit: Duration,
    stop: Option<&AtomicBool>,
    statement: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> std::result::Result<T, Failed> {
    if stop.is_none() {
        return bounded(spec, client, limit, statement).await;
    }
    tokio::select! {
        r = bounded(spec, client, limit, statement) => r,
        _ = stop_asked(stop) => {
            spec.cancel_in_background(client.cancel_token());
            Err(Failed::Stopped)
        }
    }
}

/// Resolves once `stop` is set (looked at every 50 ms); never without a flag. For racing a wait
/// (a connect, a backoff, a statement) against Ctrl-C / SIGTERM.
pub async fn stop_asked(stop: Option<&AtomicBool>) {
    let Some(stop) = stop else {
        return std::future::pending().await;
    };
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
