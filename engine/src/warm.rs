//! Warming: parallel sessions read the plan's block ranges with pg_prewarm. Every statement runs under
//! statement_timeout and lock_timeout. A range ends in exactly one recorded outcome (or several, when
//! it is split), or stays pending when the deadline comes: outcomes plus pending always partition the
//! planned ranges exactly.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;
use tracing::{debug, info, warn};

use crate::connect::ConnectionSpec;
use crate::error::{describe, is_connection_error, Error, Result};
use crate::plan::{BlockRange, Plan, ServerInfo, Skip, SkipReason};
use crate::sql::{prewarm_call, ServerSql};

/// pg_prewarm's modes. `read` and `buffer` read every block synchronously (verified hydration);
/// `prefetch` only asks the kernel (posix_fadvise) and returns before the I/O is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Read,
    Buffer,
    Prefetch,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Read => "read",
            Mode::Buffer => "buffer",
            Mode::Prefetch => "prefetch",
        }
    }

    /// The `auto` choice per server version, from the lazy-volume benchmark (docs/benchmark.md: 50 ms
    /// per cold 512 KiB chunk, 8 fetches at once, 509 MiB): on 15 `read` and `buffer` tie (19.5 s);
    /// on 17 `buffer` (read streams, I/O in the backend) takes the same 19.5 s; on 18 with
    /// io_method = worker (the default) every `buffer` read goes through the io_workers (3 by
    /// default), which caps the reads in flight: 40.9 s against 19.8 s for `read`. So: `buffer`
    /// where it is not capped (17; 18 with io_uring or sync), `read` elsewhere (it does not churn
    /// shared_buffers either).
    pub fn auto(server: &ServerInfo) -> Mode {
        match server.major() {
            17 => Mode::Buffer,
            m if m >= 18 && matches!(server.io_method.as_deref(), Some("io_uring" | "sync")) => Mode::Buffer,
            _ => Mode::Read,
        }
    }
}

#[derive(Debug, Clone)]
pub struct WarmOptions {
    pub sessions: u32,
    pub mode: Mode,
    /// Upper bound for one pg_prewarm call.
    pub statement_timeout: Duration,
    /// How long a call may wait for its AccessShareLock before the range is put back for later.
    pub lock_timeout: Duration,
    /// Attempts per range under lock contention before it is skipped with `lock_timeout`.
    pub lock_attempts: u32,
    /// Start no new range once less than `margin` is left before the deadline.
    pub deadline: Option<Instant>,
    pub margin: Duration,
    /// How long a lost session keeps trying to reconnect before its database is declared unreachable.
    pub reconnect_for: Duration,
}

impl Default for WarmOptions {
    fn default() -> Self {
        WarmOptions {
            sessions: 8,
            mode: Mode::Read,
            statement_timeout: Duration::from_secs(300),
            lock_timeout: Duration::from_secs(5),
            lock_attempts: 5,
            deadline: None,
            margin: Duration::from_secs(30),
            reconnect_for: Duration::from_secs(120),
        }
    }
}

/// What happened to one (part of a) planned range.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RangeOutcome {
    pub range: BlockRange,
    #[serde(flatten)]
    pub result: RangeResult,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RangeResult {
    Warmed { blocks: u64, seconds: f64 },
    Skipped(Skip),
}

/// Live counters a front end may poll for progress.
#[derive(Debug, Default)]
pub struct Counters {
    pub planned_bytes: AtomicU64,
    pub done_bytes: AtomicU64,
    pub warmed_bytes: AtomicU64,
    pub busy_sessions: AtomicUsize,
    pub sessions: AtomicUsize,
}

#[derive(Debug, Clone)]
struct Task {
    range: BlockRange,
    attempts: u32,
    role_override: Option<String>,
    not_before: Option<Instant>,
}

impl Task {
    fn new(range: BlockRange) -> Self {
        Task { range, attempts: 0, role_override: None, not_before: None }
    }
}

struct Queue {
    tasks: VecDeque<Task>,
    in_flight: usize,
}

struct Shared {
    plan: Arc<Plan>,
    spec: ConnectionSpec,
    opts: WarmOptions,
    queue: Mutex<Queue>,
    outcomes: Mutex<Vec<RangeOutcome>>,
    unreachable: Mutex<HashSet<String>>,
    counters: Arc<Counters>,
}

