//! The engine ends well in every storm, on real servers: a half-open connection (no answer, no close),
//! a database unreachable for longer than the reconnect window, a database dropped mid-run, a worker
//! that panics, a maintenance statement longer than any call, and Ctrl-C. Each test fails on the
//! engine as it was before its fix (hangs, loses work, or skips what is only late). RELIABILITY.md
//! lists them with their measured results.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pghydrate::catalog::{make_plan, PlanOptions};
use pghydrate::maintain::{maintain, MaintainOptions, Maintenance, MaintenanceOutcome, MaintenanceTarget};
use pghydrate::plan::SkipReason;
use pghydrate::report::{self, ForkOutcome, RunStatus};
use pghydrate::run::{RunOptions, RunState};
use pghydrate::warm::{Counters, Mode, RangeHook};
use pghydrate::ConnectionSpec;
use pghydrate_tests::{
    assert_all_blocks_buffered, assert_complete_and_buffered, assert_outcomes_partition_plan, pghydrate_bin, plan_opts,
    test_tls, BlackholeProxy, Cluster, SUPERUSER_PASSWORD,
};

/// [`pghydrate_tests::run_opts`] in buffer mode, with a 4 s margin.
fn run_opts(sessions: u32) -> RunOptions {
    let mut opts = pghydrate_tests::run_opts(sessions, Mode::Buffer);
    opts.warm.margin = Duration::from_secs(4);
    opts
}

/// Advances the state, failing the test if it does not end within `bound` (a hang is the failure
/// these tests exist to catch).
async fn advance_within(spec: &ConnectionSpec, st: &mut RunState, opts: &RunOptions, bound: Duration) -> Duration {
    let started = Instant::now();
    let run = st.advance(spec, opts, Arc::new(Counters::default()));
    tokio::time::timeout(bound, run).await.unwrap_or_else(|_| panic!("the run hung for {bound:?}")).unwrap();
    started.elapsed()
}

fn via_proxy(port: u16) -> ConnectionSpec {
    ConnectionSpec::parse(
        Some(&format!(
            "postgresql://postgres:{SUPERUSER_PASSWORD}@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={}",
            test_tls().ca.display()
        )),
        |_| None,
    )
    .unwrap()
}

/// Half-open connections: the proxy stops forwarding mid-conversation and keeps the sockets open, so
/// neither the server's statement_timeout nor a close ever arrives. First within a Lambda-like
/// deadline (10 s): the call returns before it, with what it could not read pending. Then without a
/// deadline: each held session is given up after its client-side bound, the range is read on a new
/// session, and the run ends complete, every block once.
async fn a_half_open_connection_is_noticed_and_the_run_ends_complete(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.client("app").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let plan = make_plan(&cluster.superuser_spec(), &plan_opts(&["app"])).await.unwrap();
    let mut st = RunState::new(plan, Mode::Buffer, 2, Maintenance::None);

    // 1. A deadline 10 s away; every connection is held after 6 KB (the handshake passes).
    let proxy = BlackholeProxy::start(cluster.port, 6000, u32::MAX).await;
    let mut opts = run_opts(2);
    opts.warm.deadline = Some(Instant::now() + Duration::from_secs(10));
    let took = advance_within(&via_proxy(proxy.port), &mut st, &opts, Duration::from_secs(60)).await;
    assert!(proxy.held() >= 1, "the proxy held nothing: the test did not test");
    assert!(took < Duration::from_secs(10), "the call ran past its deadline: {took:?}");
    assert!(!st.pending.is_empty(), "held sessions cannot have finished the run");
    assert_outcomes_partition_plan(&st);
    eprintln!("measured: PostgreSQL {major}: deadline call returned after {:.1} s (deadline 10 s), {} connections held, {} ranges pending",
              took.as_secs_f64(), proxy.held(), st.pending.len());
    drop(proxy);

    // 2. No deadline: the first two connections are held; statement_timeout 3 s.
    let proxy = BlackholeProxy::start(cluster.port, 6000, 2).await;
    let mut opts = run_opts(2);
    opts.warm.statement_timeout = Duration::from_secs(3);
    let took = advance_within(&via_proxy(proxy.port), &mut st, &opts, Duration::from_secs(90)).await;
    assert_eq!(proxy.held(), 2, "both holds must have happened");
    assert_complete_and_buffered(&cluster, &st, "held sessions given up").await;
    eprintln!(
        "measured: PostgreSQL {major}: 2 half-open sessions noticed, run complete in {:.1} s (statement_timeout 3 s)",
        took.as_secs_f64()
    );
}

/// Planning over a half-open connection: the catalog statements are client-bounded too, so the plan
/// ends (the database skipped, or the run refused, with "no answer") instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planning_over_a_half_open_connection_ends() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    for hold_after in [2500, 6000] {
        let proxy = BlackholeProxy::start(cluster.port, hold_after, 1).await;
        let spec = via_proxy(proxy.port).with_timeouts(Duration::from_secs(2), Duration::from_secs(3));
        let started = Instant::now();
        let res = tokio::time::timeout(Duration::from_secs(60), make_plan(&spec, &plan_opts(&["app"])))
            .await
            .expect("planning hung on a half-open connection");
        assert_eq!(proxy.held(), 1, "the test did not hold a planning connection");
        let said = match res {
            Err(e) => e.to_string(),
            Ok(plan) => plan.databases.iter().filter_map(|d| d.reason.clone()).collect::<Vec<_>>().join("; "),
        };
        assert!(said.contains("no answer"), "{said}");
        eprintln!(
            "measured: held after {hold_after} bytes: planning ended in {:.1} s: {said}",
            started.elapsed().as_secs_f64()
        );
    }
}

