//! The hot set: what a running server keeps in shared buffers, written into each database itself so
//! that every snapshot, point-in-time restore, read replica and Blue/Green green environment of it
//! carries it; after a restore the plan reads it first ([`crate::plan::order_ranges`]).
//!
//! **Capture** ([`capture`]) reads pg_buffercache once, summarized on the server into runs of
//! consecutive cached blocks, resolves each run's filenode to its relation in its database, compacts
//! the runs into at most `max_ranges` block ranges per database (merging the smallest gaps first: a
//! merged gap costs a few extra blocks read early, never a block unread), and replaces the previous
//! capture in one transaction: `pghydrate.hot_set` (one row per range) and `pghydrate.capture` (one
//! row: when, from what). Nothing else in the database is written. It needs pg_buffercache installed
//! in the database it connects to (`CREATE EXTENSION pg_buffercache`) and a role that may read it
//! (`pg_monitor`), and in each database the right to create the schema `pghydrate` (or to own it).
//!
//! **Size.** A stored range takes 71 bytes on disk, measured (tuple header, seven columns, line
//! pointer, page overhead: 11,154 ranges in 794,624 bytes), so the default cap of
//! [`DEFAULT_MAX_RANGES`] ranges keeps a database's hot set under 4.5 MiB however scattered its
//! buffers: 64 GiB of shared buffers are 8.4 million buffers, and every other block cached would be
//! 4.2 million runs before compaction (`sixty_four_gib_of_scattered_buffers_compact_to_the_cap`
//! compacts exactly that; `tests/tests/hotset.rs` measures the bytes per range on a real server).
//!
//! **Trust.** The schema and tables must be owned by the capturing role (a schema someone else made
//! first is refused, not written into: their trigger or rule would run as us). Replay treats the hot set
//! as data from anyone: it reads it only when both relations are plain tables of exactly the columns
//! capture writes, without row security or inheritance children (so a SELECT runs no one's code), at
//! most [`READ_LIMIT`] rows, and every range is checked against the catalog now (relation, filenode,
//! size). The worst a forged hot set can do is change the order of reading; every block is still read.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::bounded::{bounded, client_bound};
use crate::catalog::quote_ident;
use crate::connect::ConnectionSpec;
use crate::error::{describe, Error, Result};
use crate::plan::{BlockRange, Fork};

/// Ranges per database a capture keeps at most (see the module's size note).
pub const DEFAULT_MAX_RANGES: usize = 65_536;
/// The unit a lazily loaded volume fetches: EBS snapshots store 512 KiB blocks, and the first read of
/// any part of one fetches all of it. Replay widens each hot range to whole units of this size.
pub const FETCH_BYTES: u64 = 512 * 1024;

/// `[first, last]` widened to whole units of `align` blocks (the plan clips to the fork's end).
pub fn aligned(first: u64, last: u64, align: u64) -> (u64, u64) {
    let align = align.max(1);
    (first - first % align, last.saturating_add(align - 1 - last % align))
}

/// Rows replay reads at most from one database's hot set: a table grown by hand or by someone hostile
/// cannot grow the plan without bound.
pub const READ_LIMIT: i64 = 1_000_000;

const HOT_SET_COLUMNS: &[&str] = &[
    "relid oid",
    "relfilenode oid",
    "fork text",
    "first_block bigint",
    "last_block bigint",
    "heat real",
    "cached_blocks integer",
];
const CAPTURE_COLUMNS: &[&str] = &[
    "captured_at timestamp with time zone",
    "tool text",
    "server_version text",
    "shared_buffers bigint",
    "buffers bigint",
    "runs integer",
    "ranges integer",
    "largest_gap_merged bigint",
    "forks_dropped integer",
];

/// Cached blocks `[first, last]` of one relation fork, as captured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachedRun {
    pub relid: u32,
    pub filenode: u32,
    pub fork: Fork,
    pub first: u64,
    pub last: u64,
    /// Buffers of the range that were cached (fewer than its blocks once gaps are merged).
    pub buffers: u64,
    /// Their usage counts, summed.
    pub usage: u64,
}

impl CachedRun {
    /// Mean usage count of its cached buffers (0 to 5): the range's heat.
    pub fn heat(&self) -> f32 {
        if self.buffers == 0 {
            0.0
        } else {
            self.usage as f32 / self.buffers as f32
        }
    }
}

fn fork_number(f: Fork) -> u8 {
    match f {
        Fork::Main => 0,
        Fork::Fsm => 1,
        Fork::Vm => 2,
        Fork::Init => 3,
    }
}

fn fork_from_number(n: i32) -> Option<Fork> {
    Some(match n {
        0 => Fork::Main,
        1 => Fork::Fsm,
        2 => Fork::Vm,
        3 => Fork::Init,
        _ => return None,
    })
}

fn fork_from_name(s: &str) -> Option<Fork> {
    Fork::ALL.into_iter().find(|f| f.as_str() == s)
}

/// What [`compact`] made of the runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Compacted {
    pub ranges: Vec<CachedRun>,
    /// Runs before compaction.
    pub runs: usize,
    /// The largest gap (uncached blocks) that merging took into a range.
    pub largest_gap_merged: u64,
    /// Forks left out because there were more forks than `max_ranges` (the coldest, by summed usage).
    pub forks_dropped: usize,
}