/// Reads `ranges` of `plan`. Returns the outcomes recorded and the ranges left pending (only when the
/// deadline came first). Never fails for what happens to a single relation or session; fails only if
/// the runtime itself does.
pub async fn warm(
    spec: &ConnectionSpec,
    plan: Arc<Plan>,
    ranges: Vec<BlockRange>,
    opts: &WarmOptions,
    counters: Arc<Counters>,
) -> Result<(Vec<RangeOutcome>, Vec<BlockRange>)> {
    if opts.sessions == 0 {
        return Err(Error::InvalidInput("sessions must be at least 1".into()));
    }
    let total: u64 = ranges.iter().map(|r| plan.bytes(r.blocks())).sum();
    counters.planned_bytes.fetch_add(total, Ordering::Relaxed);
    let workers = (opts.sessions as usize).min(ranges.len()).max(1);
    counters.sessions.store(workers, Ordering::Relaxed);
    let shared = Arc::new(Shared {
        plan,
        spec: spec.clone(),
        opts: opts.clone(),
        queue: Mutex::new(Queue { tasks: ranges.into_iter().map(Task::new).collect(), in_flight: 0 }),
        outcomes: Mutex::new(Vec::new()),
        unreachable: Mutex::new(HashSet::new()),
        counters,
    });
    let mut handles = Vec::new();
    for id in 0..workers {
        let s = shared.clone();
        handles.push(tokio::spawn(async move { worker(id, s).await }));
    }
    for h in handles {
        h.await.map_err(|e| Error::Io { context: "warm session task".into(), source: std::io::Error::other(e) })?;
    }
    let outcomes = std::mem::take(&mut *shared.outcomes.lock().unwrap());
    let pending: Vec<BlockRange> = shared.queue.lock().unwrap().tasks.drain(..).map(|t| t.range).collect();
    Ok((outcomes, pending))
}

struct Session {
    database: String,
    client: Client,
    /// The pg_prewarm call as this session's server resolved it (None: the extension is not there).
    prewarm: Option<ServerSql>,
    role: Option<String>,
    statement_timeout_ms: u64,
}

enum Next {
    Run(Task),
    Wait,
    Done,
}

