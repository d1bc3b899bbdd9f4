//! Hydration on real PostgreSQL 15, 16, 17 and 18 servers started by the harness. Each scenario runs
//! once per version (modules pg15..pg18 below).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pghydrate::catalog::{make_plan, PlanOptions};
use pghydrate::maintain::{Maintenance, MaintenanceOutcome};
use pghydrate::pattern::RelationPattern;
use pghydrate::plan::{BlockRange, DatabaseOutcome, SkipReason};
use pghydrate::report::{self, ForkOutcome, Report, RunStatus};
use pghydrate::run::{RunOptions, RunState};
use pghydrate::warm::{Counters, Mode, RangeResult, WarmOptions};
use pghydrate_tests::{
    assert_all_blocks_buffered, assert_outcomes_partition_plan, cli, expected_forks, Cluster, ForkKey,
};

fn plan_opts(range_blocks: u64) -> PlanOptions {
    PlanOptions { range_blocks, create_extension: true, lock_attempts: 3, ..Default::default() }
}

fn run_opts(deadline: Option<Instant>) -> RunOptions {
    RunOptions {
        warm: WarmOptions {
            sessions: 4,
            lock_timeout: Duration::from_secs(2),
            deadline,
            margin: Duration::from_secs(1),
            reconnect_for: Duration::from_secs(20),
            ..WarmOptions::default()
        },
        maintenance: Maintenance::None,
        maintenance_timeout: Duration::from_secs(60),
    }
}

fn report_keys(r: &Report, outcome: ForkOutcome) -> BTreeSet<ForkKey> {
    r.relations.iter().filter(|x| x.outcome == outcome).map(|x| (x.database.clone(), x.oid, x.fork.clone())).collect()
}

/// Every fork appears exactly once in the report, and the set is exactly what the catalog holds.
fn assert_report_lists_every_fork_once(r: &Report, expected: &BTreeMap<ForkKey, u64>) {
    let mut seen = BTreeSet::new();
    for x in &r.relations {
        assert!(seen.insert((x.database.clone(), x.oid, x.fork.clone())), "fork listed twice: {x:?}");
        assert!(x.warmed_blocks <= x.blocks, "more blocks warmed than planned: {x:?}");
    }
    let expected_keys: BTreeSet<ForkKey> = expected.keys().cloned().collect();
    let missing: Vec<_> = expected_keys.difference(&seen).collect();
    let extra: Vec<_> = seen.difference(&expected_keys).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "report differs from the catalog: missing {missing:?}, extra {extra:?}"
    );
}

/// After a restart, `pghydrate run --mode buffer` reads every block of every fork of every database:
/// each is in shared_buffers afterwards, and the report lists exactly the catalog's forks, all warmed.
async fn every_block_is_read(major: u32) {
    let cluster = Cluster::start(major, &[]);
    for db in ["postgres", "app", "Ü ber \"db\""] {
        if db != "postgres" {
            cluster.load_sample(db, 1, None).await;
        }
        cluster
            .client(db)
            .await
            .batch_execute("CREATE EXTENSION pg_buffercache; CREATE EXTENSION pg_prewarm")
            .await
            .unwrap();
    }
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE closed; ALTER DATABASE closed ALLOW_CONNECTIONS false").await.ok();
    admin.batch_execute("CREATE DATABASE closed2").await.unwrap();
    admin.batch_execute("ALTER DATABASE closed2 ALLOW_CONNECTIONS false").await.unwrap();
    drop(admin);
    let expected = expected_forks(&cluster).await;
    cluster.restart();

    let tmp = cluster.dir().to_path_buf();
    let report_path = tmp.join("report.json");
    let (code, stdout, stderr) = cli(
        &[
            "run",
            &cluster.superuser_url("postgres"),
            "--mode",
            "buffer",
            "--sessions",
            "4",
            "--range-blocks",
            "64",
            "--maintenance",
            "none",
            "--report",
            report_path.to_str().unwrap(),
        ],
        &tmp,
    );
    assert_eq!(code, 0, "exit code; stdout:\n{stdout}\nstderr:\n{stderr}");
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(r.status, RunStatus::Complete);
    assert_eq!(r.coverage, 1.0);
    assert_eq!(r.warmed_bytes, r.total_bytes);
    assert_report_lists_every_fork_once(&r, &expected);
    for x in &r.relations {
        assert_eq!(x.outcome, ForkOutcome::Warmed, "{x:?}");
        assert_eq!(Some(&x.blocks), expected.get(&(x.database.clone(), x.oid, x.fork.clone())), "size of {x:?}");
    }
    // Every kind of relation is there, in every database with the sample.
    for db in ["app", "Ü ber \"db\""] {
        for name in [
            "customers",
            "customers_email_hash",
            "customers_profile_gin",
            "customers_created_brin",
            "events_2025",
            "places_area_gist",
            "places_pos_spgist",
            "customer_tiers",
            "order_numbers",
            "order; DROP TABLE customers;--",
            "idx\nwith newline",
        ] {
            assert!(r.relations.iter().any(|x| x.database == db && x.name == name), "{name} missing in {db}");
        }
        assert!(r
            .relations
            .iter()
            .any(|x| x.database == db && x.kind == pghydrate::plan::RelKind::ToastTable && x.blocks > 0));
        assert!(r
            .relations
            .iter()
            .any(|x| x.database == db && x.kind == pghydrate::plan::RelKind::ToastIndex && x.blocks > 0));
        assert!(r.relations.iter().any(|x| x.database == db && x.fork == "init" && x.blocks > 0), "unlogged init fork");
        assert!(r.relations.iter().any(|x| x.database == db && x.fork == "vm"), "visibility map fork");
    }
    let closed = r.databases.iter().find(|d| d.name == "closed2").unwrap();
    assert_eq!(closed.outcome, DatabaseOutcome::Skipped);
    assert!(closed.reason.as_deref().unwrap().contains("datallowconn"));
    let checked = assert_all_blocks_buffered(&cluster, &r).await;
    assert!(checked > 300, "only {checked} forks checked");
}

