//! A hostile catalog: in every database an unprivileged role (`mallory`) with CREATE on `public` and on
//! the schema pg_prewarm lives in has planted an overload of every function, aggregate and operator
//! name in the SQL this project executes (tests/hostile_catalog.py derives the names from the source),
//! and owns a table whose expression index calls its function. Every planted object counts its runs in
//! a sequence (rolled-back runs too) and tries to make mallory SUPERUSER.
//!
//! Runs as the superuser and as an unprivileged login role, a stopped run resumed, and a continuation
//! that someone edited to carry SQL: nothing planted ever runs, nobody's role changes, and coverage is
//! what it was before the planting. RELIABILITY.md has the case and its measured result.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use pghydrate::maintain::MaintenanceOutcome;
use pghydrate::report::{ForkOutcome, Report, RunStatus};
use pghydrate::ConnectionSpec;
use pghydrate_tests::{
    cli, cli_env, hostile_plant, hostile_runs, hostile_setup, ident, pinned_client, Cluster, Planted,
};

const DATABASES: [&str; 4] = ["postgres", "app", "extdb", "fresh"];
const HYDRATOR_PW: &str = "hydrator-pw";

fn read_report(path: &std::path::Path) -> Report {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Per relation (database, oid): its forks' outcomes and skip reasons; per maintained table: the
/// outcome. Relations, not forks, and not bytes: the planting itself grows catalogs (pg_proc and its
/// TOAST, pg_operator...), which may gain a free-space map fork on the way.
type Outcomes = (BTreeMap<(String, u32), BTreeSet<String>>, BTreeSet<(String, String, String)>);

fn outcomes(r: &Report) -> Outcomes {
    let mut rels: BTreeMap<(String, u32), BTreeSet<String>> = BTreeMap::new();
    for x in &r.relations {
        rels.entry((x.database.clone(), x.oid)).or_default().insert(format!("{:?} {:?}", x.outcome, x.reason_code));
    }
    (rels, r.maintenance.iter().map(|m| (m.database.clone(), m.table.clone(), format!("{:?}", m.outcome))).collect())
}

async fn rolsuper(cluster: &Cluster, role: &str) -> bool {
    pinned_client(cluster, "postgres")
        .await
        .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&role])
        .await
        .unwrap()
        .get(0)
}