/// A server down for longer than `reconnect_for` (a failover, a long reboot): the ranges stay pending,
/// the report says which databases were unreachable and exits 3, and the next call (resume, or the
/// workflow's retry) reads exactly the rest. A database dropped during the run vanished: it does not
/// count against coverage and is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_stays_pending_and_a_dropped_one_vanished() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.load_sample("gone", 1, None).await;
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &plan_opts(&["app", "gone"])).await.unwrap();
    let mut st = RunState::new(plan, Mode::Read, 2, Maintenance::None);

    cluster.stop("fast");
    let mut opts = run_opts(2);
    opts.warm.reconnect_for = Duration::from_secs(2);
    advance_within(&spec, &mut st, &opts, Duration::from_secs(60)).await;
    assert!(st.outcomes.is_empty(), "nothing could be read, so nothing may be recorded: {:?}", &st.outcomes[..1]);
    assert_eq!(st.pending.len(), st.plan.ranges.len(), "every range stays pending");
    assert_eq!(st.unreachable.keys().collect::<Vec<_>>(), ["app", "gone"]);
    let r = report::build(&st);
    assert_eq!((r.status, r.exit_code), (RunStatus::StoppedUnreachable, 3));
    assert!(r.summary().contains("unreachable app: cannot connect"), "{}", r.summary());
    // Through JSON, as a continuation is.
    let mut st = RunState::from_json(&serde_json::to_string(&st).unwrap()).unwrap();

    cluster.start_again();
    cluster.client("postgres").await.batch_execute("DROP DATABASE gone WITH (FORCE)").await.unwrap();
    advance_within(&spec, &mut st, &opts, Duration::from_secs(120)).await;
    assert_outcomes_partition_plan(&st);
    assert!(st.unreachable.is_empty());
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status, r.exit_code), (1.0, RunStatus::Complete, 0));
    let gone: Vec<_> = r
        .relations
        .iter()
        .filter(|x| x.database == "gone" && x.outcome != ForkOutcome::Excluded && x.blocks > 0)
        .collect();
    assert!(!gone.is_empty());
    for x in gone {
        assert_eq!(x.reason_code, Some(SkipReason::DatabaseDropped), "{x:?}");
    }
    for x in r.relations.iter().filter(|x| x.database == "app" && x.outcome != ForkOutcome::Excluded) {
        assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
    }
}

/// A worker that panics (a bug) loses nothing: the range it held goes back to the queue and is read
/// on the next attempt; a range that panics every time is reported as an internal error instead of
/// looping; no other worker waits forever for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_loses_no_range() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &plan_opts(&["app"])).await.unwrap();
    let mut st = RunState::new(plan, Mode::Read, 3, Maintenance::None);
    let once = Arc::new(AtomicU32::new(0));
    let seen = once.clone();
    let mut opts = run_opts(3);
    opts.warm.before_range = Some(RangeHook(Arc::new(move |fork, range| {
        if fork.name == "customers" && fork.fork == pghydrate::plan::Fork::Main && range.first == 0 {
            seen.fetch_add(1, Ordering::SeqCst);
            if seen.load(Ordering::SeqCst) == 1 {
                panic!("injected: first attempt at customers");
            }
        }
        if fork.name == "tiny" && fork.fork == pghydrate::plan::Fork::Main {
            panic!("injected: tiny always");
        }
    })));
    advance_within(&spec, &mut st, &opts, Duration::from_secs(120)).await;
    assert_outcomes_partition_plan(&st);
    assert_eq!(once.load(Ordering::SeqCst), 2, "customers' first range: one panic, then read");
    let r = report::build(&st);
    for x in r.relations.iter().filter(|x| x.database == "app" && x.outcome != ForkOutcome::Excluded) {
        if x.name == "tiny" && x.fork == "main" {
            assert_eq!(x.outcome, ForkOutcome::Skipped, "{x:?}");
            assert!(x.reason.as_deref().unwrap_or("").contains("internal error: injected"), "{x:?}");
        } else {
            assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
        }
    }
}