/// At most `max_ranges` ranges covering every cached block of `runs` (overlapping or touching runs of
/// a fork are joined first). Where there are more, the smallest gaps within a fork are merged first;
/// where even one range per fork is too many, the coldest forks are left out.
pub fn compact(mut runs: Vec<CachedRun>, max_ranges: usize) -> Compacted {
    let max_ranges = max_ranges.max(1);
    let key = |r: &CachedRun| (r.relid, fork_number(r.fork));
    runs.sort_by_key(|r| (key(r), r.first));
    let before = runs.len();
    // Join what touches or overlaps.
    let mut joined: Vec<CachedRun> = Vec::with_capacity(runs.len());
    for r in runs {
        match joined.last_mut() {
            Some(l) if key(l) == key(&r) && r.first <= l.last.saturating_add(1) => {
                l.last = l.last.max(r.last);
                l.buffers += r.buffers;
                l.usage += r.usage;
            }
            _ => joined.push(r),
        }
    }
    // Forks: at most max_ranges of them, the hottest (summed usage, then buffers).
    let mut forks: Vec<((u32, u8), u64, u64)> = Vec::new();
    for r in &joined {
        match forks.last_mut() {
            Some((k, u, b)) if *k == key(r) => {
                *u += r.usage;
                *b += r.buffers;
            }
            _ => forks.push((key(r), r.usage, r.buffers)),
        }
    }
    let mut forks_dropped = 0;
    if forks.len() > max_ranges {
        let mut order: Vec<usize> = (0..forks.len()).collect();
        order.sort_by(|&a, &b| forks[b].1.cmp(&forks[a].1).then(forks[b].2.cmp(&forks[a].2)).then(a.cmp(&b)));
        let kept: std::collections::HashSet<(u32, u8)> = order[..max_ranges].iter().map(|&i| forks[i].0).collect();
        forks_dropped = forks.len() - max_ranges;
        joined.retain(|r| kept.contains(&key(r)));
    }
    // Merge the smallest gaps until at most max_ranges remain.
    let excess = joined.len().saturating_sub(max_ranges);
    let mut merge = vec![false; joined.len()];
    let mut largest_gap_merged = 0;
    if excess > 0 {
        let mut gaps: Vec<(u64, usize)> = (1..joined.len())
            .filter(|&i| key(&joined[i]) == key(&joined[i - 1]))
            .map(|i| (joined[i].first - joined[i - 1].last - 1, i))
            .collect();
        gaps.sort_unstable();
        for &(gap, i) in gaps.iter().take(excess) {
            merge[i] = true;
            largest_gap_merged = largest_gap_merged.max(gap);
        }
    }
    let mut ranges: Vec<CachedRun> = Vec::with_capacity(joined.len() - excess);
    for (i, r) in joined.into_iter().enumerate() {
        if merge[i] {
            let l = ranges.last_mut().expect("a merged run follows a run of its fork");
            l.last = r.last;
            l.buffers += r.buffers;
            l.usage += r.usage;
        } else {
            ranges.push(r);
        }
    }
    Compacted { ranges, runs: before, largest_gap_merged, forks_dropped }
}

/// What to capture.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    pub max_ranges: usize,
    /// Database name globs; empty: every database with cached blocks.
    pub include_databases: Vec<String>,
    pub exclude_databases: Vec<String>,
    /// Capture nothing from a server up for less than this: right after a restart (or a restore, a
    /// failover) its buffers hold what the first queries and any hydration read, not yet the
    /// application's hot set, and a capture would replace a good one with that.
    pub min_uptime: Option<std::time::Duration>,
    /// Start no database's capture after this instant (a Lambda call's deadline less its margin):
    /// databases are captured hottest first (most cached buffers), so what time allows is what matters
    /// most; the rest are reported not captured and keep their previous capture.
    pub deadline: Option<Instant>,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            max_ranges: DEFAULT_MAX_RANGES,
            include_databases: Vec::new(),
            exclude_databases: Vec::new(),
            min_uptime: None,
            deadline: None,
        }
    }
}

/// One database's capture.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CapturedDatabase {
    pub database: String,
    /// Buffers of this database in the cache.
    pub buffers: u64,
    /// Buffers whose filenode no relation has any more (dropped or rewritten since they were read).
    pub unresolved_buffers: u64,
    pub runs: usize,
    pub ranges: usize,
    /// Blocks the stored ranges span (cached blocks plus merged gaps).
    pub blocks: u64,
    pub largest_gap_merged: u64,
    pub forks_dropped: usize,
    /// pg_total_relation_size of pghydrate.hot_set after the capture.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table_bytes: Option<i64>,
    /// Why nothing was stored (the previous capture, if any, is unchanged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CaptureReport {
    pub server: String,
    pub block_size: u64,
    /// shared_buffers, in buffers.
    pub shared_buffers: u64,
    /// Buffers holding a block of some database (shared catalogs left out).
    pub buffers_cached: u64,
    /// How long the one read of pg_buffercache took.
    pub read_seconds: f64,
    pub seconds: f64,
    pub databases: Vec<CapturedDatabase>,
    /// Databases with cached blocks that were left out by the patterns or cannot be connected to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<String>,
    /// Seconds since the server started (pg_postmaster_start_time).
    #[serde(default)]
    pub uptime_seconds: f64,
    /// Why nothing was captured on purpose (a server up for less than the minimum uptime): every
    /// database keeps its previous capture. Not a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

