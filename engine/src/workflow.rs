//! The serverless workflow's state, kept small: a plan is cut into self-contained work items (one
//! database, the forks they touch, their ranges) that a Lambda call warms until its deadline and returns
//! with exactly what is left. Items never hold a secret. Each state stays far below Step Functions'
//! 256 KiB: items are bounded in ranges and in serialized size, and a plan with more items than the
//! inline limit goes to S3 for a Distributed Map.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::connect::ConnectionSpec;
use crate::error::{Error, Result};
use crate::plan::{BlockRange, DatabaseEntry, DatabaseOutcome, ForkEntry, Plan};
use crate::warm::{self, Counters, Mode, RangeOutcome, RangeResult, WarmOptions};

/// Step Functions' limit on a state's input or output.
pub const STATE_LIMIT_BYTES: usize = 256 * 1024;
/// Largest serialized work item: a quarter of the state limit, leaving room for the rest of the state.
pub const ITEM_LIMIT_BYTES: usize = 64 * 1024;
/// Items carried inline (and run by an inline Map) when they fit, in count and in bytes; more go to
/// S3 for a Distributed Map. The inline items stay in the instance's branch state until it ends, beside
/// everything else it carries. The budget against Step Functions' 256 KiB (an estimate from the bounds
/// below, not a measurement):
/// - the items: at most INLINE_BYTES_LIMIT (128 KiB);
/// - their summaries once warmed: at most 40 x (ITEM_LISTED_SKIPS lines of at most 200 characters,
///   plus about 300 bytes): about 36 KiB;
/// - the plan summary (at most 50 planned skips, LISTED_SKIPS databases and LISTED_SKIPS hot-set uses
///   listed, whatever the number of databases): about 24 KiB;
/// - the maintenance summary (LISTED_SKIPS lines): about 8 KiB;
/// - the run, target, endpoint and storage progress: about 4 KiB.
///
/// That is about 196 KiB at worst, so 60 KiB are left to spare. A database's catalog alone is about 300
/// forks (measured: 594 forks in two databases), which is estimated at 80 KiB of items, so an ordinary
/// database still runs inline (the twin's sample and slowed-server scenarios do).
pub const INLINE_ITEMS_LIMIT: usize = 40;
pub const INLINE_BYTES_LIMIT: usize = 128 * 1024;
/// Skips listed by name in any summary carried in the workflow's state (the rest are counted).
pub const LISTED_SKIPS: usize = 20;
/// Skips listed by name in one item's summary.
pub const ITEM_LISTED_SKIPS: usize = 3;

/// Whether `items` may travel inline: at most INLINE_ITEMS_LIMIT of them, INLINE_BYTES_LIMIT in all.
pub fn fits_inline(items: &[WorkItem]) -> bool {
    items.len() <= INLINE_ITEMS_LIMIT
        && serde_json::to_vec(items).map(|b| b.len()).unwrap_or(usize::MAX) <= INLINE_BYTES_LIMIT
}

/// One work item: ranges of one database, with the forks they name (`range.fork` indexes `forks`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkItem {
    pub id: u32,
    pub database: String,
    /// The pg_prewarm mode, resolved for the server when planning.
    pub mode: Mode,
    pub block_size: u64,
    pub forks: Vec<ForkEntry>,
    /// Ranges still to read.
    pub pending: Vec<BlockRange>,
    /// Totals of what earlier calls did (per-range outcomes are summarized, not carried).
    pub done: ItemTotals,
    /// Forks with a non-vanished skip, with the first reason seen (reported once per fork).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skipped: BTreeMap<u32, String>,
    pub calls: u32,
    /// Main forks (indices into `forks`) that another session held ACCESS EXCLUSIVE throughout
    /// planning. The item's first call sizes them once more and reads them, or reports them skipped
    /// (`lock_timeout`); such items come last, so the lock has had the whole warm phase to go away.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locked: Vec<u32>,
    /// Range size for what `locked` adds.
    #[serde(default = "default_range_blocks")]
    pub range_blocks: u64,
    /// The most sessions one call reads this item with (its controller climbs towards it from
    /// [`crate::adaptive::START`]); Plan sets it from the instance's free connection slots
    /// ([`warm_sizing`]). An item without it, from a plan made before it existed, reads with one.
    #[serde(default = "one_session")]
    pub sessions: u32,
    /// Where the next call's controller starts: the level the last call ended at, or half its start
    /// when it read nothing (on a starved server, opening many sessions can take a whole call; each
    /// call without progress halves them, down to one). None: [`crate::adaptive::START`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_sessions: Option<u32>,
    /// Calls in a row that changed nothing: no block read, skipped or vanished, no range cut smaller.
    /// At [`MAX_CALLS_WITHOUT_PROGRESS`] the item's pending ranges are reported skipped (`no_progress`)
    /// instead of being handed to yet another call that would do the same, until the execution's
    /// history is full.
    #[serde(default, skip_serializing_if = "no_calls")]
    pub calls_without_progress: u32,
}

/// Calls in a row without progress after which an item gives up its pending ranges. A call can end
/// without reading anything for a passing reason (a session lost at the deadline); six in a row
/// (with the session ceiling halved after each, down to one) means each call's window is used up
/// before a range is read: by connecting, on a server too slow for the call's time.
pub const MAX_CALLS_WITHOUT_PROGRESS: u32 = 6;

fn no_calls(n: &u32) -> bool {
    *n == 0
}

fn one_session() -> u32 {
    1
}

/// The next call's start level from this call's levels (the first is where it started).
fn next_start(levels: &[crate::adaptive::Level], progress: bool, finished: bool) -> Option<u32> {
    let (first, last) = (levels.first()?.sessions as u32, levels.last()?.sessions as u32);
    match (progress, finished) {
        (_, true) => None,
        (true, false) => Some(last),
        (false, false) => Some((first / 2).max(1)),
    }
}