/// A maintenance statement longer than any call (VACUUM of a large lazily-loaded table, here an
/// ANALYZE slowed by an expression index): the first cut puts it back, the second reports it with the
/// statement to run from a host. Before, it went back to the front of every later call, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maintenance_statement_longer_than_a_call_is_reported_not_retried_forever() {
    let cluster = Cluster::start(15, &[]);
    let c = cluster.client("postgres").await;
    c.batch_execute(
        "CREATE FUNCTION slow(i int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT i FROM (SELECT pg_sleep(0.01)) s';
         CREATE TABLE \"sl'ow\" AS SELECT g AS id FROM generate_series(1, 600) g;
         CREATE INDEX ON \"sl'ow\" (slow(id));
         CREATE TABLE quick AS SELECT 1 AS id;",
    )
    .await
    .unwrap();
    let oid = |name: &str| {
        let c = &c;
        let name = name.to_string();
        async move { c.query_one("SELECT $1::text::regclass::oid", &[&name]).await.unwrap().get::<_, u32>(0) }
    };
    let mut pending = vec![
        MaintenanceTarget {
            database: "postgres".into(),
            table: "public.sl'ow".into(),
            oid: oid("\"sl'ow\"").await,
            cut: 0,
            vacuum_only: false,
        },
        MaintenanceTarget {
            database: "postgres".into(),
            table: "public.quick".into(),
            oid: oid("quick").await,
            cut: 0,
            vacuum_only: false,
        },
    ];
    let spec = cluster.superuser_spec();
    let mut results = Vec::new();
    let mut calls = 0;
    while !pending.is_empty() {
        calls += 1;
        assert!(calls <= 3, "still not done after {calls} calls: {pending:?}");
        let opts = MaintainOptions {
            action: Maintenance::Analyze,
            statement_timeout: Duration::from_secs(3600),
            lock_timeout: Duration::from_secs(2),
            deadline: Some(Instant::now() + Duration::from_secs(3)),
            margin: Duration::from_secs(1),
            stop: None,
        };
        let (r, left) = maintain(&spec, std::mem::take(&mut pending), &opts).await;
        results.extend(r);
        pending = left;
    }
    // Call 1: cut, put back. Call 2: cut again, reported; the deadline is then within the margin, so
    // quick goes to call 3, where it is done. Before, every call was call 1 again.
    assert_eq!(calls, 3);
    let slow = results.iter().find(|m| m.table == "public.sl'ow").unwrap();
    assert_eq!(slow.outcome, MaintenanceOutcome::Skipped);
    let why = slow.reason.as_deref().unwrap();
    assert!(why.contains(r#"ANALYZE public."sl'ow""#) && why.contains("from a host"), "{why}");
    assert_eq!(results.iter().find(|m| m.table == "public.quick").unwrap().outcome, MaintenanceOutcome::Done);
}

/// Ctrl-C (SIGINT) while a statement hangs on a half-open connection: the run stops at once, cancels
/// what is in flight, writes the report and the continuation and exits 5; `resume` reads exactly the
/// rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_writes_the_continuation_and_resume_finishes() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    // Held after 20 KB: past planning (a few KB per connection), well inside the warm phase.
    let proxy = BlackholeProxy::start(cluster.port, 20_000, 1).await;
    let dir = cluster.dir().to_path_buf();
    let cont = dir.join("cont.json");
    let report_path = dir.join("r.json");
    let url = format!(
        "postgresql://postgres:{SUPERUSER_PASSWORD}@127.0.0.1:{}/app?sslmode=verify-full&sslrootcert={}",
        proxy.port,
        test_tls().ca.display()
    );
    let child = std::process::Command::new(pghydrate_bin())
        // Ranges of 4 blocks: many single statements, so a warm session soon passes 20 KB (small forks
        // are batched and send little).
        .args(["run", &url, "--include-database", "app", "--sessions", "2", "--range-blocks", "4"])
        .args(["--maintenance", "none", "--progress", "none", "--continuation", cont.to_str().unwrap()])
        .args(["--report", report_path.to_str().unwrap()])
        .current_dir(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until a session is held (the run cannot end by itself now: statement_timeout is 5 min).
    let waited = Instant::now();
    while proxy.held() == 0 {
        assert!(waited.elapsed() < Duration::from_secs(60), "nothing was held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = Instant::now();
    assert!(std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    let stopped_in = signalled.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "stderr:\n{stderr}");
    assert!(stopped_in < Duration::from_secs(30), "stopping took {stopped_in:?}");
    assert!(stderr.contains("stopped by a signal") && stderr.contains("pghydrate resume"), "{stderr}");
    let r: report::Report = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(r.status, RunStatus::Interrupted);
    let st = RunState::from_json(&std::fs::read_to_string(&cont).unwrap()).unwrap();
    assert!(!st.pending.is_empty(), "the held range must be pending");
    assert_outcomes_partition_plan(&st);
    eprintln!(
        "measured: SIGINT to exit 5 in {:.2} s with {} ranges pending",
        stopped_in.as_secs_f64(),
        st.pending.len()
    );

    let direct = cluster.superuser_url("app");
    let (code, stdout, stderr) = pghydrate_tests::cli(
        &["resume", cont.to_str().unwrap(), &direct, "--report", report_path.to_str().unwrap(), "--progress", "none"],
        &dir,
    );
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let r: report::Report = serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    for x in r.relations.iter().filter(|x| x.outcome != ForkOutcome::Excluded) {
        assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
    }
}

/// Sets `stop` once `ready` holds and `after` more has passed, and returns how long the run took to
/// end after that (it must end by itself within `bound`).
async fn stop_when(
    spec: &ConnectionSpec,
    st: &mut RunState,
    opts: &RunOptions,
    ready: impl Fn() -> bool + Send + 'static,
    after: Duration,
) -> Duration {
    let stop = opts.warm.stop.clone().unwrap();
    let signalled = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let at = signalled.clone();
    let signaller = tokio::spawn(async move {
        let waited = Instant::now();
        while !ready() {
            assert!(waited.elapsed() < Duration::from_secs(60), "the run never got where the signal is due");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(after).await;
        *at.lock().unwrap() = Some(Instant::now());
        stop.store(true, Ordering::SeqCst);
    });
    advance_within(spec, st, opts, Duration::from_secs(90)).await;
    signaller.await.unwrap();
    let at = signalled.lock().unwrap().expect("the stop was set before the run ended");
    at.elapsed()
}

/// A signal while the server is down, the sessions reconnecting: the run stops at once, not after
/// the reconnect's backoff (up to 5 s) or a connect to a server that does not answer (connect_timeout,
/// 10 s), and leaves every range pending for resume. First with the port refusing (the sessions deep
/// in their backoff), then with a listener that accepts and never answers (a connect in flight).
/// Before the fix the stop was seen only after the wait: 4 s and 9 s late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_while_reconnecting_stops_at_once() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &plan_opts(&["app"])).await.unwrap();
    let mut st = RunState::new(plan, Mode::Read, 2, Maintenance::None);
    let mut opts = run_opts(2);
    opts.warm.reconnect_for = Duration::from_secs(120);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    opts.warm.stop = Some(stop.clone());

    // Refused: the backoff doubles from 200 ms to 5 s; after 7 s each session sleeps its 5 s.
    cluster.stop("immediate");
    let late = stop_when(&spec, &mut st, &opts, || true, Duration::from_secs(7)).await;
    assert!(late < Duration::from_millis(1500), "stopped {late:?} after the signal, in the backoff");
    assert_eq!(st.pending.len(), st.plan.ranges.len(), "every range stays pending");
    assert!(st.unreachable.is_empty(), "stopped, not given up: {:?}", st.unreachable);
    eprintln!("measured: stop during the reconnect backoff ended the run {:.2} s later", late.as_secs_f64());

    // A listener on the server's port that completes the TCP handshake and never answers.
    stop.store(false, Ordering::SeqCst);
    let listener = std::net::TcpListener::bind(("127.0.0.1", cluster.port)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let accepted = Arc::new(AtomicU32::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (count, finished) = (accepted.clone(), done.clone());
    let held = std::thread::spawn(move || {
        // Keeps the sockets open (no answer, no close) until the test is done with them.
        let mut sockets = Vec::new();
        while !finished.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((socket, _)) => {
                    count.fetch_add(1, Ordering::SeqCst);
                    sockets.push(socket);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        sockets.len()
    });
    let late =
        stop_when(&spec, &mut st, &opts, move || accepted.load(Ordering::SeqCst) >= 1, Duration::from_secs(1)).await;
    assert!(late < Duration::from_millis(1500), "stopped {late:?} after the signal, in a connect");
    assert_eq!(st.pending.len(), st.plan.ranges.len(), "every range stays pending");
    eprintln!("measured: stop during a connect to a silent server ended the run {:.2} s later", late.as_secs_f64());

    // Resume on the server back up: every block, once.
    done.store(true, Ordering::SeqCst);
    assert!(held.join().unwrap() >= 1);
    stop.store(false, Ordering::SeqCst);
    cluster.start_again();
    advance_within(&spec, &mut st, &opts, Duration::from_secs(120)).await;
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
}

/// `resume` honours --sessions / --mode / --maintenance (they used to be ignored silently) and refuses
/// a --time-limit not longer than --margin, as `run` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_honours_its_flags() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let dir = cluster.dir().to_path_buf();
    let cont = dir.join("cont.json");
    let url = cluster.superuser_url("postgres");
    let (code, _, stderr) = pghydrate_tests::cli(
        &["run", &url, "--time-limit", "2s", "--margin", "1990ms", "--continuation", cont.to_str().unwrap()],
        &dir,
    );
    assert_eq!(code, 5, "{stderr}");
    let (code, _, stderr) =
        pghydrate_tests::cli(&["resume", cont.to_str().unwrap(), &url, "--time-limit", "10s", "--margin", "30s"], &dir);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--time-limit"), "{stderr}");
    let (code, stdout, stderr) = pghydrate_tests::cli(
        &["resume", cont.to_str().unwrap(), &url, "--sessions", "1", "--mode", "prefetch", "--maintenance", "none"],
        &dir,
    );
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("mode prefetch, 1 sessions"), "{stdout}");
    assert!(!stdout.contains("maintenance ("), "--maintenance none was honoured: {stdout}");
}

/// The new skip reason's name, checked here so that a rename breaks a test, not a report reader.
#[test]
fn the_new_reason_is_a_stable_name() {
    assert_eq!(serde_json::to_value(SkipReason::DatabaseDropped).unwrap(), "database_dropped");
    assert!(SkipReason::DatabaseDropped.vanished());
}

/// Partitioned tables: a pattern naming a partitioned table (even sub-partitioned) matches its
/// partitions, their indexes and TOAST, for --include, --exclude and --first; ANALYZE of the parent
/// recurses, so partitions are not analyzed a second time; excluding the parent excludes its
/// partitions from maintenance too. A schema with a dot in its name is matched, not split at the dot.
async fn partitions_follow_their_parent(major: u32) {
    let cluster = Cluster::start(major, &["autovacuum = off"]);
    let c = cluster.client("postgres").await;
    c.batch_execute(
        "CREATE TABLE orders (id int, at date, note text) PARTITION BY RANGE (at);
         CREATE TABLE orders_2024 PARTITION OF orders FOR VALUES FROM ('2024-01-01') TO ('2025-01-01') PARTITION BY HASH (id);
         CREATE TABLE orders_2024_a PARTITION OF orders_2024 FOR VALUES WITH (MODULUS 2, REMAINDER 0);
         CREATE TABLE orders_2024_b PARTITION OF orders_2024 FOR VALUES WITH (MODULUS 2, REMAINDER 1);
         CREATE TABLE orders_2025 PARTITION OF orders FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
         CREATE INDEX ON orders (id);
         INSERT INTO orders SELECT g, date '2024-01-01' + (g % 700), repeat(md5(g::text), 100) FROM generate_series(1, 3000) g;
         CREATE TABLE other AS SELECT g AS id FROM generate_series(1, 1000) g;
         CREATE SCHEMA \"a.b\"; CREATE TABLE \"a.b\".c AS SELECT 1 AS x;",
    )
    .await
    .unwrap();
    let spec = cluster.superuser_spec();
    let pat = |p: &str| pghydrate::pattern::RelationPattern::parse(p).unwrap();
    let leaves = ["public.orders_2024_a", "public.orders_2024_b", "public.orders_2025"];

    // --include the parent: exactly the leaves' forks (tables, indexes, TOAST) are planned.
    let opts = PlanOptions { include: vec![pat("public.orders")], ..plan_opts(&["postgres"]) };
    let plan = make_plan(&spec, &opts).await.expect("a pattern on a partitioned table matches its partitions");
    let planned: std::collections::BTreeSet<&str> =
        plan.forks.iter().filter(|f| !f.excluded).map(|f| f.table.as_str()).collect();
    assert_eq!(planned.into_iter().collect::<Vec<_>>(), leaves);
    assert!(plan.forks.iter().any(|f| !f.excluded && f.kind == pghydrate::plan::RelKind::ToastTable));
    assert!(plan.forks.iter().any(|f| !f.excluded && f.kind == pghydrate::plan::RelKind::Index));

    // --first the sub-partitioned middle level: its leaves are read before anything else.
    let opts = PlanOptions { first: vec![pat("orders_2024")], ..plan_opts(&["postgres"]) };
    let plan = make_plan(&spec, &opts).await.unwrap();
    let firsts: Vec<&str> = plan
        .ranges
        .iter()
        .map(|r| plan.fork(r).table.as_str())
        .take_while(|t| t.starts_with("public.orders_2024_"))
        .collect();
    let all_2024 = plan.ranges.iter().filter(|r| plan.fork(r).table.starts_with("public.orders_2024_")).count();
    assert_eq!(firsts.len(), all_2024, "every orders_2024 range comes first");

    // A dotless pattern names the table, whatever dots its schema holds.
    let opts = PlanOptions { include: vec![pat("c")], ..plan_opts(&["postgres"]) };
    let plan = make_plan(&spec, &opts).await.expect("table c in schema a.b");
    assert!(plan.forks.iter().any(|f| !f.excluded && f.table == "a.b.c" && f.table_parts() == ("a.b", "c")));

    let analyzed = || async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let c = cluster.client("postgres").await;
        let mut counts = std::collections::BTreeMap::new();
        for t in leaves.iter().chain(&["public.other"]) {
            let n: i64 = c
                .query_one("SELECT analyze_count FROM pg_stat_user_tables WHERE relid = $1::text::regclass", &[t])
                .await
                .unwrap()
                .get(0);
            counts.insert(t.to_string(), n);
        }
        counts
    };
    // Excluding the parent keeps its partitions out of maintenance too.
    let opts = PlanOptions { exclude: vec![pat("public.orders")], ..plan_opts(&["postgres"]) };
    let mut st = RunState::new(make_plan(&spec, &opts).await.unwrap(), Mode::Read, 2, Maintenance::Analyze);
    let mut ropts = run_opts(2);
    ropts.maintenance = Maintenance::Analyze;
    advance_within(&spec, &mut st, &ropts, Duration::from_secs(120)).await;
    let counts = analyzed().await;
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), [0, 0, 0, 1], "{counts:?}");
    assert!(
        st.maintenance_results.iter().all(|m| !m.table.starts_with("public.orders")),
        "{:?}",
        st.maintenance_results
    );

    // Everything: each partition analyzed once (by the parent's ANALYZE), not twice.
    let mut st =
        RunState::new(make_plan(&spec, &plan_opts(&["postgres"])).await.unwrap(), Mode::Read, 2, Maintenance::Analyze);
    advance_within(&spec, &mut st, &ropts, Duration::from_secs(120)).await;
    let counts = analyzed().await;
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), [1, 1, 1, 2], "{counts:?}");
    let orders = st.maintenance_results.iter().find(|m| m.table == "public.orders").unwrap();
    assert_eq!((orders.action.as_str(), orders.outcome), ("ANALYZE", MaintenanceOutcome::Done));
    assert!(st.maintenance_results.iter().all(|m| !leaves.contains(&m.table.as_str())), "{:?}", st.maintenance_results);

    // VACUUM ANALYZE: partitions get VACUUM only, the parent's ANALYZE covers their statistics.
    let mut st = RunState::new(
        make_plan(&spec, &plan_opts(&["postgres"])).await.unwrap(),
        Mode::Read,
        2,
        Maintenance::VacuumAnalyze,
    );
    ropts.maintenance = Maintenance::VacuumAnalyze;
    advance_within(&spec, &mut st, &ropts, Duration::from_secs(120)).await;
    let counts = analyzed().await;
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), [2, 2, 2, 3], "{counts:?}");
    for leaf in leaves {
        let m = st.maintenance_results.iter().find(|m| m.table == leaf).unwrap();
        assert_eq!((m.action.as_str(), m.outcome), ("VACUUM", MaintenanceOutcome::Done), "{m:?}");
    }
}