/// Truth by trying: as `role`, call pg_prewarm on each fork; those refused with 42501 are the ones the
/// role cannot read.
async fn unreadable_by(cluster: &Cluster, role: &str, pw: &str, r: &Report) -> BTreeSet<ForkKey> {
    let mut out = BTreeSet::new();
    let mut dbs: BTreeSet<String> = BTreeSet::new();
    for x in &r.relations {
        dbs.insert(x.database.clone());
    }
    for db in dbs {
        let c = cluster.client_as(role, pw, &db).await;
        for x in r.relations.iter().filter(|x| x.database == db) {
            let (first, last) = if x.blocks > 0 { (Some(0i64), Some(0i64)) } else { (None, None) };
            let res = c
                .query_one(
                    "SELECT pg_prewarm($1::oid::regclass, 'prefetch', $2, $3, $4)",
                    &[&x.oid, &x.fork, &first, &last],
                )
                .await;
            if let Err(e) = res {
                if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
                    out.insert((x.database.clone(), x.oid, x.fork.clone()));
                } else {
                    panic!("unexpected error for {x:?}: {e:?}");
                }
            }
        }
    }
    out
}

/// A role that owns nothing reports exactly the forks it could not read (and exits 4); a role that is
/// a member of the owner reads every user relation by acting as the owner; the fix the report proposes
/// for catalog relations (pg_read_all_data) really gives full coverage.
async fn permissions_are_reported_exactly(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, Some("app_owner")).await;
    let admin = cluster.client("postgres").await;
    admin
        .batch_execute(
            "CREATE ROLE reader LOGIN PASSWORD 'reader-pw';
             CREATE ROLE member LOGIN PASSWORD 'member-pw' IN ROLE app_owner;",
        )
        .await
        .unwrap();
    let app = cluster.client("app").await;
    app.batch_execute("CREATE EXTENSION pg_prewarm; GRANT SELECT ON customers TO reader").await.unwrap();
    admin.batch_execute("CREATE EXTENSION pg_prewarm").await.unwrap();

    let run_as = |user: &'static str, pw: &'static str| {
        let spec = cluster.spec(user, pw, "postgres");
        async move {
            let plan = make_plan(&spec, &plan_opts(1024)).await.unwrap();
            let mut st = RunState::new(plan, Mode::Read, 4, Maintenance::None);
            st.advance(&spec, &run_opts(None), Arc::new(Counters::default())).await.unwrap();
            report::build(&st)
        }
    };

    let r = run_as("reader", "reader-pw").await;
    let truth = unreadable_by(&cluster, "reader", "reader-pw", &r).await;
    let skipped: BTreeSet<ForkKey> = r
        .relations
        .iter()
        .filter(|x| x.outcome == ForkOutcome::Skipped)
        .inspect(|x| {
            assert_eq!(x.reason_code, Some(SkipReason::Permission), "{x:?}");
            assert!(x.fix.as_deref().is_some_and(|f| f.starts_with("GRANT ")), "{x:?}");
        })
        .map(|x| (x.database.clone(), x.oid, x.fork.clone()))
        .collect();
    assert_eq!(skipped, truth, "skipped forks differ from the forks the role cannot read");
    assert!(!truth.is_empty());
    assert_eq!(r.exit_code, 4);
    assert_eq!(r.status, RunStatus::Incomplete);
    assert!(r.coverage < 1.0);
    // customers' heap was granted: read, and so is its index (the servers tested check an index's table).
    let pkey = r.relations.iter().find(|x| x.database == "app" && x.name == "customers_pkey").unwrap();
    let heap = r.relations.iter().find(|x| x.database == "app" && x.name == "customers" && x.fork == "main").unwrap();
    assert_eq!(heap.outcome, ForkOutcome::Warmed);
    assert_eq!(pkey.outcome, ForkOutcome::Warmed, "{pkey:?}");
    let other = r.relations.iter().find(|x| x.database == "app" && x.name == "documents" && x.fork == "main").unwrap();
    assert_eq!(other.reason_code, Some(SkipReason::Permission), "{other:?}");

    // The member of app_owner reads all of the sample as its owner.
    let r = run_as("member", "member-pw").await;
    for x in r
        .relations
        .iter()
        .filter(|x| x.database == "app" && x.schema != "pg_catalog" && x.schema != "information_schema")
    {
        if x.schema == "pg_toast" && r.relations.iter().all(|y| y.oid != x.oid || y.outcome != ForkOutcome::Skipped) {
            continue;
        }
        if ["public", "Sales \"EU\" ü"].contains(&x.schema.as_str()) {
            assert_eq!(x.outcome, ForkOutcome::Warmed, "{x:?}");
        }
    }

    // The proposed fix for what remains works.
    admin.batch_execute("GRANT pg_read_all_data TO reader").await.unwrap();
    let r = run_as("reader", "reader-pw").await;
    assert_eq!(r.coverage, 1.0, "skipped: {:?}", report_keys(&r, ForkOutcome::Skipped));
    assert_eq!(r.exit_code, 0);
}