impl CaptureReport {
    /// Every database with cached blocks was captured, or nothing was, on purpose ([`Self::skipped`]).
    pub fn complete(&self) -> bool {
        self.databases.iter().all(|d| d.error.is_none())
    }

    pub fn summary(&self) -> String {
        if let Some(why) = &self.skipped {
            return format!("captured nothing: {why}; every database keeps its previous capture\n");
        }
        let mut out = format!(
            "captured the hot set of {} database(s): {} of {} buffers cached ({}), read in {:.2} s, {:.2} s in all\n",
            self.databases.iter().filter(|d| d.error.is_none()).count(),
            self.buffers_cached,
            self.shared_buffers,
            crate::report::human_bytes(self.buffers_cached * self.block_size),
            self.read_seconds,
            self.seconds
        );
        for d in &self.databases {
            match &d.error {
                Some(e) => out.push_str(&format!("  {}: NOT captured: {e}\n", d.database)),
                None => out.push_str(&format!(
                    "  {}: {} buffers -> {} runs -> {} ranges ({} blocks; largest gap merged {} blocks{}{}), table {}\n",
                    d.database,
                    d.buffers,
                    d.runs,
                    d.ranges,
                    d.blocks,
                    d.largest_gap_merged,
                    if d.forks_dropped > 0 { format!("; {} coldest forks left out", d.forks_dropped) } else { String::new() },
                    if d.unresolved_buffers > 0 {
                        format!("; {} buffers of dropped or rewritten relations", d.unresolved_buffers)
                    } else {
                        String::new()
                    },
                    d.table_bytes.map_or("?".into(), |b| crate::report::human_bytes(b as u64)),
                )),
            }
        }
        for d in &self.left_out {
            out.push_str(&format!("  {d}: left out\n"));
        }
        out
    }
}

/// Whether the schema pghydrate exists here, and if so whether the login role owns it and who does.
async fn schema_owner(
    tx: &tokio_postgres::Transaction<'_>,
) -> std::result::Result<Option<(bool, String)>, tokio_postgres::Error> {
    Ok(tx
        .query_opt(
            "SELECT n.nspowner = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user),
                    pg_catalog.pg_get_userbyid(n.nspowner)::text
               FROM pg_catalog.pg_namespace n WHERE n.nspname = 'pghydrate'",
            &[],
        )
        .await?
        .map(|row| (row.get(0), row.get(1))))
}