/// A table held ACCESS EXCLUSIVE while planning (a migration, say) is tried once while planning and
/// once more after warming, when the lock has had the whole warm to go away: once released, it is read
/// completely, with its free-space and visibility maps, and the run is complete. Before, it was
/// reported `lock_timeout` (exit 4) although it could be read a few seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_locked_while_planning_is_read_once_the_lock_goes() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    cluster.client("app").await.batch_execute("CREATE EXTENSION pg_buffercache").await.unwrap();
    let locker = cluster.client("app").await;
    locker.batch_execute("BEGIN; LOCK TABLE documents IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_millis(200), Duration::from_secs(60));
    let opts = PlanOptions { lock_attempts: 1, ..plan_opts(&["app"]) };
    let plan = make_plan(&spec, &opts).await.unwrap();
    let docs = plan.forks.iter().find(|f| f.name == "documents").unwrap();
    assert_eq!(docs.planned_skip.as_ref().map(|s| s.reason), Some(SkipReason::LockTimeout));
    locker.batch_execute("COMMIT").await.unwrap();

    let mut st = RunState::new(plan, Mode::Buffer, 2, Maintenance::None);
    let mut ropts = run_opts(2);
    ropts.warm.lock_timeout = Duration::from_millis(200);
    advance_within(&spec, &mut st, &ropts, Duration::from_secs(120)).await;
    assert!(st.locks_retried);
    assert_outcomes_partition_plan(&st);
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status, r.exit_code), (1.0, RunStatus::Complete, 0));
    let forks: Vec<_> = r.relations.iter().filter(|x| x.name == "documents").collect();
    assert!(forks.iter().any(|x| x.fork == "vm") && forks.iter().any(|x| x.fork == "fsm"), "{forks:?}");
    for x in forks {
        assert_eq!((x.outcome, x.warmed_blocks), (ForkOutcome::Warmed, x.blocks), "{x:?}");
    }
    assert_all_blocks_buffered(&cluster, &r).await;
}

