//! The captured hot set (`pghydrate capture`): what a server keeps in shared buffers is stored in each
//! database, travels with it (here: survives a restart, which empties the cache as a restore does), and
//! the next run reads it first, still reading every block once. It is bounded in size, refuses a
//! schema someone else made, and replay runs none of a hostile user's code.

use pghydrate::hotset::CaptureReport;
use pghydrate::plan::Plan;
use pghydrate::report::Report;
use pghydrate_tests::{cli, cli_env, Cluster};

fn tmp(cluster: &Cluster) -> std::path::PathBuf {
    let d = cluster.dir().join("work");
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn oid_of(c: &tokio_postgres::Client, rel: &str) -> u32 {
    c.query_one("SELECT $1::text::regclass::oid", &[&rel]).await.unwrap().get(0)
}

async fn blocks_of(c: &tokio_postgres::Client, rel: &str) -> u64 {
    let n: i64 = c
        .query_one("SELECT pg_relation_size($1::text::regclass) / current_setting('block_size')::int8", &[&rel])
        .await
        .unwrap()
        .get(0);
    n as u64
}

/// Hot blocks the plan reads first, per relation oid in database `db`.
fn hot_blocks(plan: &Plan, db: &str, oid: u32) -> u64 {
    let h = plan.hot_set.as_ref().expect("the plan has a hot set");
    h.ranges
        .iter()
        .filter(|r| {
            let f = plan.fork(r);
            f.database == db && f.oid == oid && f.fork == pghydrate::plan::Fork::Main
        })
        .map(|r| r.blocks())
        .sum()
}

/// ACCESS EXCLUSIVE on a table, taken by a session of its own (a migration, say). Planning waits for
/// it (up to its lock_timeout) while a head start, which lists only the hot set's relations and waits
/// for no lock, reads: without it, planning a small local database can end before the head start has
/// begun. The test releases it when what it needs has happened ([`HeldLock::release_when`]), not after
/// a number of seconds: how far a head start gets in two seconds depends on the machine.
struct HeldLock(tokio_postgres::Client);

impl HeldLock {
    /// Returns once the lock is granted (the session's own LOCK statement has returned).
    async fn take(cluster: &Cluster, db: &str, table: &str) -> HeldLock {
        let holder = cluster.client(db).await;
        holder.batch_execute(&format!("BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")).await.unwrap();
        HeldLock(holder)
    }

    /// Releases the lock once `until` completes, or after 120 s (then the test's own assertions say
    /// what did not happen while planning waited).
    async fn release_when(self, until: impl std::future::Future<Output = ()>) {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(120), until).await;
        self.0.batch_execute("COMMIT").await.unwrap();
    }
}

