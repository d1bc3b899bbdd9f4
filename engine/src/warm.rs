//! Warming: parallel sessions read the plan's block ranges with pg_prewarm. Every statement runs under
//! statement_timeout and lock_timeout. A range ends in exactly one recorded outcome (or several, when
//! it is split), or stays pending when the deadline comes: outcomes plus pending always partition the
//! planned ranges exactly.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::bounded::{bounded, bounded_or_stopped, client_bound, stop_asked, Failed};
use crate::connect::ConnectionSpec;
use crate::error::{Disposition, Error, Result};
use crate::plan::{BlockRange, Plan, ServerInfo, Skip, SkipReason};
use crate::sql::{prewarm_batch_call, prewarm_call, ServerSql};

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

/// The mode asked for: one of pg_prewarm's, or `auto` (resolved per server, [`Mode::auto`]). Read from
/// the CLI, a trigger's overrides and the deployment's defaults; anything else is refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum ModeChoice {
    Auto,
    Read,
    Buffer,
    Prefetch,
}

impl ModeChoice {
    pub fn resolve(self, server: &ServerInfo) -> Mode {
        match self {
            ModeChoice::Auto => Mode::auto(server),
            ModeChoice::Read => Mode::Read,
            ModeChoice::Buffer => Mode::Buffer,
            ModeChoice::Prefetch => Mode::Prefetch,
        }
    }
}

impl std::str::FromStr for ModeChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(ModeChoice::Auto),
            "read" => Ok(ModeChoice::Read),
            "buffer" => Ok(ModeChoice::Buffer),
            "prefetch" => Ok(ModeChoice::Prefetch),
            _ => Err(format!(
                "mode: {:?} is not one of auto, read, buffer, prefetch",
                s.chars().take(80).collect::<String>()
            )),
        }
    }
}

impl TryFrom<String> for ModeChoice {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
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
    /// How long a lost session keeps trying to reconnect before its database is declared unreachable
    /// (its ranges then stay pending).
    pub reconnect_for: Duration,
    /// Set (by a Ctrl-C or SIGTERM handler, say) to stop: no new range starts, and the ranges left are
    /// pending, as at a deadline.
    pub stop: Option<Arc<AtomicBool>>,
    /// Set to end the warm without cutting anything short: no new range starts, the statements
    /// already sent finish (and count), and the ranges left are pending. A head start ends this way
    /// when planning ends ([`crate::run::plan_with_head_start`]): a block it began is not read twice.
    pub drain: Option<Arc<AtomicBool>>,
    /// Adapt how many sessions read at once to the throughput they deliver ([`crate::adaptive`]),
    /// between 1 and `sessions`; otherwise exactly `sessions` read.
    pub adaptive: bool,
    /// With `adaptive`: the level to start at (None: [`crate::adaptive::START`]).
    pub start_sessions: Option<u32>,
    /// A planned range longer than this is read in statements of this many blocks, each taken from
    /// the queue on its own: any session may read the next step of a large relation (parallelism
    /// within it), and throughput is seen every few seconds, not once per range.
    pub step_blocks: u64,
    /// Called before each range is worked on. For fault-injection tests only (a panic here is a bug in
    /// a worker); None in every binary.
    #[doc(hidden)]
    pub before_range: Option<RangeHook>,
}

/// See [`WarmOptions::before_range`].
#[derive(Clone)]
pub struct RangeHook(pub Arc<RangeHookFn>);

/// The function a [`RangeHook`] calls.
pub type RangeHookFn = dyn Fn(&crate::plan::ForkEntry, &BlockRange) + Send + Sync;

impl std::fmt::Debug for RangeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RangeHook")
    }
}

impl WarmOptions {
    /// With a deadline: the time left now before its margin, when no new range starts.
    pub fn time_before_margin(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()).saturating_sub(self.margin))
    }
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
            stop: None,
            drain: None,
            adaptive: false,
            start_sessions: None,
            step_blocks: DEFAULT_STEP_BLOCKS,
            before_range: None,
        }
    }
}

/// 8 MiB with 8 KiB blocks: at the tens of MiB/s one session gets from a lazily loaded volume, a step
/// is a second or less, and one round trip per step costs nothing measurable.
pub const DEFAULT_STEP_BLOCKS: u64 = 1024;

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
    /// What the warmed ranges cost a lazily loaded volume, in bytes: each range counts whole fetch
    /// units ([`crate::hotset::FETCH_BYTES`]), at least one ([`volume_work`]). The controller measures
    /// this, not bytes: a small fork costs the volume a whole fetch however few its bytes.
    pub volume_work: AtomicU64,
    pub busy_sessions: AtomicUsize,
    pub sessions: AtomicUsize,
}

/// What [`warm`] did: the outcomes recorded, the ranges left, and why they were left.
#[derive(Debug, Default)]
pub struct Warmed {
    pub outcomes: Vec<RangeOutcome>,
    /// Ranges not read: the deadline came, the run was interrupted, or their database could not be
    /// reached. Never lost: they are the continuation (CLI) or the item's rest (workflow).
    pub pending: Vec<BlockRange>,
    /// Databases that could not be reached for `reconnect_for`, with the last reason. Their ranges are
    /// pending, not skipped: a failover or a reboot longer than `reconnect_for` ends the run with a
    /// continuation, and the rest is read when it is resumed (or when the workflow retries the call).
    pub unreachable: BTreeMap<String, String>,
    /// With `adaptive`: every change of the number of reading sessions, with the throughput that led
    /// to it (the first entry is the start).
    pub levels: Vec<crate::adaptive::Level>,
    /// Seconds after which every block of the plan's hot phase among the ranges given was read (None:
    /// there was none among them, or not all of it was read).
    pub hot_read_at: Option<f64>,
}

/// Attempts a range gets for each cause before it is given up with that cause: a range that lost its
/// session four times is not thereby closer to being skipped for a lock.
const MAX_RECONNECTS: u32 = 8;
const MAX_BUSY_WAITS: u32 = 5;
const MAX_RECHECKS: u32 = 3;
const MAX_PANICS: u32 = 2;

#[derive(Debug, Clone)]
struct Task {
    range: BlockRange,
    /// Sessions lost while reading this range.
    reconnects: u32,
    /// lock_timeout (or deadlock) while reading it.
    lock_waits: u32,
    /// The server short of memory, connections or disk.
    busy_waits: u32,
    /// Looks at the relation after an unexpected error (it shrank: read to its new end).
    rechecks: u32,
    /// Internal failures (a panic) while working on it.
    panics: u32,
    role_override: Option<String>,
    not_before: Option<Instant>,
    /// Read on its own from now on (a batch it was in failed).
    alone: bool,
}

impl Task {
    fn new(range: BlockRange) -> Self {
        Task {
            range,
            reconnects: 0,
            lock_waits: 0,
            busy_waits: 0,
            rechecks: 0,
            panics: 0,
            role_override: None,
            not_before: None,
            alone: false,
        }
    }
}