/// At 100,000 relations most forks are a block or two: they are read many to a statement, not one
/// round trip each. Counted on the server: the transactions the run committed in a database of 2,000
/// one-block indexes. A batch that fails is read one by one, so a batch statement that never works
/// would still give full coverage: this test is what notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_forks_are_read_many_to_a_statement() {
    let cluster = Cluster::start(15, &[]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE many").await.unwrap();
    let c = cluster.client("many").await;
    c.batch_execute(
        "CREATE EXTENSION pg_prewarm;
         DO $$ BEGIN FOR i IN 1..2000 LOOP EXECUTE format('CREATE TABLE t_%s (id int PRIMARY KEY)', i); END LOOP; END $$;",
    )
    .await
    .unwrap();
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &plan_opts(&["many"])).await.unwrap();
    let forks = plan.ranges.len();
    assert!(forks >= 2000, "{forks} ranges");
    let commits = || async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let c = cluster.client("postgres").await;
        c.query_one("SELECT xact_commit FROM pg_stat_database WHERE datname = 'many'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let before = commits().await;
    let mut st = RunState::new(plan, Mode::Read, 2, Maintenance::None);
    advance_within(&spec, &mut st, &run_opts(2), Duration::from_secs(120)).await;
    let statements = commits().await - before;
    assert_outcomes_partition_plan(&st);
    assert_eq!(report::build(&st).coverage, 1.0);
    assert!(
        statements < forks as i64 / 10,
        "{statements} transactions for {forks} ranges: small forks are not batched"
    );
    eprintln!("measured: {forks} ranges read in {statements} transactions");
}

pghydrate_tests::on_oldest_and_newest!(
    a_half_open_connection_is_noticed_and_the_run_ends_complete,
    partitions_follow_their_parent
);

/// The workflow's Warm call, same fault: a database unreachable for the whole reconnect window fails
/// the call as `ConnectionFailed`, which the state machine's Retry names (5 attempts, 5 s doubling);
/// the retry starts from the item as it came in. Before, the call succeeded with every range skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_call_whose_database_stays_unreachable_fails_retryably() {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig};
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "read", "include_databases": ["app"]}),
        None,
        None,
    )
    .unwrap();
    let defaults = Defaults::from_env(|_| None).unwrap();
    let (_, items) = plan_items(&spec, &RunConfig::new("exec-down", trigger, &defaults), None).await.unwrap();
    cluster.stop("fast");
    let mut item = items[0].clone();
    let mut opts = call_options(Instant::now() + Duration::from_secs(60), Duration::from_secs(5), 1);
    opts.reconnect_for = Duration::from_secs(2);
    let e = item.advance(&spec, &opts).await.unwrap_err();
    assert_eq!(e.name(), "ConnectionFailed", "{e}");
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("\"app\""), "{e}");
}