/// Captures the hot set of every database with cached blocks (see the module documentation).
pub async fn capture(spec: &ConnectionSpec, opts: &CaptureOptions) -> Result<CaptureReport> {
    let started = Instant::now();
    if opts.max_ranges == 0 {
        return Err(Error::InvalidInput("--max-ranges must be at least 1".into()));
    }
    let (client, first_db) = crate::catalog::connect_any(spec).await?;
    let server = crate::catalog::server_info(spec, &client).await?;
    if server.in_recovery {
        return Err(Error::InvalidInput(
            "this server is a standby (read replica): capture writes the hot set into each database, so run it \
             against the primary"
                .into(),
        ));
    }
    let uptime = client
        .query_one("SELECT extract(epoch FROM pg_catalog.now() - pg_catalog.pg_postmaster_start_time())::float8", &[])
        .await
        .map_err(|e| Error::query("reading the server's start time", e))?;
    let uptime_seconds: f64 = uptime.get(0);
    if let Some(min) = opts.min_uptime.filter(|m| uptime_seconds < m.as_secs_f64()) {
        let why = format!(
            "the server started {} ago, less than the minimum uptime of {}: its buffers do not hold the \
             application's hot set yet",
            minutes(uptime_seconds),
            minutes(min.as_secs_f64())
        );
        info!(uptime_seconds, min_uptime_seconds = min.as_secs(), "hot set not captured: the server is too young");
        return Ok(CaptureReport {
            server: server.version.clone(),
            block_size: server.block_size,
            shared_buffers: 0,
            buffers_cached: 0,
            read_seconds: 0.0,
            seconds: started.elapsed().as_secs_f64(),
            databases: Vec::new(),
            left_out: Vec::new(),
            uptime_seconds,
            skipped: Some(why),
        });
    }
    let Some(read) =
        crate::sql::buffercache_runs(&client).await.map_err(|e| Error::query("finding pg_buffercache", e))?
    else {
        return Err(Error::Unsupported(format!(
            "pg_buffercache is not installed in database {first_db:?}; fix: CREATE EXTENSION pg_buffercache (as a \
             superuser or rds_superuser) in it, and GRANT pg_monitor TO {}",
            quote_ident(&server.login_role)
        )));
    };
    let settings = client
        .query_one(
            "SELECT pg_catalog.pg_size_bytes(current_setting('shared_buffers')) / current_setting('block_size')::int8",
            &[],
        )
        .await
        .map_err(|e| Error::query("reading shared_buffers", e))?;
    let shared_buffers = settings.get::<_, i64>(0) as u64;
    let dbs = client
        .query("SELECT oid, datname::text, datallowconn AND NOT datistemplate FROM pg_catalog.pg_database", &[])
        .await
        .map_err(|e| Error::query("listing databases", e))?;
    let names: HashMap<u32, (String, bool)> = dbs.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect();

    // Runs per database: (tablespace, filenode, fork, first, last, buffers, usage).
    type Run = (u32, u32, Fork, u64, u64, u64, u64);
    let mut by_db: BTreeMap<String, Vec<Run>> = BTreeMap::new();
    let mut left_out = Vec::new();
    let mut buffers_cached = 0;
    // Streamed, each row kept as a 48-byte run as it arrives: a row of the driver takes a few hundred
    // bytes, and a scattered cache of 64 GiB can have millions of runs (docs/benchmark.md, "capture").
    let bound = client_bound(spec.statement_timeout(), std::time::Duration::from_secs(600));
    let read_started = Instant::now();
    let read_runs = async {
        let no_params: [&(dyn tokio_postgres::types::ToSql + Sync); 0] = [];
        let stream =
            client.query_raw(read.as_str(), no_params.iter().map(|p| *p as &dyn tokio_postgres::types::ToSql)).await?;
        futures_util::pin_mut!(stream);
        while let Some(r) = futures_util::TryStreamExt::try_next(&mut stream).await? {
            let db: u32 = r.get(0);
            let Some(fork) = fork_from_number(r.get(3)) else { continue };
            let buffers = r.get::<_, i64>(6) as u64;
            buffers_cached += buffers;
            let Some((name, connectable)) = names.get(&db) else { continue };
            let included = if opts.include_databases.is_empty() {
                !crate::catalog::DEFAULT_EXCLUDED_DATABASES.contains(&name.as_str())
            } else {
                opts.include_databases.iter().any(|p| crate::pattern::glob(p, name))
            };
            if !connectable || !included || opts.exclude_databases.iter().any(|p| crate::pattern::glob(p, name)) {
                if !left_out.contains(name) {
                    left_out.push(name.clone());
                }
                continue;
            }
            by_db.entry(name.clone()).or_default().push((
                r.get(1),
                r.get(2),
                fork,
                r.get::<_, i64>(4) as u64,
                r.get::<_, i64>(5) as u64,
                buffers,
                r.get::<_, i64>(7) as u64,
            ));
        }
        Ok::<(), tokio_postgres::Error>(())
    };
    bounded(spec, &client, bound, read_runs).await.map_err(|f| match f {
        crate::bounded::Failed::Server(e)
            if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
        {
            Error::InvalidInput(format!(
                "{} may not read pg_buffercache ({}); fix: GRANT pg_monitor TO {}",
                server.login_role,
                describe(&e),
                quote_ident(&server.login_role)
            ))
        }
        other => other.into_error(spec.target(), "reading pg_buffercache"),
    })?;
    let read_seconds = read_started.elapsed().as_secs_f64();
    drop(client);
    // Hottest first (most buffers; then by name): a deadline leaves out what matters least.
    let mut by_db: Vec<(String, Vec<Run>)> = by_db.into_iter().collect();
    by_db.sort_by_key(|(name, runs)| (std::cmp::Reverse(runs.iter().map(|r| r.5).sum::<u64>()), name.clone()));
    let mut databases = Vec::new();
    for (db, runs) in by_db {
        let buffers: u64 = runs.iter().map(|r| r.5).sum();
        let mut d = CapturedDatabase {
            database: db.clone(),
            buffers,
            unresolved_buffers: 0,
            runs: runs.len(),
            ranges: 0,
            blocks: 0,
            largest_gap_merged: 0,
            forks_dropped: 0,
            table_bytes: None,
            error: None,
        };
        if opts.deadline.is_some_and(|until| Instant::now() >= until) {
            warn!(database = %db, "hot set not captured: out of time");
            d.error = Some(
                "not captured: the time ran out first (databases are captured hottest first); its previous capture, \
                 if any, stays"
                    .into(),
            );
            databases.push(d);
            continue;
        }
        match capture_database(spec, &server, &db, runs, shared_buffers, opts.max_ranges, &mut d).await {
            Ok(()) => info!(database = %db, ranges = d.ranges, blocks = d.blocks, "hot set captured"),
            Err(e) => {
                warn!(database = %db, error = %e, "hot set not captured");
                d.error = Some(e.to_string());
            }
        }
        databases.push(d);
    }
    Ok(CaptureReport {
        server: server.version.clone(),
        block_size: server.block_size,
        shared_buffers,
        buffers_cached,
        read_seconds,
        seconds: started.elapsed().as_secs_f64(),
        databases,
        left_out,
        uptime_seconds,
        skipped: None,
    })
}

/// "42 min", "3.5 h", "2.0 d".
fn minutes(seconds: f64) -> String {
    let m = seconds / 60.0;
    if m < 120.0 {
        format!("{m:.0} min")
    } else if m < 48.0 * 60.0 {
        format!("{:.1} h", m / 60.0)
    } else {
        format!("{:.1} d", m / 1440.0)
    }
}