/// A relation dropped and ones truncated between planning and warming end with the right outcome;
/// nothing that still exists is missed, nothing is counted twice.
async fn dropped_and_truncated_during_the_run(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let mut opts = plan_opts(8);
    opts.include_databases = vec!["app".into()];
    let plan = make_plan(&spec, &opts).await.unwrap();
    let blocks_of = |name: &str| {
        plan.forks.iter().find(|f| f.name == name && f.fork == pghydrate::plan::Fork::Main).unwrap().blocks
    };
    let events_before = blocks_of("events_2026");

    let app = cluster.client("app").await;
    // dropped: the table, its TOAST table and index, its primary key
    app.batch_execute("DROP TABLE documents").await.unwrap();
    // truncated to nothing (new empty file)
    app.batch_execute("TRUNCATE session_cache").await.unwrap();
    // shrunk: the second half deleted, VACUUM cuts the file
    app.batch_execute("DELETE FROM events_2026 WHERE id > (SELECT min(id) + 100 FROM events_2026)").await.unwrap();
    app.batch_execute("VACUUM events_2026").await.unwrap();
    let events_after: i64 = app.query_one("SELECT pg_relation_size('events_2026') / 8192", &[]).await.unwrap().get(0);
    assert!((events_after as u64) < events_before / 2, "VACUUM did not shrink the file");

    let mut st = RunState::new(plan.clone(), Mode::Read, 4, Maintenance::None);
    st.advance(&spec, &run_opts(None), Arc::new(Counters::default())).await.unwrap();
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    let find = |name: &str, fork: &str| r.relations.iter().find(|x| x.name == name && x.fork == fork).unwrap().clone();

    let docs = find("documents", "main");
    assert_eq!((docs.outcome, docs.reason_code), (ForkOutcome::Skipped, Some(SkipReason::Dropped)));
    assert_eq!(find("documents_pkey", "main").reason_code, Some(SkipReason::Dropped));
    let toast = r
        .relations
        .iter()
        .filter(|x| x.table_is("public.documents", &plan) && x.kind == pghydrate::plan::RelKind::ToastTable);
    for t in toast {
        assert_eq!(t.reason_code, Some(SkipReason::Dropped), "{t:?}");
    }
    let cache = find("session_cache", "main");
    assert_eq!(
        (cache.outcome, cache.reason_code, cache.warmed_blocks),
        (ForkOutcome::Skipped, Some(SkipReason::Truncated), 0)
    );
    let ev = find("events_2026", "main");
    assert_eq!(ev.outcome, ForkOutcome::Warmed, "{ev:?}");
    assert_eq!(ev.reason_code, Some(SkipReason::Truncated));
    assert_eq!(ev.warmed_blocks, events_after as u64, "every block that still exists is read, once");
    // Nothing else is affected; what vanished does not count against coverage.
    assert_eq!(r.coverage, 1.0, "{:?}", report_keys(&r, ForkOutcome::Skipped));
    assert_eq!(r.status, RunStatus::Complete);
    assert!(r.vanished_bytes > 0);
    for x in &r.relations {
        if x.outcome == ForkOutcome::Skipped {
            assert!(matches!(x.reason_code, Some(SkipReason::Dropped | SkipReason::Truncated)), "{x:?}");
        }
    }
}