/// Warm calls whose whole window goes before a range is read (on the twin: a server slowed to 1% of a
/// CPU, where connecting and the first statement took a 2 s window). The session's first statement is
/// held (a half-open connection) until the call's deadline cuts it; each call ends as it began. Before,
/// the range went back whole every time and the item was handed to call after call, forever (until
/// the execution's history limit). Now the item gives up after [`MAX_CALLS_WITHOUT_PROGRESS`] such
/// calls, and not before: its pending ranges are reported skipped, `no_progress`, with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_calls_that_never_read_end_the_item_with_a_named_skip() {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig, WorkItem, MAX_CALLS_WITHOUT_PROGRESS};
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "buffer", "maintenance": "none", "include_databases": ["app"]}),
        None,
        None,
    )
    .unwrap();
    let defaults = Defaults::from_env(|_| None).unwrap();
    let run = RunConfig::new("exec-stall", trigger, &defaults);
    let (summary, items) = plan_items(&cluster.superuser_spec(), &run, None).await.unwrap();
    // Every connection is held once its client has sent 1,500 bytes, before the session's pg_prewarm
    // lookup (at 2,000 bytes the server's log showed the session open, its settings made, the lookup
    // never arriving): no range is ever read.
    // Calls of 3 s before a 1 s margin; connect timeout 10 s (as on AWS), longer than a call.
    let proxy = BlackholeProxy::start(cluster.port, 1500, u32::MAX).await;
    let spec = via_proxy(proxy.port).with_timeouts(Duration::from_secs(10), Duration::from_secs(300));
    let (mut skipped, mut calls) = (0, 0);
    for item in items {
        let mut text = serde_json::to_string(&item).unwrap();
        let item = loop {
            let mut item: WorkItem = serde_json::from_str(&text).unwrap();
            let opts = call_options(Instant::now() + Duration::from_secs(4), Duration::from_secs(1), item.sessions);
            let took = Instant::now();
            tokio::time::timeout(Duration::from_secs(30), item.advance(&spec, &opts))
                .await
                .expect("a call ran past its deadline")
                .unwrap();
            assert!(took.elapsed() < Duration::from_secs(5), "the call ran past its deadline: {:?}", took.elapsed());
            text = serde_json::to_string(&item).unwrap();
            if item.done() {
                break item;
            }
            assert!(item.calls < 2 * MAX_CALLS_WITHOUT_PROGRESS, "handed to call after call: {:?}", item.summary());
        };
        assert_eq!(
            item.calls,
            MAX_CALLS_WITHOUT_PROGRESS,
            "given up after exactly that many calls without progress: {:?}",
            item.summary()
        );
        let s = item.summary();
        assert_eq!((s.warmed_bytes, s.pending_bytes), (0, 0), "{s:?}");
        let reasons: Vec<&String> = item.skipped.values().collect();
        assert!(
            !reasons.is_empty() && reasons.iter().all(|r| r.starts_with("NoProgress: no block read in 6 calls")),
            "{reasons:?}"
        );
        skipped += s.skipped_bytes;
        calls += item.calls;
    }
    assert!(proxy.held() >= calls, "each call's first statement was held: {} of {calls}", proxy.held());
    assert_eq!(skipped, summary.planned_bytes, "every planned byte is reported skipped");
    // Every held connection is closed by pghydrate within the connect timeout (the time its cancel
    // request has) of the session's drop; before, each stayed open, its statement unanswered, as long
    // as the path acknowledged: a server's slots and a Lambda's sockets filled with sessions nobody
    // would use again.
    let waited = Instant::now();
    while proxy.released() < proxy.held() && waited.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        proxy.released(),
        proxy.held(),
        "held connections still open {:?} after the last call",
        waited.elapsed()
    );
}

/// A migration holding sixty tables ACCESS EXCLUSIVE while the workflow plans. Planning spends at most
/// `lock_attempts` lock waits in all (here 3 x 2 s), not per table: before, it waited 3 x 2 s for each
/// table, 6 minutes here, and with a thousand tables a Plan Lambda ran past its 15 minutes and failed.
/// The locked tables are left out of the plan's total and tried again by the last work items: released
/// by then, they are sized, every fork is read, and the totals add up to full coverage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_locking_many_tables_neither_stalls_the_workflows_plan_nor_loses_them() {
    use pghydrate::workflow::{call_options, plan_items, Defaults, RunConfig, WorkItem};
    let cluster = Cluster::start(15, &[]);
    let admin = cluster.client("postgres").await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let c = cluster.client("app").await;
    c.batch_execute(
        "CREATE EXTENSION pg_prewarm; CREATE EXTENSION pg_buffercache;
         DO $$ BEGIN FOR i IN 1..60 LOOP
           EXECUTE format('CREATE TABLE m_%s (id int PRIMARY KEY, v text)', i);
           EXECUTE format('INSERT INTO m_%s SELECT g, repeat(''x'', 200) FROM generate_series(1, 2000) g', i);
         END LOOP; END $$;",
    )
    .await
    .unwrap();
    c.batch_execute("VACUUM").await.unwrap();
    drop(c);
    cluster.restart();
    let c = cluster.client("app").await;
    let tables: Vec<String> = (1..=60).map(|i| format!("m_{i}")).collect();
    let locker = cluster.client("app").await;
    locker.batch_execute(&format!("BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", tables.join(", "))).await.unwrap();

    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(2), Duration::from_secs(60));
    let trigger = pghydrate::events::parse_input(
        &serde_json::json!({"instance": "local", "mode": "buffer", "include_databases": ["app"]}),
        None,
        None,
    )
    .unwrap();
    let run = RunConfig::new("exec-locks", trigger, &Defaults::from_env(|_| None).unwrap());
    let started = Instant::now();
    let (summary, items) = plan_items(&spec, &run, None).await.unwrap();
    let planning = started.elapsed();
    eprintln!("planning with 60 tables locked: {planning:?}");
    // A stall detector, not a speed goal: 3 waits of 2 s and the catalog work, against 360 s before.
    assert!(planning < Duration::from_secs(60), "planning took {planning:?}");
    assert_eq!(summary.locked_while_planning, 60, "{summary:?}");
    assert!(
        summary.planned_skips.iter().all(|s| !s.contains("m_")),
        "locked tables are not planned skips: {summary:?}"
    );
    let locked_items: Vec<&WorkItem> = items.iter().filter(|i| !i.locked.is_empty()).collect();
    assert_eq!(locked_items.iter().map(|i| i.locked.len()).sum::<usize>(), 60);
    assert!(items.iter().rev().take(locked_items.len()).all(|i| !i.locked.is_empty()), "locked items come last");
    locker.batch_execute("COMMIT").await.unwrap();

    let (mut warmed, mut added, mut skipped) = (0, 0, 0);
    for item in items {
        let mut text = serde_json::to_string(&item).unwrap();
        loop {
            let mut item: WorkItem = serde_json::from_str(&text).unwrap();
            let opts = call_options(Instant::now() + Duration::from_secs(60), Duration::from_secs(5), 1);
            item.advance(&spec, &opts).await.unwrap();
            text = serde_json::to_string(&item).unwrap();
            if item.done() {
                let s = item.summary();
                assert_eq!((s.vanished_bytes, s.pending_bytes), (0, 0), "{s:?}");
                (warmed, added, skipped) = (warmed + s.warmed_bytes, added + s.added_bytes, skipped + s.skipped_bytes);
                break;
            }
            assert!(item.calls < 20, "no progress");
        }
    }
    assert_eq!(skipped, 0);
    assert_eq!(warmed, summary.total_bytes + added, "coverage 1.0 of a total that includes what was locked");
    // Every block of every fork of the sixty tables (heap, its maps, TOAST and the key) is buffered.
    let row = c
        .query_one(
            "WITH rels AS (
               SELECT c.oid, c.relfilenode FROM pg_class c
                WHERE c.relname LIKE 'm\\_%' OR c.oid IN (SELECT reltoastrelid FROM pg_class WHERE relname LIKE 'm\\_%')
                   OR c.oid IN (SELECT indexrelid FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid WHERE t.relname LIKE 'm\\_%')),
             sizes AS (
               SELECT sum(pg_relation_size(oid, f) / 8192)::int8 AS blocks
                 FROM rels, unnest(ARRAY['main', 'fsm', 'vm']) f)
             SELECT (SELECT blocks FROM sizes),
                    (SELECT count(*) FROM pg_buffercache b JOIN rels r ON b.relfilenode = r.relfilenode
                      WHERE b.reldatabase = (SELECT oid FROM pg_database WHERE datname = 'app'))",
            &[],
        )
        .await
        .unwrap();
    let (blocks, buffered): (i64, i64) = (row.get(0), row.get(1));
    assert!(blocks > 60 * 10, "{blocks} blocks");
    assert_eq!(buffered, blocks, "every block of the locked tables is in shared_buffers");
    let heap_bytes: i64 = c
        .query_one(
            "SELECT sum(pg_relation_size(c.oid, f))::int8 FROM pg_class c, unnest(ARRAY['main', 'fsm', 'vm']) f
              WHERE c.relname LIKE 'm\\_%' AND c.relkind = 'r'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(added, heap_bytes as u64, "the items added the locked heaps (main, fsm, vm) to the total");
}