fn default_range_blocks() -> u64 {
    crate::plan::DEFAULT_RANGE_BLOCKS
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ItemTotals {
    pub warmed_blocks: u64,
    pub vanished_blocks: u64,
    pub skipped_blocks: u64,
    /// Seconds the item's successful calls spent, from the request to the answer: what Lambda
    /// bills for them (a failed call's time is not carried).
    #[serde(default)]
    pub call_seconds: f64,
    /// Blocks this item added to the instance's total: relations locked while planning, which the
    /// plan's total leaves out, sized by this item (every fork), or their estimate if still locked.
    #[serde(default)]
    pub added_blocks: u64,
}

/// Cuts a plan into work items of at most `max_blocks` blocks, `max_ranges` ranges and
/// [`ITEM_LIMIT_BYTES`] serialized (one database per item), keeping the plan's reading order.
pub fn work_items(plan: &Plan, max_blocks: u64, max_ranges: usize) -> Result<Vec<WorkItem>> {
    let mut items: Vec<WorkItem> = Vec::new();
    let mut sizes: Vec<usize> = Vec::new();
    let mut open: BTreeMap<String, usize> = BTreeMap::new();
    for r in &plan.ranges {
        let fork = plan.fork(r);
        let db = &fork.database;
        let fork_cost = json_len(fork);
        let range_cost = json_len(r) + 8;
        let fits = |i: usize, items: &Vec<WorkItem>, sizes: &Vec<usize>| {
            let known = items[i].forks.iter().any(|f| f.oid == fork.oid && f.fork == fork.fork);
            items[i].pending.len() < max_ranges
                && blocks(&items[i]) + r.blocks() <= max_blocks.max(r.blocks())
                && sizes[i] + range_cost + if known { 0 } else { fork_cost } <= ITEM_LIMIT_BYTES
        };
        let idx = match open.get(db) {
            Some(&i) if fits(i, &items, &sizes) => i,
            _ => {
                let item = WorkItem::empty(items.len() as u32, db, plan);
                sizes.push(json_len(&item) + 64);
                items.push(item);
                open.insert(db.clone(), items.len() - 1);
                items.len() - 1
            }
        };
        let item = &mut items[idx];
        let local = match item.forks.iter().position(|f| f.oid == fork.oid && f.fork == fork.fork) {
            Some(i) => i,
            None => {
                item.forks.push(fork.clone());
                sizes[idx] += fork_cost;
                item.forks.len() - 1
            }
        } as u32;
        item.pending.push(BlockRange { fork: local, ..*r });
        sizes[idx] += range_cost;
    }
    for item in &items {
        let size = serde_json::to_vec(item).expect("serializes").len();
        if size > ITEM_LIMIT_BYTES {
            return Err(Error::InvalidInput(format!(
                "work item {} serializes to {size} bytes (limit {ITEM_LIMIT_BYTES}): a single relation entry is too large",
                item.id
            )));
        }
    }
    Ok(items)
}

/// Serialized length of a value plus a separator: what it adds to an item's JSON.
fn json_len<T: Serialize>(v: &T) -> usize {
    serde_json::to_vec(v).map(|b| b.len()).unwrap_or(0) + 1
}

fn blocks(item: &WorkItem) -> u64 {
    item.pending.iter().map(BlockRange::blocks).sum()
}

impl WorkItem {
    /// An item of `plan`'s database `database` with nothing in it yet.
    fn empty(id: u32, database: &str, plan: &Plan) -> WorkItem {
        WorkItem {
            id,
            database: database.into(),
            mode: Mode::auto(&plan.server),
            block_size: plan.server.block_size,
            forks: Vec::new(),
            pending: Vec::new(),
            done: ItemTotals::default(),
            skipped: BTreeMap::new(),
            calls: 0,
            locked: Vec::new(),
            range_blocks: plan.range_blocks,
            sessions: 1,
            start_sessions: None,
            calls_without_progress: 0,
        }
    }

    /// Warms this item's pending ranges until done or until `deadline` (minus `opts.margin`); records
    /// the totals and keeps exactly the ranges not yet read. Returns the session levels the call's
    /// controller chose (empty without `opts.adaptive`).
    pub async fn advance(&mut self, spec: &ConnectionSpec, opts: &WarmOptions) -> Result<Vec<crate::adaptive::Level>> {
        // An item comes from state that someone may have edited: it is data, and must be consistent.
        crate::plan::check_state(self.block_size, &self.pending, self.forks.len())?;
        if self.locked.iter().any(|&i| i as usize >= self.forks.len()) {
            return Err(Error::InvalidInput(format!("work item {}: a locked fork index is out of range", self.id)));
        }
        self.calls += 1;
        if !self.locked.is_empty() {
            self.size_locked_again(spec).await;
        }
        if self.pending.is_empty() {
            return Ok(Vec::new());
        }
        // A call that starts inside its margin can never read anything: looping on it would never end.
        if let Some(d) = opts.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left <= opts.margin {
                return Err(Error::InvalidInput(format!(
                    "this call has {:.1} s left, not more than its margin of {} s: the function's timeout must exceed PGHYDRATE_MARGIN_SECONDS",
                    left.as_secs_f64(),
                    opts.margin.as_secs()
                )));
            }
        }
        let plan = Arc::new(self.as_plan());
        let ranges = std::mem::take(&mut self.pending);
        let mut pending_before = ranges.clone();
        let window = opts.time_before_margin();
        let opts = WarmOptions {
            mode: self.mode,
            start_sessions: self.start_sessions.or(opts.start_sessions),
            ..opts.clone()
        };
        let warmed = warm::warm(spec, plan, ranges, &opts, Arc::new(Counters::default())).await?;
        let before = self.done.clone();
        self.absorb(&warmed.outcomes);
        self.pending = warmed.pending;
        if opts.adaptive {
            self.start_sessions = next_start(&warmed.levels, self.done != before, self.pending.is_empty());
        }
        let mut pending_after = self.pending.clone();
        pending_before.sort_unstable_by_key(|r| (r.fork, r.first, r.last));
        pending_after.sort_unstable_by_key(|r| (r.fork, r.first, r.last));
        if self.done != before || pending_before != pending_after {
            self.calls_without_progress = 0;
        } else if warmed.unreachable.is_empty() {
            self.calls_without_progress += 1;
            if self.calls_without_progress >= MAX_CALLS_WITHOUT_PROGRESS {
                self.give_up_pending(window);
            }
        }
        // The item's database could not be reached for the whole reconnect window: the call fails as
        // ConnectionFailed, which the state machine retries with backoff (a failover or a reboot). The
        // ranges this call did read are read again by the retry, from the item as it came in: cheap,
        // they are hydrated now, and counted once (only the successful call's result counts).
        if let Some((database, reason)) = warmed.unreachable.into_iter().next() {
            return Err(Error::Connect {
                target: format!("database {database:?}"),
                reason: format!("unreachable for the whole reconnect window, its ranges left for the retry: {reason}"),
                source: None,
            });
        }
        Ok(warmed.levels)
    }

    /// One more try at the relations locked while planning: each that can be sized now gets its forks
    /// and ranges added to `pending`; each still locked (or whose database cannot be reached) is
    /// skipped with the planner's reason. Either way the item's total grows by what it accounts for.
    async fn size_locked_again(&mut self, spec: &ConnectionSpec) {
        let mut plan = self.as_plan();
        plan.range_blocks = self.range_blocks.max(1);
        let before = plan.forks.len();
        let added = crate::catalog::plan_locked_again(spec, &mut plan).await;
        for &i in &self.locked {
            let f = &plan.forks[i as usize];
            self.done.added_blocks += f.blocks;
            if let Some(skip) = &f.planned_skip {
                self.done.skipped_blocks += f.blocks;
                self.skipped.entry(i).or_insert_with(|| format!("{:?}: {}", skip.reason, skip.detail));
            }
        }
        self.done.added_blocks += plan.forks[before..].iter().map(|f| f.blocks).sum::<u64>();
        self.forks = plan.forks;
        self.pending.extend(added);
        self.locked.clear();
    }

    /// After [`MAX_CALLS_WITHOUT_PROGRESS`] calls that changed nothing: the pending ranges are reported
    /// skipped, with why, so that the run ends and its report names them (each further call would
    /// have done the same until the execution's history limit).
    fn give_up_pending(&mut self, window: Option<Duration>) {
        let window = match window {
            Some(w) => format!("{:.1} s", w.as_secs_f64()),
            None => "no deadline".into(),
        };
        let detail = format!(
            "no block read in {} calls in a row (each call's time before its margin: {window}): opening a \
             session and the first statement took all of it; the server answers too slowly for the Warm \
             function's timeout",
            self.calls_without_progress
        );
        tracing::warn!(item = self.id, database = %self.database, calls = self.calls_without_progress, window = %window,
              "no progress call after call: the item's pending ranges are reported skipped");
        let outcomes: Vec<RangeOutcome> = std::mem::take(&mut self.pending)
            .into_iter()
            .map(|range| RangeOutcome {
                range,
                result: RangeResult::Skipped(crate::plan::Skip {
                    reason: crate::plan::SkipReason::NoProgress,
                    detail: detail.clone(),
                    fix: Some(
                        "raise the Warm function's timeout (or lower PGHYDRATE_MARGIN_SECONDS), then run again: \
                         the continuation reads only what is left"
                            .into(),
                    ),
                }),
            })
            .collect();
        self.absorb(&outcomes);
    }

    fn absorb(&mut self, outcomes: &[RangeOutcome]) {
        for o in outcomes {
            match &o.result {
                RangeResult::Warmed { .. } => self.done.warmed_blocks += o.range.blocks(),
                RangeResult::Skipped(s) if s.reason.vanished() => self.done.vanished_blocks += o.range.blocks(),
                RangeResult::Skipped(s) => {
                    self.done.skipped_blocks += o.range.blocks();
                    self.skipped.entry(o.range.fork).or_insert_with(|| format!("{:?}: {}", s.reason, s.detail));
                }
            }
        }
    }

    fn as_plan(&self) -> Plan {
        Plan {
            format: crate::plan::PLAN_FORMAT,
            created_at: String::new(),
            server: crate::plan::ServerInfo {
                version_num: 0,
                version: String::new(),
                block_size: self.block_size,
                login_role: String::new(),
                is_superuser: false,
                max_connections: 0,
                reserved_connections: 0,
                connections_in_use: 0,
                io_method: None,
                in_recovery: false,
            },
            range_blocks: 0,
            databases: vec![DatabaseEntry {
                name: self.database.clone(),
                outcome: DatabaseOutcome::Planned,
                reason: None,
                prewarm_schema: None,
                counts_against_coverage: true,
            }],
            forks: self.forks.clone(),
            ranges: self.pending.clone(),
            plan_seconds: 0.0,
            hot_set: None,
        }
    }

    pub fn done(&self) -> bool {
        self.pending.is_empty() && self.locked.is_empty()
    }
}