async fn capture_database(
    spec: &ConnectionSpec,
    server: &crate::plan::ServerInfo,
    db: &str,
    runs: Vec<(u32, u32, Fork, u64, u64, u64, u64)>,
    shared_buffers: u64,
    max_ranges: usize,
    d: &mut CapturedDatabase,
) -> Result<()> {
    let mut client = spec.connect(db).await?;
    // Filenodes to relations, in this database (0 for its default tablespace is handled by the server).
    let mut files: Vec<(u32, u32)> = runs.iter().map(|r| (r.0, r.1)).collect();
    files.sort_unstable();
    files.dedup();
    let (ts, fns): (Vec<u32>, Vec<u32>) = files.iter().copied().unzip();
    let resolved = client
        .query(
            "SELECT u.t, u.f, pg_catalog.pg_filenode_relation(u.t, u.f)::pg_catalog.oid
               FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.oid[]), pg_catalog.unnest($2::pg_catalog.oid[])) AS u(t, f)",
            &[&ts, &fns],
        )
        .await
        .map_err(|e| Error::query("resolving filenodes to relations", e))?;
    let relids: HashMap<(u32, u32), u32> =
        resolved.iter().filter_map(|r| Some(((r.get(0), r.get(1)), r.get::<_, Option<u32>>(2)?))).collect();
    let mut cached = Vec::with_capacity(runs.len());
    for (t, f, fork, first, last, buffers, usage) in runs {
        match relids.get(&(t, f)) {
            Some(&relid) if relid != 0 => {
                cached.push(CachedRun { relid, filenode: f, fork, first, last, buffers, usage })
            }
            _ => d.unresolved_buffers += buffers,
        }
    }
    let c = compact(cached, max_ranges);
    d.ranges = c.ranges.len();
    d.blocks = c.ranges.iter().map(|r| r.last - r.first + 1).sum();
    d.largest_gap_merged = c.largest_gap_merged;
    d.forks_dropped = c.forks_dropped;

    let tx = client.transaction().await.map_err(|e| Error::query("starting the capture's transaction", e))?;
    let schema = schema_owner(&tx).await.map_err(|e| Error::query("looking for the schema pghydrate", e))?;
    match schema {
        None => tx.batch_execute("CREATE SCHEMA pghydrate").await.map_err(|e| {
            let context = format!(
                "creating the schema pghydrate; fix: GRANT CREATE ON DATABASE {} TO {}",
                quote_ident(db),
                quote_ident(&server.login_role)
            );
            Error::query(context, e)
        })?,
        Some((false, owner)) => {
            return Err(Error::InvalidInput(format!(
                "the schema pghydrate in database {db:?} belongs to {owner}, not {}: refusing to write into a schema \
                 someone else controls; its owner can drop it (DROP SCHEMA pghydrate CASCADE) or run the capture",
                server.login_role
            )));
        }
        Some((true, _)) => {}
    }
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS pghydrate.hot_set (relid oid NOT NULL, relfilenode oid NOT NULL, fork text NOT NULL,
                                                     first_block bigint NOT NULL, last_block bigint NOT NULL,
                                                     heat real NOT NULL, cached_blocks integer NOT NULL);
         CREATE TABLE IF NOT EXISTS pghydrate.capture (captured_at timestamp with time zone NOT NULL, tool text NOT NULL,
                                                     server_version text NOT NULL, shared_buffers bigint NOT NULL,
                                                     buffers bigint NOT NULL, runs integer NOT NULL, ranges integer NOT NULL,
                                                     largest_gap_merged bigint NOT NULL, forks_dropped integer NOT NULL)",
    )
    .await
    .map_err(|e| Error::query("creating pghydrate.hot_set", e))?;
    // Ours, plain, and nothing attached that would run on our writes.
    let checks = tx
        .query(
            "SELECT c.relname::text,
                    c.relowner = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user) AND c.relkind = 'r'
                    AND NOT c.relrowsecurity
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid)
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_rewrite w WHERE w.ev_class = c.oid)
                    AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhparent = c.oid OR i.inhrelid = c.oid)
               FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'pghydrate' AND c.relname IN ('hot_set', 'capture')",
            &[],
        )
        .await
        .map_err(|e| Error::query("checking pghydrate.hot_set", e))?;
    if checks.len() != 2 || checks.iter().any(|r| r.get::<_, Option<bool>>(1) != Some(true)) {
        return Err(Error::InvalidInput(format!(
            "pghydrate.hot_set or pghydrate.capture in database {db:?} is not a plain table of {} without triggers, \
             rules or inheritance: refusing to write into it; drop them (pghydrate capture --drop) and capture again",
            server.login_role
        )));
    }
    let relid: Vec<u32> = c.ranges.iter().map(|r| r.relid).collect();
    let filenode: Vec<u32> = c.ranges.iter().map(|r| r.filenode).collect();
    let fork: Vec<&str> = c.ranges.iter().map(|r| r.fork.as_str()).collect();
    let first: Vec<i64> = c.ranges.iter().map(|r| r.first as i64).collect();
    let last: Vec<i64> = c.ranges.iter().map(|r| r.last as i64).collect();
    let heat: Vec<f32> = c.ranges.iter().map(CachedRun::heat).collect();
    let cached_blocks: Vec<i32> = c.ranges.iter().map(|r| r.buffers.min(i32::MAX as u64) as i32).collect();
    tx.batch_execute(
        "LOCK TABLE pghydrate.hot_set, pghydrate.capture IN ACCESS EXCLUSIVE MODE;
         TRUNCATE pghydrate.hot_set, pghydrate.capture",
    )
    .await
    .map_err(|e| Error::query("replacing the previous capture", e))?;
    tx.execute(
        "INSERT INTO pghydrate.hot_set (relid, relfilenode, fork, first_block, last_block, heat, cached_blocks)
         SELECT * FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.oid[]), pg_catalog.unnest($2::pg_catalog.oid[]),
                                  pg_catalog.unnest($3::pg_catalog.text[]), pg_catalog.unnest($4::pg_catalog.int8[]),
                                  pg_catalog.unnest($5::pg_catalog.int8[]), pg_catalog.unnest($6::pg_catalog.float4[]),
                                  pg_catalog.unnest($7::pg_catalog.int4[]))",
        &[&relid, &filenode, &fork, &first, &last, &heat, &cached_blocks],
    )
    .await
    .map_err(|e| Error::query("writing pghydrate.hot_set", e))?;
    let tool = concat!("pghydrate ", env!("CARGO_PKG_VERSION"));
    tx.execute(
        "INSERT INTO pghydrate.capture VALUES (pg_catalog.now(), $1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &tool,
            &server.version,
            &(shared_buffers as i64),
            &(d.buffers as i64),
            &(c.runs.min(i32::MAX as usize) as i32),
            &(c.ranges.len() as i32),
            &(c.largest_gap_merged as i64),
            &(c.forks_dropped as i32),
        ],
    )
    .await
    .map_err(|e| Error::query("writing pghydrate.capture", e))?;
    tx.commit().await.map_err(|e| Error::query("committing the capture", e))?;
    d.table_bytes = client
        .query_one("SELECT pg_catalog.pg_total_relation_size('pghydrate.hot_set'::pg_catalog.regclass)", &[])
        .await
        .ok()
        .map(|r| r.get(0));
    Ok(())
}

