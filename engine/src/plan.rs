//! The plan: every relation fork of every database, each with what will happen to it, and the block
//! ranges to read, in the order they will be read. A plain serializable value: the CLI prints it, a
//! continuation carries it, the Lambdas will pass it through S3.

use serde::{Deserialize, Serialize};

use crate::pattern::RelationPattern;

/// Bumped whenever the serialized shape changes incompatibly.
pub const PLAN_FORMAT: u32 = 1;

/// Default block-range size: 8192 blocks (64 MiB with 8 KiB blocks). See docs/tuning.md for the
/// measurement behind it.
pub const DEFAULT_RANGE_BLOCKS: u64 = 8192;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ServerInfo {
    /// server_version_num, e.g. 170011.
    pub version_num: u32,
    pub version: String,
    pub block_size: u64,
    pub login_role: String,
    pub is_superuser: bool,
    pub max_connections: u32,
    /// Slots kept for superusers and reserved roles.
    pub reserved_connections: u32,
    /// Client backends connected when the plan was made.
    pub connections_in_use: u32,
    /// `io_method` (PostgreSQL 18+: worker, io_uring or sync); None before 18.
    #[serde(default)]
    pub io_method: Option<String>,
    /// A standby (read replica, or a physical-replication green environment): it can be read and
    /// warmed, but nothing can be created or maintained on it.
    #[serde(default)]
    pub in_recovery: bool,
}

impl ServerInfo {
    pub fn major(&self) -> u32 {
        self.version_num / 10000
    }

