//! A whole hydration as one serializable state: the plan, what has happened to each range, what is
//! left, and maintenance. Saved as the continuation when a deadline stops a run; `resume` picks it up
//! and does exactly the rest. Holds no secret: the connection is given again on resume.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::connect::ConnectionSpec;
use crate::error::{Error, Result};
use crate::maintain::{self, MaintainOptions, Maintenance, MaintenanceResult, MaintenanceTarget};
use crate::plan::{BlockRange, Plan, ServerInfo};
use crate::warm::{self, Counters, Mode, RangeOutcome, WarmOptions};

pub const STATE_FORMAT: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunState {
    pub format: u32,
    pub plan: Plan,
    pub mode: Mode,
    pub sessions: u32,
    pub maintenance: Maintenance,
    /// Every outcome so far; with `pending` they partition the plan's ranges.
    pub outcomes: Vec<RangeOutcome>,
    pub pending: Vec<BlockRange>,
    /// None until maintenance starts; then the tables still to do.
    pub maintenance_pending: Option<Vec<MaintenanceTarget>>,
    pub maintenance_results: Vec<MaintenanceResult>,
    pub warm_seconds: f64,
    pub maintain_seconds: f64,
    /// How many calls (runs, resumes, Lambda invocations) worked on this state.
    pub calls: u32,
    /// Databases the last call could not reach (their ranges are in `pending`), with why.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unreachable: BTreeMap<String, String>,
    /// Whether what locks kept from being read had its one more try ([`RunState::retry_locked`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub locks_retried: bool,
    /// Set when the last call was stopped by a signal (its name), not by the time limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<String>,
    /// Whether the number of reading sessions adapts to the throughput measured, up to `sessions`
    /// ([`crate::adaptive`]); otherwise `sessions` read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adaptive: bool,
    /// With `adaptive`: the levels chosen, over every call (seconds counted in warm time).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub levels: Vec<crate::adaptive::Level>,
    /// Seconds of warming after which the plan's hot phase (a captured hot set) was wholly read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_read_at_seconds: Option<f64>,
    /// Seconds of warming done by a head start ([`plan_with_head_start`]), and of those, the seconds
    /// that overlapped planning (so that the run's wall time is not overstated).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head_start_seconds: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub head_start_overlap_seconds: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub warm: WarmOptions,
    pub maintenance: Maintenance,
    pub maintenance_timeout: Duration,
}

/// The session count actually used: at most the request, and at most half of the connection slots
/// free when the plan was made (never fewer than one). Returns a warning when it had to cap.
pub fn effective_sessions(requested: u32, server: &ServerInfo) -> (u32, Option<String>) {
    let free =
        server.max_connections.saturating_sub(server.reserved_connections).saturating_sub(server.connections_in_use);
    let cap = (free / 2).max(1);
    if requested > cap {
        (
            cap,
            Some(format!(
                "using {cap} sessions instead of {requested}: the server has {free} free connection slots \
                 (max_connections {}, reserved {}, in use {}) and pghydrate takes at most half",
                server.max_connections, server.reserved_connections, server.connections_in_use
            )),
        )
    } else {
        (requested, None)
    }
}

/// What a head start read: its plan (the captured hot set alone, [`crate::catalog::plan_hot_phase`]) and
/// the warm of it.
#[derive(Debug)]
pub struct HeadStart {
    pub plan: Plan,
    pub warmed: warm::Warmed,
    pub seconds: f64,
}