/// `capture --drop`: removes pghydrate.hot_set, pghydrate.capture and the schema from every database
/// where the schema is the login role's. Per database: what happened.
pub async fn drop_capture(spec: &ConnectionSpec) -> Result<Vec<(String, std::result::Result<bool, String>)>> {
    let (client, _) = crate::catalog::connect_any(spec).await?;
    let dbs: Vec<String> = client
        .query(
            "SELECT datname::text FROM pg_catalog.pg_database
              WHERE datallowconn AND NOT datistemplate AND has_database_privilege(oid, 'CONNECT') ORDER BY 1",
            &[],
        )
        .await
        .map_err(|e| Error::query("listing databases", e))?
        .iter()
        .map(|r| r.get(0))
        .filter(|d: &String| !crate::catalog::DEFAULT_EXCLUDED_DATABASES.contains(&d.as_str()))
        .collect();
    drop(client);
    let mut out = Vec::new();
    for db in dbs {
        let result = async {
            let mut c = spec.connect(&db).await.map_err(|e| e.to_string())?;
            let tx = c.transaction().await.map_err(|e| describe(&e))?;
            match schema_owner(&tx).await.map_err(|e| describe(&e))? {
                None => Ok(false),
                Some((false, owner)) => Err(format!("the schema pghydrate belongs to {owner}: left alone")),
                Some((true, _)) => {
                    tx.batch_execute(
                        "DROP TABLE IF EXISTS pghydrate.hot_set, pghydrate.capture; DROP SCHEMA pghydrate RESTRICT",
                    )
                    .await
                    .map_err(|e| format!("{} (the schema holds something else: left alone)", describe(&e)))?;
                    tx.commit().await.map_err(|e| describe(&e))?;
                    Ok(true)
                }
            }
        }
        .await;
        out.push((db, result));
    }
    Ok(out)
}

/// One stored range as replay reads it, with the relation's filenode now.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRange {
    pub relid: u32,
    pub filenode: u32,
    pub fork: Option<Fork>,
    pub first: i64,
    pub last: i64,
    pub heat: f32,
    /// pg_relation_filenode now: None when no relation has that oid any more.
    pub filenode_now: Option<u32>,
}

/// A database's hot set as replay found it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoredHotSet {
    pub captured_at: Option<String>,
    pub ranges: Vec<StoredRange>,
    /// More rows than [`READ_LIMIT`]: the hottest were read.
    pub truncated: bool,
    /// Why the hot set was not used at all (its ranges are then empty).
    pub ignored: Option<String>,
}