/// Completes when the head start has read all of `table`'s main fork (pg_buffercache, installed in
/// database postgres: the restart before emptied the cache, and planning reads no table's data) and its
/// sessions have ended: no pghydrate session is connected to `db` but those waiting for a lock
/// (planning, held up by a [`HeldLock`]).
async fn head_start_read(cluster: &Cluster, db: &str, table: &str) {
    let c = cluster.client(db).await;
    let (filenode, blocks): (u32, i64) = {
        let r = c
            .query_one(
                "SELECT pg_relation_filenode($1::text::regclass)::oid, pg_relation_size($1::text::regclass) / 8192",
                &[&table],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    let admin = cluster.client("postgres").await;
    loop {
        let r = admin
            .query_one(
                "SELECT (SELECT count(*) FROM pg_buffercache b JOIN pg_database d ON d.oid = b.reldatabase
                          WHERE d.datname = $1 AND b.relfilenode = $2 AND b.relforknumber = 0),
                        (SELECT count(*) FROM pg_stat_activity
                          WHERE datname = $1 AND application_name = 'pghydrate' AND wait_event_type IS DISTINCT FROM 'Lock')",
                &[&db, &filenode],
            )
            .await
            .unwrap();
        if r.get::<_, i64>(0) >= blocks && r.get::<_, i64>(1) == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// (blocks read, buffer hits) of relation `oid` as the server counts them, once they reach `blocks` (or
/// after 10 s): statistics reach the view once the sessions have ended (before 15: through the
/// collector).
async fn blocks_read_and_hit(app: &tokio_postgres::Client, oid: u32, blocks: u64) -> (u64, u64) {
    let mut seen = (0, 0);
    for _ in 0..50 {
        let row = app
            .query_one(
                "SELECT coalesce(heap_blks_read, idx_blks_read, 0)::int8, coalesce(heap_blks_hit, idx_blks_hit, 0)::int8
                   FROM (SELECT relid, heap_blks_read, heap_blks_hit, NULL::int8 AS idx_blks_read, NULL::int8 AS idx_blks_hit
                           FROM pg_statio_all_tables
                         UNION ALL
                         SELECT indexrelid, NULL, NULL, idx_blks_read, idx_blks_hit FROM pg_statio_all_indexes) s
                  WHERE relid = $1",
                &[&oid],
            )
            .await
            .unwrap();
        seen = (row.get::<_, i64>(0) as u64, row.get::<_, i64>(1) as u64);
        if seen.0 + seen.1 >= blocks {
            break;
        }
        app.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    seen
}

async fn a_captured_hot_set_is_read_first_and_every_block_still_once(major: u32) {
    let cluster = Cluster::start(major, &["shared_buffers = 64MB"]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let app = cluster.client("app").await;
    app.batch_execute(
        "CREATE EXTENSION pg_prewarm;
         CREATE TABLE hot (id int PRIMARY KEY, v text) WITH (fillfactor = 10);
         INSERT INTO hot SELECT i, 'h' || i FROM generate_series(1, 20000) i;
         CREATE TABLE cold (id int PRIMARY KEY, v text) WITH (fillfactor = 10);
         INSERT INTO cold SELECT i, 'c' || i FROM generate_series(1, 60000) i;
         CREATE TABLE rewritten (id int, v text);
         INSERT INTO rewritten SELECT i, repeat('r', 100) FROM generate_series(1, 20000) i;
         CREATE TABLE migrating (id int)",
    )
    .await
    .unwrap();
    app.batch_execute("VACUUM").await.unwrap();
    let (hot, hot_pkey, cold, rewritten) = (
        oid_of(&app, "hot").await,
        oid_of(&app, "hot_pkey").await,
        oid_of(&app, "cold").await,
        oid_of(&app, "rewritten").await,
    );
    let hot_size = blocks_of(&app, "hot").await;
    let pkey_size = blocks_of(&app, "hot_pkey").await;
    drop(app);
    drop(admin);

    // The application's working set: hot and its index, and rewritten; cold is not in the cache.
    cluster.restart();
    let app = cluster.client("app").await;
    app.batch_execute("SELECT pg_prewarm('hot'), pg_prewarm('hot_pkey'), pg_prewarm('rewritten')").await.unwrap();
    let work = tmp(&cluster);
    let url = cluster.superuser_url("postgres");
    let (code, out, err) = cli(&["capture", "--json", &url], &work);
    assert_eq!(code, 0, "capture failed: {out}\n{err}");
    let captured: CaptureReport = serde_json::from_str(&out).unwrap();
    let app_capture = captured.databases.iter().find(|d| d.database == "app").expect("app captured");
    assert!(app_capture.error.is_none(), "{app_capture:?}");
    assert!(app_capture.buffers >= hot_size + pkey_size, "{app_capture:?}");
    let stored: i64 = app
        .query_one("SELECT coalesce(sum(last_block - first_block + 1), 0)::int8 FROM pghydrate.hot_set WHERE relid = $1 AND fork = 'main'", &[&hot])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored as u64, hot_size, "every cached block of hot is in its stored ranges");

    // After the capture, rewritten is rewritten (its filenode changes), then the cache is emptied: the
    // volume a restore gives.
    app.batch_execute("VACUUM FULL rewritten").await.unwrap();
    drop(app);
    cluster.restart();

    let (code, out, err) = cli(&["plan", "--json", "--include-database", "app", &url], &work);
    assert_eq!(code, 0, "plan failed: {err}");
    let plan: Plan = serde_json::from_str(&out).unwrap();
    let h = plan.hot_set.as_ref().expect("the plan read the hot set");
    let used = h.databases.iter().find(|d| d.database == "app").unwrap();
    assert!(used.ignored.is_none() && used.captured_at.is_some(), "{used:?}");
    assert!(used.rewritten >= 1, "the rewritten table's ranges are left out: {used:?}");
    assert_eq!(&plan.ranges[..h.ranges.len()], &h.ranges[..], "the hot phase comes first");
    assert_eq!(hot_blocks(&plan, "app", hot), hot_size, "all of hot is in the hot phase");
    assert_eq!(hot_blocks(&plan, "app", hot_pkey), pkey_size, "all of hot_pkey is in the hot phase");
    assert_eq!(hot_blocks(&plan, "app", cold), 0, "cold was not cached");
    assert_eq!(hot_blocks(&plan, "app", rewritten), 0, "rewritten's captured blocks are not its blocks now");
    // Every block of every fork exactly once, hot phase included.
    let mut per_fork: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = Default::default();
    for r in &plan.ranges {
        per_fork.entry(r.fork).or_default().push((r.first, r.last));
    }
    for (i, f) in plan.forks.iter().enumerate() {
        let mut got = per_fork.remove(&(i as u32)).unwrap_or_default();
        got.sort();
        if f.planned_skip.is_some() || f.excluded {
            continue;
        }
        let mut next = 0;
        for (a, b) in got {
            assert_eq!(a, next, "{}.{} {:?}: a gap or an overlap", f.schema, f.name, f.fork);
            next = b + 1;
        }
        assert_eq!(next, f.blocks, "{}.{} {:?}", f.schema, f.name, f.fork);
    }

    // The run reads the hot set while the rest is planned (a head start), then the rest: every block
    // of hot, hot_pkey and cold is asked of the buffer manager exactly once, which the server counts
    // (blocks read + buffer hits per relation; a second read of a block still cached would be a hit).
    let app = cluster.client("app").await;
    app.batch_execute(
        "ALTER TABLE hot SET (autovacuum_enabled = off); ALTER TABLE cold SET (autovacuum_enabled = off);
         SELECT pg_stat_reset()",
    )
    .await
    .unwrap();
    let report_path = work.join("report.json");
    // A migration holds a table for the first 2 s: planning waits for it, the head start reads (how
    // much of the hot set it reads by then, nothing below depends on).
    let migration = HeldLock::take(&cluster, "app", "migrating").await;
    let migration = tokio::spawn(migration.release_when(tokio::time::sleep(std::time::Duration::from_secs(2))));
    let (code, out, err) = cli_env(
        &[
            "run",
            "--include-database",
            "app",
            "--mode",
            "buffer",
            "--maintenance",
            "none",
            "--report",
            report_path.to_str().unwrap(),
            &url,
        ],
        &work,
        &[("PGHYDRATE_LOG", "info")],
    );
    assert_eq!(code, 0, "run failed: {out}\n{err}");
    migration.await.unwrap();
    assert!(out.contains("captured hot set"), "the summary says what of the hot set was read: {out}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(report.coverage, 1.0);
    let hs = report.hot_set.expect("the report has the hot set");
    assert_eq!(hs.read_share, 1.0, "{hs:?}");
    assert!(hs.read_by_seconds.is_some_and(|t| t <= report.timings.warm_seconds), "{hs:?}");
    let head = report.timings.head_start_seconds.expect("the hot set was read by a head start");
    assert!(head > 0.0 && head <= report.timings.warm_seconds, "{:?}", report.timings);
    for (rel, oid) in [("hot", hot), ("hot_pkey", hot_pkey), ("cold", cold)] {
        // Every fork of the relation counts against it (main, and a table's free space and visibility
        // maps).
        let forks = report.relations.iter().filter(|r| r.database == "app" && r.oid == oid);
        let blocks: u64 = forks.clone().map(|r| r.blocks).sum();
        assert!(blocks > 0 && forks.clone().all(|r| r.warmed_blocks == r.blocks), "{rel}: read whole");
        let seen = blocks_read_and_hit(&app, oid, blocks).await;
        assert_eq!(seen, (blocks, 0), "{rel}: (blocks read, buffer hits): every block read once, none again\n{err}");
    }
    drop(app);

    // --no-hot-set orders as if there were none.
    let (code, out, _) = cli(&["plan", "--json", "--no-hot-set", "--include-database", "app", &url], &work);
    assert_eq!(code, 0);
    assert!(serde_json::from_str::<Plan>(&out).unwrap().hot_set.is_none());

    // --drop removes it, and only it.
    let (code, out, err) = cli(&["capture", "--drop", &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("app: hot set dropped"), "{out}");
    let app = cluster.client("app").await;
    let left: i64 =
        app.query_one("SELECT count(*) FROM pg_namespace WHERE nspname = 'pghydrate'", &[]).await.unwrap().get(0);
    assert_eq!(left, 0);
    let (_, out, _) = cli(&["plan", "--json", "--include-database", "app", &url], &work);
    assert!(serde_json::from_str::<Plan>(&out).unwrap().hot_set.is_none());
}

/// Buffers as scattered as they get (every other block of a table) are stored as ranges of about 71
/// bytes each (measured), so the default cap (65,536 ranges) stays under 5 MiB; `--max-ranges` is a hard cap that
/// merges the smallest gaps and keeps every cached block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_is_bounded_and_small() {
    let cluster = Cluster::start(15, &["shared_buffers = 256MB"]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let app = cluster.client("app").await;
    app.batch_execute(
        "CREATE EXTENSION pg_prewarm;
         CREATE TABLE scattered (id int, v text) WITH (fillfactor = 10);
         INSERT INTO scattered SELECT i, 's' || i FROM generate_series(1, 400000) i",
    )
    .await
    .unwrap();
    let blocks = blocks_of(&app, "scattered").await;
    assert!(blocks >= 16_000, "{blocks}");
    drop(app);
    cluster.restart();
    let app = cluster.client("app").await;
    app.query_one(
        "SELECT count(pg_prewarm('scattered', 'buffer', 'main', b, b)) FROM generate_series(0, $1::int8 - 1, 2) b",
        &[&(blocks as i64)],
    )
    .await
    .unwrap();
    let work = tmp(&cluster);
    let url = cluster.superuser_url("postgres");

    let (code, out, err) = cli(&["capture", "--json", "--include-database", "app", &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    let c: CaptureReport = serde_json::from_str(&out).unwrap();
    let d = &c.databases[0];
    let scattered_runs = blocks.div_ceil(2) as usize;
    assert!(d.runs >= scattered_runs && d.ranges == d.runs, "under the cap nothing is merged: {d:?}");
    let bytes = d.table_bytes.expect("table size measured") as f64;
    let per_range = bytes / d.ranges as f64;
    let at_cap = per_range * pghydrate::hotset::DEFAULT_MAX_RANGES as f64;
    eprintln!(
        "hot set: {} ranges in {bytes} bytes, {per_range:.1} bytes/range, {at_cap:.0} bytes at the cap",
        d.ranges
    );
    assert!(at_cap < 5.0 * 1024.0 * 1024.0, "{per_range} bytes per range");
    let stored: i64 =
        app.query_one("SELECT sum(cached_blocks)::int8 FROM pghydrate.hot_set", &[]).await.unwrap().get(0);
    assert_eq!(stored as u64, d.buffers - d.unresolved_buffers);

    let (code, out, err) =
        cli(&["capture", "--json", "--include-database", "app", "--max-ranges", "1000", &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    let c: CaptureReport = serde_json::from_str(&out).unwrap();
    let d = &c.databases[0];
    assert_eq!(d.ranges, 1000, "{d:?}");
    assert_eq!(d.largest_gap_merged, 1, "only one-block gaps needed merging: {d:?}");
    let (rows, cached): (i64, i64) = {
        let r = app.query_one("SELECT count(*), sum(cached_blocks)::int8 FROM pghydrate.hot_set", &[]).await.unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(rows, 1000, "the second capture replaced the first");
    assert_eq!(cached as u64, d.buffers - d.unresolved_buffers, "merging keeps every cached block");

    let (code, _, err) = cli(&["capture", "--max-ranges", "0", &url], &work);
    assert_eq!(code, 2, "{err}");
}

/// How often mallory's function ran, and whether she became superuser.
async fn mallory_runs(cluster: &Cluster) -> (i64, bool) {
    let c = cluster.client("app").await;
    let r =
        c.query_one("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pghydrate.runs", &[]).await.unwrap();
    let sup: bool = c.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'", &[]).await.unwrap().get(0);
    (r.get(0), sup)
}

/// mallory may create schemas in app. Before any capture she makes `pghydrate` hers, with a view or a
/// row-security table named hot_set whose every read calls her function (it counts its calls and tries
/// to make her superuser). Planning reads none of it and says why; capture refuses to write into her
/// schema; coverage is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_hot_set_runs_nothing_and_is_not_written_into() {
    let cluster = Cluster::start(15, &[]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin
        .batch_execute(
            "CREATE EXTENSION pg_buffercache;
             CREATE ROLE mallory LOGIN PASSWORD 'mallory-pw';
             GRANT CREATE ON DATABASE app TO mallory",
        )
        .await
        .unwrap();
    let app = cluster.client("app").await;
    app.batch_execute("CREATE TABLE t AS SELECT i FROM generate_series(1, 10000) i").await.unwrap();
    let mallory = cluster.client_as("mallory", "mallory-pw", "app").await;
    mallory
        .batch_execute(
            "CREATE SCHEMA pghydrate;
             CREATE SEQUENCE pghydrate.runs;
             GRANT USAGE ON SCHEMA pghydrate TO PUBLIC;
             GRANT USAGE, UPDATE ON SEQUENCE pghydrate.runs TO PUBLIC;
             CREATE FUNCTION pghydrate.evil() RETURNS oid LANGUAGE plpgsql AS $$
             BEGIN
               PERFORM nextval('pghydrate.runs');
               BEGIN EXECUTE 'ALTER ROLE mallory SUPERUSER'; EXCEPTION WHEN OTHERS THEN NULL; END;
               RETURN 0;
             END $$;
             CREATE VIEW pghydrate.hot_set AS
               SELECT pghydrate.evil() AS relid, 0::oid AS relfilenode, 'main'::text AS fork, 0::int8 AS first_block,
                      0::int8 AS last_block, 5::real AS heat, 1 AS cached_blocks;
             GRANT SELECT ON pghydrate.hot_set TO PUBLIC",
        )
        .await
        .unwrap();
    let work = tmp(&cluster);
    let url = cluster.superuser_url("postgres");
    let plan_of = || {
        let (code, out, err) = cli(&["plan", "--json", "--include-database", "app", &url], &work);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Plan>(&out).unwrap()
    };
    let plan = plan_of();
    let used = &plan.hot_set.as_ref().expect("the planted hot set is reported").databases[0];
    assert!(used.ignored.as_deref().is_some_and(|w| w.contains("not the plain table")), "{used:?}");
    assert!(plan.hot_set.as_ref().unwrap().ranges.is_empty());
    assert_eq!(mallory_runs(&cluster).await, (0, false), "reading the plan ran mallory's view");

    // A table of the right columns, with row security whose policy calls her function.
    mallory
        .batch_execute(
            "DROP VIEW pghydrate.hot_set;
             CREATE TABLE pghydrate.hot_set (relid oid, relfilenode oid, fork text, first_block bigint,
                                              last_block bigint, heat real, cached_blocks integer);
             INSERT INTO pghydrate.hot_set VALUES (0, 0, 'main', 0, 0, 5, 1);
             GRANT SELECT ON pghydrate.hot_set TO PUBLIC;
             ALTER TABLE pghydrate.hot_set ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY;
             CREATE POLICY p ON pghydrate.hot_set USING (pghydrate.evil() = 0)",
        )
        .await
        .unwrap();
    let plan = plan_of();
    let used = &plan.hot_set.as_ref().unwrap().databases[0];
    assert!(used.ignored.is_some(), "{used:?}");
    assert_eq!(mallory_runs(&cluster).await, (0, false), "reading the plan ran mallory's policy");

    // Capture refuses her schema, and says whose it is.
    let (code, out, err) = cli(&["capture", &url], &work);
    assert_eq!(code, 4, "{out}\n{err}");
    assert!(out.contains("belongs to mallory"), "{out}");
    assert_eq!(mallory_runs(&cluster).await, (0, false), "capture ran mallory's code");
    let rows: i64 = app.query_one("SELECT count(*) FROM pghydrate.hot_set", &[]).await.unwrap().get(0);
    assert_eq!(rows, 1, "capture wrote into mallory's table");

    // And her forged (but plain, readable) ranges can only reorder: every block is still read.
    mallory
        .batch_execute(
            "ALTER TABLE pghydrate.hot_set DISABLE ROW LEVEL SECURITY, NO FORCE ROW LEVEL SECURITY;
             DROP POLICY p ON pghydrate.hot_set; TRUNCATE pghydrate.hot_set;
             INSERT INTO pghydrate.hot_set
               SELECT 'pg_class'::regclass::oid, pg_relation_filenode('pg_class'), 'main', 0, 1000000000, 5::real, 1
               UNION ALL SELECT 'pg_class'::regclass::oid, pg_relation_filenode('pg_class'), 'main', 0, 2, 4::real, 1
               UNION ALL SELECT 4294967295, 1, 'nonsense', -5, -9, 'NaN'::real, 0",
        )
        .await
        .unwrap();
    let report_path = work.join("report.json");
    let (code, out, err) =
        cli(&["run", "--include-database", "app", "--report", report_path.to_str().unwrap(), &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(report.coverage, 1.0);
    let hs = report.hot_set.unwrap();
    assert_eq!(hs.read_share, 1.0);
    assert_eq!(hs.databases[0].used, 1, "pg_class read once, clipped to its size: {:?}", hs.databases[0]);
    assert_eq!(mallory_runs(&cluster).await, (0, false));
}

async fn has_capture_schema(c: &tokio_postgres::Client) -> bool {
    let n: i64 =
        c.query_one("SELECT count(*) FROM pg_namespace WHERE nspname = 'pghydrate'", &[]).await.unwrap().get(0);
    n > 0
}

/// What a user meets before capture can work, each refused with its fix and nothing written: no
/// pg_buffercache in the database it connects to, a login role that may not read it (no pg_monitor), and a
/// standby (a read replica cannot be written; the capture belongs on the primary). A read replica created
/// after a capture carries it and replays it: the hot blocks come first there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_says_what_it_needs_and_a_replica_replays_the_primarys_capture() {
    let primary = Cluster::start(15, &["shared_buffers = 64MB"]);
    {
        let admin = primary.client("postgres").await;
        admin.batch_execute("CREATE DATABASE app").await.unwrap();
        admin
            .batch_execute("CREATE ROLE viewer LOGIN PASSWORD 'viewer-pw'; GRANT CREATE ON DATABASE app TO viewer")
            .await
            .unwrap();
        primary
            .client("app")
            .await
            .batch_execute(
                "CREATE EXTENSION pg_prewarm;
                 CREATE TABLE hot (id int PRIMARY KEY, v text);
                 INSERT INTO hot SELECT i, 'h' || i FROM generate_series(1, 20000) i;
                 CREATE TABLE cold (id int, v text);
                 INSERT INTO cold SELECT i, 'c' || i FROM generate_series(1, 200000) i;
                 CHECKPOINT",
            )
            .await
            .unwrap();
    }
    // An empty cache, then only hot is read.
    primary.restart();
    let admin = primary.client("postgres").await;
    let app = primary.client("app").await;
    app.query_one("SELECT count(*) FROM hot", &[]).await.unwrap();
    let work = tmp(&primary);
    let url = primary.superuser_url("postgres");
    // No pg_buffercache: exit 2, the CREATE EXTENSION and the GRANT to run.
    let (code, out, err) = cli(&["capture", &url], &work);
    assert_eq!(code, 2, "{out}\n{err}");
    let err = format!("{out}{err}");
    assert!(
        err.contains("pg_buffercache is not installed") && err.contains("CREATE EXTENSION pg_buffercache"),
        "{err}"
    );
    assert!(!has_capture_schema(&app).await, "nothing written");

    // A role without pg_monitor: pg_buffercache is there but not readable to it.
    admin.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let viewer_url = primary.url("viewer", "viewer-pw", "postgres");
    let (code, out, err) = cli(&["capture", &viewer_url], &work);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("may not read pg_buffercache") && err.contains("GRANT pg_monitor TO \"viewer\""), "{err}");
    assert!(!has_capture_schema(&app).await, "nothing written");
    // With the grant it captures (it may create the schema in app: it has CREATE there).
    admin.batch_execute("GRANT pg_monitor TO viewer").await.unwrap();
    let (code, out, err) = cli(&["capture", "--json", "--include-database", "app", &viewer_url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    let owner: String = app
        .query_one("SELECT pg_get_userbyid(nspowner)::text FROM pg_namespace WHERE nspname = 'pghydrate'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner, "viewer");
    let stored: i64 = app
        .query_one("SELECT count(*) FROM pghydrate.hot_set WHERE relid = 'hot'::regclass", &[])
        .await
        .unwrap()
        .get(0);
    assert!(stored >= 1, "the hot table was captured");

    // The replica: capture refused there, the primary's capture replayed first.
    let standby = primary.start_standby();
    let standby_url = standby.superuser_url("postgres");
    let swork = tmp(&standby);
    let (code, out, err) = cli(&["capture", &standby_url], &swork);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("standby") && err.contains("primary"), "{err}");
    let (code, out, err) = cli(&["plan", "--json", "--include-database", "app", &standby_url], &swork);
    assert_eq!(code, 0, "{err}");
    let plan: Plan = serde_json::from_str(&out).unwrap();
    let sapp = standby.client("app").await;
    let hot = oid_of(&sapp, "hot").await;
    let cold = oid_of(&sapp, "cold").await;
    assert!(hot_blocks(&plan, "app", hot) >= 1, "the replica's plan reads the primary's hot set first");
    assert_eq!(hot_blocks(&plan, "app", cold), 0, "cold was never cached");
    let position = |oid: u32| {
        plan.ranges.iter().position(|r| {
            let f = plan.fork(r);
            f.database == "app" && f.oid == oid
        })
    };
    assert!(position(hot).unwrap() < position(cold).unwrap(), "hot is read before cold on the replica");
}

/// The network is cut again and again while the head start reads (every connection through a proxy
/// is dropped after 20 KB from its client: planning's sessions get through, reading sessions are cut
/// every hundred or so ranges). The head start's lost ranges are read again or left to the run, and
/// the run ends complete: every fork's blocks all warmed, each range counted once (the outcomes
/// partition the plan), every block in shared_buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_cuts_during_the_head_start_lose_nothing_and_count_nothing_twice() {
    use pghydrate::run::{plan_with_head_start, RunState};
    use pghydrate::warm::{Counters, Mode};
    use pghydrate_tests::{assert_complete_and_buffered, test_tls, CuttingProxy};
    use std::time::Duration;
    let cluster = Cluster::start(15, &["shared_buffers = 64MB"]);
    cluster.load_sample("app", 1, None).await;
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let app = cluster.client("app").await;
    app.batch_execute("CREATE EXTENSION pg_buffercache; CREATE EXTENSION pg_prewarm").await.unwrap();
    drop(app);
    cluster.restart();
    // The application's working set: every table and index of the sample (about 21 MB).
    let app = cluster.client("app").await;
    app.batch_execute(
        "SELECT count(pg_prewarm(oid)) FROM pg_class
          WHERE relkind IN ('r', 'i', 't', 'm') AND relpersistence = 'p' AND relnamespace <> 'pg_catalog'::regnamespace",
    )
    .await
    .unwrap();
    let work = tmp(&cluster);
    let (code, out, err) = cli(&["capture", &cluster.superuser_url("postgres")], &work);
    assert_eq!(code, 0, "capture failed: {out}\n{err}");
    drop(app);
    drop(admin);
    cluster.restart();

    let proxy = CuttingProxy::start(cluster.port, 20_000).await;
    let spec = pghydrate::ConnectionSpec::parse(
        Some(&format!(
            "postgresql://postgres:{}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
            pghydrate_tests::SUPERUSER_PASSWORD,
            proxy.port,
            test_tls().ca.display()
        )),
        |_| None,
    )
    .unwrap()
    // Planning waits for the migration below as long as it holds its lock.
    .with_timeouts(Duration::from_secs(120), Duration::from_secs(300));
    let opts = pghydrate_tests::run_opts(2, Mode::Buffer);
    // 32 KiB ranges: a thousand statements, so that reading sessions reach the cut.
    let plan_opts = pghydrate::catalog::PlanOptions { range_blocks: 4, ..pghydrate_tests::plan_opts(&["app"]) };
    // Planning waits for a migration's lock until the head start's reading has been cut at least once.
    let migration = HeldLock::take(&cluster, "app", "tiny").await;
    let cut = async {
        while proxy.cuts() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (planned, ()) = tokio::join!(
        plan_with_head_start(&spec, &plan_opts, &opts.warm, |_| (Mode::Buffer, 2, false)),
        migration.release_when(cut)
    );
    let (plan, head) = planned.unwrap();
    let cuts_while_planning = proxy.cuts();
    let head = head.expect("a head start");
    assert!(cuts_while_planning >= 1, "no cut while the head start read: the test did not test");
    let mut st = RunState::new(plan, Mode::Buffer, 2, opts.maintenance);
    let taken = st.absorb_head_start(head);
    assert!(taken > 0);
    let run = st.advance(&spec, &opts, std::sync::Arc::new(Counters::default()));
    tokio::time::timeout(Duration::from_secs(300), run).await.expect("run hung").unwrap();
    eprintln!(
        "measured: {} cuts while planning and the head start read ({taken} bytes taken in), {} in all; {} ranges",
        cuts_while_planning,
        proxy.cuts(),
        st.plan.ranges.len()
    );
    assert_complete_and_buffered(&cluster, &st, &format!("{} cuts", proxy.cuts())).await;
}

pghydrate_tests::on_oldest_and_newest!(a_captured_hot_set_is_read_first_and_every_block_still_once);

/// What the scheduled capture relies on: a server up for less than the minimum uptime captures nothing
/// and every database keeps its previous capture (its buffers would be the first queries', not the
/// application's hot set); databases are captured hottest first; one whose turn comes after the deadline
/// is reported not captured, and keeps its previous capture too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_young_server_or_a_deadline_keeps_the_previous_capture() {
    let cluster = Cluster::start(15, &["shared_buffers = 64MB"]);
    let admin = cluster.client("postgres").await;
    for sql in ["CREATE EXTENSION pg_buffercache", "CREATE DATABASE big", "CREATE DATABASE small"] {
        admin.batch_execute(sql).await.unwrap();
    }
    for (db, rows) in [("big", 200_000), ("small", 20_000)] {
        let c = cluster.client(db).await;
        c.batch_execute(&format!(
            "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, {rows}) i;
             SELECT count(*) FROM t"
        ))
        .await
        .unwrap();
    }
    let work = tmp(&cluster);
    let url = cluster.superuser_url("postgres");
    let (code, out, err) =
        cli(&["capture", "--json", "--include-database", "big", "--include-database", "small", &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    let first: CaptureReport = serde_json::from_str(&out).unwrap();
    let order: Vec<&str> = first.databases.iter().map(|d| d.database.as_str()).collect();
    assert_eq!(order, ["big", "small"], "hottest first: {first:?}");
    assert!(first.databases[0].buffers > first.databases[1].buffers, "{first:?}");
    assert!(first.uptime_seconds >= 0.0 && first.skipped.is_none());
    let stamp = |db: &'static str| {
        let cluster = &cluster;
        async move {
            let c = cluster.client(db).await;
            let r = c
                .query_one(
                    "SELECT (SELECT captured_at::text FROM pghydrate.capture), count(*) FROM pghydrate.hot_set",
                    &[],
                )
                .await
                .unwrap();
            (r.get::<_, String>(0), r.get::<_, i64>(1))
        }
    };
    let before = (stamp("big").await, stamp("small").await);
    assert!(before.0 .1 > 0 && before.1 .1 > 0, "{before:?}");

    // Restarted a moment ago: nothing captured, exit 0, and why.
    cluster.restart();
    let (code, out, err) = cli(&["capture", "--min-uptime", "60", "--include-database", "*", &url], &work);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("captured nothing: the server started") && out.contains("minimum uptime of 60 min"), "{out}");
    assert_eq!((stamp("big").await, stamp("small").await), before, "every previous capture kept");

    // A deadline already past: each database reported, none written.
    let opts = pghydrate::hotset::CaptureOptions {
        include_databases: vec!["big".into(), "small".into()],
        deadline: Some(std::time::Instant::now()),
        ..Default::default()
    };
    let c = cluster.client("big").await;
    c.batch_execute("SELECT count(*) FROM t").await.unwrap();
    let late = pghydrate::hotset::capture(&cluster.superuser_spec(), &opts).await.unwrap();
    assert!(!late.complete() && !late.databases.is_empty(), "{late:?}");
    for d in &late.databases {
        assert!(d.error.as_deref().is_some_and(|e| e.contains("time ran out")), "{d:?}");
    }
    assert_eq!((stamp("big").await, stamp("small").await), before, "every previous capture kept");
}

/// The serverless workflow's Plan call gives the hot set the same head start as `run`: it reads the
/// captured hot set while it plans, its items leave out what it read, and the Warm calls read the rest.
/// Every block of hot, its index and cold is asked of the buffer manager exactly once (the server's
/// own counters), and what the items warmed plus what the head start warmed is exactly what was
/// planned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plan_call_reads_the_hot_set_while_it_plans_and_no_item_reads_it_again() {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig, WorkItem};
    use std::time::{Duration, Instant};
    let cluster = Cluster::start(18, &["shared_buffers = 64MB"]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let app = cluster.client("app").await;
    app.batch_execute(
        "CREATE EXTENSION pg_prewarm;
         CREATE TABLE hot (id int PRIMARY KEY, v text) WITH (fillfactor = 10, autovacuum_enabled = off);
         INSERT INTO hot SELECT i, 'h' || i FROM generate_series(1, 20000) i;
         CREATE TABLE cold (id int PRIMARY KEY, v text) WITH (fillfactor = 10, autovacuum_enabled = off);
         INSERT INTO cold SELECT i, 'c' || i FROM generate_series(1, 60000) i;
         CREATE TABLE migrating (id int)",
    )
    .await
    .unwrap();
    app.batch_execute("VACUUM").await.unwrap();
    let (hot, hot_pkey, cold) = (oid_of(&app, "hot").await, oid_of(&app, "hot_pkey").await, oid_of(&app, "cold").await);
    drop(app);
    cluster.restart();
    let app = cluster.client("app").await;
    app.batch_execute("SELECT pg_prewarm('hot'), pg_prewarm('hot_pkey')").await.unwrap();
    let work = tmp(&cluster);
    let (code, out, err) = cli(&["capture", &cluster.superuser_url("postgres")], &work);
    assert_eq!(code, 0, "capture failed: {out}\n{err}");
    // The source had no pg_prewarm (the usual first restore): the run creates it, and the head start
    // must not wait for the full plan to have done so.
    app.batch_execute("DROP EXTENSION pg_prewarm").await.unwrap();
    drop(app);
    cluster.restart();
    let app = cluster.client("app").await;
    // Planning waits for the migration below as long as it holds its lock.
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(120), Duration::from_secs(300));
    // The head start's own plan, alone (in the run below, whether the full plan's CREATE EXTENSION
    // comes first is timing): it creates pg_prewarm as the full plan would, and plans the hot set.
    let (alone, _) = pghydrate::catalog::plan_hot_phase(&spec, &pghydrate_tests::plan_opts(&["app"]))
        .await
        .unwrap()
        .expect("a head start on a database without pg_prewarm");
    assert!(alone.ranges.iter().any(|r| alone.forks[r.fork as usize].oid == hot), "{:?}", alone.databases);
    app.batch_execute("DROP EXTENSION pg_prewarm; SELECT pg_stat_reset()").await.unwrap();

    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "buffer", "maintenance": "none", "include_databases": ["app"]}),
        None,
        None,
    )
    .unwrap();
    let run = RunConfig::new("exec-head", trigger, &Defaults::from_env(|_| None).unwrap());
    // As the Plan function: the call's deadline, margin and timeouts; sessions and mode from the plan.
    let head = call_options(Instant::now() + Duration::from_secs(120), Duration::from_secs(5), 1);
    // A migration holds a table until the head start has read hot and ended: planning waits for it.
    let migration = HeldLock::take(&cluster, "app", "migrating").await;
    let (planned, ()) = tokio::join!(
        plan_items(&spec, &run, Some(&head)),
        migration.release_when(head_start_read(&cluster, "app", "hot"))
    );
    let (summary, items) = planned.unwrap();
    let h = summary.head_start.clone().expect("the Plan call made a head start");
    assert!(summary.hot_bytes > 0 && h.warmed_bytes > 0, "{summary:?}");
    assert_eq!(h.hot_bytes_left, 0, "planning waited until the head start ended: it read the whole hot set: {h:?}");
    // No item holds a block of hot's or hot_pkey's main fork (what was cached, so captured): the head
    // start read them all.
    for item in &items {
        for r in &item.pending {
            let f = &item.forks[r.fork as usize];
            let again = (f.oid == hot || f.oid == hot_pkey) && f.fork == pghydrate::plan::Fork::Main;
            assert!(!again, "item {} reads {}'s blocks {}-{} again", item.id, f.name, r.first, r.last);
        }
    }
    let mut warmed = 0;
    for item in items {
        let mut text = serde_json::to_string(&item).unwrap();
        loop {
            let mut item: WorkItem = serde_json::from_str(&text).unwrap();
            let opts = call_options(Instant::now() + Duration::from_secs(60), Duration::from_secs(5), item.sessions);
            item.advance(&spec, &opts).await.unwrap();
            text = serde_json::to_string(&item).unwrap();
            if item.done() {
                let s = item.summary();
                assert_eq!((s.skipped_bytes, s.vanished_bytes, s.pending_bytes), (0, 0, 0), "{s:?}");
                warmed += s.warmed_bytes;
                break;
            }
            assert!(item.calls < 20, "no progress");
        }
    }
    assert_eq!(warmed + h.warmed_bytes, summary.planned_bytes, "every planned byte warmed once: {summary:?}");
    assert_eq!(summary.planned_bytes, summary.total_bytes);
    for (rel, oid) in [("hot", hot), ("hot_pkey", hot_pkey), ("cold", cold)] {
        // Every fork of the relation counts against it (main, and a table's free space and visibility maps).
        let blocks: i64 = app
            .query_one(
                "SELECT (sum(pg_relation_size($1::text::regclass, f)) / current_setting('block_size')::int8)::int8
                   FROM unnest(ARRAY['main', 'fsm', 'vm', 'init']) f",
                &[&rel],
            )
            .await
            .unwrap()
            .get(0);
        let blocks = blocks as u64;
        assert!(blocks > 0);
        let seen = blocks_read_and_hit(&app, oid, blocks).await;
        assert_eq!(seen, (blocks, 0), "{rel}: (blocks read, buffer hits): every block read once, none again");
    }
}