impl HeadStart {
    /// `pending` (ranges of `plan`, the full plan) without the blocks this head start warmed, in the
    /// same order (a range partly read is cut to what is left), and the head start's outcomes mapped
    /// onto `plan`'s forks (by database, oid and fork). What it skipped, or read past a fork's end as
    /// the full plan sized it, stays pending: it is read as if there had been no head start.
    pub fn cut(&self, plan: &Plan, pending: Vec<BlockRange>) -> (Vec<BlockRange>, Vec<RangeOutcome>) {
        let index: std::collections::HashMap<(&str, u32, crate::plan::Fork), usize> =
            plan.forks.iter().enumerate().map(|(i, f)| ((f.database.as_str(), f.oid, f.fork), i)).collect();
        let mut read: std::collections::HashMap<u32, Vec<(u64, u64)>> = Default::default();
        let mut outcomes = Vec::new();
        for o in &self.warmed.outcomes {
            let warm::RangeResult::Warmed { seconds, .. } = o.result else { continue };
            let hf = self.plan.fork(&o.range);
            let Some(&i) = index.get(&(hf.database.as_str(), hf.oid, hf.fork)) else { continue };
            let f = &plan.forks[i];
            if f.excluded || f.planned_skip.is_some() || o.range.first >= f.blocks {
                continue;
            }
            let range = BlockRange { fork: i as u32, first: o.range.first, last: o.range.last.min(f.blocks - 1) };
            read.entry(range.fork).or_default().push((range.first, range.last));
            outcomes.push(warm::RangeOutcome {
                range,
                result: warm::RangeResult::Warmed { blocks: range.blocks(), seconds },
            });
        }
        for spans in read.values_mut() {
            spans.sort_unstable();
        }
        let mut left = Vec::with_capacity(pending.len());
        for r in pending {
            match read.get(&r.fork) {
                None => left.push(r),
                Some(spans) => {
                    let mut next = r.first;
                    for &(a, b) in spans {
                        if b < next || a > r.last {
                            continue;
                        }
                        if a > next {
                            left.push(BlockRange { fork: r.fork, first: next, last: a - 1 });
                        }
                        next = next.max(b.saturating_add(1));
                        if next > r.last {
                            break;
                        }
                    }
                    if next <= r.last {
                        left.push(BlockRange { fork: r.fork, first: next, last: r.last });
                    }
                }
            }
        }
        (left, outcomes)
    }
}

/// Plans the whole server with [`crate::catalog::make_plan`] and, at the same time, reads the captured
/// hot sets (a head start): a restored server's catalogs are as cold as its data, and listing every
/// relation takes seconds (3.1-3.6 s for 1,478 relations on the benchmark's lazy volume, next to the
/// application's own cold reads) before which no hot block would be read. `configure` gives the head
/// start's mode, session ceiling and whether it adapts, for the server found (the CLI gives it half of
/// the run's ceiling); it reads with no more sessions than the full plan's leave of pghydrate's half of
/// the free connection slots ([`crate::catalog::plan_hot_phase`]).
///
/// The head start fills planning time and no more: when the full plan is made it starts no new range,
/// and the statements it has sent finish (a block it began is not read twice). What it did not reach
/// stays in the full plan, first in its order, for the run's (or the workflow's) own sessions, all of
/// them. Whatever fails in the head start leaves its ranges to the full plan; the full plan's error is
/// the error.
pub async fn plan_with_head_start(
    spec: &ConnectionSpec,
    plan_opts: &crate::catalog::PlanOptions,
    warm_opts: &WarmOptions,
    configure: impl FnOnce(&ServerInfo) -> (warm::Mode, u32, bool),
) -> Result<(Plan, Option<HeadStart>)> {
    let planned = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let full = async {
        let plan = crate::catalog::make_plan(spec, plan_opts).await;
        planned.store(true, std::sync::atomic::Ordering::Relaxed);
        plan
    };
    let head = async {
        let (hot, connections) = match crate::catalog::plan_hot_phase(spec, plan_opts).await {
            Ok(Some(p)) => p,
            Ok(None) => return None,
            Err(e) => {
                warn!(error = %e, "head start not made (the full plan reads the hot set)");
                return None;
            }
        };
        if planned.load(std::sync::atomic::Ordering::Relaxed) {
            info!("head start not made: the full plan was ready first");
            return None;
        }
        let (mode, sessions, adaptive) = configure(&hot.server);
        let mut opts = warm_opts.clone();
        opts.mode = mode;
        // Within what the full plan's sessions leave of pghydrate's share of the connection slots.
        opts.sessions = sessions.clamp(1, connections);
        opts.adaptive = adaptive && opts.sessions > 1;
        opts.drain = Some(planned.clone());
        let started = Instant::now();
        let ranges = hot.ranges.clone();
        let plan = Arc::new(hot);
        match warm::warm(spec, plan.clone(), ranges, &opts, Arc::new(Counters::default())).await {
            Ok(warmed) if warmed.outcomes.is_empty() => None,
            Ok(warmed) => {
                let plan = Arc::try_unwrap(plan).unwrap_or_else(|p| (*p).clone());
                let seconds = started.elapsed().as_secs_f64();
                info!(
                    ranges_read = warmed.outcomes.len(),
                    ranges_left = warmed.pending.len(),
                    seconds,
                    "head start ended with planning"
                );
                Some(HeadStart { plan, warmed, seconds })
            }
            Err(e) => {
                warn!(error = %e, "head start stopped (the full plan reads the hot set)");
                None
            }
        }
    };
    let (plan, head) = tokio::join!(full, head);
    Ok((plan?, head))
}