/// A DB instance as DescribeDBInstances shows it (only what the workflow uses).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct InstanceView {
    pub id: String,
    pub arn: Option<String>,
    pub status: String,
    pub engine: String,
    pub address: Option<String>,
    pub port: Option<u16>,
    /// StorageOperationStatus: present only while an operation (Initializing, Optimizing) runs.
    pub storage_status: Option<String>,
    pub storage_progress: Option<i32>,
    pub master_secret_arn: Option<String>,
    pub master_username: Option<String>,
    pub tags: BTreeMap<String, String>,
}

/// Instance states in which waiting is pointless: the instance is gone or going, or RDS says it cannot
/// finish creating or restoring it (restore-error, an encryption key it can no longer use). A stopped
/// instance is not hydrated either: it will not become available unless someone starts it.
pub const TERMINAL_STATES: &[&str] = &[
    "deleted",
    "deleting",
    "failed",
    "incompatible-restore",
    "incompatible-parameters",
    "incompatible-network",
    "incompatible-option-group",
    "incompatible-create",
    "restore-error",
    "inaccessible-encryption-credentials",
    "stopped",
    "stopping",
];

/// Instance states in which sessions work: `available`, and `storage-optimization`, which RDS
/// documents as fully operational (a restore that changes storage goes there, for hours or days).
pub const USABLE_STATES: &[&str] = &["available", "storage-optimization"];

/// Whether the instance accepts sessions: "available", "failed" (with why), or "waiting".
pub fn ready_state(v: &InstanceView) -> (&'static str, String) {
    if USABLE_STATES.contains(&v.status.as_str()) {
        ("available", format!("{} is {}", v.id, v.status))
    } else if TERMINAL_STATES.contains(&v.status.as_str()) {
        ("failed", format!("{} is {}: it will not become available", v.id, v.status))
    } else {
        ("waiting", format!("{} is {}", v.id, v.status))
    }
}

/// Storage initialization (the lazy loading from S3): "initializing" (with the percentage) while
/// StorageOperationStatus says `Initializing`; "initialized" otherwise, with what was seen: another
/// operation (`Optimizing` is not initialization: the blocks are already local), or no status at all,
/// which RDS does not report for every trigger, so the progress is then unknown, not 100.
/// "failed" if the instance went away.
pub fn storage_state(v: &InstanceView) -> (&'static str, String, Option<i32>) {
    if TERMINAL_STATES.contains(&v.status.as_str()) {
        return ("failed", format!("{} is {}", v.id, v.status), None);
    }
    match v.storage_status.as_deref() {
        None => {
            ("initialized", format!("{}: no storage operation reported (StorageOperationStatus absent)", v.id), None)
        }
        Some(op) if op.eq_ignore_ascii_case("initializing") => (
            "initializing",
            format!("{}: {op} {}%", v.id, v.storage_progress.map(|p| p.to_string()).unwrap_or_else(|| "?".into())),
            v.storage_progress,
        ),
        Some(op) => {
            ("initialized", format!("{}: storage operation {op} in progress, which is not initialization", v.id), None)
        }
    }
}

/// Username and password from a secret's JSON text. The error never quotes the secret.
pub fn credentials_from_secret(text: &str) -> std::result::Result<(String, String), String> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|_| "the secret value is not JSON".to_string())?;
    let field = |name: &str| -> std::result::Result<String, String> {
        match v.get(name) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(_) => Err(format!("the secret's {name:?} is not a non-empty string")),
            None => Err(format!("the secret has no {name:?} field")),
        }
    };
    Ok((field("username")?, field("password")?))
}

/// Workflow defaults, read once from the Resolve Lambda's environment (the SAM template sets them);
/// tests shorten the intervals through the same variables.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Defaults {
    pub sessions: u32,
    pub call_sessions: u32,
    pub mode: crate::warm::ModeChoice,
    pub maintenance: crate::maintain::Maintenance,
    pub range_blocks: u64,
    pub item_blocks: u64,
    pub item_ranges: usize,
    /// Glob over DB instance identifiers that qualify ("*": every PostgreSQL instance).
    pub instance_pattern: String,
    /// `key=value`: only instances with this tag qualify (empty: no tag needed).
    pub required_tag: Option<(String, String)>,
    pub credentials: crate::events::Credentials,
    pub ready_poll_seconds: u32,
    pub storage_poll_seconds: u32,
    pub ready_limit_minutes: u32,
    pub storage_limit_minutes: u32,
}

impl Defaults {
    /// Reads PGHYDRATE_* variables; every one has a default; a bad value names its variable.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn num<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, name: &str, default: T) -> Result<T> {
            match get(name) {
                None => Ok(default),
                Some(v) if v.trim().is_empty() => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| Error::InvalidInput(format!("{name}={v:?} is not a number"))),
            }
        }
        let get: &dyn Fn(&str) -> Option<String> = &get;
        let text = |name: &str, default: &str| {
            get(name).filter(|v| !v.trim().is_empty()).unwrap_or_else(|| default.to_string())
        };
        let required_tag = match get("PGHYDRATE_REQUIRED_TAG").filter(|v| !v.trim().is_empty()) {
            None => None,
            Some(t) => match t.split_once('=') {
                Some((k, v)) if !k.is_empty() => Some((k.to_string(), v.to_string())),
                _ => return Err(Error::InvalidInput(format!("PGHYDRATE_REQUIRED_TAG={t:?} is not key=value"))),
            },
        };
        let credentials = crate::events::Credentials::deployment_default(get("PGHYDRATE_SECRET_ARN"));
        let d = Defaults {
            sessions: num(get, "PGHYDRATE_SESSIONS", 64)?,
            call_sessions: num(get, "PGHYDRATE_CALL_SESSIONS", 64)?,
            mode: text("PGHYDRATE_MODE", "auto")
                .parse()
                .map_err(|e| Error::InvalidInput(format!("PGHYDRATE_MODE: {e}")))?,
            maintenance: text("PGHYDRATE_MAINTENANCE", "analyze")
                .parse()
                .map_err(|e| Error::InvalidInput(format!("PGHYDRATE_MAINTENANCE: {e}")))?,
            range_blocks: num(get, "PGHYDRATE_RANGE_BLOCKS", crate::plan::DEFAULT_RANGE_BLOCKS)?,
            item_blocks: num(get, "PGHYDRATE_ITEM_BLOCKS", 1_048_576)?,
            item_ranges: num(get, "PGHYDRATE_ITEM_RANGES", 256)?,
            instance_pattern: text("PGHYDRATE_INSTANCE_PATTERN", "*"),
            required_tag,
            credentials,
            ready_poll_seconds: num(get, "PGHYDRATE_READY_POLL_SECONDS", 60)?,
            storage_poll_seconds: num(get, "PGHYDRATE_STORAGE_POLL_SECONDS", 300)?,
            ready_limit_minutes: num(get, "PGHYDRATE_READY_LIMIT_MINUTES", 240)?,
            storage_limit_minutes: num(get, "PGHYDRATE_STORAGE_LIMIT_MINUTES", 2880)?,
        };
        // The same check as a manual start's sessions (mode and maintenance were parsed above).
        crate::events::parse_input(&serde_json::json!({"instance": "defaults", "sessions": d.sessions}), None, None)
            .map_err(|e| Error::InvalidInput(format!("PGHYDRATE_* defaults: {e}")))?;
        if d.range_blocks == 0
            || d.item_blocks == 0
            || d.item_ranges == 0
            || d.call_sessions == 0
            || d.ready_poll_seconds == 0
            || d.storage_poll_seconds == 0
        {
            return Err(Error::InvalidInput("PGHYDRATE_* sizes and intervals must be positive".into()));
        }
        Ok(d)
    }
}