trait TableIs {
    fn table_is(&self, table: &str, plan: &pghydrate::plan::Plan) -> bool;
}
impl TableIs for pghydrate::report::RelationReport {
    fn table_is(&self, table: &str, plan: &pghydrate::plan::Plan) -> bool {
        plan.forks.iter().any(|f| f.oid == self.oid && f.database == self.database && f.table == table)
    }
}

/// A run stopped by its deadline (a table locked after planning holds it up) leaves a continuation;
/// resuming it (after a JSON round trip, as the CLI and the Lambdas do) reads exactly the remaining
/// blocks: both calls together read every block once, and all of them end up buffered.
async fn continuation_covers_exactly_the_rest(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.client("app").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    cluster.restart();

    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(60), Duration::from_secs(300));
    let mut popts = plan_opts(16);
    popts.include_databases = vec!["app".into()];
    popts.first = vec![RelationPattern::parse("tiny").unwrap(), RelationPattern::parse("customers").unwrap()];
    let plan = make_plan(&spec, &popts).await.unwrap();
    assert_eq!(plan.fork(&plan.ranges[0]).name, "tiny", "priority pattern first");

    // Lock customers now: the run reads `tiny`, then waits on customers until its deadline cuts it off.
    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let mut st = RunState::new(plan, Mode::Buffer, 1, Maintenance::Analyze);
    let mut opts = run_opts(Some(Instant::now() + Duration::from_secs(3)));
    opts.warm.lock_timeout = Duration::from_secs(60);
    st.advance(&spec, &opts, Arc::new(Counters::default())).await.unwrap();
    assert!(!st.finished());
    assert!(!st.pending.is_empty());
    assert!(st.outcomes.iter().all(|o| matches!(o.result, RangeResult::Warmed { .. })), "{:?}", st.outcomes);
    assert!(st.outcomes.iter().any(|o| st.plan.fork(&o.range).name == "tiny"), "the priority table was read");
    assert!(!st.outcomes.iter().any(|o| st.plan.fork(&o.range).name == "customers"), "the locked table was not");
    assert_outcomes_partition_plan(&st);
    assert_eq!(report::build(&st).exit_code, 5);
    let pending_before = st.pending.clone();
    let done_before = st.outcomes.len();

    let mut resumed = RunState::from_json(&serde_json::to_string(&st).unwrap()).unwrap();
    assert_eq!(resumed, st);
    locker.batch_execute("COMMIT").await.unwrap();
    resumed.advance(&spec, &run_opts(None), Arc::new(Counters::default())).await.unwrap();
    assert!(resumed.finished());
    assert_outcomes_partition_plan(&resumed);
    // Block by block (adjacent ranges read in one call are recorded as one outcome).
    let blocks = |ranges: &mut dyn Iterator<Item = BlockRange>| -> BTreeSet<(u32, u64)> {
        ranges.flat_map(|r| (r.first..=r.last).map(move |b| (r.fork, b))).collect()
    };
    let read_now = blocks(&mut resumed.outcomes[done_before..].iter().map(|o| o.range));
    let want = blocks(&mut pending_before.into_iter());
    assert_eq!(read_now, want, "the resumed call read exactly the pending blocks");
    let r = report::build(&resumed);
    assert_eq!((r.coverage, r.exit_code, r.pending_bytes), (1.0, 0, 0));
    for x in r.relations.iter().filter(|x| x.outcome != ForkOutcome::Excluded) {
        assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
    }
    assert!(
        !r.maintenance.is_empty() && r.maintenance.iter().all(|m| m.outcome == MaintenanceOutcome::Done),
        "{:?}",
        r.maintenance
    );
    assert_all_blocks_buffered(&cluster, &r).await;
}

/// A relation held ACCESS EXCLUSIVE while planning does not stall the plan: it is tried
/// `lock_attempts` times, then planned as skipped with reason lock_timeout; everything else is planned.
async fn locked_while_planning_is_reported_not_waited_for(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE documents IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_millis(200), Duration::from_secs(60));
    let mut popts = plan_opts(1024);
    popts.include_databases = vec!["app".into()];
    popts.lock_attempts = 2;
    // A guard against a hang, not a performance assertion.
    let plan =
        tokio::time::timeout(Duration::from_secs(60), make_plan(&spec, &popts)).await.expect("plan hung").unwrap();
    let docs = plan.forks.iter().find(|f| f.name == "documents" && f.fork == pghydrate::plan::Fork::Main).unwrap();
    assert_eq!(docs.planned_skip.as_ref().map(|s| s.reason), Some(SkipReason::LockTimeout), "{docs:?}");
    let mut st = RunState::new(plan, Mode::Read, 2, Maintenance::Analyze);
    let mut opts = run_opts(None);
    opts.warm.lock_timeout = Duration::from_millis(200);
    st.advance(&spec, &opts, Arc::new(Counters::default())).await.unwrap();
    let r = report::build(&st);
    // Only documents is skipped: its heap (locked while planning) and its indexes (pg_prewarm locks an
    // index's table too), each with reason lock_timeout.
    let skipped: Vec<_> = r.relations.iter().filter(|x| x.outcome == ForkOutcome::Skipped).collect();
    assert!(skipped.iter().any(|x| x.name == "documents"), "{skipped:?}");
    for x in &skipped {
        assert_eq!(x.reason_code, Some(SkipReason::LockTimeout), "{x:?}");
        assert!(st.plan.forks.iter().any(|f| f.oid == x.oid && f.table == "public.documents"), "{x:?}");
    }
    assert_eq!(r.exit_code, 4);
    let m = r.maintenance.iter().find(|m| m.table == "public.documents").unwrap();
    assert_eq!(
        m.outcome,
        MaintenanceOutcome::Skipped,
        "ANALYZE of the locked table gives up after lock_timeout: {m:?}"
    );
    locker.batch_execute("COMMIT").await.unwrap();
}

