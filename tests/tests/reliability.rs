//! Reliability and security on real servers: nothing written, sessions named and capped, no session
//! left waiting behind a run, network cuts and rewritten relations survived with exact coverage,
//! hostile identifiers warmed (never interpolated), TLS refused when the certificate is not trusted.
//! RELIABILITY.md lists these with their results.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pghydrate::catalog::make_plan;
use pghydrate::maintain::{Maintenance, MaintenanceOutcome};
use pghydrate::pattern::RelationPattern;
use pghydrate::plan::DatabaseOutcome;
use pghydrate::report::{self, ForkOutcome, RunStatus};
use pghydrate::run::{RunOptions, RunState};
use pghydrate::warm::{Counters, Mode};
use pghydrate::ConnectionSpec;
use pghydrate_tests::{
    assert_all_blocks_buffered, assert_complete_and_buffered, assert_outcomes_partition_plan, cli, plan_opts, run_opts,
    test_tls, Cluster, CuttingProxy, SUPERUSER_PASSWORD,
};

async fn run(spec: &ConnectionSpec, st: &mut RunState, opts: &RunOptions) {
    let run = st.advance(spec, opts, Arc::new(Counters::default()));
    tokio::time::timeout(Duration::from_secs(300), run).await.expect("run hung").unwrap();
}