/// The `run` object every state carries: what to do, fixed at the start. No secret.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunConfig {
    pub execution: String,
    pub trigger: crate::events::Trigger,
    /// The most sessions for the instance, over all its calls at once.
    pub sessions: u32,
    /// The most sessions per Warm call. A run started before this existed reads one per call, as
    /// its state machine expects.
    #[serde(default = "one_session")]
    pub call_sessions: u32,
    pub mode: crate::warm::ModeChoice,
    pub maintenance: crate::maintain::Maintenance,
    pub range_blocks: u64,
    pub item_blocks: u64,
    pub item_ranges: usize,
    pub include_databases: Vec<String>,
    pub exclude_databases: Vec<String>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub first: Vec<String>,
    pub credentials: crate::events::Credentials,
    pub ready_poll_seconds: u32,
    pub storage_poll_seconds: u32,
    pub ready_limit_minutes: u32,
    pub storage_limit_minutes: u32,
}

impl RunConfig {
    /// The trigger's overrides over the defaults.
    pub fn new(execution: &str, trigger: crate::events::Trigger, d: &Defaults) -> Self {
        let o = trigger.overrides.clone();
        RunConfig {
            execution: execution.to_string(),
            sessions: o.sessions.unwrap_or(d.sessions),
            call_sessions: d.call_sessions,
            mode: o.mode.unwrap_or(d.mode),
            maintenance: o.maintenance.unwrap_or(d.maintenance),
            range_blocks: d.range_blocks,
            item_blocks: d.item_blocks,
            item_ranges: d.item_ranges,
            include_databases: o.include_databases,
            exclude_databases: o.exclude_databases,
            include: o.include,
            exclude: o.exclude,
            first: o.first,
            credentials: o.credentials.unwrap_or_else(|| d.credentials.clone()),
            ready_poll_seconds: d.ready_poll_seconds,
            storage_poll_seconds: d.storage_poll_seconds,
            ready_limit_minutes: d.ready_limit_minutes,
            storage_limit_minutes: d.storage_limit_minutes,
            trigger,
        }
    }

    pub fn plan_options(&self, lock_attempts: u32) -> Result<crate::catalog::PlanOptions> {
        let pats =
            |v: &Vec<String>| v.iter().map(|p| crate::pattern::RelationPattern::parse(p)).collect::<Result<Vec<_>>>();
        Ok(crate::catalog::PlanOptions {
            include_databases: self.include_databases.clone(),
            exclude_databases: self.exclude_databases.clone(),
            include: pats(&self.include)?,
            exclude: pats(&self.exclude)?,
            first: pats(&self.first)?,
            range_blocks: self.range_blocks,
            create_extension: true,
            dry_run: false,
            lock_attempts,
            ignore_hot_set: false,
            databases_at_once: crate::catalog::DATABASES_AT_ONCE,
        })
    }
}

/// One instance to hydrate, as Resolve found it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Target {
    pub instance: String,
    /// False for a Multi-AZ conversion (or poll_only): storage progress is only watched.
    pub reads_blocks: bool,
    pub sessions: u32,
}

/// Whether an instance qualifies under the configured filter; Err holds why not (the run then ends
/// cleanly with that reason).
pub fn qualifies(v: &InstanceView, d: &Defaults) -> std::result::Result<(), String> {
    if v.engine != "postgres" {
        return Err(format!("{} runs {:?}, not PostgreSQL", v.id, v.engine));
    }
    if !crate::pattern::glob(&d.instance_pattern, &v.id) {
        return Err(format!("{} does not match PGHYDRATE_INSTANCE_PATTERN {:?}", v.id, d.instance_pattern));
    }
    if let Some((k, val)) = &d.required_tag {
        if v.tags.get(k) != Some(val) {
            return Err(format!("{} lacks the tag {k}={val}", v.id));
        }
    }
    Ok(())
}

/// Whether the event that started the run means new storage on this instance; Err holds why not (the
/// run then ends cleanly with that reason). RDS sends RDS-EVENT-0046 when a read replica is first
/// created, and also "as a monitoring message confirming that replication is functioning properly"
/// (after RDS-EVENT-0045, a reboot of the source, a replication hiccup): so a 0046 hydrates only a
/// replica whose storage RDS reports initializing. A new replica also sends RDS-EVENT-0005, which
/// hydrates it whatever its storage reports.
pub fn trigger_applies(kind: crate::events::TriggerKind, v: &InstanceView) -> std::result::Result<(), String> {
    if kind == crate::events::TriggerKind::ReplicaReady && storage_state(v).0 != "initializing" {
        return Err(format!(
            "{}: RDS-EVENT-0046 on a replica whose storage is not initializing ({}); RDS also sends it when \
             replication resumes: nothing to read",
            v.id,
            storage_state(v).1
        ));
    }
    Ok(())
}

/// A running execution of the workflow, as far as duplicate detection needs it.
/// Where and as whom to connect, resolved by the describe call that saw the instance available.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Endpoint {
    pub address: String,
    pub port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_secret_arn: Option<String>,
}

/// A connection spec for `endpoint` with `user`/`password`, TLS `tls` against `ca_file`, and the
/// session timeouts. The password lives only in the returned value.
pub fn endpoint_spec(
    endpoint: &Endpoint,
    user: &str,
    password: &str,
    tls: crate::connect::TlsMode,
    ca_file: Option<std::path::PathBuf>,
) -> Result<ConnectionSpec> {
    let env = |k: &str| -> Option<String> {
        match k {
            "PGHOST" => Some(endpoint.address.clone()),
            "PGPORT" => Some(endpoint.port.to_string()),
            "PGUSER" => Some(user.to_string()),
            "PGPASSWORD" => Some(password.to_string()),
            "PGDATABASE" => Some("postgres".into()),
            _ => None,
        }
    };
    Ok(ConnectionSpec::parse(None, env)?.with_tls(tls, ca_file))
}

fn locked_while_planning(f: &ForkEntry) -> bool {
    !f.excluded
        && f.fork == crate::plan::Fork::Main
        && f.planned_skip.as_ref().is_some_and(|s| s.reason == crate::plan::SkipReason::LockTimeout)
}

/// Work items for the relations held ACCESS EXCLUSIVE throughout planning, at most
/// [`LOCKED_PER_ITEM`] each, one database per item; numbered from `first_id`.
fn locked_items(plan: &Plan, first_id: u32) -> Vec<WorkItem> {
    let mut items: Vec<WorkItem> = Vec::new();
    for f in plan.forks.iter().filter(|f| locked_while_planning(f)) {
        let open = items.last_mut().filter(|i| i.database == f.database && i.forks.len() < LOCKED_PER_ITEM);
        let item = match open {
            Some(i) => i,
            None => {
                items.push(WorkItem::empty(first_id + items.len() as u32, &f.database, plan));
                items.last_mut().expect("just pushed")
            }
        };
        item.locked.push(item.forks.len() as u32);
        item.forks.push(f.clone());
    }
    items
}