/// The CLI writes a continuation when its time limit stops it (exit 5) and `resume` finishes the
/// job (exit 0, full coverage) and removes the continuation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_resume_finishes_a_stopped_run() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let dir = cluster.dir().to_path_buf();
    let cont = dir.join("cont.json");
    let url = cluster.superuser_url("postgres");
    // A margin just under the limit: planning uses up the rest, so no range starts.
    let (code, stdout, stderr) =
        cli(&["run", &url, "--time-limit", "2s", "--margin", "1990ms", "--continuation", cont.to_str().unwrap()], &dir);
    assert_eq!(code, 5, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains(&format!("pghydrate resume {}", cont.display())), "{stderr}");
    let st = RunState::from_json(&std::fs::read_to_string(&cont).unwrap()).unwrap();
    assert_eq!(st.pending.len(), st.plan.ranges.len());
    assert!(!std::fs::read_to_string(&cont).unwrap().contains(pghydrate_tests::SUPERUSER_PASSWORD));
    let report = dir.join("r.json");
    let (code, stdout, stderr) =
        cli(&["resume", cont.to_str().unwrap(), &url, "--report", report.to_str().unwrap()], &dir);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    assert!(stdout.contains("pghydrate complete"), "{stdout}");
    assert!(!cont.exists());
}

/// Bad input: one clear line on stderr, a documented non-zero exit, and never the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_one_clear_line() {
    let cluster = Cluster::start(15, &[]);
    // A server without TLS, for the cases where TLS is asked for and not offered.
    let plain = Cluster::start(15, &["ssl = off"]);
    let dir = cluster.dir().to_path_buf();
    let tls = pghydrate_tests::test_tls();
    let ca = format!("sslmode=verify-full&sslrootcert={}", tls.ca.display());
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let wrong_pw = format!("postgresql://postgres:Wr0ng-pass@127.0.0.1:{}/postgres?{ca}", cluster.port);
    let no_tls = format!("postgresql://postgres:x@127.0.0.1:{}/postgres?sslmode=require", plain.port);
    let no_tls_default = format!("postgresql://postgres:x@127.0.0.1:{}/postgres?{ca}", plain.port);
    let untrusted = format!(
        "postgresql://postgres:{}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pghydrate_tests::SUPERUSER_PASSWORD,
        cluster.port,
        tls.rogue_ca.display()
    );
    let no_ca =
        format!("postgresql://postgres:{}@127.0.0.1:{}/postgres", pghydrate_tests::SUPERUSER_PASSWORD, cluster.port);
    let good = cluster.superuser_url("postgres");
    let unreachable = format!("postgresql://postgres:x@127.0.0.1:{closed_port}/postgres?{ca}");
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["run", &unreachable], 3, "cannot connect"),
        (vec!["run", &wrong_pw], 3, "authentication failed"),
        (vec!["run", &no_tls], 3, "TLS"),
        (vec!["run", &no_tls_default], 3, "TLS"),
        (vec!["run", &untrusted], 3, "certificate"),
        (vec!["run", &no_ca], 2, "CA bundle"),
        (vec!["run", &good, "--include-database", "nosuchdb"], 2, "matches no database"),
        (vec!["run", &good, "--include", "public.no_such_table"], 2, "matches no relation"),
        (vec!["run", &good, "--first", "pg_class_oid_index"], 2, "is an index of the table \"pg_catalog.pg_class\""),
        (vec!["run", &good, "--sessions", "0"], 2, "--sessions"),
        (vec!["run", &good, "--mode", "fast"], 2, "--mode"),
        (vec!["run", &good, "--lock-timeout", "soon"], 2, "--lock-timeout"),
        (vec!["run", &good, "--range-blocks", "0"], 2, "--range-blocks"),
        (vec!["run", &good, "--time-limit", "10s", "--margin", "30s"], 2, "--time-limit"),
        (vec!["run", &good, "--tls", "sometimes"], 2, "--tls"),
        (vec!["run", "postgresql://h/db?sslmode=maybe"], 2, "sslmode"),
        (vec!["run", &good, "--tls", "verify-full", "--ca-file", "/nonexistent/ca.pem"], 2, "CA bundle"),
        (vec!["resume", "/nonexistent/continuation.json", &good], 1, "continuation"),
    ];
    for (args, want_code, want_text) in cases {
        let (code, _stdout, stderr) = cli(&args, &dir);
        // One line for the error; a warning the options ask for (e.g. sslmode=require) may precede it.
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty() && !l.contains(" WARN ")).collect();
        assert_eq!(code, want_code, "{args:?}: {stderr}");
        assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {stderr}");
        assert!(lines[0].starts_with("pghydrate: ") && lines[0].contains(want_text), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("Wr0ng-pass") && !stderr.contains(pghydrate_tests::SUPERUSER_PASSWORD),
            "{args:?}: password leaked"
        );
    }
}