/// Databases a run connects to: all but template0.
async fn connectable(cluster: &Cluster) -> Vec<String> {
    let c = cluster.client("postgres").await;
    c.query("SELECT datname FROM pg_database WHERE datallowconn ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// What a run must leave unchanged: the row counters of every database and the WAL position.
async fn writes_so_far(cluster: &Cluster) -> (i64, i64, i64, String) {
    tokio::time::sleep(Duration::from_millis(1500)).await; // ended backends flush their statistics
    let c = cluster.client("postgres").await;
    let r = c
        .query_one(
            "SELECT sum(tup_inserted)::int8, sum(tup_updated)::int8, sum(tup_deleted)::int8, pg_current_wal_lsn()::text
               FROM pg_stat_database",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

/// Read-only by default: with the extension in place and maintenance off, a whole `pghydrate run`
/// (planning, warming every block of every database, the report) inserts, updates and deletes no row
/// and writes no WAL at all.
async fn a_run_writes_nothing(major: u32) {
    // wal_level=minimal: no standby snapshots in the WAL on a timer, so any WAL is the run's.
    let cluster = Cluster::start(major, &["wal_level = minimal", "max_wal_senders = 0"]);
    cluster.load_sample("app", 1, None).await;
    for db in connectable(&cluster).await {
        let c = cluster.client(&db).await;
        c.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm").await.unwrap();
        // Hint bits set now, not by the run's catalog reads: with data checksums (initdb's default from
        // PostgreSQL 18) the first hint bit set on a page after a checkpoint is WAL-logged, by any reader.
        c.batch_execute("VACUUM (FREEZE)").await.unwrap();
    }
    cluster.client("postgres").await.batch_execute("CHECKPOINT").await.unwrap();
    cluster.restart();
    let before = writes_so_far(&cluster).await;
    let url = cluster.superuser_url("postgres");
    let (code, _out, err) =
        cli(&["run", &url, "--mode", "buffer", "--maintenance", "none", "--progress", "none"], cluster.dir());
    assert_eq!(code, 0, "{err}");
    let after = writes_so_far(&cluster).await;
    assert_eq!(before, after, "(inserted, updated, deleted, WAL position) before and after the run");
    eprintln!("measured: PostgreSQL {major}: rows written and WAL position unchanged: {after:?}");
}

/// A server of many small databases (SaaS tenants): each session works through databases of its own,
/// instead of every session following the queue's head into every database. 60 databases, `pghydrate
/// run` with its default sessions: the connections it opens (the server's own log counts them) stay
/// near two per database, planning included, where every session used to enter every database
/// (measured on 300 databases, --no-hot-set: 5,940 connections and 24.6 s before, 650 and 5.8 s after;
/// docs/benchmark.md). Every block is still read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_spread_over_many_small_databases_one_connection_each() {
    let cluster = Cluster::start(15, &["log_connections = on"]);
    let admin = cluster.client("postgres").await;
    let names: Vec<String> = (0..60).map(|i| format!("tenant_{i:02}")).collect();
    for name in &names {
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    }
    drop(admin);
    let connections = || {
        let log = std::fs::read_to_string(cluster.dir().join("log")).unwrap();
        log.lines().filter(|l| l.contains("connection authorized") && l.contains("application_name=pghydrate")).count()
    };
    let before = connections();
    // As a user runs it: default sessions (adaptive, 16 to start), planning included.
    let report = cluster.dir().join("spread.json");
    let args = ["run", "--maintenance", "none", "--progress", "none", "--include-database", "tenant_*", "--report"];
    let mut args: Vec<&str> = args.to_vec();
    let (url, path) = (cluster.superuser_url("postgres"), report.display().to_string());
    args.extend([path.as_str(), url.as_str()]);
    let (code, _out, err) = cli(&args, cluster.dir());
    assert_eq!(code, 0, "{err}");
    let opened = connections() - before;
    let r: pghydrate::report::Report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    eprintln!("measured: {} databases: {opened} connections in the whole run", names.len());
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    // Planning: one per database and a few; warming: one per database, and a few more per session at
    // the end, when every database left has a session in it (measured: 259 in all with 28 sessions;
    // before, 1,232: every session into every database).
    let bound = 2 * names.len() + 8 * r.sessions as usize;
    assert!(opened <= bound, "{opened} connections for {} databases (at most {bound})", names.len());
}

/// Every session is named `pghydrate` and there are never more than the server can spare: asked for
/// 30 sessions on a server with max_connections = 20, the run uses at most half the free slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_named_and_capped_by_max_connections() {
    let cluster = Cluster::start(15, &["max_connections = 20"]);
    cluster.load_sample("app", 2, None).await;
    // A captured hot set: its head start and planning share the same half of the free slots.
    cluster.client("postgres").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    cluster.client("app").await.batch_execute("SELECT count(*) FROM customers").await.unwrap();
    let (code, out, err) = cli(&["capture", &cluster.superuser_url("postgres")], cluster.dir());
    assert_eq!(code, 0, "capture: {out}\n{err}");
    let monitor = cluster.client("postgres").await;
    let done = Arc::new(AtomicBool::new(false));
    let seen: Arc<Mutex<BTreeMap<String, i64>>> = Arc::default();
    let watcher = {
        let (done, seen) = (done.clone(), seen.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let rows = monitor
                    .query(
                        "SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity
                          WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() GROUP BY 1",
                        &[],
                    )
                    .await
                    .unwrap();
                {
                    let mut seen = seen.lock().unwrap();
                    for r in rows {
                        let (name, n): (String, i64) = (r.get(0), r.get(1));
                        let max = seen.entry(name).or_default();
                        *max = (*max).max(n);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let url = cluster.superuser_url("postgres");
    let dir = cluster.dir().to_path_buf();
    let (code, _out, err) = tokio::task::spawn_blocking(move || {
        cli(
            &[
                "run",
                &url,
                "--sessions",
                "30",
                "--mode",
                "buffer",
                "--range-blocks",
                "16",
                "--maintenance",
                "none",
                "--progress",
                "none",
            ],
            &dir,
        )
    })
    .await
    .unwrap();
    done.store(true, Ordering::Relaxed);
    watcher.await.unwrap();
    assert_eq!(code, 0, "{err}");
    let used: u32 = err
        .split("using ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no warning about the session cap: {err}"));
    assert!(used <= (20 - 3) / 2, "{used} sessions on a server with 17 free slots");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.keys().collect::<Vec<_>>(), vec!["pghydrate"], "sessions seen during the run: {seen:?}");
    // Warm sessions plus the planning/report session that stays open.
    assert!(seen["pghydrate"] as u32 <= used + 1, "{seen:?} with {used} sessions");
    assert!(seen["pghydrate"] >= 2, "the run was never seen in parallel: {seen:?}");
    eprintln!("measured: sessions asked 30, cap {used}, most seen at once {}", seen["pghydrate"]);
}

/// DDL waiting on a table the run is about to read never waits behind the run for longer than the
/// run's lock_timeout: the run gives way, comes back later, and still reads every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_table_is_skipped_then_read_and_nobody_waits_behind_the_run() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_millis(300), Duration::from_secs(60));
    let mut popts = plan_opts(&["app"]);
    popts.first = vec![RelationPattern::parse("customers").unwrap()];
    let plan = make_plan(&spec, &popts).await.unwrap();

    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let mut opts = run_opts(2, Mode::Read);
    opts.warm.lock_timeout = Duration::from_millis(300);
    opts.warm.lock_attempts = 100;
    let run = {
        let spec = spec.clone();
        tokio::spawn(async move {
            let mut st = RunState::new(plan, Mode::Read, 2, Maintenance::None);
            run(&spec, &mut st, &opts).await;
            st
        })
    };
    // Once the run waits for the table, a migration queues for it too: behind the lock holder, and
    // behind the run's request while that lasts (lock_timeout).
    let watcher = cluster.client("postgres").await;
    let waiting = async {
        loop {
            let rows = watcher
                .query(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = 'pghydrate' AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .unwrap();
            if !rows.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("the run never waited for the lock");
    let migration = {
        let c = cluster.client("app").await;
        tokio::spawn(async move {
            c.batch_execute("ALTER TABLE customers ADD COLUMN note text").await.unwrap();
        })
    };
    // Watch who blocks whom for 3 s, then let the holder go.
    let monitor = cluster.client("postgres").await;
    let mut blocked_since: BTreeMap<(i32, i32), Instant> = BTreeMap::new();
    let mut longest = Duration::ZERO;
    let mut samples = 0;
    let mut blocked_samples = 0;
    let end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < end {
        let rows = monitor
            .query(
                "SELECT a.pid, b.pid FROM pg_stat_activity a
                   CROSS JOIN LATERAL unnest(pg_blocking_pids(a.pid)) AS blocker(pid)
                   JOIN pg_stat_activity b ON b.pid = blocker.pid
                  WHERE b.application_name = 'pghydrate' AND a.application_name <> 'pghydrate'",
                &[],
            )
            .await
            .unwrap();
        let now = Instant::now();
        let pairs: Vec<(i32, i32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        blocked_since.retain(|k, _| pairs.contains(k));
        blocked_samples += usize::from(!pairs.is_empty());
        for p in pairs {
            let since = *blocked_since.entry(p).or_insert(now);
            longest = longest.max(now - since);
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(samples > 50);
    locker.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), migration).await.expect("the migration still waits").unwrap();
    let st = tokio::time::timeout(Duration::from_secs(120), run).await.expect("run hung").unwrap();
    assert!(
        longest < Duration::from_millis(300 + 400),
        "a session waited {longest:?} behind the run (lock_timeout 300 ms)"
    );
    eprintln!(
        "measured: longest wait of another session behind the run {longest:?} ({blocked_samples} of {samples} samples saw one)"
    );
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    let customers = r.relations.iter().find(|x| x.name == "customers" && x.fork == "main").unwrap();
    assert_eq!(customers.warmed_blocks, customers.blocks, "{customers:?}");
}

/// The network is cut again and again: every connection through a proxy is dropped after 6 KB from
/// the client. The run reconnects each time and ends with every block read exactly once.
async fn network_cuts_are_survived(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.client("app").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let plan = make_plan(&cluster.superuser_spec(), &plan_opts(&["app"])).await.unwrap();
    let proxy = CuttingProxy::start(cluster.port, 6000).await;
    let via_proxy = ConnectionSpec::parse(
        Some(&format!(
            "postgresql://postgres:{SUPERUSER_PASSWORD}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
            proxy.port,
            test_tls().ca.display()
        )),
        |_| None,
    )
    .unwrap();
    cluster.restart();
    let mut st = RunState::new(plan, Mode::Buffer, 2, Maintenance::None);
    run(&via_proxy, &mut st, &run_opts(2, Mode::Buffer)).await;
    assert!(proxy.cuts() >= 3, "only {} cuts: the test did not cut the run", proxy.cuts());
    eprintln!(
        "measured: PostgreSQL {major}: {} connections cut mid-run, {} ranges",
        proxy.cuts(),
        st.plan.ranges.len()
    );
    // Every block really is in shared_buffers: the cuts lost nothing.
    assert_complete_and_buffered(&cluster, &st, &format!("{} cuts", proxy.cuts())).await;
}

/// Relations rewritten after planning (VACUUM FULL after a large DELETE, CLUSTER): the run reads their
/// new files by oid; what shrank is read up to its new end and reported as truncated; coverage is exact.
async fn relations_rewritten_after_planning(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &plan_opts(&["app"])).await.unwrap();
    let app = cluster.client("app").await;
    for sql in
        ["DELETE FROM documents WHERE id % 4 <> 0", "VACUUM FULL documents", "CLUSTER customers USING customers_pkey"]
    {
        app.batch_execute(sql).await.unwrap();
    }
    let mut st = RunState::new(plan, Mode::Read, 3, Maintenance::None);
    run(&spec, &mut st, &run_opts(3, Mode::Read)).await;
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    for x in r.relations.iter().filter(|x| x.database == "app" && x.outcome != ForkOutcome::Excluded) {
        let now: i64 = app
            .query_one(
                "SELECT coalesce((SELECT pg_relation_size(oid, $2) / 8192 FROM pg_class WHERE oid = $1), 0)",
                &[&x.oid, &x.fork],
            )
            .await
            .unwrap()
            .get(0);
        let expect = x.blocks.min(now as u64);
        assert_eq!(x.warmed_blocks, expect, "{}.{} {}: {x:?}", x.schema, x.name, x.fork);
    }
    let docs = r.relations.iter().find(|x| x.name == "documents" && x.fork == "main").unwrap();
    assert!(docs.warmed_blocks < docs.blocks, "VACUUM FULL should have shrunk documents: {docs:?}");
}

/// Names built to break SQL: quotes, semicolons, backslashes, `$$`, newlines, non-ASCII, in database,
/// schema, table, index and column names. Everything is read and maintained (VACUUM ANALYZE), and the
/// canary table that an injected statement would drop is still there.
async fn hostile_identifiers_are_warmed_not_interpolated(major: u32) {
    let cluster = Cluster::start(major, &[]);
    let db = "d'b\"; DROP TABLE canary; --\\ $$ ü\nx";
    let admin = cluster.client("postgres").await;
    admin.batch_execute(&format!("CREATE DATABASE {}", pghydrate_tests::ident(db))).await.unwrap();
    let c = cluster.client(db).await;
    c.batch_execute(
        r#"CREATE TABLE canary (id int);
           CREATE SCHEMA "s'; DROP TABLE canary; --";
           CREATE TABLE "s'; DROP TABLE canary; --"."t$$x\'y"" ""ä
z" (id int PRIMARY KEY, "b;o\dy" text);
           CREATE INDEX "i$q$'"";
x" ON "s'; DROP TABLE canary; --"."t$$x\'y"" ""ä
z" ("b;o\dy");
           INSERT INTO "s'; DROP TABLE canary; --"."t$$x\'y"" ""ä
z" SELECT g, repeat(md5(g::text), 200) FROM generate_series(1, 3000) g;"#,
    )
    .await
    .unwrap();
    let url = cluster.superuser_url("postgres");
    let report_path = cluster.dir().join("hostile.json");
    let (code, _out, err) = cli(
        &[
            "run",
            &url,
            "--mode",
            "buffer",
            "--maintenance",
            "analyze",
            "--progress",
            "none",
            "--report",
            report_path.to_str().unwrap(),
        ],
        cluster.dir(),
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(r["coverage"], 1.0, "{r}");
    let hostile: Vec<&serde_json::Value> =
        r["relations"].as_array().unwrap().iter().filter(|x| x["database"] == db).collect();
    let names: Vec<&str> = hostile.iter().map(|x| x["name"].as_str().unwrap()).collect();
    for want in ["t$$x\\'y\" \"ä\nz", "i$q$'\";\nx", "canary"] {
        assert!(names.contains(&want), "{want:?} not in {names:?}");
    }
    assert!(hostile.iter().any(|x| x["schema"] == "pg_toast"), "the hostile table's TOAST is read too");
    for x in &hostile {
        assert_eq!(x["outcome"], "warmed", "{x}");
    }
    let analyzed: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL AND relname = $1",
            &[&"t$$x\\'y\" \"ä\nz"],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(analyzed, 1, "the hostile table was maintained");
    c.query_one("SELECT count(*) FROM canary", &[]).await.expect("the canary table is gone: SQL was injected");
}

/// verify-full is the default; a server whose certificate the CA bundle does not vouch for is refused
/// before any password is sent; connecting unencrypted takes an explicit option and logs a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_untrusted_refused_and_disable_is_explicit() {
    let cluster = Cluster::start(15, &["log_connections = on", "log_min_messages = log"]);
    let base = format!("postgresql://postgres:{SUPERUSER_PASSWORD}@127.0.0.1:{}/postgres", cluster.port);
    let tls = test_tls();
    let untrusted = format!("{base}?sslrootcert={}", tls.rogue_ca.display());
    let (code, _out, err) = cli(&["plan", &untrusted], cluster.dir());
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("TLS") && err.contains("certificate"), "{err}");
    assert!(!err.contains(SUPERUSER_PASSWORD));
    let log = std::fs::read_to_string(cluster.dir().join("log")).unwrap_or_default();
    assert!(!log.contains("connection authorized"), "a session was opened with an untrusted certificate:\n{log}");

    let trusted = format!("{base}?sslrootcert={}", tls.ca.display());
    let (code, _out, err) = cli(&["plan", &trusted], cluster.dir());
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("WARN"), "verify-full warns about nothing: {err}");

    let (code, _out, err) = cli(&["plan", &base, "--tls", "disable"], cluster.dir());
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("WARN") && err.contains("TLS is disabled"), "{err}");
}

/// A hot standby (an RDS read replica; a physical-replication green environment) is read like any
/// server, but nothing can be created or maintained on it. Without pg_prewarm on the primary, each
/// database is skipped with the way out (create it on the primary); once it has replicated, every block
/// is read on the standby, and maintenance is reported skipped with why, not attempted table by table.
async fn a_standby_is_warmed_and_nothing_is_attempted_on_it(major: u32) {
    let primary = Cluster::start(major, &[]);
    primary.load_sample("app", 1, None).await;
    let standby = primary.start_standby();
    let url = standby.superuser_url("postgres");
    let report = standby.dir().join("standby.json");
    let run = |extra: &[&str]| {
        let mut args =
            vec!["run", &url, "--maintenance", "analyze", "--progress", "none", "--report", report.to_str().unwrap()];
        args.extend_from_slice(extra);
        cli(&args, standby.dir())
    };
    let (code, _out, err) = run(&[]);
    assert_eq!(code, 4, "{err}");
    let r: report::Report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let app = r.databases.iter().find(|d| d.name == "app").unwrap();
    let reason = app.reason.as_deref().unwrap_or("");
    assert!(
        app.outcome == DatabaseOutcome::Skipped && reason.contains("standby") && reason.contains("primary"),
        "{app:?}"
    );
    assert!(!err.contains("cannot execute"), "nothing was attempted that a standby refuses: {err}");

    for db in ["postgres", "app"] {
        primary
            .client(db)
            .await
            .batch_execute("CREATE EXTENSION pg_prewarm; CREATE EXTENSION pg_buffercache")
            .await
            .unwrap();
    }
    let replica = standby.client("app").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while replica.query_opt("SELECT 1 FROM pg_extension WHERE extname = 'pg_buffercache'", &[]).await.unwrap().is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the extensions did not replicate; standby log:\n{}",
            std::fs::read_to_string(standby.dir().join("log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    standby.restart(); // cold
    let (code, _out, err) = run(&["--mode", "buffer"]);
    assert_eq!(code, 0, "{err}");
    let r: report::Report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r.coverage, 1.0);
    assert!(!r.maintenance.is_empty());
    for m in &r.maintenance {
        assert!(
            m.outcome == MaintenanceOutcome::Skipped && m.reason.as_deref().unwrap_or("").contains("standby"),
            "{m:?}"
        );
    }
    let checked = assert_all_blocks_buffered(&standby, &r).await;
    eprintln!("measured: PostgreSQL {major} standby: {checked} forks, every block buffered; {} tables not maintained, with why", r.maintenance.len());
}

pghydrate_tests::on_oldest_and_newest!(
    a_run_writes_nothing,
    network_cuts_are_survived,
    relations_rewritten_after_planning,
    hostile_identifiers_are_warmed_not_interpolated,
    a_standby_is_warmed_and_nothing_is_attempted_on_it
);

/// Step Functions retries a Warm call with its original input when the call fails (its result lost).
/// Here the first call of each item half finishes and its result is thrown away; the retry from the
/// original item then ends the item, and the bytes counted are exactly the planned bytes: the half
/// done work is neither lost nor counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_item_that_had_half_finished_counts_every_byte_once() {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig, WorkItem};
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(60), Duration::from_secs(300));
    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "read", "include_databases": ["app"], "first": ["tiny", "customers"]}),
        None,
        None,
    )
    .unwrap();
    let mut defaults = Defaults::from_env(|_| None).unwrap();
    defaults.range_blocks = 16;
    let (summary, items) = plan_items(&spec, &RunConfig::new("exec-retry", trigger, &defaults), None).await.unwrap();
    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let mut counted = 0;
    let mut half_done = 0;
    for (n, original) in items.iter().enumerate() {
        let original = serde_json::to_string(original).unwrap();
        if n == 0 {
            // The failed call: it warms what it can before customers' lock holds it to its deadline.
            let mut lost: WorkItem = serde_json::from_str(&original).unwrap();
            let mut opts = call_options(Instant::now() + Duration::from_secs(3), Duration::from_secs(1), 1);
            opts.lock_timeout = Duration::from_secs(60);
            lost.advance(&spec, &opts).await.unwrap();
            let s = lost.summary();
            assert!(s.warmed_bytes > 0 && s.pending_bytes > 0, "the lost call half finished: {s:?}");
            half_done = s.warmed_bytes;
            locker.batch_execute("COMMIT").await.unwrap();
        }
        // The retry: the original input, continued until done.
        let mut text = original;
        loop {
            let mut item: WorkItem = serde_json::from_str(&text).unwrap();
            item.advance(&spec, &call_options(Instant::now() + Duration::from_secs(60), Duration::from_secs(1), 1))
                .await
                .unwrap();
            text = serde_json::to_string(&item).unwrap();
            if item.done() {
                let s = item.summary();
                assert_eq!((s.skipped_bytes, s.pending_bytes), (0, 0), "{s:?}");
                counted += s.warmed_bytes;
                break;
            }
        }
    }
    assert!(half_done > 0);
    assert_eq!(counted, summary.planned_bytes, "every planned byte counted exactly once");
}