/// Small forks are read many to a statement: at 100,000 relations most forks are one or two blocks,
/// and one round trip each (plus SET ROLE when owners alternate) costs more than reading them. A
/// batch holds whole forks of at most [`BATCH_FORK_BLOCKS`] blocks of one database, read as one role.
const BATCH_FORK_BLOCKS: u64 = 16;
const BATCH_MAX: usize = 64;
/// How far past the first task `next` looks for more of a batch (the plan orders small forks by
/// database, so they are near each other).
const BATCH_WINDOW: usize = 1024;
/// How far past the first task `next` looks for small forks of a database no other session is in.
const SPREAD_WINDOW: usize = 65_536;

/// How many tasks one batch takes when `queued` tasks wait for `sessions` reading sessions: an even
/// share, at most [`BATCH_MAX`]. A batch's forks are read one after another, and on a cold volume
/// each costs a fetch: 256 one-block forks taken 64 at a time by 4 of 16 sessions leave 12 idle and
/// take 64 fetch latencies; shared out, 16 each.
fn batch_share(queued: usize, sessions: usize) -> usize {
    queued.div_ceil(sessions.max(1)).clamp(1, BATCH_MAX)
}

/// How long one batch statement should take: several per controller window, so that what the
/// sessions read is counted as it is read (a statement's forks count when it ends), and a change of
/// level takes effect within a window. On a cold volume at 50 ms a fetch, 64 one-block forks took
/// 3.2 s to a statement.
const BATCH_TARGET: Duration = Duration::from_millis(200);
/// Forks to a batch before any batch was timed.
const BATCH_START: usize = 8;

/// How many small forks fit in [`BATCH_TARGET`] at `micros_per_fork` (0: not measured yet), within
/// 1..=[`BATCH_MAX`].
fn batch_by_time(micros_per_fork: u64) -> usize {
    if micros_per_fork == 0 {
        return BATCH_START;
    }
    ((BATCH_TARGET.as_micros() as u64 / micros_per_fork) as usize).clamp(1, BATCH_MAX)
}

/// The running estimate of a batched fork's time: the latest batch weighs 30%.
fn next_fork_micros(before: u64, measured: u64) -> u64 {
    if before == 0 {
        measured.max(1)
    } else {
        ((before as f64 * 0.7 + measured as f64 * 0.3) as u64).max(1)
    }
}

struct Queue {
    tasks: VecDeque<Task>,
    in_flight: usize,
    /// Databases that could not be reached: their tasks stay in the queue, untaken.
    unreachable: BTreeMap<String, String>,
    /// Databases that no longer exist: their ranges vanished.
    gone: HashSet<String>,
    /// Per worker, the database of the last task it took (where its session is, or is being opened);
    /// None when it holds no session.
    heading: Vec<Option<String>>,
}

struct Shared {
    plan: Arc<Plan>,
    spec: ConnectionSpec,
    opts: WarmOptions,
    queue: Mutex<Queue>,
    outcomes: Mutex<Vec<RangeOutcome>>,
    /// Per fork, the index in `outcomes` of its latest warmed outcome (steps join it).
    latest_warmed: Mutex<HashMap<u32, usize>>,
    counters: Arc<Counters>,
    /// The tasks each worker holds, so that a worker that panics loses nothing.
    in_hand: Vec<Mutex<Vec<Task>>>,
    /// Workers with an id below this read; the others wait, without a session (adaptive).
    active: AtomicUsize,
    levels: Mutex<Vec<crate::adaptive::Level>>,
    /// What one fork of a batch took so far, microseconds ([`next_fork_micros`]; 0: no batch yet).
    batch_fork_micros: AtomicU64,
    /// The plan's hot blocks among the ranges given, how many are left to read, and when the last was.
    hot: crate::hotset::HotBlocks,
    hot_left: AtomicU64,
    hot_read_at: Mutex<Option<f64>>,
    started: Instant,
}

/// Reads `ranges` of `plan`. Returns the outcomes recorded and the ranges left pending (the deadline
/// came first, the run was stopped, or their database could not be reached). Never fails for what
/// happens to a single relation, session or worker.
pub async fn warm(
    spec: &ConnectionSpec,
    plan: Arc<Plan>,
    ranges: Vec<BlockRange>,
    opts: &WarmOptions,
    counters: Arc<Counters>,
) -> Result<Warmed> {
    if opts.sessions == 0 {
        return Err(Error::InvalidInput("sessions must be at least 1".into()));
    }
    let total: u64 = ranges.iter().map(|r| plan.bytes(r.blocks())).sum();
    counters.planned_bytes.fetch_add(total, Ordering::Relaxed);
    let workers = (opts.sessions as usize).min(ranges.len()).max(1);
    let controller = opts.adaptive.then(|| match opts.start_sessions {
        Some(start) => crate::adaptive::Controller::starting_at(opts.sessions as usize, start as usize),
        None => crate::adaptive::Controller::new(opts.sessions as usize),
    });
    let active = controller.as_ref().map_or(workers, |c| c.level().min(workers));
    counters.sessions.store(active, Ordering::Relaxed);
    let hot = plan.hot_set.as_ref().map(|h| crate::hotset::HotBlocks::new(&h.ranges)).unwrap_or_default();
    let hot_left: u64 = ranges.iter().map(|r| hot.within(r)).sum();
    let shared = Arc::new(Shared {
        plan,
        spec: spec.clone(),
        opts: opts.clone(),
        queue: Mutex::new(Queue {
            tasks: ranges.into_iter().map(Task::new).collect(),
            in_flight: 0,
            unreachable: BTreeMap::new(),
            gone: HashSet::new(),
            heading: vec![None; workers],
        }),
        outcomes: Mutex::new(Vec::new()),
        latest_warmed: Mutex::new(HashMap::new()),
        counters,
        in_hand: (0..workers).map(|_| Mutex::new(Vec::new())).collect(),
        active: AtomicUsize::new(active),
        levels: Mutex::new(Vec::new()),
        batch_fork_micros: AtomicU64::new(0),
        hot,
        hot_left: AtomicU64::new(hot_left),
        hot_read_at: Mutex::new(None),
        started: Instant::now(),
    });
    let mut handles = Vec::new();
    for id in 0..workers {
        let s = shared.clone();
        handles.push(tokio::spawn(async move { worker(id, s).await }));
    }
    let steering = controller.map(|c| tokio::spawn(steer(shared.clone(), c)));
    for h in handles {
        if let Err(e) = h.await {
            // worker() catches its own panics; this is the runtime shutting down under it.
            warn!(error = %e, "a warm session task ended abnormally");
        }
    }
    // Whatever a worker still held (it could not finish) goes back: nothing is lost.
    for slot in &shared.in_hand {
        for t in std::mem::take(&mut *slot.lock().unwrap()) {
            shared.queue.lock().unwrap().tasks.push_front(t);
        }
    }
    if let Some(h) = steering {
        h.abort();
    }
    let outcomes = join_steps(std::mem::take(&mut *shared.outcomes.lock().unwrap()));
    let levels = std::mem::take(&mut *shared.levels.lock().unwrap());
    let mut q = shared.queue.lock().unwrap();
    let pending: Vec<BlockRange> = q.tasks.drain(..).map(|t| t.range).collect();
    let hot_read_at = *shared.hot_read_at.lock().unwrap();
    Ok(Warmed { outcomes, pending, unreachable: std::mem::take(&mut q.unreachable), levels, hot_read_at })
}