/// Waits until a pghydrate session waits on a lock; returns its pid.
async fn pghydrate_waiting_on_lock(admin: &tokio_postgres::Client, not: Option<i32>) -> i32 {
    for _ in 0..600 {
        let row = admin
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'pghydrate' AND wait_event_type = 'Lock'
                   AND pid <> coalesce($1, 0) LIMIT 1",
                &[&not],
            )
            .await
            .unwrap();
        if let Some(r) = row {
            return r.get(0);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no pghydrate session came to wait on the lock");
}

/// A session killed mid-range (pg_terminate_backend), and then the whole server restarted mid-run:
/// the range is retried on a new session each time and the run ends complete, each block counted once.
async fn lost_sessions_and_restarts_are_survived(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(60), Duration::from_secs(300));
    let mut popts = plan_opts(64);
    popts.include_databases = vec!["app".into()];
    popts.first = vec![RelationPattern::parse("customers").unwrap()];
    let plan = make_plan(&spec, &popts).await.unwrap();

    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let mut st = RunState::new(plan, Mode::Read, 1, Maintenance::None);
    let mut opts = run_opts(None);
    opts.warm.lock_timeout = Duration::from_secs(60);
    opts.warm.reconnect_for = Duration::from_secs(60);
    let run = tokio::spawn(async move {
        st.advance(&spec, &opts, Arc::new(Counters::default())).await.unwrap();
        st
    });

    // 1. Kill the session while it waits on customers: it must come back and wait again.
    let admin = cluster.client("postgres").await;
    let pid = pghydrate_waiting_on_lock(&admin, None).await;
    admin.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap();
    let pid2 = pghydrate_waiting_on_lock(&admin, Some(pid)).await;
    assert_ne!(pid, pid2);
    drop(admin);

    // 2. Restart the server under it (this also ends the lock holder's transaction).
    cluster.stop("fast");
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.start_again();
    drop(locker);

    let st = tokio::time::timeout(Duration::from_secs(120), run).await.expect("run hung").unwrap();
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete), "{:?}", report_keys(&r, ForkOutcome::Skipped));
    for x in r.relations.iter().filter(|x| x.outcome != ForkOutcome::Excluded) {
        assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
    }
}