/// What an attempt at the first range of `customers` meets, set up by the test's hook before the read.
#[derive(Clone, Copy)]
enum Trouble {
    /// Another session takes ACCESS EXCLUSIVE; once the range's session waits for it, it is terminated.
    LockThenSessionKilled,
    /// Another session takes ACCESS EXCLUSIVE and holds it for `hold`: the read waits out lock_timeout.
    LockHeld { hold: Duration },
}

/// Sets up `trouble` from a thread of its own (the hook is synchronous) and returns once the lock is held.
fn stir(port: u16, trouble: Trouble) {
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut cfg = tokio_postgres::Config::new();
            cfg.host("127.0.0.1").port(port).user("postgres").password(SUPERUSER_PASSWORD).dbname("app");
            let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            c.batch_execute("BEGIN; LOCK TABLE customers IN ACCESS EXCLUSIVE MODE").await.unwrap();
            held_tx.send(()).unwrap();
            match trouble {
                Trouble::LockThenSessionKilled => {
                    // Wait for the range's session to queue behind the lock, then end it.
                    for _ in 0..200 {
                        let killed: i64 = c
                            .query_one(
                                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                                  WHERE application_name = 'pghydrate' AND wait_event_type = 'Lock'",
                                &[],
                            )
                            .await
                            .unwrap()
                            .get(0);
                        if killed > 0 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                Trouble::LockHeld { hold } => tokio::time::sleep(hold).await,
            }
            c.batch_execute("COMMIT").await.unwrap();
        });
    });
    held_rx.recv().unwrap();
}

/// Each cause has its own budget. The first range of `customers` loses its session four times (each
/// time while it waits for a lock, so the server ends it, SQLSTATE 57P01), then waits out a lock once,
/// with `lock_attempts` 2: it is read on the sixth attempt. Before, one counter served every cause: the
/// lock wait after four lost sessions was its fifth attempt, and it was skipped as `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_sessions_do_not_use_up_the_lock_budget() {
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec().with_timeouts(Duration::from_secs(1), Duration::from_secs(60));
    let plan = make_plan(&spec, &plan_opts(&["app"])).await.unwrap();
    let mut st = RunState::new(plan, Mode::Read, 1, Maintenance::None);
    let attempts = Arc::new(AtomicU32::new(0));
    let seen = attempts.clone();
    let port = cluster.port;
    let mut opts = run_opts(1);
    opts.warm.lock_timeout = Duration::from_secs(1);
    opts.warm.lock_attempts = 2;
    opts.warm.before_range = Some(RangeHook(Arc::new(move |fork, range| {
        if fork.name == "customers" && fork.fork == pghydrate::plan::Fork::Main && range.first == 0 {
            match seen.fetch_add(1, Ordering::SeqCst) + 1 {
                1..=4 => stir(port, Trouble::LockThenSessionKilled),
                5 => stir(port, Trouble::LockHeld { hold: Duration::from_millis(1500) }),
                _ => {}
            }
        }
    })));
    advance_within(&spec, &mut st, &opts, Duration::from_secs(120)).await;
    assert_outcomes_partition_plan(&st);
    assert_eq!(attempts.load(Ordering::SeqCst), 6, "four lost sessions, one lock wait, then read");
    let r = report::build(&st);
    let customers = r.relations.iter().find(|x| x.name == "customers" && x.fork == "main").unwrap();
    assert_eq!((customers.outcome, customers.warmed_blocks), (ForkOutcome::Warmed, customers.blocks), "{customers:?}");
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
}