/// Locked relations per item: each entry is well under 1 KiB, so an item stays far below
/// [`ITEM_LIMIT_BYTES`] even once its relations have been sized and cut into ranges.
const LOCKED_PER_ITEM: usize = 16;

/// What the Plan state reports (the plan itself is cut into items).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PlanSummary {
    pub server_version: String,
    pub mode: String,
    /// At most [`LISTED_SKIPS`] databases: those skipped first (they count against coverage when their
    /// reason says so), then planned ones, then excluded ones. One per database would outgrow the 256
    /// KiB state on a server with a few thousand tenant databases; the counts below cover them all.
    pub databases: Vec<crate::report::DatabaseReport>,
    #[serde(default)]
    pub database_counts: DatabaseCounts,
    pub forks: usize,
    pub total_bytes: u64,
    pub planned_bytes: u64,
    /// Forks skipped at planning time (permission, no extension, locked), at most 50 listed.
    pub planned_skips: Vec<String>,
    pub planned_skip_count: usize,
    pub planned_skip_bytes: u64,
    /// Relations held ACCESS EXCLUSIVE throughout planning: left out of the totals above, tried once
    /// more by the last items (which add what they find to the instance's total).
    #[serde(default)]
    pub locked_while_planning: usize,
    pub items: usize,
    /// Warm calls that run at once for this instance (the warm Map's MaxConcurrency).
    #[serde(default = "one_call")]
    pub calls: u32,
    /// The most sessions each call reads with.
    #[serde(default = "one_session")]
    pub sessions_per_call: u32,
    /// Why fewer sessions than asked for (the server's free connection slots), if so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions_note: Option<String>,
    /// The captured hot sets the plan reads first (its first items): at most [`LISTED_SKIPS`]
    /// databases listed, those where part of the capture was left out or ignored first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hot_set: Vec<crate::hotset::HotSetUse>,
    /// Databases with a captured hot set, listed or not.
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub hot_set_databases: usize,
    /// Bytes of the hot phase.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hot_bytes: u64,
    /// What the Plan call read of the hot sets while it planned (not in any item).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_start: Option<HeadStartSummary>,
}

/// What a head start read in the Plan call ([`plan_items`]): its bytes count as warmed for the
/// instance, and no item reads them again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HeadStartSummary {
    pub warmed_bytes: u64,
    pub seconds: f64,
    /// Bytes of the hot phase it did not reach: the first items read them.
    pub hot_bytes_left: u64,
}

/// How many databases a plan planned, skipped (could not plan) and excluded (patterns, defaults).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DatabaseCounts {
    pub planned: usize,
    pub skipped: usize,
    pub excluded: usize,
    /// Skipped databases whose blocks should have been read (no CONNECT privilege, cannot connect,
    /// no pg_prewarm...): the instance is not hydrated to 100% while there is one. Templates and
    /// databases that allow no connections are skipped without counting here.
    #[serde(default)]
    pub missed: usize,
}

/// The databases a plan summary lists and their counts: at most [`LISTED_SKIPS`], skipped first (those
/// that count against coverage, what a user must act on, before templates), then planned, then
/// excluded, each in the plan's (name) order.
pub fn listed_databases(databases: &[DatabaseEntry]) -> (Vec<crate::report::DatabaseReport>, DatabaseCounts) {
    let rank = |d: &DatabaseEntry| match d.outcome {
        DatabaseOutcome::Skipped if d.counts_against_coverage => 0,
        DatabaseOutcome::Skipped => 1,
        DatabaseOutcome::Planned => 2,
        DatabaseOutcome::Excluded => 3,
    };
    let mut listed: Vec<&DatabaseEntry> = databases.iter().collect();
    listed.sort_by_key(|d| rank(d));
    let count = |o: DatabaseOutcome| databases.iter().filter(|d| d.outcome == o).count();
    let counts = DatabaseCounts {
        planned: count(DatabaseOutcome::Planned),
        skipped: count(DatabaseOutcome::Skipped),
        excluded: count(DatabaseOutcome::Excluded),
        missed: databases.iter().filter(|d| d.outcome == DatabaseOutcome::Skipped && d.counts_against_coverage).count(),
    };
    let listed = listed
        .into_iter()
        .take(LISTED_SKIPS)
        .map(|d| crate::report::DatabaseReport { name: d.name.clone(), outcome: d.outcome, reason: d.reason.clone() })
        .collect();
    (listed, counts)
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_usize(n: &usize) -> bool {
    *n == 0
}

/// The hot-set uses a plan summary lists: one per database would outgrow the workflow's 256 KiB state
/// on an instance with thousands of databases, so at most [`LISTED_SKIPS`], the ones that say
/// something went wrong (ignored, or ranges left out) first; the summary counts the rest.
pub fn listed_hot_sets(uses: &[crate::hotset::HotSetUse]) -> Vec<crate::hotset::HotSetUse> {
    let mut listed: Vec<&crate::hotset::HotSetUse> = uses.iter().collect();
    listed.sort_by_key(|u| {
        let left_out = u.dropped + u.rewritten + u.truncated + u.not_planned;
        (u.ignored.is_none(), left_out == 0)
    });
    listed.into_iter().take(LISTED_SKIPS).cloned().collect()
}

fn one_call() -> u32 {
    1
}

/// How an instance's warm phase is spread over Lambda calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmSizing {
    /// Calls at once (the Map's MaxConcurrency), at most [`INLINE_ITEMS_LIMIT`].
    pub calls: u32,
    /// The most sessions per call.
    pub sessions_per_call: u32,
}

/// Spreads at most `sessions` sessions (capped at half the server's free connection slots, as the
/// CLI does) over calls of at most `call_sessions` each, as few calls as that allows and the
/// sessions shared evenly (rounded down: never more than asked for): 64 sessions at 32 per call are 2 calls of 32; a server with 41 free
/// slots gets 20 sessions in one call. A Lambda call waits on the database, not on its CPU, so each
/// session in a call instead of a call per session divides the billed duration by the sessions per
/// call. Returns the warning when the server's slots capped the count.
pub fn warm_sizing(
    sessions: u32,
    call_sessions: u32,
    server: &crate::plan::ServerInfo,
) -> (WarmSizing, Option<String>) {
    let (total, note) = crate::run::effective_sessions(sessions.max(1), server);
    let per_call = call_sessions.clamp(1, total);
    let calls = total.div_ceil(per_call).min(INLINE_ITEMS_LIMIT as u32);
    (WarmSizing { calls, sessions_per_call: (total / calls).min(per_call) }, note)
}

/// The least time before its margin a Plan call needs to give a captured hot set a head start (AWS: the
/// function's 900 s timeout less a 60 s margin; the twin: 25 s less 10, on; its slowed server: 12 s less 5, off).
pub const HEAD_START_MIN_TIME: Duration = Duration::from_secs(10);