/// What the plan took from one database's hot set; in the plan and the report.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct HotSetUse {
    pub database: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured_at: Option<String>,
    /// Ranges stored (read, at most READ_LIMIT).
    pub stored: usize,
    /// Ranges the plan reads in its hot phase (possibly clipped to the relation's size now).
    pub used: usize,
    /// Ranges of relations dropped since the capture.
    pub dropped: usize,
    /// Ranges of relations rewritten since (VACUUM FULL, CLUSTER, TRUNCATE, ALTER TABLE ... TYPE): their
    /// filenode changed, so the blocks are not the ones that were hot.
    pub rewritten: usize,
    /// Ranges wholly past the relation's end now (it shrank).
    pub truncated: usize,
    /// Ranges of forks the plan does not read (excluded, skipped, or not a fork the plan lists).
    pub not_planned: usize,
    /// Why the whole hot set was ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignored: Option<String>,
}

impl HotSetUse {
    /// One line for people: what the plan took from this database's hot set, and what it left out.
    pub fn describe(&self) -> String {
        if let Some(why) = &self.ignored {
            return format!("{}: hot set ignored: {why}", self.database);
        }
        let mut left = Vec::new();
        for (n, what) in [
            (self.dropped, "of dropped relations"),
            (self.rewritten, "of rewritten relations"),
            (self.truncated, "past a relation's end"),
            (self.not_planned, "of forks not read"),
        ] {
            if n > 0 {
                left.push(format!("{n} {what}"));
            }
        }
        format!(
            "{}: hot set captured {}: {} stored ranges, {} hot ranges planned{}",
            self.database,
            self.captured_at.as_deref().unwrap_or("(time unknown)"),
            self.stored,
            self.used,
            if left.is_empty() { String::new() } else { format!("; left out: {}", left.join(", ")) }
        )
    }
}

/// Reads `db`'s hot set, if it has one, on a session of that database (search path pinned). See the
/// module's trust note for what makes it readable.
pub(crate) async fn read_stored(client: &Client, db: &str) -> Result<Option<StoredHotSet>> {
    let rels = client
        .query(
            "SELECT c.relname::text, c.relkind = 'r' AND NOT c.relrowsecurity
                      AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhparent = c.oid),
                    has_schema_privilege(n.oid, 'USAGE') AND has_table_privilege(c.oid, 'SELECT'),
                    (SELECT pg_catalog.array_agg(a.attname::text || ' ' || pg_catalog.format_type(a.atttypid, NULL) ORDER BY a.attnum)
                       FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
                    pg_catalog.pg_get_userbyid(c.relowner)::text
               FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'pghydrate' AND c.relname IN ('hot_set', 'capture')",
            &[],
        )
        .await
        .map_err(|e| Error::query("looking for a captured hot set", e))?;
    let find = |name: &str| rels.iter().find(|r| r.get::<_, String>(0) == name);
    // Privilege functions answer NULL for a table dropped after this statement's snapshot listed it: a
    // NULL is a no.
    let yes = |r: &tokio_postgres::Row, column: usize| r.get::<_, Option<bool>>(column) == Some(true);
    let Some(hot) = find("hot_set") else { return Ok(None) };
    let plain = |r: &tokio_postgres::Row, columns: &[&str]| {
        yes(r, 1) && r.get::<_, Option<Vec<String>>>(3).unwrap_or_default() == columns
    };
    let ignored = |why: String| {
        warn!(database = %db, reason = %why, "captured hot set ignored");
        Ok(Some(StoredHotSet { ignored: Some(why), ..Default::default() }))
    };
    if !plain(hot, HOT_SET_COLUMNS) {
        return ignored(format!(
            "pghydrate.hot_set (owner {}) is not the plain table capture writes (a view, row security, inheritance \
             or other columns): not read",
            hot.get::<_, String>(4)
        ));
    }
    if !yes(hot, 2) {
        return ignored(format!(
            "the login role may not read pghydrate.hot_set; fix: GRANT USAGE ON SCHEMA pghydrate TO <role>; \
             GRANT SELECT ON pghydrate.hot_set, pghydrate.capture TO <role> (as {})",
            hot.get::<_, String>(4)
        ));
    }
    let rows = client
        .query(
            "SELECT h.relid, h.relfilenode, h.fork, h.first_block, h.last_block, h.heat,
                    pg_catalog.pg_relation_filenode(h.relid::pg_catalog.regclass)
               FROM ONLY pghydrate.hot_set h ORDER BY h.heat DESC LIMIT $1",
            &[&(READ_LIMIT + 1)],
        )
        .await
        .map_err(|e| Error::query("reading pghydrate.hot_set", e))?;
    let truncated = rows.len() as i64 > READ_LIMIT;
    let ranges = rows
        .iter()
        .take(READ_LIMIT as usize)
        .map(|r| StoredRange {
            relid: r.get(0),
            filenode: r.get(1),
            fork: fork_from_name(r.get(2)),
            first: r.get(3),
            last: r.get(4),
            heat: r.get(5),
            filenode_now: r.get(6),
        })
        .collect();
    let captured_at = match find("capture") {
        Some(c) if plain(c, CAPTURE_COLUMNS) && yes(c, 2) => client
            .query_one("SELECT pg_catalog.max(captured_at)::text FROM ONLY pghydrate.capture", &[])
            .await
            .ok()
            .and_then(|r| r.get(0)),
        _ => None,
    };
    if truncated {
        warn!(database = %db, rows = READ_LIMIT, "captured hot set has more rows than are read; the hottest are used");
    }
    Ok(Some(StoredHotSet { captured_at, ranges, truncated, ignored: None }))
}