/// `--sessions auto` on a real server: however the controller moves, every block is read exactly
/// once (outcomes partition the plan), the run records its levels from the start level, and at no moment do
/// more sessions read than the ceiling (counted on the server, every 20 ms). Large relations are read
/// in 8 MiB steps, and their steps' outcomes are joined again: the outcomes are no more than the
/// planned ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_sessions_read_everything_within_their_ceiling() {
    let cluster = Cluster::start(15, &["shared_buffers=256MB"]);
    cluster.load_sample("app", 1, None).await;
    let c = cluster.client("app").await;
    c.batch_execute(
        "CREATE EXTENSION pg_buffercache;
         CREATE TABLE big AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 600000) g;",
    )
    .await
    .unwrap();
    c.batch_execute("VACUUM big").await.unwrap();
    drop(c);
    cluster.restart();
    let spec = cluster.superuser_spec();
    let plan = make_plan(&spec, &PlanOptions { range_blocks: 8192, ..plan_opts(&["app"]) }).await.unwrap();
    let planned_ranges = plan.ranges.len();
    assert!(plan.forks.iter().any(|f| f.blocks > 2 * 1024), "a relation large enough to be read in steps");
    let mut st = RunState::new(plan, Mode::Buffer, 24, Maintenance::None);
    st.adaptive = true;
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let most = Arc::new(AtomicU32::new(0));
    let watcher = {
        let (watching, most) = (watching.clone(), most.clone());
        let c = cluster.client("postgres").await;
        tokio::spawn(async move {
            while watching.load(Ordering::SeqCst) {
                let n: i64 = c
                    .query_one("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pghydrate'", &[])
                    .await
                    .unwrap()
                    .get(0);
                most.fetch_max(n as u32, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    advance_within(&spec, &mut st, &run_opts(24), Duration::from_secs(300)).await;
    watching.store(false, Ordering::SeqCst);
    watcher.await.unwrap();
    assert_outcomes_partition_plan(&st);
    assert!(st.outcomes.len() <= planned_ranges, "{} outcomes for {planned_ranges} ranges", st.outcomes.len());
    let start = pghydrate::adaptive::START.min(24);
    assert_eq!(st.levels.first().map(|l| l.sessions), Some(start), "{:?}", st.levels);
    assert!(st.levels.iter().all(|l| l.sessions >= 1 && l.sessions <= 24), "{:?}", st.levels);
    let peak = most.load(Ordering::SeqCst);
    assert!((1..=24).contains(&peak), "{peak} sessions at once");
    let r = report::build(&st);
    assert_eq!((r.coverage, r.status, r.adaptive), (1.0, RunStatus::Complete, true));
    assert!(r.summary().contains(&format!("sessions adapted {start}")), "{}", r.summary());
    assert_all_blocks_buffered(&cluster, &r).await;
}

/// A drain (how a head start ends once planning ends) starts no new range but lets the statements
/// under way finish: the range taken when the drain was asked is read and counted (a stop would have
/// cancelled it, and its blocks would be read again later), the rest stays pending, and outcomes and
/// pending still partition the plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_finishes_the_ranges_under_way_and_leaves_the_rest() {
    use pghydrate::plan::BlockRange;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    let cluster = Cluster::start(15, &[]);
    cluster.load_sample("app", 1, None).await;
    let spec = cluster.superuser_spec();
    let mut o = plan_opts(&["app"]);
    o.range_blocks = 16;
    let plan = make_plan(&spec, &o).await.unwrap();
    let drain = Arc::new(AtomicBool::new(false));
    let under_way: Arc<Mutex<Option<BlockRange>>> = Arc::default();
    let mut opts = pghydrate_tests::run_opts(2, Mode::Buffer).warm;
    opts.drain = Some(drain.clone());
    let (d, u, taken) = (drain.clone(), under_way.clone(), Arc::new(AtomicU32::new(0)));
    opts.before_range = Some(RangeHook(Arc::new(move |_, range| {
        if taken.fetch_add(1, Ordering::SeqCst) == 10 {
            *u.lock().unwrap() = Some(*range);
            d.store(true, Ordering::SeqCst);
        }
    })));
    let ranges = plan.ranges.clone();
    let plan = Arc::new(plan);
    let warmed =
        pghydrate::warm::warm(&spec, plan.clone(), ranges.clone(), &opts, Arc::new(Counters::default())).await.unwrap();
    let r = under_way.lock().unwrap().expect("the drain was asked");
    let read = |x: &BlockRange| {
        warmed.outcomes.iter().any(|o| {
            matches!(o.result, pghydrate::warm::RangeResult::Warmed { .. })
                && o.range.fork == x.fork
                && o.range.first <= x.first
                && x.last <= o.range.last
        })
    };
    assert!(read(&r), "the range under way when the drain was asked was read: {r:?}");
    assert!(!warmed.pending.is_empty(), "the ranges not yet taken stay pending");
    let mut st = RunState::new((*plan).clone(), Mode::Buffer, 2, Maintenance::None);
    st.outcomes = warmed.outcomes;
    st.pending = warmed.pending;
    assert_outcomes_partition_plan(&st);
}

/// A migration that creates and drops tables while the plan lists relations. has_table_privilege
/// answers NULL for a relation that the listing statement's snapshot holds but that was dropped before
/// its row was computed, and the planner used to panic on it (3 of 40 `pghydrate plan` runs, measured).
/// Two sessions create and drop tables without pause while the same database is planned 40 times:
/// every plan succeeds; every stable table is planned whole; a churned table is absent, planned, planned
/// skipped as dropped (vanished: not counted against coverage) or, locked by its DROP when the plan
/// read pg_locks, skipped for its lock; nothing else is skipped.
async fn tables_dropped_while_the_plan_lists_them_are_planned_dropped_never_a_panic(major: u32) {
    let cluster = Cluster::start(major, &[]);
    cluster.client("postgres").await.batch_execute("CREATE DATABASE app").await.unwrap();
    let app = cluster.client("app").await;
    app.batch_execute(
        "DO $$ BEGIN FOR i IN 1..300 LOOP
           EXECUTE format('CREATE TABLE stable_%s (id int PRIMARY KEY); INSERT INTO stable_%s SELECT generate_series(1, 50)', i, i);
         END LOOP; END $$",
    )
    .await
    .unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut churners = Vec::new();
    for session in 0..2 {
        let (c, stop) = (cluster.client("app").await, stop.clone());
        churners.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                // Each statement commits on its own, so that other sessions see the table come and go.
                c.batch_execute(&format!("CREATE TABLE churn_{session}_{n} (id int PRIMARY KEY, v text)"))
                    .await
                    .unwrap();
                if n > 0 {
                    c.batch_execute(&format!("DROP TABLE churn_{session}_{}", n - 1)).await.unwrap();
                }
                n += 1;
            }
            n
        }));
    }
    let spec = cluster.superuser_spec();
    let mut dropped_seen = 0;
    for _ in 0..40 {
        // A panic in the planner fails the test here.
        let plan = make_plan(&spec, &plan_opts(&["app"])).await.expect("planning succeeds while tables come and go");
        for i in 1..=300 {
            let name = format!("stable_{i}");
            let main = plan.forks.iter().find(|f| f.name == name && f.fork == pghydrate::plan::Fork::Main);
            assert!(main.is_some_and(|f| f.blocks > 0 && f.planned_skip.is_none()), "{name}: {main:?}");
        }
        for f in plan.forks.iter().filter(|f| f.planned_skip.is_some()) {
            let reason = f.planned_skip.as_ref().unwrap().reason;
            assert!(
                f.name.starts_with("churn_") || f.table.contains("churn_"),
                "only churned tables are skipped: {f:?}"
            );
            // Dropped mid-statement: vanished. Or being dropped when the plan read pg_locks, after the
            // plan's lock waits were spent: skipped for its lock, to be sized again after warming.
            assert!(matches!(reason, SkipReason::Dropped | SkipReason::LockTimeout), "{f:?}");
            dropped_seen += usize::from(reason == SkipReason::Dropped);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut churned = 0;
    for c in churners {
        churned += c.await.unwrap();
    }
    eprintln!("measured: PostgreSQL {major}: 40 plans while {churned} tables were created and dropped; {dropped_seen} forks planned as dropped");
    assert!(churned >= 40, "the churn did not churn: {churned} tables");
}

pghydrate_tests::on_every_version!(tables_dropped_while_the_plan_lists_them_are_planned_dropped_never_a_panic);