impl Shared {
    fn time_left(&self) -> Option<Duration> {
        self.opts.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    fn deadline_near(&self) -> bool {
        self.time_left().is_some_and(|left| left <= self.opts.margin)
    }

    fn next(&self) -> Next {
        let mut q = self.queue.lock().unwrap();
        let now = Instant::now();
        if let Some(pos) = q.tasks.iter().position(|t| t.not_before.is_none_or(|nb| nb <= now)) {
            let t = q.tasks.remove(pos).unwrap();
            q.in_flight += 1;
            return Next::Run(t);
        }
        if q.tasks.is_empty() && q.in_flight == 0 {
            Next::Done
        } else {
            Next::Wait
        }
    }

    /// Puts a task back (front: retry at once; back: after the others) and ends its flight.
    fn requeue(&self, t: Task, front: bool) {
        let mut q = self.queue.lock().unwrap();
        if front {
            q.tasks.push_front(t);
        } else {
            q.tasks.push_back(t);
        }
        q.in_flight -= 1;
    }

    /// Puts a range back as two halves, first in the queue.
    fn split_front(&self, task: Task) {
        let range = task.range;
        let mid = range.first + range.blocks() / 2;
        let mut q = self.queue.lock().unwrap();
        q.tasks.push_front(Task { range: BlockRange { first: mid, ..range }, ..task.clone() });
        q.tasks.push_front(Task { range: BlockRange { last: mid - 1, ..range }, ..task });
        q.in_flight -= 1;
    }

    fn finish(&self) {
        self.queue.lock().unwrap().in_flight -= 1;
    }

    fn record(&self, range: BlockRange, result: RangeResult) {
        let bytes = self.plan.bytes(range.blocks());
        self.counters.done_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let RangeResult::Warmed { .. } = result {
            self.counters.warmed_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if let RangeResult::Skipped(s) = &result {
            let f = self.plan.fork(&range);
            if !s.reason.vanished() {
                warn!(database = %f.database, relation = %format!("{}.{}", f.schema, f.name), fork = f.fork.as_str(),
                      first = range.first, last = range.last, reason = ?s.reason, detail = %s.detail, "range skipped");
            } else {
                info!(database = %f.database, relation = %format!("{}.{}", f.schema, f.name), fork = f.fork.as_str(),
                      reason = ?s.reason, "relation changed during the run");
            }
        }
        self.outcomes.lock().unwrap().push(RangeOutcome { range, result });
    }

    fn skip(&self, range: BlockRange, reason: SkipReason, detail: String, fix: Option<String>) {
        self.record(range, RangeResult::Skipped(Skip { reason, detail, fix }));
        self.finish();
    }
}

async fn worker(id: usize, s: Arc<Shared>) {
    let mut session: Option<Session> = None;
    loop {
        if s.deadline_near() {
            debug!(session = id, "deadline near: starting no new range");
            break;
        }
        let task = match s.next() {
            Next::Run(t) => t,
            Next::Wait => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Next::Done => break,
        };
        s.counters.busy_sessions.fetch_add(1, Ordering::Relaxed);
        let stop = run_task(id, &s, &mut session, task).await;
        s.counters.busy_sessions.fetch_sub(1, Ordering::Relaxed);
        if stop {
            break;
        }
    }
}

/// Opens a session to `db`, retrying connection failures until `reconnect_for` runs out or the deadline
/// comes. None means give up.
async fn open_session(s: &Shared, db: &str) -> std::result::Result<Session, String> {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    loop {
        let attempt = async {
            let client = s.spec.connect(db).await?;
            if s.spec.lock_timeout() != s.opts.lock_timeout {
                client
                    .query_one(
                        "SELECT pg_catalog.set_config('lock_timeout', $1, false)",
                        &[&format!("{}ms", s.opts.lock_timeout.as_millis().max(1))],
                    )
                    .await
                    .map_err(|e| Error::query("setting lock_timeout", e))?;
            }
            let prewarm = prewarm_call(&client).await.map_err(|e| Error::query("finding pg_prewarm", e))?;
            Ok::<_, Error>((client, prewarm.map(|(_, call)| call)))
        };
        match attempt.await {
            Ok((client, prewarm)) => {
                return Ok(Session { database: db.to_string(), client, prewarm, role: None, statement_timeout_ms: 0 })
            }
            Err(e) => {
                if !e.is_retryable() || started.elapsed() >= s.opts.reconnect_for || s.deadline_near() {
                    return Err(e.to_string());
                }
                warn!(database = %db, error = %e, retry_in_ms = backoff.as_millis() as u64, "session lost; reconnecting");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Runs one task; returns true when the worker must stop (deadline).
async fn run_task(id: usize, s: &Shared, session: &mut Option<Session>, mut task: Task) -> bool {
    let range = task.range;
    let fork = s.plan.fork(&range).clone();
    if s.unreachable.lock().unwrap().contains(&fork.database) {
        s.skip(
            range,
            SkipReason::DatabaseUnreachable,
            format!("database {:?} could not be reached", fork.database),
            None,
        );
        return false;
    }
    if session.as_ref().is_none_or(|x| x.database != fork.database) {
        *session = None;
        match open_session(s, &fork.database).await {
            Ok(x) => *session = Some(x),
            Err(reason) => {
                if s.deadline_near() {
                    s.requeue(task, true);
                    return true;
                }
                s.unreachable.lock().unwrap().insert(fork.database.clone());
                s.skip(range, SkipReason::DatabaseUnreachable, reason, None);
                return false;
            }
        }
    }
    let sess = session.as_mut().unwrap();
    let Some(prewarm) = sess.prewarm.clone() else {
        s.skip(
            range,
            SkipReason::NoExtension,
            format!("pg_prewarm's extension is not installed in database {:?}", fork.database),
            Some("CREATE EXTENSION pg_prewarm (as a superuser or rds_superuser)".into()),
        );
        return false;
    };

    // Statement timeout: never past the deadline (minus half the margin), never above the option.
    let mut timeout = s.opts.statement_timeout;
    let mut capped_by_deadline = false;
    if let Some(left) = s.time_left() {
        let budget = left.saturating_sub(s.opts.margin / 2);
        if budget < timeout {
            timeout = budget.max(Duration::from_millis(100));
            capped_by_deadline = true;
        }
    }
    let timeout_ms = timeout.as_millis().max(1) as u64;
    let role = task.role_override.clone().or_else(|| fork.as_role.clone());
    let prepared: std::result::Result<(), tokio_postgres::Error> = async {
        if sess.statement_timeout_ms != timeout_ms {
            sess.client
                .query_one(
                    "SELECT pg_catalog.set_config('statement_timeout', $1, false)",
                    &[&format!("{timeout_ms}ms")],
                )
                .await?;
            sess.statement_timeout_ms = timeout_ms;
        }
        if sess.role != role {
            match &role {
                Some(r) => {
                    sess.client.query_one("SELECT pg_catalog.set_config('role', $1, false)", &[r]).await?;
                }
                None => sess.client.batch_execute("RESET ROLE").await?,
            }
            sess.role = role.clone();
        }
        Ok(())
    }
    .await;

    let started = Instant::now();
    let result = match prepared {
        Err(e) => Err(e),
        Ok(()) => {
            sess.client
                .query_one(
                    prewarm.as_str(),
                    &[
                        &fork.oid,
                        &s.opts.mode.as_str(),
                        &fork.fork.as_str(),
                        &(range.first as i64),
                        &(range.last as i64),
                    ],
                )
                .await
        }
    };
    match result {
        Ok(row) => {
            let blocks: i64 = row.get(0);
            debug!(session = id, database = %fork.database, relation = %fork.name, fork = fork.fork.as_str(),
                   first = range.first, last = range.last, blocks, "range read");
            s.record(range, RangeResult::Warmed { blocks: blocks as u64, seconds: started.elapsed().as_secs_f64() });
            s.finish();
            false
        }
        Err(e) if is_connection_error(&e) => {
            *session = None;
            task.attempts += 1;
            if task.attempts > 8 {
                s.skip(range, SkipReason::ConnectionLost, describe(&e), None);
                return false;
            }
            warn!(session = id, database = %fork.database, error = %describe(&e), "session lost during a range; it will be retried");
            s.requeue(task, true);
            false
        }
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            task.attempts += 1;
            if task.attempts >= s.opts.lock_attempts {
                s.skip(
                    range,
                    SkipReason::LockTimeout,
                    format!("could not get a lock within {:?}, {} times", s.opts.lock_timeout, task.attempts),
                    None,
                );
            } else {
                info!(database = %fork.database, relation = %fork.name, attempt = task.attempts, "relation locked; coming back to it later");
                task.not_before = Some(Instant::now() + s.opts.lock_timeout);
                s.requeue(task, false);
            }
            false
        }
        Err(e) if e.code() == Some(&SqlState::QUERY_CANCELED) => {
            if capped_by_deadline {
                // The deadline cut the call short: the range is unfinished, not failed. It goes back
                // halved, so that a range longer than any call's window still ends: later calls finish
                // the smaller pieces (a whole range cut by every call would never finish).
                if range.blocks() > 1 {
                    info!(relation = %fork.name, blocks = range.blocks(), "deadline cut a range; it continues halved");
                    s.split_front(task);
                } else {
                    s.requeue(task, true);
                }
                return true;
            }
            if range.blocks() > 1 {
                info!(relation = %fork.name, blocks = range.blocks(), "statement timeout; splitting the range");
                s.split_front(task);
            } else {
                s.skip(range, SkipReason::StatementTimeout, describe(&e), None);
            }
            false
        }
        Err(e) if e.code() == Some(&SqlState::AMBIGUOUS_FUNCTION) => {
            // Someone created, beside the extension's pg_prewarm, an overload with extra defaulted
            // arguments: PostgreSQL refuses the call (nothing runs). Reported, with the way out.
            s.skip(
                range,
                SkipReason::Error,
                format!("{} (another role created an overload of pg_prewarm in the extension's schema)", describe(&e)),
                Some(
                    "drop the pg_prewarm functions that are not members of the extension (\\df pg_prewarm) and \
                     REVOKE CREATE on that schema FROM PUBLIC"
                        .into(),
                ),
            );
            false
        }
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            if role.is_none() && fork.owner_settable {
                task.role_override = Some(fork.owner.clone());
                s.requeue(task, true);
            } else {
                s.skip(
                    range,
                    SkipReason::Permission,
                    describe(&e),
                    Some(format!(
                        "GRANT pg_read_all_data TO {}",
                        crate::catalog::quote_ident(&s.plan.server.login_role)
                    )),
                );
            }
            false
        }
        Err(e) => reexamine(s, session, task, &e).await,
    }
}

/// After an unexpected error: find out whether the relation was dropped or shrank, and record or
/// retry accordingly.
async fn reexamine(s: &Shared, session: &mut Option<Session>, mut task: Task, err: &tokio_postgres::Error) -> bool {
    let range = task.range;
    let fork = s.plan.fork(&range).clone();
    let sess = session.as_ref().unwrap();
    let looked = sess
        .client
        .query_opt(
            "SELECT coalesce(pg_catalog.pg_relation_size(c.oid, $2), 0) FROM pg_catalog.pg_class c WHERE c.oid = $1",
            &[&fork.oid, &fork.fork.as_str()],
        )
        .await;
    match looked {
        Err(e) if is_connection_error(&e) => {
            *session = None;
            task.attempts += 1;
            s.requeue(task, true);
        }
        Err(e) => s.skip(range, SkipReason::Error, format!("{}; then: {}", describe(err), describe(&e)), None),
        Ok(None) => s.skip(range, SkipReason::Dropped, "dropped during the run".into(), None),
        Ok(Some(row)) => {
            let now_blocks = (row.get::<_, i64>(0) as u64) / s.plan.server.block_size;
            if range.first >= now_blocks {
                s.skip(range, SkipReason::Truncated, format!("relation now has {now_blocks} blocks"), None);
            } else if range.last >= now_blocks && task.attempts < 3 {
                let gone = BlockRange { first: now_blocks, ..range };
                s.record(
                    gone,
                    RangeResult::Skipped(Skip {
                        reason: SkipReason::Truncated,
                        detail: format!("relation now has {now_blocks} blocks"),
                        fix: None,
                    }),
                );
                task.range = BlockRange { last: now_blocks - 1, ..range };
                task.attempts += 1;
                s.requeue(task, true);
            } else {
                s.skip(range, SkipReason::Error, describe(err), None);
            }
        }
    }
    false
}