/// Include / exclude / first patterns through the CLI: excluded tables (with their indexes and TOAST)
/// are listed as excluded and not read, the rest is complete, and `plan --json` puts `--first` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patterns_choose_what_is_read_and_when() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.load_sample("other", 1, None).await;
    let dir = cluster.dir().to_path_buf();
    let url = cluster.superuser_url("postgres");
    let (code, stdout, stderr) = cli(
        &["plan", &url, "--json", "--include-database", "app", "--first", "places", "--exclude", "public.documents"],
        &dir,
    );
    assert_eq!(code, 0, "{stderr}");
    let plan: pghydrate::plan::Plan = serde_json::from_str(&stdout).unwrap();
    assert_eq!(plan.fork(&plan.ranges[0]).table, "public.places");
    assert!(plan.forks.iter().all(|f| f.database == "app"), "only the included database is planned");
    assert_eq!(plan.databases.iter().find(|d| d.name == "other").unwrap().outcome, DatabaseOutcome::Excluded);

    let report = dir.join("r.json");
    let (code, stdout, stderr) = cli(
        &[
            "run",
            &url,
            "--include-database",
            "app",
            "--exclude",
            "public.documents",
            "--report",
            report.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let excluded: Vec<_> = r.relations.iter().filter(|x| x.outcome == ForkOutcome::Excluded).collect();
    let kinds: BTreeSet<String> = excluded.iter().map(|x| format!("{:?}", x.kind)).collect();
    assert_eq!(
        kinds,
        ["Index", "Table", "ToastIndex", "ToastTable"].iter().map(|s| s.to_string()).collect(),
        "documents with its index and TOAST: {excluded:?}"
    );
    assert!(excluded.iter().all(|x| x.warmed_blocks == 0));
    assert!(r.excluded_bytes > 0);
    assert_eq!(r.coverage, 1.0);
    assert!(r.maintenance.iter().all(|m| m.table != "public.documents"), "excluded tables are not maintained");
}

/// The workflow path: the plan cut into items, each item warmed by "Lambda calls" with a deadline and a
/// JSON round trip between calls, until done. The first call is held up by a locked table until its
/// deadline, so it must hand back a continuation; in the end every planned block is read exactly once
/// and all of them are in shared_buffers.
async fn workflow_items_continue_until_done(major: u32) {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig, WorkItem, ITEM_LIMIT_BYTES};
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.client("app").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    cluster.restart();
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(60), Duration::from_secs(300));
    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "buffer", "include_databases": ["app"], "first": ["tiny", "customers"]}),
        None,
        None,
    )
    .unwrap();
    let mut defaults = Defaults::from_env(|_| None).unwrap();
    defaults.range_blocks = 16;
    let run = RunConfig::new("exec-1", trigger, &defaults);
    let (summary, items) = plan_items(&spec, &run, None).await.unwrap();
    assert_eq!(summary.items, items.len());
    assert_eq!(summary.mode, "buffer");
    assert_eq!(items[0].forks[items[0].pending[0].fork as usize].name, "tiny");

    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let mut warmed = 0;
    let mut first_call = true;
    for item in items {
        let mut text = serde_json::to_string(&item).unwrap();
        assert!(text.len() <= ITEM_LIMIT_BYTES, "item of {} bytes", text.len());
        loop {
            let mut item: WorkItem = serde_json::from_str(&text).unwrap();
            // As the Warm function: several sessions per call, as the plan sized them.
            assert!(item.sessions > 1 && item.sessions == summary.sessions_per_call, "{}", item.sessions);
            // The first call reads tiny, then waits for customers' lock until its deadline. 15 s gives its
            // sessions time to connect and read tiny on a busy machine too: with 3 s (2 s before the
            // margin) it once read nothing, with the twin suite running beside it. The later calls end
            // when their item is done.
            let mut opts =
                call_options(Instant::now() + Duration::from_secs(15), Duration::from_secs(1), item.sessions);
            opts.lock_timeout = Duration::from_secs(60);
            item.advance(&spec, &opts).await.unwrap();
            text = serde_json::to_string(&item).unwrap();
            if first_call {
                first_call = false;
                assert!(!item.done(), "the first call stopped at its deadline");
                let s = item.summary();
                assert!(s.warmed_bytes > 0 && s.pending_bytes > 0, "{s:?}");
                locker.batch_execute("COMMIT").await.unwrap();
                continue;
            }
            if item.done() {
                let s = item.summary();
                assert_eq!((s.skipped_bytes, s.vanished_bytes, s.pending_bytes), (0, 0, 0), "{s:?}");
                warmed += s.warmed_bytes;
                break;
            }
            assert!(item.calls < 20, "no progress");
        }
    }
    assert_eq!(warmed, summary.planned_bytes, "every planned byte warmed exactly once");
    assert_eq!(summary.planned_bytes, summary.total_bytes);
    // And the blocks really are in shared buffers.
    let mut o = plan_opts(1024);
    o.include_databases = vec!["app".into()];
    let plan = make_plan(&spec, &o).await.unwrap();
    let mut st = RunState::new(plan, Mode::Buffer, 1, Maintenance::None);
    st.outcomes = st
        .plan
        .ranges
        .iter()
        .map(|r| pghydrate::warm::RangeOutcome {
            range: *r,
            result: RangeResult::Warmed { blocks: r.blocks(), seconds: 0.0 },
        })
        .collect();
    st.pending.clear();
    assert_all_blocks_buffered(&cluster, &report::build(&st)).await;
}