async fn sequence_value(cluster: &Cluster, db: &str, seq: &str) -> i64 {
    pinned_client(cluster, db)
        .await
        .query_one(&format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {seq}"), &[])
        .await
        .unwrap()
        .get(0)
}

async fn a_hostile_catalog_runs_nothing(major: u32) {
    let cluster = Cluster::start(major, &[]);
    let dir = cluster.dir().to_path_buf();
    cluster.load_sample("app", 1, None).await;
    let admin = cluster.client("postgres").await;
    for db in ["extdb", "fresh"] {
        admin.batch_execute(&format!("CREATE DATABASE {}", ident(db))).await.unwrap();
    }
    admin
        .batch_execute(&format!(
            "CREATE ROLE mallory LOGIN PASSWORD 'mallory-pw';
             CREATE ROLE hydrator LOGIN PASSWORD '{HYDRATOR_PW}' IN ROLE pg_read_all_data;
             -- Settings that would loosen the search path if sessions did not pin it.
             ALTER ROLE hydrator SET search_path = public, pg_catalog;
             ALTER ROLE postgres SET search_path = public, pg_catalog;
             ALTER DATABASE app SET search_path = public, pg_catalog;"
        ))
        .await
        .unwrap();
    // pg_prewarm where the customer put it: public in postgres and app, its own schema in extdb (which
    // everyone may create in), not yet installed in fresh (the superuser's run creates it).
    for db in ["postgres", "app"] {
        cluster.client(db).await.batch_execute("CREATE EXTENSION pg_prewarm").await.unwrap();
    }
    let extdb = cluster.client("extdb").await;
    extdb
        .batch_execute(
            "CREATE SCHEMA ext; CREATE EXTENSION pg_prewarm SCHEMA ext;
             CREATE TABLE items (id int PRIMARY KEY, body text);
             INSERT INTO items SELECT g, repeat(md5(g::text), 50) FROM generate_series(1, 5000) g;",
        )
        .await
        .unwrap();
    cluster
        .client("fresh")
        .await
        .batch_execute("CREATE TABLE t AS SELECT g AS id FROM generate_series(1, 20000) g")
        .await
        .unwrap();
    for db in DATABASES {
        hostile_setup(&cluster, db, "mallory").await;
    }
    // mallory's own table in app, with an expression index on a function that notes whom it ran as and
    // tries to escalate: ANALYZE evaluates it, as the table's owner (a security-restricted operation).
    let app = cluster.client("app").await;
    app.batch_execute(
        "CREATE TABLE canary (id int); INSERT INTO canary VALUES (1);
         SET ROLE mallory;
         CREATE SEQUENCE hostile.idx_as_owner; CREATE SEQUENCE hostile.idx_as_other;
         GRANT USAGE, UPDATE ON SEQUENCE hostile.idx_as_owner, hostile.idx_as_other TO PUBLIC;
         CREATE FUNCTION hostile.idx(x int) RETURNS int IMMUTABLE LANGUAGE plpgsql AS $f$
         BEGIN
           IF CURRENT_USER OPERATOR(pg_catalog.=) 'mallory'::pg_catalog.name THEN
             PERFORM pg_catalog.nextval('hostile.idx_as_owner'::pg_catalog.regclass);
           ELSE
             PERFORM pg_catalog.nextval('hostile.idx_as_other'::pg_catalog.regclass);
           END IF;
           BEGIN
             EXECUTE 'ALTER ROLE mallory SUPERUSER';
           EXCEPTION WHEN OTHERS THEN NULL;
           END;
           RETURN x;
         END $f$;
         CREATE TABLE public.mallory_t (x int);
         INSERT INTO public.mallory_t SELECT pg_catalog.generate_series(1, 2000);
         CREATE INDEX mallory_t_idx ON public.mallory_t (hostile.idx(x));
         RESET ROLE;",
    )
    .await
    .unwrap();
    let canary_oid: u32 = app.query_one("SELECT 'public.canary'::regclass::oid", &[]).await.unwrap().get(0);
    let owner_runs_at_setup = sequence_value(&cluster, "app", "hostile.idx_as_owner").await;

    // Baseline, before anything is planted: the unprivileged role's run.
    let hydrator_url = cluster.url("hydrator", HYDRATOR_PW, "postgres");
    let hydrator_run = |name: &str, env: &[(&str, &str)]| {
        let report = dir.join(name);
        let (code, _out, err) = cli_env(
            &[
                "run",
                &hydrator_url,
                "--maintenance",
                "analyze",
                "--progress",
                "none",
                "--report",
                report.to_str().unwrap(),
            ],
            &dir,
            env,
        );
        assert_eq!(code, 4, "the unprivileged role cannot read TOAST or create the extension: {err}");
        read_report(&report)
    };
    let before = hydrator_run("hydrator-before.json", &[]);

    // The planting.
    let mut planted = Planted::default();
    for db in DATABASES {
        let p = hostile_plant(&cluster, db, "mallory").await;
        eprintln!("planted in {db}: {p:?}");
        planted.functions += p.functions;
        planted.aggregates += p.aggregates;
        planted.operators += p.operators;
    }
    assert!(planted.functions > 500 && planted.operators > 500 && planted.aggregates > 0, "{planted:?}");
    let prewarm_overloads: i64 = pinned_client(&cluster, "extdb")
        .await
        .query_one(
            "SELECT count(*) FROM pg_proc WHERE proname = 'pg_prewarm' AND pronamespace = 'ext'::regnamespace",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(prewarm_overloads > 10, "overloads of pg_prewarm in its own schema: {prewarm_overloads}");

    let super_url = cluster.superuser_url("postgres");
    // 1. The unprivileged role, with PGOPTIONS asking for public first: the same outcomes as before
    //    (before the superuser's run, which creates the extension in fresh).
    let after = hydrator_run("hydrator-after.json", &[("PGOPTIONS", "-c search_path=public,pg_catalog")]);
    let (rel_before, maint_before) = outcomes(&before);
    let (rel_after, maint_after) = outcomes(&after);
    for (key, was) in &rel_before {
        assert_eq!(rel_after.get(key), Some(was), "relation {key:?}: outcome changed by the planting");
    }
    assert_eq!(rel_before.len(), rel_after.len(), "the planting adds no relation with storage");
    assert_eq!(maint_before, maint_after);
    eprintln!(
        "measured: PostgreSQL {major}: unprivileged role, coverage {:.4} before the planting, {:.4} after \
         (the same {} relations, each with the same outcome; catalogs grew)",
        before.coverage,
        after.coverage,
        rel_after.len()
    );

    // 2. The superuser: every block, VACUUM ANALYZE of every table (mallory's too), the extension
    //    created in a database whose public schema is full of traps.
    let report = dir.join("super.json");
    let (code, _out, err) = cli(
        &[
            "run",
            &super_url,
            "--maintenance",
            "vacuum-analyze",
            "--progress",
            "none",
            "--report",
            report.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 0, "{err}");
    let r = read_report(&report);
    assert_eq!((r.coverage, r.status), (1.0, RunStatus::Complete));
    assert!(r.relations.iter().any(|x| x.database == "fresh" && x.outcome == ForkOutcome::Warmed), "fresh was read");
    let m = r.maintenance.iter().find(|m| m.table == "public.mallory_t").expect("mallory's table maintained");
    assert_eq!((m.action.as_str(), m.outcome), ("VACUUM ANALYZE", MaintenanceOutcome::Done));

    // 3. A run stopped by its time limit, resumed.
    let cont = dir.join("cont.json");
    let stop = |cont: &std::path::Path| {
        let (code, _out, err) = cli(
            &["run", &super_url, "--time-limit", "2s", "--margin", "1990ms", "--continuation", cont.to_str().unwrap()],
            &dir,
        );
        assert_eq!(code, 5, "{err}");
    };
    stop(&cont);
    let (code, _out, err) = cli(&["resume", cont.to_str().unwrap(), &super_url], &dir);
    assert_eq!(code, 0, "{err}");

    // 4. A continuation edited to carry SQL wherever a string goes: it is read as data. The edited
    //    maintenance target names the canary by oid; its "name" and the old format's "qualified"
    //    statement are SQL that would make mallory SUPERUSER.
    stop(&cont);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cont).unwrap()).unwrap();
    let payload = "x\"; SELECT hostile.trap('tampered'); ALTER ROLE mallory SUPERUSER; --";
    for d in v["plan"]["databases"].as_array_mut().unwrap() {
        d["prewarm_schema"] = payload.into();
        d["prewarm_function"] = "hostile.trap('tampered'); SELECT ext.pg_prewarm".into();
    }
    for f in v["plan"]["forks"].as_array_mut().unwrap() {
        for key in ["schema", "name", "table", "owner"] {
            f[key] = payload.into();
        }
    }
    v["maintenance"] = "analyze".into();
    v["maintenance_pending"] = serde_json::json!([{
        "database": "app", "table": payload, "oid": canary_oid,
        "qualified": "hostile.ran; ALTER ROLE mallory SUPERUSER", "partitioned": false, "allowed": true
    }]);
    std::fs::write(&cont, serde_json::to_string(&v).unwrap()).unwrap();
    let report = dir.join("tampered.json");
    let (code, _out, err) =
        cli(&["resume", cont.to_str().unwrap(), &super_url, "--report", report.to_str().unwrap()], &dir);
    assert_eq!(code, 0, "an edited continuation is read as data: {err}");
    let r = read_report(&report);
    assert_eq!(r.coverage, 1.0);
    let analyzed: bool = pinned_client(&cluster, "app")
        .await
        .query_one("SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables WHERE relid = $1", &[&canary_oid])
        .await
        .unwrap()
        .get(0);
    assert!(analyzed, "the target was maintained by its oid");

    // 5. A continuation whose ranges name forks it does not list: a clear error, no panic.
    stop(&cont);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cont).unwrap()).unwrap();
    v["pending"][0]["fork"] = 999_999.into();
    std::fs::write(&cont, serde_json::to_string(&v).unwrap()).unwrap();
    let (code, _out, err) = cli(&["resume", cont.to_str().unwrap(), &super_url], &dir);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid input") && err.contains("does not fit"), "{err}");

    // 6. The engine's own sessions: the search path is pinned whatever the role, the database and
    //    PGOPTIONS say.
    let spec = ConnectionSpec::parse(Some(&cluster.url("hydrator", HYDRATOR_PW, "app")), |k| {
        (k == "PGOPTIONS").then(|| "-c search_path=public".to_string())
    })
    .unwrap();
    let session = spec.connect("app").await.unwrap();
    let shown: String = session.query_one("SHOW search_path", &[]).await.unwrap().get(0);
    assert_eq!(shown, pghydrate::sql::SEARCH_PATH);

    // 7. An overload of pg_prewarm with an extra defaulted argument in the extension's own schema:
    //    PostgreSQL refuses every call as ambiguous. Nothing runs; the reads are reported, with the fix.
    cluster
        .client("extdb")
        .await
        .batch_execute(
            "SET ROLE mallory;
             CREATE FUNCTION ext.pg_prewarm(regclass, text, text, bigint, bigint, extra int DEFAULT 0)
               RETURNS bigint LANGUAGE plpgsql AS $f$ BEGIN PERFORM hostile.trap('ambiguous'); RETURN 0; END $f$;",
        )
        .await
        .unwrap();
    let report = dir.join("ambiguous.json");
    let (code, _out, err) = cli(
        &[
            "run",
            &super_url,
            "--include-database",
            "extdb",
            "--maintenance",
            "none",
            "--progress",
            "none",
            "--report",
            report.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 4, "{err}");
    let r = read_report(&report);
    let refused: Vec<_> = r.relations.iter().filter(|x| x.outcome != ForkOutcome::Warmed).collect();
    assert!(!refused.is_empty());
    for x in refused {
        assert!(x.reason.as_deref().unwrap_or("").contains("is not unique"), "{x:?}");
        assert!(x.fix.as_deref().unwrap_or("").contains("not members of the extension"), "{x:?}");
    }

    // Nothing planted ran, in any database, as anyone; nobody became superuser; the expression index
    // ran only as its owner (ANALYZE evaluated it: the count went up).
    tokio::time::sleep(Duration::from_millis(200)).await;
    for db in DATABASES {
        assert_eq!(hostile_runs(&cluster, db).await, (0, String::new()), "planted objects ran in {db}");
    }
    assert_eq!(sequence_value(&cluster, "app", "hostile.idx_as_other").await, 0, "index expression ran as us");
    let owner_runs = sequence_value(&cluster, "app", "hostile.idx_as_owner").await;
    assert!(owner_runs > owner_runs_at_setup, "ANALYZE evaluated the expression index as its owner");
    assert!(!rolsuper(&cluster, "mallory").await, "mallory made itself superuser");
    assert!(!rolsuper(&cluster, "hydrator").await);
    eprintln!(
        "measured: PostgreSQL {major}: planted {} functions, {} aggregates, {} operators ({} objects) in {} databases; \
         ran 0 times; expression index ran {} times, only as its owner",
        planted.functions,
        planted.aggregates,
        planted.operators,
        planted.total(),
        DATABASES.len(),
        owner_runs - owner_runs_at_setup
    );
}

pghydrate_tests::on_every_version!(a_hostile_catalog_runs_nothing);