    /// A PostgreSQL 17 server with 8 KiB blocks, 100 connections (3 reserved, 1 in use) and a login
    /// role `hydrator` that is not a superuser: for unit tests.
    #[cfg(test)]
    pub(crate) fn example() -> ServerInfo {
        ServerInfo {
            version_num: 170000,
            version: "17.0".into(),
            block_size: 8192,
            login_role: "hydrator".into(),
            is_superuser: false,
            max_connections: 100,
            reserved_connections: 3,
            connections_in_use: 1,
            io_method: None,
            in_recovery: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Fork {
    Main,
    Fsm,
    Vm,
    Init,
}

impl Fork {
    pub const ALL: [Fork; 4] = [Fork::Main, Fork::Fsm, Fork::Vm, Fork::Init];
    pub fn as_str(self) -> &'static str {
        match self {
            Fork::Main => "main",
            Fork::Fsm => "fsm",
            Fork::Vm => "vm",
            Fork::Init => "init",
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RelKind {
    Table,
    Index,
    ToastTable,
    ToastIndex,
    MaterializedView,
    Sequence,
}

/// Why a fork is not (or not entirely) read. Stable names: they appear in reports.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// The login role may not read it and cannot act as its owner.
    Permission,
    /// pg_prewarm is not installed in the database and could not be created.
    NoExtension,
    /// The database could not be reached during the run. No longer recorded by the engine (their
    /// ranges stay pending); kept so that reports and continuations of earlier versions still read.
    DatabaseUnreachable,
    /// The relation was dropped after it was planned.
    Dropped,
    /// Its database was dropped after it was planned.
    DatabaseDropped,
    /// The relation shrank after it was planned; the missing blocks no longer exist.
    Truncated,
    /// A lock could not be had within lock_timeout, on every attempt.
    LockTimeout,
    /// A single block could not be read within statement_timeout.
    StatementTimeout,
    /// The session was lost and could not be re-established in time.
    ConnectionLost,
    /// Any other server error (its message is in the detail).
    Error,
    /// A work item's calls read nothing, several in a row: each call's time was used up before a
    /// range could be read (a server too slow for the Warm function's timeout).
    NoProgress,
}

impl SkipReason {
    /// Blocks that vanished (dropped, truncated) no longer exist: they need no hydration and do not
    /// count against coverage.
    pub fn vanished(self) -> bool {
        matches!(self, SkipReason::Dropped | SkipReason::DatabaseDropped | SkipReason::Truncated)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Skip {
    pub reason: SkipReason,
    pub detail: String,
    /// The statement that would let the next run read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

/// One fork of one relation in one database.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ForkEntry {
    pub database: String,
    pub schema: String,
    pub name: String,
    pub oid: u32,
    pub kind: RelKind,
    pub fork: Fork,
    /// Blocks when planned (pg_relation_size / block_size).
    pub blocks: u64,
    /// `schema.table` of the table this relation belongs to (itself for tables).
    pub table: String,
    pub owner: String,
    /// Role to act as (SET ROLE) when reading, when the login role cannot read it itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub as_role: Option<String>,
    /// The login role may act as the owner (used when the server refuses a direct read).
    pub owner_settable: bool,
    /// Decided at planning time: excluded by a pattern, or unreadable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_skip: Option<Skip>,
    /// Excluded by the user's patterns: listed, never read, not counted in coverage.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub excluded: bool,
    /// The schema of the table in `table`, where it is not `schema` (TOAST relations, which live in
    /// pg_toast): with it `table` splits into schema and name exactly, whatever dots the names hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_schema: Option<String>,
    /// When the table is a partition: its ancestors up to the partition root, each [schema, name]. A
    /// pattern naming a partitioned table matches its partitions (and their indexes and TOAST).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partition_of: Vec<[String; 2]>,
}

impl ForkEntry {
    /// The schema and name of the table this fork belongs to.
    pub fn table_parts(&self) -> (&str, &str) {
        let schema = self.table_schema.as_deref().unwrap_or(&self.schema);
        match self.table.strip_prefix(schema).and_then(|rest| rest.strip_prefix('.')) {
            Some(name) => (schema, name),
            None => self.table.split_once('.').unwrap_or(("", &self.table)),
        }
    }

    /// Whether `pattern` names this fork's table, or a partitioned table it is a partition of.
    pub fn matched_by(&self, pattern: &RelationPattern) -> bool {
        let (schema, table) = self.table_parts();
        pattern.matches(&self.database, schema, table)
            || self.partition_of.iter().any(|[s, n]| pattern.matches(&self.database, s, n))
    }
}

/// What planning did with a database.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DatabaseOutcome {
    /// Listed; its forks are in the plan.
    Planned,
    /// Could not be planned (reason says why); counts against coverage unless it never could be read.
    Skipped,
    /// Left out by the include/exclude patterns or the default exclusions.
    Excluded,
}

impl DatabaseOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DatabaseOutcome::Planned => "planned",
            DatabaseOutcome::Skipped => "skipped",
            DatabaseOutcome::Excluded => "excluded",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DatabaseEntry {
    pub name: String,
    pub outcome: DatabaseOutcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The schema pg_prewarm's extension lives in. A label for people: the function a session calls
    /// is found again by that session on the server (`crate::sql`), never taken from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prewarm_schema: Option<String>,
    /// Whether this database being skipped makes the run incomplete (templates and
    /// non-connectable databases by definition do not).
    pub counts_against_coverage: bool,
}

/// Inclusive block range `[first, last]` of one fork (`fork` indexes `Plan::forks`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockRange {
    pub fork: u32,
    pub first: u64,
    pub last: u64,
}

impl BlockRange {
    pub fn blocks(&self) -> u64 {
        self.last - self.first + 1
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    pub format: u32,
    pub created_at: String,
    pub server: ServerInfo,
    pub range_blocks: u64,
    pub databases: Vec<DatabaseEntry>,
    pub forks: Vec<ForkEntry>,
    /// Ranges to read, in reading order.
    pub ranges: Vec<BlockRange>,
    pub plan_seconds: f64,
    /// What the plan took from captured hot sets (`pghydrate capture`); None when no database had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_set: Option<HotSetPlan>,
}

impl Plan {
    pub fn fork(&self, r: &BlockRange) -> &ForkEntry {
        &self.forks[r.fork as usize]
    }

    pub fn bytes(&self, blocks: u64) -> u64 {
        blocks * self.server.block_size
    }

    pub fn planned_blocks(&self) -> u64 {
        self.ranges.iter().map(BlockRange::blocks).sum()
    }

    /// A plan read from a file or state is data someone may have edited: see [`check_state`].
    pub fn validate(&self) -> crate::error::Result<()> {
        check_state(self.server.block_size, &self.ranges, self.forks.len())
    }
}

/// State read back from a file, S3 or Step Functions is data that someone may have edited: the block
/// size must be one PostgreSQL can have, and every range must name one of the `forks` forks listed and
/// be a block range (first <= last). Anything else is `InvalidInput`, never a panic.
pub fn check_state<'a>(
    block_size: u64,
    ranges: impl IntoIterator<Item = &'a BlockRange>,
    forks: usize,
) -> crate::error::Result<()> {
    use crate::error::Error;
    if !(512..=65536).contains(&block_size) || !block_size.is_power_of_two() {
        return Err(Error::InvalidInput(format!("block size {block_size} is not a PostgreSQL block size")));
    }
    for r in ranges {
        if r.fork as usize >= forks || r.first > r.last || r.last > u32::MAX as u64 {
            return Err(Error::InvalidInput(format!(
                "block range {r:?} does not fit the {forks} forks listed (or is not a block range)"
            )));
        }
    }
    Ok(())
}

/// Splits `blocks` blocks into consecutive inclusive ranges of at most `range_blocks`.
pub fn split_blocks(blocks: u64, range_blocks: u64) -> Vec<(u64, u64)> {
    assert!(range_blocks > 0, "range size must be positive");
    let mut out = Vec::with_capacity(blocks.div_ceil(range_blocks) as usize);
    let mut first = 0;
    while first < blocks {
        let last = (first + range_blocks - 1).min(blocks - 1);
        out.push((first, last));
        first = last + 1;
    }
    out
}

/// A captured hot range ([`crate::hotset`]) matched to a fork of the plan: blocks `[first, last]` of
/// `fork` (an index into `Plan::forks`), with its heat (the mean buffer usage count when captured).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HotSpan {
    pub fork: u32,
    pub first: u64,
    pub last: u64,
    pub heat: f32,
}

/// What the plan took from the captured hot sets of its databases.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HotSetPlan {
    /// Per database with a capture: when it was taken and what of it the plan uses.
    pub databases: Vec<crate::hotset::HotSetUse>,
    /// The hot phase's ranges, hottest region first, as they are in `Plan::ranges` (a range of them may be
    /// joined with its neighbours in the outcomes: the report intersects, it does not match).
    pub ranges: Vec<BlockRange>,
}

impl HotSetPlan {
    pub fn blocks(&self) -> u64 {
        self.ranges.iter().map(BlockRange::blocks).sum()
    }
}

/// The hot phase reads by region: an aligned window of this many blocks of a fork (8 MiB of 8 KiB
/// blocks), hottest region first, each region's hot blocks in block order. Hottest span first instead
/// put a lukewarm hot set's 512 KiB units in random order over a large table, one statement each: on
/// the lazy-volume simulator the hot phase then fetched 8-20% slower than the sequential rest, and
/// time to 100% was 1.07x that without a capture (`scripts/bench-normal.py --keys old`, docs/benchmark.md).
pub const HOT_REGION_BLOCKS: u64 = 1024;

/// A hot-phase region: a fork's index and the region's number (its first block / HOT_REGION_BLOCKS).
type RegionKey = (u32, u64);
/// Blocks first..=last of one fork.
type Interval = (u64, u64);

/// Builds the reading order for the forks that are to be read, in three phases:
/// 1. forks of tables matching a `first` pattern, whole, in pattern order (the user said so);
/// 2. the captured hot set (`hot`), each block once however the spans overlap, clipped to the fork's
///    size now (a span wholly past it is dropped), by region ([`HOT_REGION_BLOCKS`]): the regions with
///    the most heat per block first, each region's hot blocks in block order, adjacent spans joined;
/// 3. the rest: forks of at least one full range ("large"), newest blocks first, then the small forks
///    grouped by database (so that sessions do not hop between databases), largest first; a fork with
///    hot spans contributes only the blocks the hot phase did not read.
///
/// Newest first: a fork grows at its end (appended rows, pages split off an index), so its last blocks
/// are the ones most recently added, which applications read most (recent rows, the right-most leaves
/// of an index on a growing key). Each large fork's ranges go from its end back to its first block,
/// interleaved across the large forks by the share of the fork that lies after the range (every large
/// fork's last range, then every one's next, ...; ties: larger fork first). No giant relation is the
/// tail either: all large forks end together, spread over every session. The `first` tables' large
/// forks are ordered the same way, per pattern.
///
/// Returns every range in reading order, and the hot phase's ranges. Every block of every readable
/// fork is in exactly one range.
pub fn order_ranges(
    forks: &[ForkEntry],
    first: &[RelationPattern],
    range_blocks: u64,
    hot: &[HotSpan],
) -> (Vec<BlockRange>, Vec<BlockRange>) {
    let is_readable = |f: &ForkEntry| f.planned_skip.is_none() && !f.excluded && f.blocks > 0;
    let mut readable: Vec<(usize, &ForkEntry)> = forks.iter().enumerate().filter(|(_, f)| is_readable(f)).collect();
    let priority = |f: &ForkEntry| -> usize { first.iter().position(|p| f.matched_by(p)).unwrap_or(first.len()) };
    readable.sort_by(|(ia, a), (ib, b)| {
        let pa = priority(a);
        let pb = priority(b);
        let large_a = a.blocks >= range_blocks;
        let large_b = b.blocks >= range_blocks;
        pa.cmp(&pb)
            .then(large_b.cmp(&large_a))
            .then_with(|| if large_a { std::cmp::Ordering::Equal } else { a.database.cmp(&b.database) })
            .then(b.blocks.cmp(&a.blocks))
            .then(ia.cmp(ib))
    });

    // Phase 2's spans: of readable forks not read whole in phase 1, within the fork, hottest first.
    let mut spans: Vec<HotSpan> = hot
        .iter()
        .filter_map(|s| {
            let f = forks.get(s.fork as usize)?;
            if !is_readable(f) || priority(f) < first.len() || s.first > s.last || s.first >= f.blocks {
                return None;
            }
            Some(HotSpan { last: s.last.min(f.blocks - 1), ..*s })
        })
        .collect();
    spans.sort_by(|a, b| {
        let heat = |h: f32| if h.is_nan() { f32::NEG_INFINITY } else { h };
        heat(b.heat).total_cmp(&heat(a.heat)).then(a.fork.cmp(&b.fork)).then(a.first.cmp(&b.first))
    });
    // Per fork: the disjoint block intervals phase 2 reads, first -> last. Where spans overlap, a block
    // counts with the hottest span's heat.
    let mut taken: std::collections::HashMap<u32, std::collections::BTreeMap<u64, u64>> = Default::default();
    // Per region (a fork and an aligned window of HOT_REGION_BLOCKS): its heat times blocks, and the
    // intervals of it phase 2 reads.
    let mut regions: std::collections::HashMap<RegionKey, (f64, Vec<Interval>)> = Default::default();
    for s in spans {
        let fork_taken = taken.entry(s.fork).or_default();
        let heat = if s.heat.is_finite() { f64::from(s.heat.max(0.0)) } else { 0.0 };
        for (a, b) in uncovered(fork_taken, s.first, s.last) {
            fork_taken.insert(a, b);
            let mut x = a;
            while x <= b {
                let region = x / HOT_REGION_BLOCKS;
                let end = b.min((region + 1) * HOT_REGION_BLOCKS - 1);
                let r = regions.entry((s.fork, region)).or_default();
                r.0 += heat * (end - x + 1) as f64;
                r.1.push((x, end));
                x = end + 1;
            }
        }
    }
    // Hottest region first (heat per block of the region, so a small relation read hot whole comes
    // before a large one's lukewarm stretch), each read in block order, adjacent intervals as one range.
    let mut regions: Vec<(RegionKey, f64, Vec<Interval>)> = regions
        .into_iter()
        .map(|((fork, region), (mass, intervals))| {
            let blocks = forks[fork as usize].blocks;
            let size = HOT_REGION_BLOCKS.min(blocks - region * HOT_REGION_BLOCKS);
            ((fork, region), mass / size as f64, intervals)
        })
        .collect();
    regions.sort_by(|(ka, da, _), (kb, db, _)| db.total_cmp(da).then(ka.cmp(kb)));
    let mut hot_ranges = Vec::new();
    for ((fork, _), _, mut intervals) in regions {
        intervals.sort_unstable();
        let mut joined: Vec<(u64, u64)> = Vec::with_capacity(intervals.len());
        for (a, b) in intervals {
            match joined.last_mut() {
                Some(last) if last.1 + 1 == a => last.1 = b,
                _ => joined.push((a, b)),
            }
        }
        for (a, b) in joined {
            for (x, y) in split_blocks(b - a + 1, range_blocks) {
                hot_ranges.push(BlockRange { fork, first: a + x, last: a + y });
            }
        }
    }

    let mut ranges = Vec::new();
    let mut rest = Vec::new();
    let empty = std::collections::BTreeMap::new();
    // `readable` is sorted by priority: each pattern's forks, then the rest, each group large first.
    for group in readable.chunk_by(|(_, a), (_, b)| priority(a) == priority(b)) {
        let out = if priority(group[0].1) < first.len() { &mut ranges } else { &mut rest };
        let mut large = Vec::new(); // (the fork's rank in the group, its blocks, a range)
        let mut small = Vec::new();
        for (rank, &(i, f)) in group.iter().enumerate() {
            let fork_taken = taken.get(&(i as u32)).unwrap_or(&empty);
            for (a, b) in uncovered(fork_taken, 0, f.blocks - 1) {
                for (x, y) in split_blocks(b - a + 1, range_blocks) {
                    let r = BlockRange { fork: i as u32, first: a + x, last: a + y };
                    if f.blocks >= range_blocks {
                        large.push((rank, f.blocks, r));
                    } else {
                        small.push(r);
                    }
                }
            }
        }
        // The share of its fork after a range, (blocks - 1 - last) / blocks, compared exactly.
        large.sort_by(|(rank_a, n_a, a), (rank_b, n_b, b)| {
            let after_a = u128::from(n_a - 1 - a.last) * u128::from(*n_b);
            let after_b = u128::from(n_b - 1 - b.last) * u128::from(*n_a);
            after_a.cmp(&after_b).then(rank_a.cmp(rank_b))
        });
        out.extend(large.into_iter().map(|(_, _, r)| r));
        out.extend(small);
    }
    ranges.extend(hot_ranges.iter().copied());
    ranges.extend(rest);
    (ranges, hot_ranges)
}

/// The parts of `[first, last]` that no interval of `taken` (disjoint, keyed by first block) covers.
fn uncovered(taken: &std::collections::BTreeMap<u64, u64>, first: u64, last: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut next = first;
    // The interval that starts before `first` may reach into it.
    let before = taken.range(..first).next_back().map(|(&a, &b)| (a, b));
    for (a, b) in before.into_iter().chain(taken.range(first..=last).map(|(&a, &b)| (a, b))) {
        if b < next {
            continue;
        }
        if a > next {
            out.push((next, a - 1));
        }
        next = b.saturating_add(1);
        if next > last {
            return out;
        }
    }
    out.push((next, last));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fork(db: &str, table: &str, blocks: u64) -> ForkEntry {
        ForkEntry {
            database: db.into(),
            schema: "public".into(),
            name: table.into(),
            oid: 1,
            kind: RelKind::Table,
            fork: Fork::Main,
            blocks,
            table: format!("public.{table}"),
            owner: "o".into(),
            as_role: None,
            owner_settable: false,
            planned_skip: None,
            excluded: false,
            table_schema: None,
            partition_of: Vec::new(),
        }
    }

    proptest! {
        /// Ranges of a fork never overlap, leave no gap, stay within the fork and respect the size.
        #[test]
        fn split_covers_exactly(blocks in 0u64..200_000, range_blocks in 1u64..20_000) {
            let ranges = split_blocks(blocks, range_blocks);
            let mut next = 0;
            for (first, last) in &ranges {
                prop_assert_eq!(*first, next);
                prop_assert!(last >= first);
                prop_assert!(last - first < range_blocks);
                next = last + 1;
            }
            prop_assert_eq!(next, blocks);
        }

        /// The ordered plan holds every block of every readable fork exactly once, whatever hot spans
        /// (overlapping, past the end, of unreadable or unknown forks, NaN heat) it is given; the hot
        /// phase comes first and reads only blocks of its spans.
        #[test]
        fn ordering_covers_every_readable_block_once(
            sizes in proptest::collection::vec((0u64..50_000, 0usize..3, any::<bool>()), 0..40),
            range_blocks in 1u64..10_000,
            spans in proptest::collection::vec((0u32..45, 0u64..60_000, 0u64..20_000, -1.0f32..6.0), 0..30),
        ) {
            let forks: Vec<ForkEntry> = sizes.iter().enumerate().map(|(i, (b, db, skip))| {
                let mut f = fork(&format!("db{db}"), &format!("t{i}"), *b);
                if *skip {
                    f.planned_skip = Some(Skip { reason: SkipReason::Permission, detail: String::new(), fix: None });
                }
                f
            }).collect();
            let hot: Vec<HotSpan> = spans.iter().map(|&(fork, first, len, heat)| HotSpan {
                fork, first, last: first + len, heat: if heat < 0.0 { f32::NAN } else { heat },
            }).collect();
            let (ranges, hot_ranges) = order_ranges(&forks, &[], range_blocks, &hot);
            prop_assert_eq!(&ranges[..hot_ranges.len()], &hot_ranges[..]);
            for r in &hot_ranges {
                // Within the union of the fork's spans (adjacent spans are read as one range).
                let mut of_fork: Vec<(u64, u64)> =
                    hot.iter().filter(|s| s.fork == r.fork).map(|s| (s.first, s.last)).collect();
                of_fork.sort();
                let mut union: Vec<(u64, u64)> = Vec::new();
                for (a, b) in of_fork {
                    match union.last_mut() {
                        Some(last) if a <= last.1 + 1 => last.1 = last.1.max(b),
                        _ => union.push((a, b)),
                    }
                }
                prop_assert!(union.iter().any(|&(a, b)| a <= r.first && r.last <= b), "{:?} not in {:?}", r, union);
                prop_assert!(r.blocks() <= range_blocks);
                prop_assert_eq!(r.first / HOT_REGION_BLOCKS, r.last / HOT_REGION_BLOCKS, "{:?} crosses a region", r);
            }
            let mut per_fork: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = Default::default();
            for r in &ranges { per_fork.entry(r.fork).or_default().push((r.first, r.last)); }
            // After the hot phase, every large fork is read newest first: its ranges' first blocks fall.
            let mut after_hot: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
            for r in &ranges[hot_ranges.len()..] { after_hot.entry(r.fork).or_default().push(r.first); }
            for (fork, firsts) in &after_hot {
                if forks[*fork as usize].blocks >= range_blocks {
                    prop_assert!(firsts.windows(2).all(|w| w[0] > w[1]), "fork {} read {:?}", fork, firsts);
                }
            }
            for (i, f) in forks.iter().enumerate() {
                let mut got = per_fork.remove(&(i as u32)).unwrap_or_default();
                got.sort();
                if f.planned_skip.is_some() { prop_assert!(got.is_empty()); continue; }
                let mut next = 0;
                for (first, last) in got { prop_assert_eq!(first, next); next = last + 1; }
                prop_assert_eq!(next, f.blocks);
            }
        }
    }

    #[test]
    fn priority_then_newest_first_then_small_by_database() {
        let forks = vec![
            fork("b", "small_b", 3),
            fork("a", "big", 100),
            fork("a", "small_a", 5),
            fork("a", "urgent", 2),
            fork("c", "bigger", 300),
        ];
        let first = vec![RelationPattern::parse("urgent").unwrap()];
        let (ranges, hot) = order_ranges(&forks, &first, 50, &[]);
        assert!(hot.is_empty());
        let order: Vec<&str> = ranges.iter().map(|r| forks[r.fork as usize].name.as_str()).collect();
        assert_eq!(
            order,
            ["urgent", "bigger", "big", "bigger", "bigger", "bigger", "big", "bigger", "bigger", "small_a", "small_b"]
        );
        // Newest first: each large fork from its last range back to its first.
        let firsts = |name: &str| -> Vec<u64> {
            ranges.iter().filter(|r| forks[r.fork as usize].name == name).map(|r| r.first).collect()
        };
        assert_eq!(firsts("bigger"), [250, 200, 150, 100, 50, 0]);
        assert_eq!(firsts("big"), [50, 0]);
    }

    /// The hot phase goes region by region, the most heat per block first, and reads a region's hot
    /// blocks in block order, adjacent spans as one range, whatever their heat order; a small relation
    /// read hot whole comes before a large one's lukewarm stretch.
    #[test]
    fn hot_spans_by_region_in_block_order() {
        let r = HOT_REGION_BLOCKS;
        let forks = vec![fork("a", "big", 4 * r), fork("a", "hot_index", 10)];
        let span = |fork, first, last, heat| HotSpan { fork, first, last, heat };
        let hot = [
            // Region 2 of big: three units, lukewarm, given hottest first.
            span(0, 2 * r + 640, 2 * r + 703, 1.5),
            span(0, 2 * r + 64, 2 * r + 127, 1.0),
            span(0, 2 * r + 128, 2 * r + 191, 1.2),
            // Region 0 of big: one hot unit, less heat per block of the region than region 2.
            span(0, 0, 63, 3.0),
            // The small index, all of it hot.
            span(1, 0, 9, 3.0),
        ];
        let (ranges, hot_ranges) = order_ranges(&forks, &[], 8192, &hot);
        assert_eq!(
            hot_ranges,
            [
                BlockRange { fork: 1, first: 0, last: 9 },
                BlockRange { fork: 0, first: 2 * r + 64, last: 2 * r + 191 },
                BlockRange { fork: 0, first: 2 * r + 640, last: 2 * r + 703 },
                BlockRange { fork: 0, first: 0, last: 63 },
            ]
        );
        assert_eq!(&ranges[..4], &hot_ranges[..]);
    }

    /// A `--first` table's large forks are read newest first too, before everything else; a hot span
    /// in the rest takes its blocks out of the newest-first order, not out of coverage.
    #[test]
    fn first_tables_and_hot_spans_newest_first() {
        let forks = vec![fork("a", "log", 120), fork("a", "urgent", 100), fork("a", "small", 7)];
        let first = vec![RelationPattern::parse("urgent").unwrap()];
        let hot = [HotSpan { fork: 0, first: 40, last: 59, heat: 5.0 }];
        let (ranges, hot_ranges) = order_ranges(&forks, &first, 50, &hot);
        let got: Vec<(&str, u64, u64)> =
            ranges.iter().map(|r| (forks[r.fork as usize].name.as_str(), r.first, r.last)).collect();
        assert_eq!(
            got,
            [
                ("urgent", 50, 99),
                ("urgent", 0, 49),
                ("log", 40, 59),
                ("log", 110, 119),
                ("log", 60, 109),
                ("log", 0, 39),
                ("small", 0, 6),
            ]
        );
        assert_eq!(hot_ranges, [BlockRange { fork: 0, first: 40, last: 59 }]);
    }
}