/// Joins warmed outcomes of one fork that touch (the steps of a range, finished in any order) and
/// sorts by fork and block: as many outcomes as the plan had ranges, or fewer.
fn join_steps(mut outcomes: Vec<RangeOutcome>) -> Vec<RangeOutcome> {
    outcomes.sort_by_key(|o| (o.range.fork, o.range.first));
    let mut joined: Vec<RangeOutcome> = Vec::with_capacity(outcomes.len());
    for o in outcomes {
        if let (Some(last), RangeResult::Warmed { blocks, seconds }) = (joined.last_mut(), &o.result) {
            if let RangeResult::Warmed { blocks: b, seconds: sec } = &mut last.result {
                if last.range.fork == o.range.fork && last.range.last + 1 == o.range.first {
                    last.range.last = o.range.last;
                    *b += blocks;
                    *sec += seconds;
                    continue;
                }
            }
        }
        joined.push(o);
    }
    joined
}

/// What reading `bytes` of one range costs a lazily loaded volume: whole fetch units, at least one.
/// Counted in bytes, the phase of a run that reads thousands of one-block forks looks idle (18 MiB a
/// second where the volume fetched 395 MiB of units) while the volume is busy fetching a unit for
/// each: windows ran for seconds and the controller stayed where the large relations had left it (16
/// sessions on a volume serving 32 fetches at once: 12.5 s to 100% against 9.4 s with 32,
/// docs/benchmark.md).
pub fn volume_work(bytes: u64) -> u64 {
    let unit = crate::hotset::FETCH_BYTES;
    bytes.div_ceil(unit).max(1) * unit
}

/// The shortest window the controller measures before a decision; a window also lasts until half
/// the reading sessions have finished a step's worth of volume work (a slow volume's windows are
/// longer), and at most [`MAX_WINDOW`].
const WINDOW: Duration = Duration::from_millis(500);
const MAX_WINDOW: Duration = Duration::from_secs(10);

/// Feeds the controller the volume work done per window ([`volume_work`]) and applies its levels,
/// recording each change with the bytes per second read in the window that led to it.
/// After a change, one window passes unmeasured: sessions just started or stopped make the next
/// window's throughput a mix of two levels.
async fn steer(s: Arc<Shared>, mut c: crate::adaptive::Controller) {
    use crate::adaptive::Level;
    let started = Instant::now();
    let workers = s.in_hand.len();
    let step_bytes = s.plan.bytes(s.opts.step_blocks.max(1));
    let record = |level: usize, rate: f64| {
        s.levels.lock().unwrap().push(Level {
            at_seconds: started.elapsed().as_secs_f64(),
            sessions: level,
            mib_per_second: rate / 1048576.0,
        });
    };
    record(s.active.load(Ordering::Relaxed), 0.0);
    // The first window starts once bytes arrive, and after one settling window: sessions opening (TLS,
    // authentication, cold catalogs) would make the start level look slower than it is, and the next
    // level better than it is.
    let opened = Instant::now();
    while s.counters.warmed_bytes.load(Ordering::Relaxed) == 0 && opened.elapsed() < MAX_WINDOW {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(WINDOW).await;
    // The kind of work the controller's levels were measured on (bytes per unit of volume work).
    let mut regime: Option<f64> = None;
    loop {
        let level = s.active.load(Ordering::Relaxed);
        let since = Instant::now();
        let (from_bytes, from_work) =
            (s.counters.warmed_bytes.load(Ordering::Relaxed), s.counters.volume_work.load(Ordering::Relaxed));
        let (bytes, work, took) = loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let took = since.elapsed();
            let work = s.counters.volume_work.load(Ordering::Relaxed) - from_work;
            if (took >= WINDOW && work >= step_bytes * level as u64 / 2) || took >= MAX_WINDOW {
                break (s.counters.warmed_bytes.load(Ordering::Relaxed) - from_bytes, work, took);
            }
        };
        // Nothing left to share out: the level no longer matters (the tail of the run).
        if s.queue.lock().unwrap().tasks.len() < level {
            continue;
        }
        let rate = bytes as f64 / took.as_secs_f64();
        // Bytes per unit of volume work: about 1 for steps of large relations, 1/64 for one-block
        // forks. When it moves by 4x the work changed kind, and the climb starts again.
        let density = bytes as f64 / work.max(1) as f64;
        let changed = regime.is_some_and(|r: f64| density > 4.0 * r || density < r / 4.0);
        if regime.is_none() || changed {
            regime = Some(density);
        }
        if changed {
            info!(bytes_per_fetch_unit = format!("{:.3}", density), "the work changed kind: climbing again");
            c.new_regime();
        }
        let next = c.observe(work as f64 / took.as_secs_f64()).min(workers);
        if next != level {
            info!(
                sessions = next,
                before = level,
                mib_per_second = format!("{:.1}", rate / 1048576.0),
                volume_mib_per_second = format!("{:.1}", work as f64 / took.as_secs_f64() / 1048576.0),
                "reading sessions"
            );
            s.active.store(next, Ordering::Relaxed);
            s.counters.sessions.store(next, Ordering::Relaxed);
            record(next, rate);
            tokio::time::sleep(WINDOW).await;
        }
    }
}

struct WarmSession {
    database: String,
    client: crate::connect::Session,
    /// The pg_prewarm call as this session's server resolved it (None: the extension is not there).
    prewarm: Option<ServerSql>,
    role: Option<String>,
    statement_timeout_ms: u64,
    /// The batch call of pg_prewarm as this session's server resolved it, once asked for.
    batch: Option<ServerSql>,
}

enum Next {
    /// One task, or a batch of small whole forks of one database, read as one role.
    Run(Vec<Task>),
    Wait,
    Done,
}

