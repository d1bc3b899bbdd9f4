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

impl RunState {
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

    #[test]
    fn sessions_take_at_most_half_the_free_slots() {
        assert_eq!(effective_sessions(8, &server(100, 3, 10)), (8, None));
        let (n, warning) = effective_sessions(64, &server(100, 3, 10));
        assert_eq!(n, 43);
        assert!(warning.unwrap().contains("87 free connection slots"));
        assert_eq!(effective_sessions(8, &server(10, 3, 7)).0, 1, "never fewer than one");
    }
}