/// Plans for the workflow: the items and their summary. With `head_start` (the Plan call's warm
/// options: its deadline, margin and timeouts), the captured hot sets are read while the rest is
/// planned ([`crate::run::plan_with_head_start`], with at most one call's sessions, and no more than
/// half the instance's); what the head start read is left out of the items and counted in the
/// summary's `head_start`. Not when the options leave less than [`HEAD_START_MIN_TIME`] before the
/// margin: the head start's lookups (a session per database) run beside planning's, and a short call's
/// time is planning's.
pub async fn plan_items(
    spec: &ConnectionSpec,
    run: &RunConfig,
    head_start: Option<&WarmOptions>,
) -> Result<(PlanSummary, Vec<WorkItem>)> {
    let plan_opts = run.plan_options(3)?;
    let head_start = head_start.filter(|o| {
        let usable = o.time_before_margin();
        let enough = usable.is_none_or(|u| u >= HEAD_START_MIN_TIME);
        if !enough {
            tracing::info!(
                usable_seconds = usable.unwrap_or_default().as_secs_f64(),
                "no head start: this call's time is planning's"
            );
        }
        enough
    });
    let (mut plan, head) = match head_start {
        Some(opts) => {
            crate::run::plan_with_head_start(spec, &plan_opts, opts, |server| {
                let (sizing, _) = warm_sizing(run.sessions, run.call_sessions, server);
                let sessions = sizing.sessions_per_call.min((sizing.sessions_per_call * sizing.calls / 2).max(1));
                (run.mode.resolve(server), sessions, sessions > 1)
            })
            .await?
        }
        None => (crate::catalog::make_plan(spec, &plan_opts).await?, None),
    };
    let bs = plan.server.block_size;
    let planned_bytes = plan.planned_blocks() * bs;
    let head_start = head.map(|h| {
        let pending = std::mem::take(&mut plan.ranges);
        let (left, outcomes) = h.cut(&plan, pending);
        plan.ranges = left;
        let hot = plan.hot_set.as_ref().map(|s| crate::hotset::HotBlocks::new(&s.ranges)).unwrap_or_default();
        HeadStartSummary {
            warmed_bytes: outcomes.iter().map(|o| o.range.blocks()).sum::<u64>() * bs,
            seconds: (h.seconds * 1000.0).round() / 1000.0,
            hot_bytes_left: plan.ranges.iter().map(|r| hot.within(r)).sum::<u64>() * bs,
        }
    });
    let mut items = work_items(&plan, run.item_blocks, run.item_ranges)?;
    items.extend(locked_items(&plan, items.len() as u32));
    // Relations locked while planning are accounted for by their items (sized when they are tried again).
    let live: Vec<&ForkEntry> = plan.forks.iter().filter(|f| !f.excluded && !locked_while_planning(f)).collect();
    let skipped: Vec<&&ForkEntry> = live.iter().filter(|f| f.planned_skip.is_some()).collect();
    let mode = run.mode.resolve(&plan.server);
    let (sizing, sessions_note) = warm_sizing(run.sessions, run.call_sessions, &plan.server);
    for item in &mut items {
        item.mode = mode;
        item.sessions = sizing.sessions_per_call;
    }
    let (databases, database_counts) = listed_databases(&plan.databases);
    let summary = PlanSummary {
        server_version: plan.server.version.split(" on ").next().unwrap_or("").to_string(),
        mode: mode.as_str().into(),
        databases,
        database_counts,
        forks: live.len(),
        total_bytes: live.iter().map(|f| f.blocks * bs).sum(),
        planned_bytes,
        planned_skips: skipped
            .iter()
            .take(50)
            .map(|f| {
                let sk = f.planned_skip.as_ref().unwrap();
                format!("{}: {}.{} ({}): {}", f.database, f.schema, f.name, f.fork.as_str(), sk.detail)
            })
            .collect(),
        planned_skip_count: skipped.len(),
        planned_skip_bytes: skipped.iter().map(|f| f.blocks * bs).sum(),
        locked_while_planning: plan.forks.iter().filter(|f| locked_while_planning(f)).count(),
        items: items.len(),
        calls: sizing.calls,
        sessions_per_call: sizing.sessions_per_call,
        sessions_note,
        hot_set: plan.hot_set.as_ref().map(|h| listed_hot_sets(&h.databases)).unwrap_or_default(),
        hot_set_databases: plan.hot_set.as_ref().map_or(0, |h| h.databases.len()),
        hot_bytes: plan.hot_set.as_ref().map_or(0, |h| h.blocks() * bs),
        head_start,
    };
    Ok((summary, items))
}

/// What one warm call reports about its item.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ItemSummary {
    pub id: u32,
    pub database: String,
    pub warmed_bytes: u64,
    pub vanished_bytes: u64,
    pub skipped_bytes: u64,
    pub pending_bytes: u64,
    /// Bytes this item adds to the instance's total (relations locked while planning).
    #[serde(default)]
    pub added_bytes: u64,
    pub calls: u32,
    /// Seconds the item's calls took (see [`ItemTotals::call_seconds`]).
    #[serde(default)]
    pub call_seconds: f64,
    /// The most sessions a call read this item with.
    #[serde(default = "one_session")]
    pub sessions: u32,
    /// The first ITEM_LISTED_SKIPS forks skipped, with why (each cut to 200 characters).
    pub skipped: Vec<String>,
    /// How many forks of the item were skipped.
    #[serde(default)]
    pub skipped_forks: usize,
}

impl WorkItem {
    pub fn summary(&self) -> ItemSummary {
        let bs = self.block_size;
        ItemSummary {
            id: self.id,
            database: self.database.clone(),
            warmed_bytes: self.done.warmed_blocks * bs,
            vanished_bytes: self.done.vanished_blocks * bs,
            skipped_bytes: self.done.skipped_blocks * bs,
            pending_bytes: self.pending.iter().map(BlockRange::blocks).sum::<u64>() * bs,
            added_bytes: self.done.added_blocks * bs,
            calls: self.calls,
            call_seconds: (self.done.call_seconds * 1000.0).round() / 1000.0,
            sessions: self.sessions,
            skipped: self
                .skipped
                .iter()
                .take(ITEM_LISTED_SKIPS)
                .map(|(i, why)| {
                    let f = &self.forks[*i as usize];
                    let line = format!("{}.{} ({}): {why}", f.schema, f.name, f.fork.as_str());
                    line.chars().take(200).collect()
                })
                .collect(),
            skipped_forks: self.skipped.len(),
        }
    }
}