impl Shared {
    fn time_left(&self) -> Option<Duration> {
        self.opts.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The statement timeout of the next statement: never past the deadline (minus half the margin),
    /// never above the option; and whether the deadline capped it.
    fn statement_timeout(&self) -> (Duration, bool) {
        let timeout = self.opts.statement_timeout;
        match self.time_left().map(|left| left.saturating_sub(self.opts.margin / 2)) {
            Some(budget) if budget < timeout => (budget.max(Duration::from_millis(100)), true),
            _ => (timeout, false),
        }
    }

    /// `limit`, and with a deadline, no later than a quarter margin before it.
    fn within_deadline(&self, limit: Duration) -> Duration {
        match self.time_left() {
            Some(left) => limit.min(left.saturating_sub(self.opts.margin / 4)).max(Duration::from_millis(100)),
            None => limit,
        }
    }

    /// `limit`, and with a deadline, no later than when [`Self::deadline_near`] becomes true.
    fn until_deadline_near(&self, limit: Duration) -> Duration {
        match self.time_left() {
            Some(left) => limit.min(left.saturating_sub(self.opts.margin)),
            None => limit,
        }
    }

    /// Whether to start nothing new: the deadline's margin reached, a stop or a drain asked (a session
    /// being reopened gives up too; its range stays pending).
    fn deadline_near(&self) -> bool {
        self.time_left().is_some_and(|left| left <= self.opts.margin)
            || self.opts.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed))
            || self.opts.drain.as_ref().is_some_and(|s| s.load(Ordering::Relaxed))
    }

    /// The next task to run: the first ready one, preferring one in `current` (the worker's session's
    /// database), so that a worker keeps its session while it has work there. Tasks of unreachable
    /// databases are not taken.
    ///
    /// A worker with nothing left in its database, facing small whole forks of a database another
    /// worker is already in, takes the first of that run of small forks whose database no worker is
    /// in: on a server of many small databases each session then works through databases of
    /// its own, one connection each, instead of every session following the queue's head into every
    /// database (measured: 300 databases, ~6,000 connections before; docs/benchmark.md).
    fn next(&self, worker: usize, current: Option<&str>) -> Next {
        let mut q = self.queue.lock().unwrap();
        let now = Instant::now();
        let takeable = |t: &Task, q: &Queue| {
            t.not_before.is_none_or(|nb| nb <= now) && !q.unreachable.contains_key(&self.plan.fork(&t.range).database)
        };
        let first = q.tasks.iter().position(|t| takeable(t, &q));
        let in_current = match (first, current) {
            (Some(f), Some(db)) if self.plan.fork(&q.tasks[f].range).database != db => {
                q.tasks.iter().position(|t| takeable(t, &q) && self.plan.fork(&t.range).database == db)
            }
            (f, Some(_)) => f,
            (_, None) => None,
        };
        let pos = in_current.or_else(|| {
            let f = first?;
            let others: Vec<&str> =
                q.heading.iter().enumerate().filter(|&(w, _)| w != worker).filter_map(|(_, h)| h.as_deref()).collect();
            let occupied = |db: &str| others.contains(&db);
            if !self.small_whole(&q.tasks[f]) || !occupied(&self.plan.fork(&q.tasks[f].range).database) {
                return Some(f);
            }
            // Small forks come grouped by database: one look per database met, within a bounded window,
            // and not past the end of the hot set's part (hot blocks keep coming first).
            let hot = self.hot.within(&q.tasks[f].range) > 0;
            let mut seen: Option<&str> = None;
            for (i, t) in q.tasks.iter().enumerate().skip(f).take(SPREAD_WINDOW) {
                if !self.small_whole(t) || (self.hot.within(&t.range) > 0) != hot {
                    break;
                }
                let db = self.plan.fork(&t.range).database.as_str();
                if seen == Some(db) || !takeable(t, &q) {
                    continue;
                }
                seen = Some(db);
                if !occupied(db) {
                    return Some(i);
                }
            }
            Some(f)
        });
        if let Some(pos) = pos {
            let mut t = q.tasks.remove(pos).unwrap();
            // A long range is read a step at a time: the rest stays where it was, for any session.
            let step = self.opts.step_blocks.max(1);
            if t.range.blocks() > step {
                let rest = Task { range: BlockRange { first: t.range.first + step, ..t.range }, ..t.clone() };
                t.range.last = t.range.first + step - 1;
                q.tasks.insert(pos, rest);
            }
            let mut taken = vec![t];
            // More of a batch: only in the database the worker's session is already in, and no more
            // than this session's share of what is queued.
            if current == Some(self.plan.fork(&taken[0].range).database.as_str()) && self.batchable(&taken[0], now) {
                let limit = batch_share(q.tasks.len() + 1, self.active.load(Ordering::Relaxed))
                    .min(batch_by_time(self.batch_fork_micros.load(Ordering::Relaxed)));
                let mut i = pos;
                let end = (pos + BATCH_WINDOW).min(q.tasks.len());
                let mut end = end;
                while i < end && taken.len() < limit {
                    if self.batchable(&q.tasks[i], now) && self.same_batch(&taken[0], &q.tasks[i]) {
                        taken.push(q.tasks.remove(i).unwrap());
                        end -= 1;
                    } else {
                        i += 1;
                    }
                }
            }
            q.in_flight += taken.len();
            q.heading[worker] = Some(self.plan.fork(&taken[0].range).database.clone());
            *self.in_hand[worker].lock().unwrap() = taken.clone();
            return Next::Run(taken);
        }
        let waiting = q.tasks.iter().any(|t| !q.unreachable.contains_key(&self.plan.fork(&t.range).database));
        if !waiting && q.in_flight == 0 {
            Next::Done
        } else {
            Next::Wait
        }
    }

    /// Nothing queued and nothing in flight.
    fn finished(&self) -> bool {
        let q = self.queue.lock().unwrap();
        q.in_flight == 0 && q.tasks.iter().all(|t| q.unreachable.contains_key(&self.plan.fork(&t.range).database))
    }

    /// A whole fork smaller than one planned range: the plan's last phase, small forks grouped by
    /// database (and a hot set's small relations).
    fn small_whole(&self, t: &Task) -> bool {
        let f = self.plan.fork(&t.range);
        t.range.first == 0 && t.range.last + 1 == f.blocks && f.blocks < self.plan.range_blocks.max(2)
    }

    /// A whole small fork, ready, never failed: it may be read in a batch.
    fn batchable(&self, t: &Task, now: Instant) -> bool {
        let f = self.plan.fork(&t.range);
        !t.alone
            && t.range.first == 0
            && t.range.last + 1 == f.blocks
            && f.blocks <= BATCH_FORK_BLOCKS
            && t.role_override.is_none()
            && t.reconnects == 0
            && t.not_before.is_none_or(|nb| nb <= now)
    }

    fn same_batch(&self, a: &Task, b: &Task) -> bool {
        let (fa, fb) = (self.plan.fork(&a.range), self.plan.fork(&b.range));
        fa.database == fb.database && fa.as_role == fb.as_role
    }

    /// Ends a worker's flight: the task it held is resolved (recorded, requeued or split).
    fn release(&self, worker: usize) {
        self.in_hand[worker].lock().unwrap().clear();
        self.queue.lock().unwrap().in_flight -= 1;
    }

    /// Puts a task back (front: retry at once; back: after the others) and ends its flight.
    fn requeue(&self, worker: usize, t: Task, front: bool) {
        self.in_hand[worker].lock().unwrap().clear();
        let mut q = self.queue.lock().unwrap();
        if front {
            q.tasks.push_front(t);
        } else {
            q.tasks.push_back(t);
        }
        q.in_flight -= 1;
    }

    /// Puts a range back as two halves, first in the queue.
    fn split_front(&self, worker: usize, task: Task) {
        self.in_hand[worker].lock().unwrap().clear();
        let range = task.range;
        let mid = range.first + range.blocks() / 2;
        let mut q = self.queue.lock().unwrap();
        q.tasks.push_front(Task { range: BlockRange { first: mid, ..range }, ..task.clone() });
        q.tasks.push_front(Task { range: BlockRange { last: mid - 1, ..range }, ..task });
        q.in_flight -= 1;
    }

    fn record(&self, range: BlockRange, result: RangeResult) {
        let bytes = self.plan.bytes(range.blocks());
        self.counters.done_bytes.fetch_add(bytes, Ordering::Relaxed);
        if let RangeResult::Warmed { .. } = result {
            self.counters.warmed_bytes.fetch_add(bytes, Ordering::Relaxed);
            self.counters.volume_work.fetch_add(volume_work(bytes), Ordering::Relaxed);
            let hot = self.hot.within(&range);
            if hot > 0 && self.hot_left.fetch_sub(hot, Ordering::Relaxed) == hot {
                let at = self.started.elapsed().as_secs_f64();
                *self.hot_read_at.lock().unwrap() = Some(at);
                info!(seconds = at, "the captured hot set is read");
            }
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
        let mut outcomes = self.outcomes.lock().unwrap();
        let mut latest = self.latest_warmed.lock().unwrap();
        // A range read in steps gets one outcome: each warmed step joins the fork's latest warmed
        // outcome when they touch (steps may finish out of order), so that reading in steps does not
        // multiply what a continuation carries.
        if let RangeResult::Warmed { blocks, seconds } = result {
            if let Some(&i) = latest.get(&range.fork) {
                let o = &mut outcomes[i];
                if let RangeResult::Warmed { blocks: b, seconds: sec } = &mut o.result {
                    let joined = if o.range.last + 1 == range.first {
                        o.range.last = range.last;
                        true
                    } else if range.last + 1 == o.range.first {
                        o.range.first = range.first;
                        true
                    } else {
                        false
                    };
                    if joined {
                        *b += blocks;
                        *sec += seconds;
                        return;
                    }
                }
            }
            latest.insert(range.fork, outcomes.len());
        }
        outcomes.push(RangeOutcome { range, result });
    }

    fn skip(&self, worker: usize, range: BlockRange, reason: SkipReason, detail: String, fix: Option<String>) {
        self.record(range, RangeResult::Skipped(Skip { reason, detail, fix }));
        self.release(worker);
    }
}