impl RunState {
    /// Takes in what a head start read: each block it warmed leaves `pending` (a range partly read is
    /// cut to what is left) and its outcome joins, mapped onto this plan's forks; its time, levels and
    /// the moment the hot set was read count as warming. What it did not warm (skipped, stopped) stays
    /// pending here, to be read as if there had been no head start. Returns the bytes taken in.
    pub fn absorb_head_start(&mut self, head: HeadStart) -> u64 {
        let pending = std::mem::take(&mut self.pending);
        let (pending, outcomes) = head.cut(&self.plan, pending);
        self.pending = pending;
        let bytes = outcomes.iter().map(|o| self.plan.bytes(o.range.blocks())).sum();
        self.outcomes.extend(outcomes);
        let offset = self.warm_seconds;
        self.levels.extend(
            head.warmed.levels.iter().map(|l| crate::adaptive::Level { at_seconds: l.at_seconds + offset, ..*l }),
        );
        // The head start's hot set may be less than the plan's (a database it could not read, shared
        // catalogs): the plan's hot set is read when none of it is pending.
        let hot = self.plan.hot_set.as_ref().map(|h| crate::hotset::HotBlocks::new(&h.ranges)).unwrap_or_default();
        if let Some(t) = head.warmed.hot_read_at.filter(|_| self.pending.iter().all(|r| hot.within(r) == 0)) {
            self.hot_read_at_seconds.get_or_insert(t + offset);
        }
        self.warm_seconds += head.seconds;
        self.head_start_seconds = head.seconds;
        // The head start began once its own small plan was made, and the full plan ran meanwhile.
        self.head_start_overlap_seconds = head.seconds.min((self.plan.plan_seconds - head.plan.plan_seconds).max(0.0));
        info!(
            bytes,
            seconds = head.seconds,
            ranges_left = self.pending.len(),
            "head start taken in: what it read is not read again"
        );
        bytes
    }

    pub fn new(plan: Plan, mode: Mode, sessions: u32, maintenance: Maintenance) -> Self {
        let pending = plan.ranges.clone();
        RunState {
            format: STATE_FORMAT,
            plan,
            mode,
            sessions,
            maintenance,
            outcomes: Vec::new(),
            pending,
            maintenance_pending: None,
            maintenance_results: Vec::new(),
            warm_seconds: 0.0,
            maintain_seconds: 0.0,
            calls: 0,
            unreachable: BTreeMap::new(),
            interrupted: None,
            adaptive: false,
            levels: Vec::new(),
            locks_retried: false,
            hot_read_at_seconds: None,
            head_start_seconds: 0.0,
            head_start_overlap_seconds: 0.0,
        }
    }