/// Warm options for one Lambda call that must return before `deadline`, reading with up to
/// `sessions` sessions (adaptive: the controller climbs while throughput grows).
pub fn call_options(deadline: Instant, margin: Duration, sessions: u32) -> WarmOptions {
    WarmOptions {
        sessions: sessions.max(1),
        adaptive: sessions > 1,
        deadline: Some(deadline),
        margin,
        ..WarmOptions::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Fork, RelKind, ServerInfo};

    fn view(status: &str, storage: Option<&str>, progress: Option<i32>) -> InstanceView {
        InstanceView {
            id: "db1".into(),
            status: status.into(),
            storage_status: storage.map(str::to_string),
            storage_progress: progress,
            ..InstanceView::default()
        }
    }

    /// RDS-EVENT-0046 also means "replication resumed": it reads only a replica whose storage is
    /// initializing; every other trigger reads whatever the storage reports.
    #[test]
    fn a_replica_event_reads_only_storage_that_is_initializing() {
        use crate::events::TriggerKind::*;
        let initializing = view("available", Some("Initializing"), Some(3));
        for healthy in [view("available", None, None), view("available", Some("Optimizing"), Some(50))] {
            let why = trigger_applies(ReplicaReady, &healthy).unwrap_err();
            assert!(why.contains("RDS-EVENT-0046") && why.contains("not initializing"), "{why}");
            for kind in
                [SnapshotRestore, PointInTimeRestore, InstanceCreated, MultiAzConversion, BlueGreenCreated, Manual]
            {
                assert_eq!(trigger_applies(kind, &healthy), Ok(()), "{kind:?}");
            }
        }
        assert_eq!(trigger_applies(ReplicaReady, &initializing), Ok(()));
    }

    /// A server with 10,000 tenant databases: the plan summary lists a bounded number of them, the
    /// ones that could not be planned first, and counts every one (unbounded, the list alone would
    /// outgrow the workflow's state).
    #[test]
    fn plan_summary_lists_a_bounded_number_of_databases_and_counts_them_all() {
        let entries: Vec<DatabaseEntry> = (0..10_000)
            .map(|i| {
                let name = format!("tenant_{i:05}");
                match i {
                    _ if i % 3 == 0 => DatabaseEntry {
                        name,
                        outcome: DatabaseOutcome::Excluded,
                        reason: Some("not matched by the include patterns (or excluded by default)".into()),
                        prewarm_schema: None,
                        counts_against_coverage: false,
                    },
                    4_001 | 9_998 => DatabaseEntry {
                        name,
                        outcome: DatabaseOutcome::Skipped,
                        reason: Some("no CONNECT privilege for pghydrate".into()),
                        prewarm_schema: None,
                        counts_against_coverage: true,
                    },
                    _ => DatabaseEntry {
                        name,
                        outcome: DatabaseOutcome::Planned,
                        reason: None,
                        prewarm_schema: Some("public".into()),
                        counts_against_coverage: true,
                    },
                }
            })
            .collect();
        let (listed, counts) = listed_databases(&entries);
        assert_eq!(counts, DatabaseCounts { planned: 6_664, skipped: 2, excluded: 3_334, missed: 2 });
        assert_eq!(listed.len(), LISTED_SKIPS);
        let names: Vec<&str> = listed.iter().take(3).map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["tenant_04001", "tenant_09998", "tenant_00001"], "skipped first, then planned by name");
        assert!(listed[2..].iter().all(|d| d.outcome == DatabaseOutcome::Planned));
        let bytes = serde_json::to_vec(&listed).unwrap().len();
        assert!(bytes < 4 * 1024, "{bytes} bytes listed");
        let all: Vec<crate::report::DatabaseReport> = entries
            .iter()
            .map(|d| crate::report::DatabaseReport {
                name: d.name.clone(),
                outcome: d.outcome,
                reason: d.reason.clone(),
            })
            .collect();
        assert!(serde_json::to_vec(&all).unwrap().len() > STATE_LIMIT_BYTES, "unbounded would not fit");
    }

    /// An instance with thousands of databases, each with a capture: the plan summary lists a bounded
    /// number of hot-set uses (those with something left out or ignored first) and counts them all.
    #[test]
    fn plan_summary_lists_a_bounded_number_of_hot_sets() {
        let uses: Vec<crate::hotset::HotSetUse> = (0..10_000)
            .map(|i| crate::hotset::HotSetUse {
                database: format!("tenant_{i:05}"),
                captured_at: Some("2026-12-04 12:00:00+00".into()),
                stored: 65_536,
                used: 65_536,
                dropped: usize::from(i == 7_777),
                ignored: (i == 9_999).then(|| "the table is not the one capture writes".to_string()),
                ..Default::default()
            })
            .collect();
        let listed = listed_hot_sets(&uses);
        assert_eq!(listed.len(), LISTED_SKIPS);
        assert_eq!(listed[0].database, "tenant_09999", "ignored first");
        assert_eq!(listed[1].database, "tenant_07777", "then ranges left out");
        let bytes = serde_json::to_vec(&listed).unwrap().len();
        assert!(bytes < 8 * 1024, "{bytes} bytes listed");
        assert!(serde_json::to_vec(&uses).unwrap().len() > STATE_LIMIT_BYTES, "unbounded would not fit");
    }

    #[test]
    fn warm_calls_share_the_sessions_the_server_can_spare() {
        let server = |max: u32| ServerInfo { max_connections: max, ..ServerInfo::example() };
        let sizing = |sessions, per_call, max| warm_sizing(sessions, per_call, &server(max));
        // The defaults on a server with room: 64 sessions as 2 calls of 32.
        assert_eq!(sizing(64, 32, 5000).0, WarmSizing { calls: 2, sessions_per_call: 32 });
        // Shared evenly: 40 sessions at 32 a call are 2 calls of 20, not 32 + 8.
        assert_eq!(sizing(40, 32, 5000).0, WarmSizing { calls: 2, sessions_per_call: 20 });
        // One session per call: as many calls as sessions (how the workflow ran before).
        assert_eq!(sizing(8, 1, 5000).0, WarmSizing { calls: 8, sessions_per_call: 1 });
        // A small server: (45 - 3 reserved - 1 in use) / 2 = 20 sessions, one call, and a note why.
        let (s, note) = sizing(64, 32, 45);
        assert_eq!(s, WarmSizing { calls: 1, sessions_per_call: 20 });
        assert!(note.unwrap().contains("41 free connection slots"));
        // A full server still gets one session; never more calls than an inline Map runs at once.
        assert_eq!(sizing(64, 32, 4).0, WarmSizing { calls: 1, sessions_per_call: 1 });
        assert_eq!(sizing(64, 1, 5000).0.calls, INLINE_ITEMS_LIMIT as u32);
        for (sessions, per_call, max) in [(1, 1, 100), (7, 3, 100), (64, 5, 60), (33, 64, 1000), (9, 2, 12)] {
            let (s, _) = sizing(sessions, per_call, max);
            let (allowed, _) = crate::run::effective_sessions(sessions, &server(max));
            assert!(s.calls * s.sessions_per_call <= allowed, "{sessions} {per_call} {max}: {s:?}");
            assert!(s.sessions_per_call <= per_call.max(1), "{sessions} {per_call} {max}: {s:?}");
        }
    }

    #[test]
    fn the_next_call_starts_where_this_one_ended_or_lower_without_progress() {
        let level = |sessions| crate::adaptive::Level { at_seconds: 0.0, sessions, mib_per_second: 0.0 };
        assert_eq!(next_start(&[level(16), level(32), level(64)], true, false), Some(64));
        assert_eq!(next_start(&[level(16)], false, false), Some(8));
        assert_eq!(next_start(&[level(1)], false, false), Some(1));
        assert_eq!(next_start(&[level(16), level(32)], true, true), None);
        assert_eq!(next_start(&[], false, false), None);
    }

    #[test]
    fn a_run_or_item_from_before_call_sessions_reads_one_session_per_call() {
        let d = Defaults::from_env(|_| None).unwrap();
        assert_eq!((d.sessions, d.call_sessions), (64, 64));
        let trigger = crate::events::parse_input(&serde_json::json!({"instance": "db1"}), None, None).unwrap();
        let mut run = serde_json::to_value(RunConfig::new("e", trigger, &d)).unwrap();
        run.as_object_mut().unwrap().remove("call_sessions");
        let old: RunConfig = serde_json::from_value(run).unwrap();
        assert_eq!(old.call_sessions, 1);
        let item = serde_json::json!({"id": 0, "database": "app", "mode": "read", "block_size": 8192, "forks": [],
                                      "pending": [], "done": {"warmed_blocks": 0, "vanished_blocks": 0, "skipped_blocks": 0},
                                      "calls": 0});
        let old: WorkItem = serde_json::from_value(item).unwrap();
        assert_eq!((old.sessions, old.done.call_seconds), (1, 0.0));
        assert!(Defaults::from_env(|k| (k == "PGHYDRATE_CALL_SESSIONS").then(|| "0".into())).is_err());
    }

    /// Mode and maintenance are read by name wherever they come from, and written as the same names: a
    /// typo is refused (before, the workflow read it as `read` and the maintain Lambda as `analyze`).
    #[test]
    fn mode_and_maintenance_are_names_and_a_typo_is_refused() {
        use crate::maintain::Maintenance;
        use crate::warm::ModeChoice;
        let env = |name: &'static str, value: &'static str| move |k: &str| (k == name).then(|| value.to_string());
        let e = Defaults::from_env(env("PGHYDRATE_MODE", "bufer")).unwrap_err().to_string();
        assert!(
            e.contains("PGHYDRATE_MODE") && e.contains("\"bufer\" is not one of auto, read, buffer, prefetch"),
            "{e}"
        );
        let e = Defaults::from_env(env("PGHYDRATE_MAINTENANCE", "vacuum")).unwrap_err().to_string();
        assert!(e.contains("PGHYDRATE_MAINTENANCE") && e.contains("\"vacuum\" is not one of"), "{e}");
        let d = Defaults::from_env(env("PGHYDRATE_MAINTENANCE", "vacuum-analyze")).unwrap();
        assert_eq!((d.mode, d.maintenance), (ModeChoice::Auto, Maintenance::VacuumAnalyze));
        for (input, field) in [("mode", "bufer"), ("maintenance", "full")] {
            let e = crate::events::parse_input(&serde_json::json!({"instance": "db1", input: field}), None, None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{input}: \"{field}\" is not one of")), "{e}");
        }
        let trigger = crate::events::parse_input(
            &serde_json::json!({"instance": "db1", "mode": "prefetch", "maintenance": "none"}),
            None,
            None,
        )
        .unwrap();
        let run = serde_json::to_value(RunConfig::new("e", trigger, &d)).unwrap();
        assert_eq!((&run["mode"], &run["maintenance"]), (&serde_json::json!("prefetch"), &serde_json::json!("none")));
        let back: RunConfig = serde_json::from_value(run.clone()).unwrap();
        assert_eq!((back.mode, back.maintenance), (ModeChoice::Prefetch, Maintenance::None));
        // A state that a Task receives with a name it does not know (edited, or from a newer version).
        let mut odd = run;
        odd["maintenance"] = serde_json::json!("vacuum");
        let e = serde_json::from_value::<RunConfig>(odd).unwrap_err().to_string();
        assert!(e.contains("maintenance: \"vacuum\" is not one of"), "{e}");
    }

    #[test]
    fn readiness_and_storage_progress() {
        assert_eq!(ready_state(&view("available", None, None)).0, "available");
        assert_eq!(ready_state(&view("creating", None, None)).0, "waiting");
        assert_eq!(ready_state(&view("backing-up", None, None)).0, "waiting");
        assert_eq!(ready_state(&view("storage-optimization", None, None)).0, "available");
        assert_eq!(ready_state(&view("restore-error", None, None)).0, "failed");
        for s in TERMINAL_STATES {
            assert_eq!(ready_state(&view(s, None, None)).0, "failed", "{s}");
        }
        assert_eq!(
            storage_state(&view("available", Some("Initializing"), Some(37))),
            ("initializing", "db1: Initializing 37%".into(), Some(37))
        );
        assert_eq!(
            storage_state(&view("available", None, None)),
            ("initialized", "db1: no storage operation reported (StorageOperationStatus absent)".into(), None)
        );
        let (state, detail, progress) = storage_state(&view("available", Some("Optimizing"), Some(40)));
        assert_eq!((state, progress), ("initialized", None), "{detail}");
        assert_eq!(storage_state(&view("deleting", Some("Initializing"), Some(3))).0, "failed");
    }

    #[test]
    fn secrets_are_checked_without_quoting_them() {
        assert_eq!(
            credentials_from_secret(r#"{"username":"u","password":"p4ss","engine":"postgres"}"#).unwrap(),
            ("u".into(), "p4ss".into())
        );
        for (text, want) in [
            ("p4ss-not-json", "not JSON"),
            (r#"{"username":"u"}"#, "no \"password\""),
            (r#"{"username":"u","password":7}"#, "not a non-empty string"),
            (r#"{"password":"p4ss"}"#, "no \"username\""),
        ] {
            let e = credentials_from_secret(text).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains("p4ss"), "the error quotes the secret: {e}");
        }
    }

    /// A synthetic plan of `relations` relations totalling `total_bytes`, skewed like real databases:
    /// one relation holds most of the bytes.
    fn synthetic_plan(databases: usize, relations: usize, total_bytes: u64, range_blocks: u64) -> Plan {
        let bs = 8192u64;
        let total_blocks = total_bytes / bs;
        let big = total_blocks * 6 / 10;
        let rest = (total_blocks - big) / (relations as u64 - 1);
        let forks: Vec<ForkEntry> = (0..relations)
            .map(|i| ForkEntry {
                database: format!("db{}", i % databases),
                schema: "public".into(),
                name: format!("relation_with_a_realistic_name_{i}"),
                oid: 16384 + i as u32,
                kind: RelKind::Table,
                fork: Fork::Main,
                blocks: if i == 0 { big } else { rest },
                table: format!("public.relation_with_a_realistic_name_{i}"),
                owner: "app_owner".into(),
                as_role: None,
                owner_settable: false,
                planned_skip: None,
                excluded: false,
                table_schema: None,
                partition_of: Vec::new(),
            })
            .collect();
        let (ranges, _) = crate::plan::order_ranges(&forks, &[], range_blocks, &[]);
        Plan {
            format: 1,
            created_at: String::new(),
            server: ServerInfo { block_size: bs, ..ServerInfo::example() },
            range_blocks,
            databases: (0..databases)
                .map(|d| DatabaseEntry {
                    name: format!("db{d}"),
                    outcome: DatabaseOutcome::Planned,
                    reason: None,
                    prewarm_schema: Some("public".into()),
                    counts_against_coverage: true,
                })
                .collect(),
            forks,
            ranges,
            plan_seconds: 0.0,
            hot_set: None,
        }
    }

    /// 10 TiB in 100,000 relations over 5 databases: every item stays under its size limit, every
    /// planned block is in exactly one item, and the item count is what docs/workflow-limits.md uses.
    #[test]
    fn ten_tib_and_100k_relations_fit_the_state_limits() {
        let plan = synthetic_plan(5, 100_000, 10 << 40, 8192);
        let items = work_items(&plan, 262_144, 256).unwrap();
        let planned: u64 = plan.ranges.iter().map(BlockRange::blocks).sum();
        let in_items: u64 = items.iter().flat_map(|i| &i.pending).map(BlockRange::blocks).sum();
        assert_eq!(planned, in_items);
        let largest = items.iter().map(|i| serde_json::to_vec(i).unwrap().len()).max().unwrap();
        assert!(largest <= ITEM_LIMIT_BYTES, "largest item {largest} bytes");
        // Many tiny ranges are split by size, not refused.
        let fine = synthetic_plan(1, 2_000, 1 << 30, 1);
        let items = work_items(&fine, u64::MAX, usize::MAX).unwrap();
        assert!(items.len() > 1);
        assert!(items.iter().all(|i| serde_json::to_vec(i).unwrap().len() <= ITEM_LIMIT_BYTES));
        assert!(items.len() > INLINE_ITEMS_LIMIT, "a plan this size goes through S3");
        assert!(items.len() < 10_000, "{} items: more than a Distributed Map's children", items.len());
        eprintln!("10 TiB / 100k relations: {} items, largest {largest} bytes", items.len());
    }

    /// A work item edited in the state (a range naming a fork it does not list, a range turned
    /// around, a block size of 0) is refused as `InvalidInput` before any session is opened.
    #[tokio::test]
    async fn an_edited_work_item_is_refused_before_connecting() {
        let plan = synthetic_plan(1, 10, 1 << 20, 16);
        let item = work_items(&plan, 1 << 20, 64).unwrap().remove(0);
        // Nothing listens there: reaching the network would fail differently.
        let spec = ConnectionSpec::parse(Some("postgresql://u@127.0.0.1:1/db?sslmode=disable"), |_| None).unwrap();
        let opts = call_options(Instant::now() + Duration::from_secs(60), Duration::from_secs(1), 1);
        let edits: [fn(&mut WorkItem); 3] =
            [|i| i.pending[0].fork = 99, |i| (i.pending[0].first, i.pending[0].last) = (5, 1), |i| i.block_size = 0];
        for edit in edits {
            let mut tampered = item.clone();
            edit(&mut tampered);
            let e = tampered.advance(&spec, &opts).await.unwrap_err();
            assert_eq!(e.name(), "InvalidInput", "{e}");
        }
    }

    #[test]
    fn items_never_mix_databases_and_keep_every_range_once() {
        let plan = synthetic_plan(3, 500, 2 << 30, 128);
        let items = work_items(&plan, 4096, 16).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for item in &items {
            assert!(item.pending.len() <= 16);
            for r in &item.pending {
                let f = &item.forks[r.fork as usize];
                assert_eq!(f.database, item.database);
                assert!(seen.insert((f.database.clone(), f.oid, r.first)), "range twice");
            }
        }
        assert_eq!(seen.len(), plan.ranges.len());
    }
}