async fn worker(id: usize, s: Arc<Shared>) {
    use futures_util::FutureExt;
    let mut session: Option<WarmSession> = None;
    loop {
        if s.deadline_near() {
            debug!(session = id, "deadline near, stop or drain asked: starting no new range");
            break;
        }
        if id >= s.active.load(Ordering::Relaxed) {
            // Not reading at this level: no session held, a connection slot left free.
            session = None;
            s.queue.lock().unwrap().heading[id] = None;
            if s.finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let mut tasks = match s.next(id, session.as_ref().map(|x| x.database.as_str())) {
            Next::Run(t) => t,
            Next::Wait => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Next::Done => break,
        };
        s.counters.busy_sessions.fetch_add(1, Ordering::Relaxed);
        let ran = if tasks.len() == 1 {
            let task = tasks.pop().unwrap();
            std::panic::AssertUnwindSafe(run_task(id, &s, &mut session, task)).catch_unwind().await
        } else {
            std::panic::AssertUnwindSafe(run_batch(id, &s, &mut session, tasks)).catch_unwind().await
        };
        s.counters.busy_sessions.fetch_sub(1, Ordering::Relaxed);
        match ran {
            Ok(true) => break,
            Ok(false) => {}
            Err(panic) => {
                // A bug, not the server: the session's state is unknown, so it goes; the ranges go
                // back, each alone (a range that panics again is reported, so that a bug cannot loop
                // forever).
                session = None;
                let what = panic_text(panic.as_ref());
                let held = std::mem::take(&mut *s.in_hand[id].lock().unwrap());
                let mut q = s.queue.lock().unwrap();
                q.in_flight -= held.len();
                drop(q);
                for mut task in held {
                    task.panics += 1;
                    task.alone = true;
                    if task.panics >= MAX_PANICS {
                        s.record(
                            task.range,
                            RangeResult::Skipped(Skip {
                                reason: SkipReason::Error,
                                detail: format!("internal error: {what}"),
                                fix: None,
                            }),
                        );
                    } else {
                        warn!(session = id, error = %what, "internal error while reading a range; it goes back to the queue");
                        s.queue.lock().unwrap().tasks.push_front(task);
                    }
                }
            }
        }
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Why a session could not be opened.
enum NotOpened {
    /// The database no longer exists.
    Gone(String),
    /// It could not be reached (or refused the login) for `reconnect_for`; the reason.
    Unreachable(String),
    /// The deadline came (or a stop was asked) while reconnecting.
    Stopped,
}

/// Opens a session to `db`, retrying connection failures until `reconnect_for` runs out or the deadline
/// comes.
async fn open_session(s: &Shared, db: &str) -> std::result::Result<WarmSession, NotOpened> {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    loop {
        if s.deadline_near() {
            return Err(NotOpened::Stopped);
        }
        let attempt = async {
            let connect_bound = s.within_deadline(s.spec.connect_timeout());
            let client = match tokio::time::timeout(connect_bound, s.spec.connect(db)).await {
                Ok(c) => c?,
                Err(_) => {
                    return Err(Error::Connect {
                        target: format!("{} database {db:?}", s.spec.target()),
                        reason: format!("no answer within {:.1} s while connecting", connect_bound.as_secs_f64()),
                        source: None,
                    })
                }
            };
            let bound = s.within_deadline(client_bound(s.spec.connect_timeout(), s.opts.margin));
            if s.spec.lock_timeout() != s.opts.lock_timeout {
                let ms = format!("{}ms", s.opts.lock_timeout.as_millis().max(1));
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ms];
                let set = client.query_one("SELECT pg_catalog.set_config('lock_timeout', $1, false)", &params);
                bounded(&s.spec, &client, bound, set).await.map_err(|f| lost_while_opening(&s.spec, db, f))?;
            }
            let prewarm = bounded(&s.spec, &client, bound, prewarm_call(&client))
                .await
                .map_err(|f| lost_while_opening(&s.spec, db, f))?;
            Ok::<_, Error>((client, prewarm.map(|(_, call)| call)))
        };
        // A stop ends the wait at once: a connect to a dead peer waits up to connect_timeout.
        let attempted = tokio::select! {
            r = attempt => r,
            _ = stop_asked(s.opts.stop.as_deref()) => return Err(NotOpened::Stopped),
        };
        match attempted {
            Ok((client, prewarm)) => {
                return Ok(WarmSession {
                    database: db.to_string(),
                    client,
                    prewarm,
                    role: None,
                    statement_timeout_ms: 0,
                    batch: None,
                })
            }
            Err(e) if e.sqlstate() == Some("3D000") => return Err(NotOpened::Gone(e.to_string())),
            Err(e) => {
                if s.deadline_near() {
                    return Err(NotOpened::Stopped);
                }
                if !e.is_retryable() || started.elapsed() >= s.opts.reconnect_for {
                    return Err(NotOpened::Unreachable(e.to_string()));
                }
                warn!(database = %db, error = %e, retry_in_ms = backoff.as_millis() as u64, "session lost; reconnecting");
                // Neither a stop nor the deadline's margin waits for the backoff to end.
                tokio::select! {
                    _ = tokio::time::sleep(s.until_deadline_near(backoff)) => {}
                    _ = stop_asked(s.opts.stop.as_deref()) => return Err(NotOpened::Stopped),
                    _ = stop_asked(s.opts.drain.as_deref()) => return Err(NotOpened::Stopped),
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

fn lost_while_opening(spec: &ConnectionSpec, db: &str, f: Failed) -> Error {
    f.into_error(format!("{} database {db:?}", spec.target()), "opening a session")
}

/// Makes sure `session` is open on the task's database. Returns false when the task was resolved
/// otherwise (put back, or recorded) and true when the worker must stop.
enum Ready {
    Yes,
    Resolved,
    Stop,
}

async fn ensure_session(id: usize, s: &Shared, session: &mut Option<WarmSession>, task: &Task) -> Ready {
    let db = &s.plan.fork(&task.range).database;
    if s.queue.lock().unwrap().gone.contains(db) {
        s.skip(
            id,
            task.range,
            SkipReason::DatabaseDropped,
            format!("database {db:?} was dropped during the run"),
            None,
        );
        return Ready::Resolved;
    }
    if session.as_ref().is_some_and(|x| &x.database == db) {
        return Ready::Yes;
    }
    *session = None;
    match open_session(s, db).await {
        Ok(x) => {
            *session = Some(x);
            Ready::Yes
        }
        Err(NotOpened::Stopped) => {
            s.requeue(id, task.clone(), true);
            Ready::Stop
        }
        Err(NotOpened::Gone(reason)) => {
            info!(database = %db, "the database was dropped during the run: its ranges vanished");
            s.queue.lock().unwrap().gone.insert(db.clone());
            s.skip(id, task.range, SkipReason::DatabaseDropped, reason, None);
            Ready::Resolved
        }
        Err(NotOpened::Unreachable(reason)) => {
            warn!(database = %db, reason = %reason, reconnect_for_s = s.opts.reconnect_for.as_secs(),
                  "database unreachable: its ranges stay pending (the continuation holds them)");
            s.queue.lock().unwrap().unreachable.entry(db.clone()).or_insert(reason);
            s.requeue(id, task.clone(), true);
            Ready::Resolved
        }
    }
}

/// Runs one task; returns true when the worker must stop (deadline, stop).
async fn run_task(id: usize, s: &Shared, session: &mut Option<WarmSession>, task: Task) -> bool {
    if let Some(hook) = &s.opts.before_range {
        (hook.0)(s.plan.fork(&task.range), &task.range);
    }
    match ensure_session(id, s, session, &task).await {
        Ready::Yes => {}
        Ready::Resolved => return false,
        Ready::Stop => return true,
    }
    let range = task.range;
    let fork = s.plan.fork(&range).clone();
    let sess = session.as_mut().unwrap();
    let Some(prewarm) = sess.prewarm.clone() else {
        s.skip(
            id,
            range,
            SkipReason::NoExtension,
            format!("pg_prewarm's extension is not installed in database {:?}", fork.database),
            Some("CREATE EXTENSION pg_prewarm (as a superuser or rds_superuser)".into()),
        );
        return false;
    };

    let (timeout, capped_by_deadline) = s.statement_timeout();
    let role = task.role_override.clone().or_else(|| fork.as_role.clone());
    let started = Instant::now();
    let result = read_range(s, sess, &prewarm, &fork, &range, timeout, role).await;
    match result {
        Ok(blocks) => {
            debug!(session = id, database = %fork.database, relation = %fork.name, fork = fork.fork.as_str(),
                   first = range.first, last = range.last, blocks, "range read");
            s.record(range, RangeResult::Warmed { blocks, seconds: started.elapsed().as_secs_f64() });
            s.release(id);
            false
        }
        Err(f) => dispose(id, s, session, task, f, capped_by_deadline).await,
    }
}

/// The statements of one range: the session's statement_timeout and role as this range needs them,
/// then pg_prewarm over the range. Each under a client-side bound.
async fn read_range(
    s: &Shared,
    sess: &mut WarmSession,
    prewarm: &ServerSql,
    fork: &crate::plan::ForkEntry,
    range: &BlockRange,
    timeout: Duration,
    role: Option<String>,
) -> std::result::Result<u64, Failed> {
    let quick = s.within_deadline(client_bound(s.spec.connect_timeout(), s.opts.margin));
    prepare(s, sess, quick, timeout, role).await?;
    let (mode, fork_name, first, last) =
        (s.opts.mode.as_str(), fork.fork.as_str(), range.first as i64, range.last as i64);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [&fork.oid, &mode, &fork_name, &first, &last];
    let call = sess.client.query_one(prewarm.as_str(), &params);
    // The client-side bound: a little over the server's, and with a deadline, still before it.
    let limit = s.within_deadline(client_bound(timeout, s.opts.margin)).max(timeout);
    let row = bounded_or_stopped(&s.spec, &sess.client, limit, s.opts.stop.as_deref(), call).await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// Decides what happens to a range whose statement failed, by the failure's [`Disposition`], each
/// cause with its own budget. Returns true when the worker must stop.
async fn dispose(
    id: usize,
    s: &Shared,
    session: &mut Option<WarmSession>,
    mut task: Task,
    f: Failed,
    capped_by_deadline: bool,
) -> bool {
    let range = task.range;
    let fork = s.plan.fork(&range).clone();
    if let Failed::Stopped = f {
        *session = None;
        s.requeue(id, task, true);
        return true;
    }
    match f.disposition() {
        Disposition::SessionLost => {
            *session = None;
            task.reconnects += 1;
            if task.reconnects > MAX_RECONNECTS {
                s.skip(id, range, SkipReason::ConnectionLost, f.describe(), None);
                return false;
            }
            warn!(session = id, database = %fork.database, error = %f.describe(), "session lost during a range; it will be retried");
            s.requeue(id, task, true);
            false
        }
        Disposition::DatabaseGone => {
            *session = None;
            s.queue.lock().unwrap().gone.insert(fork.database.clone());
            s.skip(id, range, SkipReason::DatabaseDropped, f.describe(), None);
            false
        }
        Disposition::LockBusy => {
            task.lock_waits += 1;
            if task.lock_waits >= s.opts.lock_attempts {
                s.skip(
                    id,
                    range,
                    SkipReason::LockTimeout,
                    format!("could not get a lock within {:?}, {} times", s.opts.lock_timeout, task.lock_waits),
                    None,
                );
            } else {
                info!(database = %fork.database, relation = %fork.name, attempt = task.lock_waits, "relation locked; coming back to it later");
                task.not_before = Some(Instant::now() + s.opts.lock_timeout);
                s.requeue(id, task, false);
            }
            false
        }
        Disposition::ServerBusy => {
            task.busy_waits += 1;
            if task.busy_waits > MAX_BUSY_WAITS {
                s.skip(id, range, SkipReason::Error, f.describe(), None);
            } else {
                let wait = Duration::from_secs(1 << task.busy_waits.min(5));
                warn!(database = %fork.database, error = %f.describe(), retry_in_s = wait.as_secs(), "server short of resources; the range is retried later");
                task.not_before = Some(Instant::now() + wait);
                s.requeue(id, task, false);
            }
            false
        }
        Disposition::Canceled => {
            if capped_by_deadline {
                // The deadline cut the call short: the range is unfinished, not failed. It goes back
                // halved, so that a range longer than any call's window still ends: later calls finish
                // the smaller pieces (a whole range cut by every call would never finish).
                if range.blocks() > 1 {
                    info!(relation = %fork.name, blocks = range.blocks(), "deadline cut a range; it continues halved");
                    s.split_front(id, task);
                } else {
                    s.requeue(id, task, true);
                }
                return true;
            }
            if range.blocks() > 1 {
                info!(relation = %fork.name, blocks = range.blocks(), "statement timeout; splitting the range");
                s.split_front(id, task);
            } else {
                s.skip(id, range, SkipReason::StatementTimeout, f.describe(), None);
            }
            false
        }
        Disposition::AmbiguousFunction => {
            // Someone created, beside the extension's pg_prewarm, an overload with extra defaulted
            // arguments: PostgreSQL refuses the call (nothing runs). Reported, with the way out.
            s.skip(
                id,
                range,
                SkipReason::Error,
                format!("{} (another role created an overload of pg_prewarm in the extension's schema)", f.describe()),
                Some(
                    "drop the pg_prewarm functions that are not members of the extension (\\df pg_prewarm) and \
                     REVOKE CREATE on that schema FROM PUBLIC"
                        .into(),
                ),
            );
            false
        }
        Disposition::Privilege => {
            if task.role_override.is_none() && fork.as_role.is_none() && fork.owner_settable {
                task.role_override = Some(fork.owner.clone());
                s.requeue(id, task, true);
            } else {
                let fix = crate::catalog::read_all_data_fix(&s.plan.server);
                s.skip(id, range, SkipReason::Permission, f.describe(), Some(fix));
            }
            false
        }
        Disposition::Examine => reexamine(id, s, session, task, &f).await,
    }
}

/// Reads a batch of small whole forks in one statement, on the session already open in their
/// database. Any failure puts them back to be read one by one, where every cause has its handling;
/// only a lost session or a stop keeps them batchable. Returns true when the worker must stop.
async fn run_batch(id: usize, s: &Shared, session: &mut Option<WarmSession>, tasks: Vec<Task>) -> bool {
    if let Some(hook) = &s.opts.before_range {
        for t in &tasks {
            (hook.0)(s.plan.fork(&t.range), &t.range);
        }
    }
    let put_back = |tasks: Vec<Task>, alone: bool, lost: bool| {
        s.in_hand[id].lock().unwrap().clear();
        let mut q = s.queue.lock().unwrap();
        q.in_flight -= tasks.len();
        for mut t in tasks.into_iter().rev() {
            t.alone |= alone;
            t.reconnects += lost as u32;
            q.tasks.push_front(t);
        }
    };
    let Some(sess) = session.as_mut().filter(|x| x.prewarm.is_some()) else {
        put_back(tasks, true, false);
        return false;
    };
    let (timeout, _) = s.statement_timeout();
    let role = s.plan.fork(&tasks[0].range).as_role.clone();
    let started = Instant::now();
    match read_batch(s, sess, &tasks, timeout, role).await {
        Ok(blocks) if blocks.len() == tasks.len() => {
            let seconds = started.elapsed().as_secs_f64() / tasks.len() as f64;
            let per_fork = (seconds * 1e6) as u64;
            let _ = s
                .batch_fork_micros
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |before| Some(next_fork_micros(before, per_fork)));
            debug!(session = id, forks = tasks.len(), "batch of small forks read");
            s.in_hand[id].lock().unwrap().clear();
            for (t, b) in tasks.iter().zip(blocks) {
                s.record(t.range, RangeResult::Warmed { blocks: b, seconds });
            }
            s.queue.lock().unwrap().in_flight -= tasks.len();
            false
        }
        Ok(_) => {
            put_back(tasks, true, false);
            false
        }
        Err(Failed::Stopped) => {
            *session = None;
            put_back(tasks, false, false);
            true
        }
        Err(f) if f.disposition() == Disposition::SessionLost => {
            *session = None;
            warn!(session = id, error = %f.describe(), forks = tasks.len(), "session lost during a batch; it will be retried");
            put_back(tasks, false, true);
            false
        }
        Err(f) => {
            debug!(session = id, error = %f.describe(), forks = tasks.len(), "a batch failed; its forks are read one by one");
            put_back(tasks, true, false);
            false
        }
    }
}

async fn read_batch(
    s: &Shared,
    sess: &mut WarmSession,
    tasks: &[Task],
    timeout: Duration,
    role: Option<String>,
) -> std::result::Result<Vec<u64>, Failed> {
    let quick = s.within_deadline(client_bound(s.spec.connect_timeout(), s.opts.margin));
    prepare(s, sess, quick, timeout, role).await?;
    if sess.batch.is_none() {
        sess.batch = bounded(&s.spec, &sess.client, quick, prewarm_batch_call(&sess.client)).await?;
    }
    let Some(call) = sess.batch.clone() else {
        return Ok(Vec::new());
    };
    let oids: Vec<u32> = tasks.iter().map(|t| s.plan.fork(&t.range).oid).collect();
    let forks: Vec<&str> = tasks.iter().map(|t| s.plan.fork(&t.range).fork.as_str()).collect();
    let firsts: Vec<i64> = tasks.iter().map(|t| t.range.first as i64).collect();
    let lasts: Vec<i64> = tasks.iter().map(|t| t.range.last as i64).collect();
    let mode = s.opts.mode.as_str();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [&oids, &mode, &forks, &firsts, &lasts];
    let call = sess.client.query(call.as_str(), &params);
    let limit = s.within_deadline(client_bound(timeout, s.opts.margin)).max(timeout);
    let rows = bounded_or_stopped(&s.spec, &sess.client, limit, s.opts.stop.as_deref(), call).await?;
    Ok(rows.iter().map(|r| r.get::<_, i64>(1) as u64).collect())
}

/// The session's statement_timeout and role as the next statement needs them.
async fn prepare(
    s: &Shared,
    sess: &mut WarmSession,
    quick: Duration,
    timeout: Duration,
    role: Option<String>,
) -> std::result::Result<(), Failed> {
    let timeout_ms = timeout.as_millis().max(1) as u64;
    if sess.statement_timeout_ms != timeout_ms {
        let ms = format!("{timeout_ms}ms");
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ms];
        let set = sess.client.query_one("SELECT pg_catalog.set_config('statement_timeout', $1, false)", &params);
        bounded(&s.spec, &sess.client, quick, set).await?;
        sess.statement_timeout_ms = timeout_ms;
    }
    if sess.role != role {
        match &role {
            Some(r) => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [r];
                let set = sess.client.query_one("SELECT pg_catalog.set_config('role', $1, false)", &params);
                bounded(&s.spec, &sess.client, quick, set).await?;
            }
            None => bounded(&s.spec, &sess.client, quick, sess.client.batch_execute("RESET ROLE")).await?,
        }
        sess.role = role;
    }
    Ok(())
}

/// After an unexpected error: find out whether the relation was dropped or shrank, and record or
/// retry accordingly.
async fn reexamine(id: usize, s: &Shared, session: &mut Option<WarmSession>, mut task: Task, err: &Failed) -> bool {
    let range = task.range;
    let fork = s.plan.fork(&range).clone();
    let sess = session.as_ref().unwrap();
    let fork_name = fork.fork.as_str();
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&fork.oid, &fork_name];
    let look = sess.client.query_opt(
        "SELECT coalesce(pg_catalog.pg_relation_size(c.oid, $2), 0) FROM pg_catalog.pg_class c WHERE c.oid = $1",
        &params,
    );
    let limit = s.within_deadline(client_bound(s.opts.statement_timeout, s.opts.margin));
    let looked = bounded(&s.spec, &sess.client, limit, look).await;
    match looked {
        Err(f) if f.disposition() == Disposition::SessionLost => {
            *session = None;
            task.reconnects += 1;
            if task.reconnects > MAX_RECONNECTS {
                s.skip(id, range, SkipReason::ConnectionLost, f.describe(), None);
            } else {
                s.requeue(id, task, true);
            }
        }
        Err(f) => s.skip(id, range, SkipReason::Error, format!("{}; then: {}", err.describe(), f.describe()), None),
        Ok(None) => s.skip(id, range, SkipReason::Dropped, "dropped during the run".into(), None),
        Ok(Some(row)) => {
            let now_blocks = (row.get::<_, i64>(0) as u64) / s.plan.server.block_size;
            if range.first >= now_blocks {
                s.skip(id, range, SkipReason::Truncated, format!("relation now has {now_blocks} blocks"), None);
            } else if range.last >= now_blocks && task.rechecks < MAX_RECHECKS {
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
                task.rechecks += 1;
                s.requeue(id, task, true);
            } else {
                s.skip(id, range, SkipReason::Error, err.describe(), None);
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warmed(fork: u32, first: u64, last: u64) -> RangeOutcome {
        RangeOutcome {
            range: BlockRange { fork, first, last },
            result: RangeResult::Warmed { blocks: last - first + 1, seconds: 1.0 },
        }
    }

    #[test]
    fn volume_work_counts_whole_fetch_units_so_small_forks_are_not_idle() {
        const KIB: u64 = 1024;
        // A one-block fork costs the volume a whole 512 KiB fetch: 64 times its bytes.
        assert_eq!(volume_work(8 * KIB), 512 * KIB);
        // A step of 1,024 blocks is 16 whole units: its work is its bytes.
        assert_eq!(volume_work(DEFAULT_STEP_BLOCKS * 8 * KIB), 8192 * KIB);
        assert_eq!(volume_work(8192 * KIB + 8 * KIB), 8704 * KIB);
        // 256 one-block forks read by 16 sessions in a window do the work of 16 steps of 8 MiB, which
        // ends a window at 32 sessions; in bytes they were 2 MiB, and the window ran for seconds.
        let forks: u64 = (0..256).map(|_| volume_work(8 * KIB)).sum();
        assert_eq!(forks, 16 * volume_work(DEFAULT_STEP_BLOCKS * 8 * KIB));
    }

    #[test]
    fn a_batch_lasts_about_its_target_whatever_the_volume() {
        // Unmeasured: a modest start, so that the first batch on a slow volume is short too.
        assert_eq!(batch_by_time(0), BATCH_START);
        // Cached or fast: the statement's round trip dominates, so the most to a statement.
        assert_eq!(batch_by_time(50), BATCH_MAX);
        // Cold at 50 ms a fetch: 4 forks, 200 ms; at 5 ms, 40.
        assert_eq!(batch_by_time(50_000), 4);
        assert_eq!(batch_by_time(5_000), 40);
        // Slower than the target: one to a statement, never none.
        assert_eq!(batch_by_time(2_000_000), 1);
        // The estimate follows the volume: from 64 forks at 50 ms to a cached run within a few batches.
        let mut e = next_fork_micros(0, 50_000);
        assert_eq!(e, 50_000);
        for _ in 0..12 {
            e = next_fork_micros(e, 50);
        }
        assert!(batch_by_time(e) >= 32, "{e}");
    }

    #[test]
    fn a_batch_takes_an_even_share_of_the_queue() {
        // 256 small forks, 16 sessions: 16 each, not 64 for 4 of them while 12 wait.
        assert_eq!(batch_share(256, 16), 16);
        assert_eq!(batch_share(257, 16), 17);
        // 100,000 relations: the cap still bounds a statement.
        assert_eq!(batch_share(100_000, 16), BATCH_MAX);
        // The tail, and one session: never less than the task taken, never more than the cap.
        assert_eq!(batch_share(3, 16), 1);
        assert_eq!(batch_share(1, 0), 1);
        assert_eq!(batch_share(1000, 1), BATCH_MAX);
    }

    #[test]
    fn steps_finished_in_any_order_join_into_one_outcome() {
        let skipped = RangeOutcome {
            range: BlockRange { fork: 1, first: 0, last: 9 },
            result: RangeResult::Skipped(Skip { reason: SkipReason::Dropped, detail: String::new(), fix: None }),
        };
        let joined = join_steps(vec![
            warmed(0, 2048, 3071),
            skipped.clone(),
            warmed(0, 0, 1023),
            warmed(2, 0, 7),
            warmed(0, 1024, 2047),
            warmed(0, 4000, 4001), // not touching: stays apart
        ]);
        assert_eq!(joined.len(), 4, "{joined:?}");
        assert_eq!(joined[0].range, BlockRange { fork: 0, first: 0, last: 3071 });
        assert_eq!(joined[0].result, RangeResult::Warmed { blocks: 3072, seconds: 3.0 });
        assert_eq!(joined[1].range, BlockRange { fork: 0, first: 4000, last: 4001 });
        assert_eq!(joined[2], skipped, "a skipped range is never joined");
        assert_eq!(joined[3], warmed(2, 0, 7));
    }
}
