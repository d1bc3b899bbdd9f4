//! The report: every relation fork exactly once with its outcome, coverage as a fraction of bytes,
//! databases with their outcome, maintenance, timings and throughput.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::error::exit;
use crate::maintain::{MaintenanceOutcome, MaintenanceResult};
use crate::plan::{DatabaseOutcome, RelKind, SkipReason};
use crate::run::RunState;
use crate::warm::RangeResult;

/// How a run ended, with its exit code (`RunStatus::exit_code`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Every planned byte still there was read and every database was planned.
    Complete,
    /// Finished, but something was skipped (reasons in the report).
    Incomplete,
    /// The time limit came first; a continuation holds what is left.
    StoppedAtDeadline,
    /// A database stayed unreachable; a continuation holds its ranges.
    StoppedUnreachable,
    /// Ctrl-C or SIGTERM; a continuation holds what is left.
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Complete => "complete",
            RunStatus::Incomplete => "incomplete",
            RunStatus::StoppedAtDeadline => "stopped_at_deadline",
            RunStatus::StoppedUnreachable => "stopped_unreachable",
            RunStatus::Interrupted => "interrupted",
        }
    }

    pub fn exit_code(self) -> i32 {
        match self {
            RunStatus::Complete => exit::COMPLETE,
            RunStatus::Incomplete => exit::INCOMPLETE,
            RunStatus::StoppedAtDeadline | RunStatus::Interrupted => exit::STOPPED_AT_DEADLINE,
            RunStatus::StoppedUnreachable => exit::CONNECTION,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub tool: String,
    pub tool_version: String,
    pub server_version: String,
    pub server_version_num: u32,
    pub login_role: String,
    pub mode: String,
    /// Reading sessions; with `adaptive`, their ceiling.
    pub sessions: u32,
    /// Whether the number of reading sessions adapted to the throughput measured (`--sessions auto`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adaptive: bool,
    /// With `adaptive`: each level chosen, when (seconds of warming), and the throughput that led to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub levels: Vec<crate::adaptive::Level>,
    pub maintenance_action: String,
    pub status: RunStatus,
    pub exit_code: i32,
    /// Databases that could not be reached, with why: their ranges are left for the continuation.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub unreachable: std::collections::BTreeMap<String, String>,
    /// warmed_bytes / (total_bytes - vanished_bytes): the share of the bytes that still exist that
    /// were read. 1.0 means every existing block of every planned fork was read.
    pub coverage: f64,
    /// Bytes of every fork not excluded by a pattern, as planned.
    pub total_bytes: u64,
    pub warmed_bytes: u64,
    /// Bytes that stopped existing during the run (relation dropped or truncated).
    pub vanished_bytes: u64,
    /// Bytes not read for a reason other than vanishing.
    pub skipped_bytes: u64,
    /// Bytes left for a continuation.
    pub pending_bytes: u64,
    pub excluded_bytes: u64,
    pub skipped_by_reason: BTreeMap<String, ReasonTotal>,
    pub databases: Vec<DatabaseReport>,
    pub relations: Vec<RelationReport>,
    pub maintenance: Vec<MaintenanceResult>,
    pub timings: Timings,
    pub throughput: Throughput,
    /// The captured hot set the plan read first, and what of it was read when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_set: Option<HotSetReport>,
}

/// What of the captured hot set was read, and when.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HotSetReport {
    pub databases: Vec<crate::hotset::HotSetUse>,
    /// Bytes the hot phase planned to read.
    pub bytes: u64,
    /// Of them, bytes read.
    pub read_bytes: u64,
    /// read_bytes / bytes (1.0 when there was nothing to read).
    pub read_share: f64,
    /// Seconds of warming after which the whole hot phase was read (None: not yet, or not measured
    /// because part of it had been read by an earlier call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_by_seconds: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ReasonTotal {
    pub forks: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DatabaseReport {
    pub name: String,
    pub outcome: DatabaseOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What became of one relation fork.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ForkOutcome {
    /// Every block still there was read (a fork that shrank says so in its reason).
    Warmed,
    /// Some blocks were not read; reason_code, reason and fix say why.
    Skipped,
    /// Left out by a pattern; not counted in coverage.
    Excluded,
    /// Left for the continuation (deadline, interruption or an unreachable database).
    Pending,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RelationReport {
    pub database: String,
    pub schema: String,
    pub name: String,
    pub oid: u32,
    pub kind: RelKind,
    pub fork: String,
    /// Blocks when planned.
    pub blocks: u64,
    pub warmed_blocks: u64,
    pub outcome: ForkOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason_code: Option<SkipReason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Timings {
    pub plan_seconds: f64,
    pub warm_seconds: f64,
    pub maintain_seconds: f64,
    /// Wall time: plan, warm and maintenance, less what of the warm ran while planning.
    pub total_seconds: f64,
    /// The head start: seconds of the warm (counted in `warm_seconds`) that read the captured hot set
    /// while the server was being planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_start_seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Throughput {
    pub warmed_bytes_per_second: f64,
    pub warmed_mib_per_second: f64,
}

#[derive(Default)]
struct Tally {
    warmed: u64,
    vanished: u64,
    pending: u64,
    skip: Option<crate::plan::Skip>,
    vanish: Option<crate::plan::Skip>,
}

pub fn build(state: &RunState) -> Report {
    let plan = &state.plan;
    let bs = plan.server.block_size;
    let mut tallies: Vec<Tally> = (0..plan.forks.len()).map(|_| Tally::default()).collect();
    for o in &state.outcomes {
        let t = &mut tallies[o.range.fork as usize];
        match &o.result {
            RangeResult::Warmed { .. } => t.warmed += o.range.blocks(),
            RangeResult::Skipped(s) if s.reason.vanished() => {
                t.vanished += o.range.blocks();
                t.vanish.get_or_insert_with(|| s.clone());
            }
            RangeResult::Skipped(s) => {
                t.skip.get_or_insert_with(|| s.clone());
            }
        }
    }
    for r in &state.pending {
        tallies[r.fork as usize].pending += r.blocks();
    }

    let mut report = Report {
        tool: "pghydrate".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        server_version: plan.server.version.clone(),
        server_version_num: plan.server.version_num,
        login_role: plan.server.login_role.clone(),
        mode: state.mode.as_str().into(),
        sessions: state.sessions,
        adaptive: state.adaptive,
        levels: state.levels.clone(),
        maintenance_action: serde_json::to_value(state.maintenance).unwrap().as_str().unwrap_or("").into(),
        status: RunStatus::Complete,
        exit_code: 0,
        unreachable: Default::default(),
        coverage: 0.0,
        total_bytes: 0,
        warmed_bytes: 0,
        vanished_bytes: 0,
        skipped_bytes: 0,
        pending_bytes: 0,
        excluded_bytes: 0,
        skipped_by_reason: BTreeMap::new(),
        databases: plan
            .databases
            .iter()
            .map(|d| DatabaseReport { name: d.name.clone(), outcome: d.outcome, reason: d.reason.clone() })
            .collect(),
        relations: Vec::with_capacity(plan.forks.len()),
        maintenance: state.maintenance_results.clone(),
        timings: Timings {
            plan_seconds: plan.plan_seconds,
            warm_seconds: state.warm_seconds,
            maintain_seconds: state.maintain_seconds,
            total_seconds: plan.plan_seconds + state.warm_seconds + state.maintain_seconds
                - state.head_start_overlap_seconds,
            head_start_seconds: (state.head_start_seconds > 0.0).then_some(state.head_start_seconds),
        },
        throughput: Throughput { warmed_bytes_per_second: 0.0, warmed_mib_per_second: 0.0 },
        hot_set: plan.hot_set.as_ref().map(|h| {
            let hot = crate::hotset::HotBlocks::new(&h.ranges);
            let read: u64 = state
                .outcomes
                .iter()
                .filter(|o| matches!(o.result, RangeResult::Warmed { .. }))
                .map(|o| hot.within(&o.range))
                .sum();
            let blocks = h.blocks();
            HotSetReport {
                databases: h.databases.clone(),
                bytes: blocks * bs,
                read_bytes: read * bs,
                read_share: if blocks == 0 { 1.0 } else { read as f64 / blocks as f64 },
                read_by_seconds: state.hot_read_at_seconds,
            }
        }),
    };

    for (f, t) in plan.forks.iter().zip(&tallies) {
        let bytes = f.blocks * bs;
        let mut rel = RelationReport {
            database: f.database.clone(),
            schema: f.schema.clone(),
            name: f.name.clone(),
            oid: f.oid,
            kind: f.kind,
            fork: f.fork.as_str().into(),
            blocks: f.blocks,
            warmed_blocks: t.warmed,
            outcome: ForkOutcome::Warmed,
            reason_code: None,
            reason: None,
            fix: None,
        };
        if f.excluded {
            report.excluded_bytes += bytes;
            rel.outcome = ForkOutcome::Excluded;
            rel.reason = Some("excluded by pattern".into());
            report.relations.push(rel);
            continue;
        }
        report.total_bytes += bytes;
        report.warmed_bytes += t.warmed * bs;
        report.vanished_bytes += t.vanished * bs;
        report.pending_bytes += t.pending * bs;
        let skipped_blocks = f.blocks - t.warmed.min(f.blocks) - t.vanished.min(f.blocks) - t.pending.min(f.blocks);
        let skip = f.planned_skip.clone().or_else(|| t.skip.clone());
        if let Some(s) = skip {
            let blocks = if f.planned_skip.is_some() { f.blocks } else { skipped_blocks };
            report.skipped_bytes += blocks * bs;
            let e = report.skipped_by_reason.entry(reason_name(s.reason)).or_default();
            e.forks += 1;
            e.bytes += blocks * bs;
            rel.outcome = ForkOutcome::Skipped;
            rel.reason_code = Some(s.reason);
            rel.reason = Some(s.detail);
            rel.fix = s.fix;
        } else if t.pending > 0 {
            rel.outcome = ForkOutcome::Pending;
        } else if let Some(v) = &t.vanish {
            let e = report.skipped_by_reason.entry(reason_name(v.reason)).or_default();
            e.forks += 1;
            e.bytes += t.vanished * bs;
            rel.reason_code = Some(v.reason);
            if t.warmed == 0 {
                rel.outcome = ForkOutcome::Skipped;
                rel.reason = Some(v.detail.clone());
            } else {
                rel.reason = Some(format!(
                    "shrank during the run: {} of {} planned blocks remained, all read",
                    t.warmed, f.blocks
                ));
            }
        } else if f.blocks == 0 {
            rel.reason = Some("empty: no blocks to read".into());
        }
        report.relations.push(rel);
    }

    let live = report.total_bytes - report.vanished_bytes;
    report.coverage = if live == 0 { 1.0 } else { report.warmed_bytes as f64 / live as f64 };
    let db_missed = plan.databases.iter().any(|d| d.outcome == DatabaseOutcome::Skipped && d.counts_against_coverage);
    report.unreachable = state.unreachable.clone();
    report.status = if !state.finished() && !state.unreachable.is_empty() {
        RunStatus::StoppedUnreachable
    } else if !state.finished() && state.interrupted.is_some() {
        RunStatus::Interrupted
    } else if !state.finished() {
        RunStatus::StoppedAtDeadline
    } else if report.warmed_bytes < live || db_missed {
        RunStatus::Incomplete
    } else {
        RunStatus::Complete
    };
    report.exit_code = report.status.exit_code();
    if state.warm_seconds > 0.0 {
        report.throughput.warmed_bytes_per_second = report.warmed_bytes as f64 / state.warm_seconds;
        report.throughput.warmed_mib_per_second = report.throughput.warmed_bytes_per_second / (1024.0 * 1024.0);
    }
    report
}

fn reason_name(r: SkipReason) -> String {
    serde_json::to_value(r).unwrap().as_str().unwrap_or("error").to_string()
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

impl Report {
    /// A few lines for people; the JSON report has everything.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let planned = self.databases.iter().filter(|d| d.outcome == DatabaseOutcome::Planned).count();
        let sessions = if self.adaptive {
            let path: Vec<String> = self.levels.iter().map(|l| l.sessions.to_string()).collect();
            let path = if path.len() > 8 {
                format!(
                    "{} -> ... -> {} ({} changes)",
                    path[..4].join(" -> "),
                    path[path.len() - 3..].join(" -> "),
                    path.len() - 1
                )
            } else {
                path.join(" -> ")
            };
            format!("sessions adapted {path} (at most {})", self.sessions)
        } else {
            format!("{} sessions", self.sessions)
        };
        let _ = writeln!(
            s,
            "pghydrate {}: {} as {}, mode {}, {sessions}",
            self.status.as_str(),
            self.server_version.split(" on ").next().unwrap_or(&self.server_version),
            self.login_role,
            self.mode,
        );
        let _ = writeln!(s, "  databases: {planned} hydrated");
        let excluded: Vec<&DatabaseReport> =
            self.databases.iter().filter(|d| d.outcome == DatabaseOutcome::Excluded).collect();
        // A server of tenant databases, one of them hydrated, would print thousands of excluded lines.
        let listed = self.databases.iter().filter(|d| {
            d.outcome == DatabaseOutcome::Skipped || (d.outcome == DatabaseOutcome::Excluded && excluded.len() <= 5)
        });
        for d in listed {
            let _ = writeln!(s, "    {} {}: {}", d.outcome.as_str(), d.name, d.reason.as_deref().unwrap_or(""));
        }
        if excluded.len() > 5 {
            let _ = writeln!(
                s,
                "    excluded {} databases (patterns or default exclusions; listed in the JSON report)",
                excluded.len()
            );
        }
        let forks = self.relations.iter().filter(|r| r.outcome != ForkOutcome::Excluded).count();
        let _ = writeln!(
            s,
            "  relation forks: {forks}, {}; warmed {} ({:.2}% coverage) in {:.1} s ({:.1} MiB/s)",
            human_bytes(self.total_bytes),
            human_bytes(self.warmed_bytes),
            self.coverage * 100.0,
            self.timings.warm_seconds,
            self.throughput.warmed_mib_per_second
        );
        for (reason, t) in &self.skipped_by_reason {
            let _ = writeln!(s, "    {reason}: {} forks, {}", t.forks, human_bytes(t.bytes));
        }
        let mut skipped: Vec<&RelationReport> =
            self.relations.iter().filter(|r| r.outcome == ForkOutcome::Skipped).collect();
        skipped.sort_by_key(|r| std::cmp::Reverse(r.blocks));
        for r in skipped.iter().take(10) {
            let _ = writeln!(
                s,
                "    skipped {}: {}.{} ({}): {}{}",
                r.database,
                r.schema,
                r.name,
                r.fork,
                r.reason.as_deref().unwrap_or(""),
                r.fix.as_deref().map(|f| format!("; fix: {f}")).unwrap_or_default()
            );
        }
        if skipped.len() > 10 {
            let _ = writeln!(s, "    ... and {} more in the JSON report (--report)", skipped.len() - 10);
        }
        if let Some(h) = &self.hot_set {
            let _ = writeln!(
                s,
                "  captured hot set: {} read first, {:.1}% read{}",
                human_bytes(h.bytes),
                h.read_share * 100.0,
                h.read_by_seconds.map(|t| format!(", all of it within {t:.1} s of warming")).unwrap_or_default()
            );
            for d in &h.databases {
                let _ = writeln!(s, "    {}", d.describe());
            }
        }
        if self.excluded_bytes > 0 {
            let _ = writeln!(s, "  excluded by patterns: {}", human_bytes(self.excluded_bytes));
        }
        for (db, why) in &self.unreachable {
            let _ = writeln!(s, "  unreachable {db}: {why}");
        }
        if self.pending_bytes > 0 {
            let _ = writeln!(s, "  left for the continuation: {}", human_bytes(self.pending_bytes));
        }
        if !self.maintenance.is_empty() {
            let done = self.maintenance.iter().filter(|m| m.outcome == MaintenanceOutcome::Done).count();
            let _ = writeln!(
                s,
                "  maintenance ({}): {done} tables done, {} skipped in {:.1} s",
                self.maintenance_action,
                self.maintenance.len() - done,
                self.timings.maintain_seconds
            );
        }
        let _ = write!(s, "  exit code {}", self.exit_code);
        s
    }
}