    /// Whether nothing is left to do (warming and maintenance).
    pub fn finished(&self) -> bool {
        self.pending.is_empty()
            && (self.maintenance == Maintenance::None
                || self.maintenance_pending.as_ref().is_some_and(|p| p.is_empty()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let state: RunState = serde_json::from_str(text)
            .map_err(|e| Error::InvalidInput(format!("not a pghydrate continuation: {e}")))?;
        if state.format != STATE_FORMAT {
            return Err(Error::InvalidInput(format!(
                "continuation format {} is not supported (expected {STATE_FORMAT})",
                state.format
            )));
        }
        // Edited by someone, perhaps: it is data, and must at least be consistent data.
        let plan = &state.plan;
        let ranges = plan.ranges.iter().chain(&state.pending).chain(state.outcomes.iter().map(|o| &o.range));
        crate::plan::check_state(plan.server.block_size, ranges, plan.forks.len())?;
        if state.sessions == 0 {
            return Err(Error::InvalidInput("the continuation's sessions must be at least 1".into()));
        }
        Ok(state)
    }

    /// Once, after warming: what a lock kept from being read gets one more try, the lock having had
    /// the whole warm to go away. Relations held ACCESS EXCLUSIVE throughout planning are sized and
    /// planned now; ranges skipped for `lock_timeout` while warming go back to pending. Returns the
    /// ranges to read.
    async fn retry_locked(&mut self, spec: &ConnectionSpec) -> Vec<BlockRange> {
        let mut again = crate::catalog::plan_locked_again(spec, &mut self.plan).await;
        let before = self.outcomes.len();
        self.outcomes.retain(|o| {
            let locked =
                matches!(&o.result, warm::RangeResult::Skipped(s) if s.reason == crate::plan::SkipReason::LockTimeout);
            if locked {
                again.push(o.range);
            }
            !locked
        });
        if !again.is_empty() {
            info!(
                ranges = again.len(),
                skipped_for_locks = before - self.outcomes.len(),
                "trying the locked relations again"
            );
        }
        again
    }

    /// Works on the state until it is finished or the deadline in `opts` comes.
    pub async fn advance(&mut self, spec: &ConnectionSpec, opts: &RunOptions, counters: Arc<Counters>) -> Result<()> {
        self.calls += 1;
        self.interrupted = None;
        let mut warm_opts = opts.warm.clone();
        warm_opts.mode = self.mode;
        warm_opts.sessions = self.sessions;
        warm_opts.adaptive = self.adaptive;
        let near = || {
            opts.warm.deadline.is_some_and(|d| d.saturating_duration_since(Instant::now()) <= opts.warm.margin)
                || opts.warm.stop.as_ref().is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
        };
        loop {
            if !self.pending.is_empty() {
                let started = Instant::now();
                let plan = Arc::new(self.plan.clone());
                let ranges = std::mem::take(&mut self.pending);
                info!(ranges = ranges.len(), sessions = self.sessions, mode = self.mode.as_str(), "warming");
                let warmed = warm::warm(spec, plan, ranges, &warm_opts, counters.clone()).await?;
                let offset = self.warm_seconds;
                self.levels.extend(
                    warmed.levels.iter().map(|l| crate::adaptive::Level { at_seconds: l.at_seconds + offset, ..*l }),
                );
                self.outcomes.extend(warmed.outcomes);
                if let Some(t) = warmed.hot_read_at {
                    self.hot_read_at_seconds.get_or_insert(t + offset);
                }
                self.pending = warmed.pending;
                self.unreachable = warmed.unreachable;
                self.warm_seconds += started.elapsed().as_secs_f64();
                if !self.pending.is_empty() {
                    if self.unreachable.is_empty() {
                        warn!(ranges_left = self.pending.len(), "stopped with ranges left (time limit or stop)");
                    } else {
                        warn!(ranges_left = self.pending.len(), databases = ?self.unreachable.keys().collect::<Vec<_>>(),
                              "stopped: databases unreachable, their ranges are left for resume");
                    }
                    return Ok(());
                }
            }
            if self.locks_retried || near() {
                break;
            }
            self.locks_retried = true;
            self.pending = self.retry_locked(spec).await;
            if self.pending.is_empty() {
                break;
            }
        }
        if self.maintenance == Maintenance::None || near() {
            return Ok(());
        }
        let started = Instant::now();
        let targets = match self.maintenance_pending.take() {
            Some(t) => t,
            None => {
                let databases: Vec<String> = self
                    .plan
                    .databases
                    .iter()
                    .filter(|d| d.outcome == crate::plan::DatabaseOutcome::Planned)
                    .map(|d| d.name.clone())
                    .collect();
                // Excluded: the tables of excluded forks, and a partitioned table all of whose
                // partitions are excluded (its ANALYZE would read them).
                let parents = |f: &'_ crate::plan::ForkEntry| {
                    f.partition_of.iter().map(|[s, n]| (f.database.clone(), format!("{s}.{n}"))).collect::<Vec<_>>()
                };
                let kept_parents: std::collections::HashSet<(String, String)> =
                    self.plan.forks.iter().filter(|f| !f.excluded).flat_map(parents).collect();
                let mut excluded: std::collections::HashSet<(String, String)> = std::collections::HashSet::new();
                for f in self.plan.forks.iter().filter(|f| f.excluded) {
                    excluded.insert((f.database.clone(), f.table.clone()));
                    excluded.extend(parents(f).into_iter().filter(|p| !kept_parents.contains(p)));
                }
                let listed = maintain::targets(spec, &databases, self.maintenance, |db, schema, name| {
                    excluded.contains(&(db.to_string(), format!("{schema}.{name}")))
                })
                .await;
                self.maintenance_results.extend(listed.unlisted);
                listed.targets
            }
        };
        let mopts = MaintainOptions {
            action: self.maintenance,
            statement_timeout: opts.maintenance_timeout,
            lock_timeout: opts.warm.lock_timeout,
            deadline: opts.warm.deadline,
            margin: opts.warm.margin,
            stop: opts.warm.stop.clone(),
        };
        let (results, left) = maintain::maintain(spec, targets, &mopts).await;
        self.maintenance_results.extend(results);
        self.maintenance_pending = Some(left);
        self.maintain_seconds += started.elapsed().as_secs_f64();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(max: u32, reserved: u32, in_use: u32) -> ServerInfo {
        ServerInfo {
            max_connections: max,
            reserved_connections: reserved,
            connections_in_use: in_use,
            ..ServerInfo::example()
        }
    }

    fn fork(db: &str, oid: u32, blocks: u64) -> crate::plan::ForkEntry {
        crate::plan::ForkEntry {
            database: db.into(),
            schema: "public".into(),
            name: format!("t{oid}"),
            oid,
            kind: crate::plan::RelKind::Table,
            fork: crate::plan::Fork::Main,
            blocks,
            table: format!("public.t{oid}"),
            owner: "o".into(),
            as_role: None,
            owner_settable: false,
            planned_skip: None,
            excluded: false,
            table_schema: None,
            partition_of: Vec::new(),
        }
    }

    fn plan_of(forks: Vec<crate::plan::ForkEntry>, range_blocks: u64) -> Plan {
        let (ranges, _) = crate::plan::order_ranges(&forks, &[], range_blocks, &[]);
        Plan {
            format: 1,
            created_at: String::new(),
            server: ServerInfo::example(),
            range_blocks,
            databases: Vec::new(),
            forks,
            ranges,
            plan_seconds: 2.0,
            hot_set: None,
        }
    }

    fn warmed(range: BlockRange) -> warm::RangeOutcome {
        warm::RangeOutcome { range, result: warm::RangeResult::Warmed { blocks: range.blocks(), seconds: 0.1 } }
    }

    /// After a head start, what it warmed and what is pending cover every block of every fork exactly
    /// once: a range the head start read in part is cut to the rest, forks are matched by database and
    /// oid (not by index), and what the head start skipped, or read of a fork the plan has since
    /// skipped, or read past a fork's end now, is not taken as read.
    #[test]
    fn a_head_start_leaves_every_block_read_exactly_once() {
        let mut excluded = fork("app", 13, 50);
        excluded.excluded = true;
        let full = plan_of(vec![fork("app", 10, 1000), fork("app", 11, 300), fork("other", 10, 40), excluded], 128);
        let mut state = RunState::new(full, Mode::Buffer, 8, Maintenance::None);
        // The head start's plan lists fewer forks, in another order.
        let mut head_plan = plan_of(vec![fork("app", 11, 310), fork("app", 13, 50), fork("app", 10, 1000)], 128);
        head_plan.plan_seconds = 0.5;
        let skipped =
            crate::plan::Skip { reason: crate::plan::SkipReason::Permission, detail: "refused".into(), fix: None };
        let head = HeadStart {
            plan: head_plan,
            warmed: warm::Warmed {
                outcomes: vec![
                    warmed(BlockRange { fork: 2, first: 100, last: 199 }), // app.10, in the middle of a range
                    warmed(BlockRange { fork: 2, first: 900, last: 999 }), // app.10, its end
                    warmed(BlockRange { fork: 0, first: 280, last: 309 }), // app.11, past its end now (300)
                    warmed(BlockRange { fork: 1, first: 0, last: 49 }),    // app.13: excluded in the plan
                    warm::RangeOutcome {
                        range: BlockRange { fork: 0, first: 0, last: 9 },
                        result: warm::RangeResult::Skipped(skipped),
                    },
                ],
                pending: vec![BlockRange { fork: 2, first: 500, last: 599 }],
                unreachable: Default::default(),
                levels: vec![crate::adaptive::Level { at_seconds: 0.0, sessions: 8, mib_per_second: 0.0 }],
                hot_read_at: None,
            },
            seconds: 1.5,
        };
        let bytes = state.absorb_head_start(head);
        assert_eq!(bytes, (100 + 100 + 20) * 8192, "only blocks the plan reads, within each fork's size now");
        assert_eq!(state.outcomes.len(), 3);
        for (i, f) in state.plan.forks.iter().enumerate() {
            let mut got: Vec<(u64, u64)> = state
                .pending
                .iter()
                .chain(state.outcomes.iter().map(|o| &o.range))
                .filter(|r| r.fork == i as u32)
                .map(|r| (r.first, r.last))
                .collect();
            got.sort_unstable();
            if f.excluded {
                assert!(got.is_empty(), "an excluded fork is not read: {got:?}");
                continue;
            }
            let mut next = 0;
            for (a, b) in got {
                assert_eq!(a, next, "fork {i}: a gap or an overlap at {a}");
                next = b + 1;
            }
            assert_eq!(next, f.blocks, "fork {i}: every block");
        }
        assert_eq!(state.warm_seconds, 1.5);
        assert_eq!(state.head_start_overlap_seconds, 1.5, "the head start ran within the full plan's 2 s");
        assert_eq!(
            crate::report::build(&state).timings.total_seconds,
            2.0,
            "wall time: plan, and the warm after it (none)"
        );
        assert_eq!(state.levels.len(), 1);
    }

    #[test]
    fn sessions_take_at_most_half_the_free_slots() {
        assert_eq!(effective_sessions(8, &server(100, 3, 10)), (8, None));
        let (n, warning) = effective_sessions(64, &server(100, 3, 10));
        assert_eq!(n, 43);
        assert!(warning.unwrap().contains("87 free connection slots"));
        assert_eq!(effective_sessions(8, &server(10, 3, 7)).0, 1, "never fewer than one");
    }
}