/// Databases planned at once give exactly the plan that one at a time gives (databases, forks, sizes,
/// ranges, in the same order), on a server with few connection slots to spare (6, 3 of them reserved
/// for superusers): the planning sessions stay within half the free ones, so nothing is refused ("too
/// many clients"), where 8 at once would be.
async fn databases_planned_at_once_plan_what_one_at_a_time_plans(major: u32) {
    let cluster = Cluster::start(major, &["max_connections = 6"]);
    let admin = cluster.client("postgres").await;
    for i in 0..12 {
        admin.batch_execute(&format!("CREATE DATABASE tenant_{i:02}")).await.unwrap();
        let db = cluster.client(&format!("tenant_{i:02}")).await;
        db.batch_execute(&format!(
            "CREATE TABLE orders (id int PRIMARY KEY, note text);
             INSERT INTO orders SELECT g, repeat(md5(g::text), {}) FROM generate_series(1, {}) g;
             CREATE INDEX ON orders (note)",
            1 + i % 3,
            500 * (i + 1)
        ))
        .await
        .unwrap();
    }
    admin.batch_execute("CREATE DATABASE closed").await.unwrap();
    admin.batch_execute("ALTER DATABASE closed ALLOW_CONNECTIONS false").await.unwrap();
    drop(admin);
    let spec = cluster.superuser_spec();
    let plan_with = |at_once: usize| {
        let spec = spec.clone();
        async move {
            let opts = PlanOptions { databases_at_once: at_once, ..plan_opts(64) };
            make_plan(&spec, &opts).await.unwrap()
        }
    };
    let one = plan_with(1).await;
    let many = plan_with(8).await;
    let databases = |p: &pghydrate::plan::Plan| {
        p.databases.iter().map(|d| (d.name.clone(), d.outcome, d.reason.clone())).collect::<Vec<_>>()
    };
    let forks = |p: &pghydrate::plan::Plan| {
        p.forks.iter().map(|f| (f.database.clone(), f.oid, f.fork, f.blocks, f.excluded)).collect::<Vec<_>>()
    };
    assert_eq!(databases(&one), databases(&many));
    assert_eq!(
        one.databases.iter().filter(|d| d.outcome == DatabaseOutcome::Planned).count(),
        13,
        "postgres and the 12 tenants: {:?}",
        databases(&one)
    );
    assert_eq!(forks(&one), forks(&many));
    assert_eq!(one.ranges, many.ranges);
    assert!(one.forks.iter().any(|f| f.database == "tenant_11" && f.name == "orders"));
}

/// Plans made at the same time on databases without pg_prewarm (a run's head start and its full plan
/// do this on every first restore; so do two runs) each create it or find it created: every database
/// is planned by every plan, none is skipped because another session's CREATE EXTENSION came first
/// (between its two lookups, or before its own CREATE could commit).
async fn plans_at_the_same_time_share_one_create_extension(major: u32) {
    let cluster = Cluster::start(major, &[]);
    let admin = cluster.client("postgres").await;
    let names: Vec<String> = (0..8).map(|i| format!("fresh_{i}")).collect();
    for name in &names {
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        let db = cluster.client(name).await;
        db.batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 1000)")
            .await
            .unwrap();
    }
    drop(admin);
    let spec = cluster.superuser_spec();
    let include: Vec<&str> = names.iter().map(String::as_str).collect();
    let opts = PlanOptions { databases_at_once: 8, ..pghydrate_tests::plan_opts(&include) };
    // In half the databases another session's CREATE EXTENSION is under way (not yet committed) while
    // the plans look: theirs waits for it, then fails on the extension's unique name.
    let mut creating = Vec::new();
    for name in &names[..4] {
        let db = cluster.client(name).await;
        db.batch_execute("BEGIN; CREATE EXTENSION pg_prewarm").await.unwrap();
        creating.push(db);
    }
    let commit = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for db in &creating {
            db.batch_execute("COMMIT").await.unwrap();
        }
    };
    let plan = || make_plan(&spec, &opts);
    let (plans, ()) = tokio::join!(async { tokio::join!(plan(), plan(), plan(), plan(), plan()) }, commit);
    for plan in [plans.0, plans.1, plans.2, plans.3, plans.4] {
        let plan = plan.unwrap();
        let planned: Vec<_> = plan
            .databases
            .iter()
            .filter(|d| d.outcome != DatabaseOutcome::Excluded)
            .map(|d| (d.name.clone(), d.outcome, d.reason.clone()))
            .collect();
        assert_eq!(planned.len(), names.len(), "{planned:?}");
        for d in &planned {
            assert_eq!(d.1, DatabaseOutcome::Planned, "skipped although pg_prewarm could be created: {d:?}");
        }
        assert!(plan.forks.iter().all(|f| f.planned_skip.is_none()), "a fork planned skipped");
    }
    for name in &names {
        let db = cluster.client(name).await;
        let n: i64 =
            db.query_one("SELECT count(*) FROM pg_extension WHERE extname = 'pg_prewarm'", &[]).await.unwrap().get(0);
        assert_eq!(n, 1, "{name}");
    }
}

pghydrate_tests::on_every_version!(
    every_block_is_read,
    permissions_are_reported_exactly,
    dropped_and_truncated_during_the_run,
    continuation_covers_exactly_the_rest,
    locked_while_planning_is_reported_not_waited_for,
    lost_sessions_and_restarts_are_survived,
    workflow_items_continue_until_done
);

pghydrate_tests::on_oldest_and_newest!(
    databases_planned_at_once_plan_what_one_at_a_time_plans,
    plans_at_the_same_time_share_one_create_extension
);