/// Per fork, the blocks of the hot set, to count what of it a set of ranges covers.
#[derive(Debug, Default, Clone)]
pub struct HotBlocks {
    by_fork: HashMap<u32, Vec<(u64, u64)>>,
}

impl HotBlocks {
    pub fn new(ranges: &[BlockRange]) -> HotBlocks {
        let mut by_fork: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
        for r in ranges {
            by_fork.entry(r.fork).or_default().push((r.first, r.last));
        }
        for v in by_fork.values_mut() {
            v.sort_unstable();
        }
        HotBlocks { by_fork }
    }

    pub fn is_empty(&self) -> bool {
        self.by_fork.is_empty()
    }

    /// Hot blocks within `r` (the hot ranges do not overlap).
    pub fn within(&self, r: &BlockRange) -> u64 {
        let Some(v) = self.by_fork.get(&r.fork) else { return 0 };
        let start = v.partition_point(|&(_, last)| last < r.first);
        v[start..]
            .iter()
            .take_while(|&&(first, _)| first <= r.last)
            .map(|&(first, last)| last.min(r.last) - first.max(r.first) + 1)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(relid: u32, first: u64, last: u64, usage_each: u64) -> CachedRun {
        let n = last - first + 1;
        CachedRun { relid, filenode: relid, fork: Fork::Main, first, last, buffers: n, usage: n * usage_each }
    }

    fn cached_blocks(ranges: &[CachedRun]) -> u64 {
        ranges.iter().map(|r| r.buffers).sum()
    }

    #[test]
    fn compaction_merges_the_smallest_gaps_first_and_keeps_every_cached_block() {
        // Gaps of 1, 5 and 100 blocks between four runs of one relation.
        let runs = vec![run(1, 0, 9, 5), run(1, 11, 20, 1), run(1, 26, 30, 1), run(1, 131, 140, 3)];
        let c = compact(runs.clone(), 2);
        assert_eq!(c.ranges.len(), 2);
        assert_eq!((c.ranges[0].first, c.ranges[0].last), (0, 30));
        assert_eq!((c.ranges[1].first, c.ranges[1].last), (131, 140));
        assert_eq!(c.largest_gap_merged, 5);
        assert_eq!(cached_blocks(&c.ranges), cached_blocks(&runs));
        assert_eq!(compact(runs.clone(), 10).ranges.len(), 4, "under the cap nothing is merged");
    }

    #[test]
    fn runs_of_different_forks_are_never_merged_and_the_coldest_forks_go_first() {
        let mut runs = vec![run(1, 0, 0, 1), run(2, 0, 0, 5), run(3, 0, 0, 2)];
        runs.push(CachedRun { fork: Fork::Fsm, ..run(2, 1, 1, 5) });
        let c = compact(runs, 2);
        assert_eq!(c.forks_dropped, 2);
        let kept: Vec<(u32, Fork)> = c.ranges.iter().map(|r| (r.relid, r.fork)).collect();
        assert_eq!(kept, [(2, Fork::Main), (2, Fork::Fsm)]);
    }

    /// The size bound: 64 GiB of shared buffers (8.4 million 8 KiB buffers) of a 1 TiB database, cached
    /// as scattered as it gets (every other block of 1,000 relations), compact to the cap.
    #[test]
    fn sixty_four_gib_of_scattered_buffers_compact_to_the_cap() {
        let buffers: u64 = 64 << 30 >> 13;
        let relations = 1000u64;
        let per_relation = buffers / relations;
        let mut runs = Vec::with_capacity(buffers as usize);
        for rel in 0..relations {
            for i in 0..per_relation {
                runs.push(run(rel as u32 + 1, 2 * i, 2 * i, 1 + (i % 5)));
            }
        }
        let c = compact(runs, DEFAULT_MAX_RANGES);
        assert_eq!(c.runs as u64, relations * per_relation);
        assert_eq!(c.ranges.len(), DEFAULT_MAX_RANGES);
        assert_eq!(cached_blocks(&c.ranges), relations * per_relation);
        assert_eq!(c.largest_gap_merged, 1);
    }

    #[test]
    fn hot_ranges_widen_to_whole_fetch_units() {
        assert_eq!(aligned(0, 0, 64), (0, 63));
        assert_eq!(aligned(70, 130, 64), (64, 191));
        assert_eq!(aligned(64, 127, 64), (64, 127));
        assert_eq!(aligned(5, 9, 1), (5, 9));
    }

    #[test]
    fn hot_blocks_count_what_a_range_covers() {
        let hot = HotBlocks::new(&[
            BlockRange { fork: 0, first: 10, last: 19 },
            BlockRange { fork: 0, first: 30, last: 39 },
            BlockRange { fork: 1, first: 0, last: 0 },
        ]);
        assert_eq!(hot.within(&BlockRange { fork: 0, first: 0, last: 100 }), 20);
        assert_eq!(hot.within(&BlockRange { fork: 0, first: 15, last: 32 }), 8);
        assert_eq!(hot.within(&BlockRange { fork: 0, first: 20, last: 29 }), 0);
        assert_eq!(hot.within(&BlockRange { fork: 2, first: 0, last: 9 }), 0);
    }
}
