//! Test harness: real PostgreSQL clusters started by the tests themselves (initdb + pg_ctl on a free
//! loopback port), one per test, stopped and removed when the test ends. Server binaries come from
//! scripts/setup.sh: $PGHYDRATE_HOME/pg/<major>/bin (default /var/tmp/pghydrate).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use pghydrate::report::ForkOutcome;
use pghydrate::ConnectionSpec;
use tokio_postgres::{Client, NoTls};

pub const SUPERUSER: &str = "postgres";
pub const SUPERUSER_PASSWORD: &str = "pw-Sup3r-S3cret";
pub const SAMPLE_SQL: &str = include_str!("../../scripts/sample.sql");

/// The user that runs the servers when the tests run as root (initdb refuses root).
const RUN_AS: &str = "pghydrate";

pub fn pghydrate_home() -> PathBuf {
    std::env::var_os("PGHYDRATE_HOME").map(PathBuf::from).unwrap_or_else(|| "/var/tmp/pghydrate".into())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions. Avoids a libc dependency for one call.
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    unsafe { geteuid() == 0 }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The harness's certificates: a test CA, a server certificate it signed (for 127.0.0.1 and localhost),
/// and an unrelated CA (`rogue_ca`) whose trust proves nothing about the server. Made once with openssl
/// under $PGHYDRATE_HOME/tls and reused.
pub struct TestTls {
    pub ca: PathBuf,
    pub rogue_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

pub fn test_tls() -> &'static TestTls {
    static TLS: std::sync::OnceLock<TestTls> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let dir = pghydrate_home().join("tls");
        let files = TestTls {
            ca: dir.join("ca.pem"),
            rogue_ca: dir.join("rogue-ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
        };
        if files.server_key.exists() {
            return files;
        }
        let tmp = pghydrate_home().join(format!("tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(&tmp).output().expect("openssl (apt: openssl)");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        for (key, cert, cn) in [("ca.key", "ca.pem", "pghydrate test CA"), ("rogue-ca.key", "rogue-ca.pem", "rogue CA")]
        {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                key,
                "-out",
                cert,
                "-days",
                "3650",
                "-subj",
                &format!("/CN={cn}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
        }
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        std::fs::write(
            tmp.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "3650",
            "-extfile",
            "ext.cnf",
        ]);
        // Another process may have won the race: then its files are used.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        files
    })
}

/// A running cluster. Dropping it stops the server and deletes its files.
pub struct Cluster {
    pub major: u32,
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Cluster {
    /// initdb + start. `settings` are extra postgresql.conf lines.
    pub fn start(major: u32, settings: &[&str]) -> Cluster {
        let bin = pghydrate_home().join("pg").join(major.to_string()).join("bin");
        assert!(
            bin.join("postgres").exists(),
            "PostgreSQL {major} server binaries are missing at {}: run scripts/setup.sh",
            bin.display()
        );
        let dir = pghydrate_home().join("clusters").join(format!(
            "pg{major}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pwfile = dir.join("pwfile");
        std::fs::write(&pwfile, SUPERUSER_PASSWORD).unwrap();
        // TLS on every server: the tool's default (verify-full) is what the tests use.
        let tls = test_tls();
        std::fs::copy(&tls.server_cert, dir.join("server.pem")).unwrap();
        std::fs::copy(&tls.server_key, dir.join("server.key")).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.join("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let c = Cluster { major, port: 0, dir, bin };
        if is_root() {
            c.run(Command::new("chown").args(["-R", RUN_AS]).arg(&c.dir));
        }
        c.run(
            c.pg("initdb")
                .args(["-U", SUPERUSER, "-A", "scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-sync"])
                .arg("--locale=C")
                .arg(format!("--pwfile={}", pwfile.display()))
                .arg("-D")
                .arg(c.data()),
        );
        let mut conf = String::from(
            "listen_addresses = '127.0.0.1'\nfsync = off\nshared_buffers = 128MB\nmax_connections = 60\n\
             autovacuum = off\nlog_min_messages = warning\n",
        );
        conf.push_str(&format!("unix_socket_directories = '{}'\n", c.dir.display()));
        conf.push_str(&format!(
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
            c.dir.join("server.pem").display(),
            c.dir.join("server.key").display()
        ));
        for s in settings {
            conf.push_str(s);
            conf.push('\n');
        }
        let conf_path = c.data().join("postgresql.auto.conf");
        let mut existing = std::fs::read_to_string(&conf_path).unwrap_or_default();
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).unwrap();
        let mut c = c;
        // The port is chosen at start; a port taken in between is retried with another.
        for attempt in 0..5 {
            c.port = free_port();
            let out = c.pg_ctl_start();
            if out.status.success() {
                return c;
            }
            eprintln!("start attempt {attempt} on port {} failed: {}", c.port, String::from_utf8_lossy(&out.stderr));
        }
        panic!(
            "PostgreSQL {major} did not start; log:\n{}",
            std::fs::read_to_string(c.dir.join("log")).unwrap_or_default()
        );
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn pg(&self, tool: &str) -> Command {
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", RUN_AS, "--"]).arg(self.bin.join(tool));
            c
        } else {
            Command::new(self.bin.join(tool))
        };
        cmd.env("LC_ALL", "C");
        cmd
    }

    fn run(&self, cmd: &mut Command) -> Output {
        let out = cmd.output().expect("spawn");
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn pg_ctl_start(&self) -> Output {
        self.pg("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "60", "-o"])
            .arg(format!("-p {}", self.port))
            .arg("start")
            .output()
            .expect("pg_ctl")
    }

    /// A streaming replica of this server (`pg_basebackup -R`), in recovery: a hot standby, as an RDS
    /// read replica or a physical-replication Blue/Green green environment is. Dropping it stops it and
    /// removes its files.
    pub fn start_standby(&self) -> Cluster {
        let dir = pghydrate_home().join("clusters").join(format!(
            "pg{}-standby-{}-{}",
            self.major,
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Cluster { major: self.major, port: 0, dir, bin: self.bin.clone() };
        if is_root() {
            c.run(Command::new("chown").args(["-R", RUN_AS]).arg(&c.dir));
        }
        c.run(
            c.pg("pg_basebackup")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", SUPERUSER, "-X", "stream", "-c", "fast"])
                .arg("-D")
                .arg(c.data())
                .env("PGPASSWORD", SUPERUSER_PASSWORD),
        );
        // A standby of the primary (written here, not by -R: the PyPI 18 build's pg_basebackup writes a
        // conninfo option its own walreceiver refuses), with its own socket directory (the copied
        // configuration names the primary's).
        std::fs::write(c.data().join("standby.signal"), "").unwrap();
        let conf_path = c.data().join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&conf_path).unwrap();
        conf.push_str(&format!(
            "unix_socket_directories = '{}'\nhot_standby = on\n\
             primary_conninfo = 'host=127.0.0.1 port={} user={SUPERUSER} password={SUPERUSER_PASSWORD} sslmode=require'\n",
            c.dir.display(),
            self.port
        ));
        std::fs::write(&conf_path, conf).unwrap();
        for attempt in 0..5 {
            c.port = free_port();
            let out = c.pg_ctl_start();
            if out.status.success() {
                return c;
            }
            eprintln!("standby start attempt {attempt} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        panic!("standby did not start; log:\n{}", std::fs::read_to_string(c.dir.join("log")).unwrap_or_default());
    }

    /// Stops and starts the server: shared_buffers start empty.
    pub fn restart(&self) {
        self.stop("fast");
        let out = self.pg_ctl_start();
        assert!(out.status.success(), "restart failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn stop(&self, mode: &str) {
        let _ = self.pg("pg_ctl").arg("-D").arg(self.data()).args(["-w", "-m", mode, "stop"]).output();
    }

    /// Starts a stopped server again on the same port.
    pub fn start_again(&self) {
        let out = self.pg_ctl_start();
        assert!(out.status.success(), "start failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// A URL with the tool's default TLS check (verify-full) against the harness's CA.
    pub fn url(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "postgresql://{user}:{password}@127.0.0.1:{}/{}?sslmode=verify-full&sslrootcert={}",
            self.port,
            pct(db),
            test_tls().ca.display()
        )
    }

    pub fn superuser_url(&self, db: &str) -> String {
        self.url(SUPERUSER, SUPERUSER_PASSWORD, db)
    }

    pub fn spec(&self, user: &str, password: &str, db: &str) -> ConnectionSpec {
        ConnectionSpec::parse(Some(&self.url(user, password, db)), |_| None).unwrap()
    }

    pub fn superuser_spec(&self) -> ConnectionSpec {
        self.spec(SUPERUSER, SUPERUSER_PASSWORD, "postgres")
    }

    /// A superuser session (not TLS) for test set-up and checks.
    pub async fn client(&self, db: &str) -> Client {
        self.client_as(SUPERUSER, SUPERUSER_PASSWORD, db).await
    }

    pub async fn client_as(&self, user: &str, password: &str, db: &str) -> Client {
        let mut cfg = tokio_postgres::Config::new();
        cfg.host("127.0.0.1").port(self.port).user(user).password(password).dbname(db);
        let (client, conn) = cfg.connect(NoTls).await.unwrap_or_else(|e| panic!("connect to {db} as {user}: {e}"));
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    /// Creates `db` and loads the sample schema into it at `scale`, owned by `owner` (created as a
    /// NOLOGIN role if missing; the superuser when None). Runs VACUUM so visibility maps exist.
    pub async fn load_sample(&self, db: &str, scale: u32, owner: Option<&str>) {
        let admin = self.client("postgres").await;
        if db != "postgres" {
            admin.batch_execute(&format!("CREATE DATABASE {}", ident(db))).await.unwrap();
        }
        if let Some(o) = owner {
            let exists = admin.query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&o]).await.unwrap();
            if exists.is_none() {
                admin.batch_execute(&format!("CREATE ROLE \"{o}\" NOLOGIN")).await.unwrap();
            }
            admin.batch_execute(&format!("ALTER DATABASE {} OWNER TO {}", ident(db), ident(o))).await.unwrap();
        }
        let c = self.client(db).await;
        let mut sql = format!("SET pghydrate.scale = '{scale}';\n");
        if let Some(o) = owner {
            c.batch_execute(&format!("GRANT CREATE ON SCHEMA public TO \"{o}\"")).await.unwrap();
            sql.push_str(&format!("SET ROLE \"{o}\";\n"));
        }
        sql.push_str(SAMPLE_SQL);
        c.batch_execute(&sql).await.unwrap_or_else(|e| panic!("loading sample: {e:?}"));
        c.batch_execute("RESET ROLE").await.unwrap();
        c.batch_execute("VACUUM").await.unwrap();
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop("immediate");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Percent-encodes a URL path segment.
pub fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Quotes an identifier for test set-up SQL.
pub fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// The `pghydrate` binary built next to this test (make test builds it first).
pub fn pghydrate_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PGHYDRATE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap(); // target/<profile>/deps -> target/<profile>
    let bin = dir.join("pghydrate");
    assert!(bin.exists(), "{} is missing: build it with `cargo build -p pghydrate-cli`", bin.display());
    bin
}

/// Runs the CLI with `args`; returns (exit code, stdout, stderr).
pub fn cli(args: &[&str], cwd: &Path) -> (i32, String, String) {
    cli_env(args, cwd, &[])
}

/// Runs the CLI with `args` and extra environment variables.
pub fn cli_env(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(pghydrate_bin())
        .args(args)
        .current_dir(cwd)
        .env_remove("PGPASSWORD")
        .env("PGHYDRATE_LOG", "warn")
        .envs(env.iter().copied())
        .output()
        .expect("run pghydrate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// (database oid-independent key) for a relation fork: (database, oid, fork).
pub type ForkKey = (String, u32, String);

/// Every relation fork with storage that a hydration must cover, found independently of the engine:
/// straight from pg_class in every connectable non-template database, shared catalogs once.
pub async fn expected_forks(cluster: &Cluster) -> std::collections::BTreeMap<ForkKey, u64> {
    let admin = cluster.client("postgres").await;
    let dbs: Vec<String> = admin
        .query("SELECT datname::text FROM pg_database WHERE datallowconn AND NOT datistemplate ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = std::collections::BTreeMap::new();
    let mut shared_seen = std::collections::HashSet::new();
    for db in dbs {
        let c = cluster.client(&db).await;
        let rows = c
            .query(
                "SELECT c.oid, c.relisshared, f.fork, pg_relation_size(c.oid, f.fork) / current_setting('block_size')::int8
                   FROM pg_class c CROSS JOIN (VALUES ('main'), ('fsm'), ('vm'), ('init')) f(fork)
                  WHERE c.relpersistence <> 't' AND c.relkind NOT IN ('v', 'c', 'f', 'p', 'I')
                    AND (f.fork = 'main' OR pg_relation_size(c.oid, f.fork) > 0)",
                &[],
            )
            .await
            .unwrap();
        for r in rows {
            let oid: u32 = r.get(0);
            let shared: bool = r.get(1);
            if shared && !shared_seen.insert((oid, r.get::<_, String>(2))) {
                continue;
            }
            out.insert((db.clone(), oid, r.get(2)), r.get::<_, i64>(3) as u64);
        }
    }
    out
}

/// Outcomes plus pending ranges cover the plan's ranges exactly: no block twice, none missing.
pub fn assert_outcomes_partition_plan(st: &pghydrate::run::RunState) {
    let mut blocks: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = std::collections::BTreeMap::new();
    for o in &st.outcomes {
        blocks.entry(o.range.fork).or_default().push((o.range.first, o.range.last));
    }
    for p in &st.pending {
        blocks.entry(p.fork).or_default().push((p.first, p.last));
    }
    let mut planned: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = std::collections::BTreeMap::new();
    for r in &st.plan.ranges {
        planned.entry(r.fork).or_default().push((r.first, r.last));
    }
    assert_eq!(blocks.keys().collect::<Vec<_>>(), planned.keys().collect::<Vec<_>>());
    for (fork, mut got) in blocks {
        got.sort();
        let mut want = planned.remove(&fork).unwrap();
        want.sort();
        let mut next = want[0].0;
        for (a, b) in &got {
            assert_eq!(*a, next, "fork {fork}: gap or overlap at block {a}: {got:?}");
            next = b + 1;
        }
        assert_eq!(next, want.last().unwrap().1 + 1, "fork {fork}: covered up to {next}");
    }
}

/// A TCP proxy on 127.0.0.1 in front of `upstream_port`: each accepted connection, with a new
/// connection to the server and the proxy's counter, goes to `relay`, which decides what passes. The
/// proxy stops when dropped.
struct Proxy {
    port: u16,
    count: std::sync::Arc<std::sync::atomic::AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start<F, Fut>(upstream_port: u16, relay: F) -> Proxy
    where
        F: Fn(tokio::net::TcpStream, tokio::net::TcpStream, std::sync::Arc<std::sync::atomic::AtomicU32>) -> Fut
            + Send
            + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let count = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = count.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream_port)).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, counter.clone()));
            }
        });
        Proxy { port, count, task }
    }

    fn count(&self) -> u32 {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP proxy in front of a server that cuts the network: every connection through it is dropped
/// (both sides, no goodbye) once its client has sent `cut_after` bytes. A client that reconnects gets
/// a fresh allowance, so a long run is cut again and again. `cuts()` counts the connections it cut.
pub struct CuttingProxy {
    pub port: u16,
    proxy: Proxy,
}

impl CuttingProxy {
    pub async fn start(upstream_port: u16, cut_after: usize) -> CuttingProxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let proxy = Proxy::start(upstream_port, move |client, server, cuts| async move {
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let down = tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
            let mut sent = 0usize;
            let mut buf = vec![0u8; 16384];
            loop {
                let n = match cr.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if sent + n > cut_after {
                    cuts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    break; // dropping both halves closes both connections mid-conversation
                }
                sent += n;
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            down.abort();
        })
        .await;
        CuttingProxy { port: proxy.port, proxy }
    }

    pub fn cuts(&self) -> u32 {
        self.proxy.count()
    }
}

/// A TCP proxy that makes connections half-open: once a connection's client has sent `hold_after`
/// bytes, the proxy stops forwarding in both directions but keeps both sockets open, as a failover,
/// a dropped NAT entry or a partition does. The first `holds` connections are held; later ones are
/// forwarded normally. Nothing ever arrives on a held connection, not even the server's own
/// statement_timeout error, so only a client-side bound ends the wait. `held()` counts them,
/// `released()` those of them whose client then closed its side.
pub struct BlackholeProxy {
    pub port: u16,
    proxy: Proxy,
    released: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl BlackholeProxy {
    pub async fn start(upstream_port: u16, hold_after: usize, holds: u32) -> BlackholeProxy {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let released = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let release = released.clone();
        let proxy = Proxy::start(upstream_port, move |client, server, counter| {
            let release = release.clone();
            async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                let closed = gate.clone();
                let down = tokio::spawn(async move {
                    let mut buf = vec![0u8; 16384];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if closed.load(SeqCst) {
                            // Held: keep the bytes, forward nothing, keep the socket.
                            std::future::pending::<()>().await;
                        }
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    std::future::pending::<()>().await;
                });
                let mut sent = 0usize;
                let mut buf = vec![0u8; 16384];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if sent + n > hold_after && !gate.load(SeqCst) {
                        let nth = counter.fetch_add(1, SeqCst);
                        if nth < holds {
                            gate.store(true, SeqCst);
                            // Hold until the client gives up (closes its side).
                            while let Ok(n) = cr.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                            }
                            release.fetch_add(1, SeqCst);
                            break;
                        }
                        counter.fetch_sub(1, SeqCst);
                        sent = 0;
                    }
                    sent += n;
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                down.abort();
            }
        })
        .await;
        BlackholeProxy { port: proxy.port, proxy, released }
    }

    pub fn held(&self) -> u32 {
        self.proxy.count()
    }

    pub fn released(&self) -> u32 {
        self.released.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// What a run that ended well leaves: complete, coverage 1.0, every block of every fork not excluded
/// warmed, each range counted once (the outcomes partition the plan), and every block in
/// shared_buffers. `context` goes into the coverage assertion's message. Returns the report.
pub async fn assert_complete_and_buffered(
    cluster: &Cluster,
    st: &pghydrate::run::RunState,
    context: &str,
) -> pghydrate::report::Report {
    assert_outcomes_partition_plan(st);
    let r = pghydrate::report::build(st);
    assert_eq!((r.coverage, r.status), (1.0, pghydrate::report::RunStatus::Complete), "{context}");
    for x in r.relations.iter().filter(|x| x.outcome != ForkOutcome::Excluded) {
        assert_eq!(x.warmed_blocks, x.blocks, "{x:?}");
    }
    assert_all_blocks_buffered(cluster, &r).await;
    r
}

/// For each warmed fork: every block 0..blocks is in shared_buffers (pg_buffercache), found through
/// the relation's current file node in its database.
pub async fn assert_all_blocks_buffered(cluster: &Cluster, r: &pghydrate::report::Report) -> usize {
    let mut by_db: std::collections::BTreeMap<String, Vec<&pghydrate::report::RelationReport>> =
        std::collections::BTreeMap::new();
    for x in r.relations.iter().filter(|x| x.outcome == ForkOutcome::Warmed && x.blocks > 0) {
        by_db.entry(x.database.clone()).or_default().push(x);
    }
    let mut checked = 0;
    for (db, rels) in by_db {
        let c = cluster.client(&db).await;
        for x in rels {
            let row = c
                .query_one(
                    "SELECT count(DISTINCT b.relblocknumber)
                       FROM pg_buffercache b
                      WHERE b.relfilenode = pg_relation_filenode($1::oid::regclass)
                        AND b.reldatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
                        AND b.relforknumber = CASE $2 WHEN 'main' THEN 0 WHEN 'fsm' THEN 1 WHEN 'vm' THEN 2 ELSE 3 END
                        AND b.relblocknumber < $3",
                    &[&x.oid, &x.fork, &(x.blocks as i64)],
                )
                .await
                .unwrap();
            let buffered: i64 = row.get(0);
            assert_eq!(
                buffered as u64, x.blocks,
                "{db}: {}.{} ({}) has {buffered} of {} blocks in shared buffers",
                x.schema, x.name, x.fork, x.blocks
            );
            checked += 1;
        }
    }
    checked
}

/// A client whose search path is pinned to pg_catalog, for the tests' own checks in a database where
/// a hostile role planted overloads in public (an unpinned client would run them itself).
pub async fn pinned_client(cluster: &Cluster, db: &str) -> Client {
    let mut cfg = tokio_postgres::Config::new();
    cfg.host("127.0.0.1")
        .port(cluster.port)
        .user(SUPERUSER)
        .password(SUPERUSER_PASSWORD)
        .dbname(db)
        .options("-c search_path=pg_catalog,pg_temp");
    let (client, conn) = cfg.connect(NoTls).await.unwrap_or_else(|e| panic!("connect to {db}: {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// What the hostile role planted in one database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Planted {
    pub functions: i32,
    pub aggregates: i32,
    pub operators: i32,
}

impl Planted {
    pub fn total(&self) -> i32 {
        self.functions + self.aggregates + self.operators
    }
}

fn hostile_script(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("hostile_catalog.py");
    let out = Command::new("python3").arg(&script).args(args).output().expect("python3");
    assert!(out.status.success(), "{}: {}", script.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Gives `role` (which must exist) the schema `hostile` in `db`, with its trap and counters
/// (tests/hostile_catalog.py), and CREATE on public and on pg_prewarm's schema, as PostgreSQL 14 and
/// earlier gave everyone. Plants nothing yet.
pub async fn hostile_setup(cluster: &Cluster, db: &str, role: &str) {
    let c = cluster.client(db).await;
    c.batch_execute(&hostile_script(&["setup", role]))
        .await
        .unwrap_or_else(|e| panic!("hostile set-up in {db}: {e:?}"));
}

/// Plants, as `role`, an overload of every function, aggregate and operator name in the project's SQL
/// text in every schema `role` can create in (tests/hostile_catalog.py). Returns what was planted.
pub async fn hostile_plant(cluster: &Cluster, db: &str, role: &str) -> Planted {
    let c = cluster.client(db).await;
    let msgs =
        c.simple_query(&hostile_script(&["sql", role])).await.unwrap_or_else(|e| panic!("planting in {db}: {e:?}"));
    let row = msgs
        .iter()
        .rev()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .expect("the planting script ends with its counts");
    let n = |i: usize| row.get(i).unwrap().parse::<i32>().unwrap();
    Planted { functions: n(0), aggregates: n(1), operators: n(2) }
}

/// How many times anything the hostile role planted ran in `db`, and as which roles.
pub async fn hostile_runs(cluster: &Cluster, db: &str) -> (i64, String) {
    let c = pinned_client(cluster, db).await;
    let row = c.query_one(&hostile_script(&["runs-sql"]), &[]).await.unwrap();
    (row.get(0), row.get(1))
}

/// Runs each named `async fn(major: u32)` as a test on PostgreSQL 15, 16, 17 and 18 (a module per
/// function, a test per version).
#[macro_export]
macro_rules! on_every_version {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg15() { super::$test(15).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg16() { super::$test(16).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg17() { super::$test(17).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg18() { super::$test(18).await }
            }
        )*
    };
}

/// Like [`on_every_version!`], on the oldest and newest versions only (15 and 18).
#[macro_export]
macro_rules! on_oldest_and_newest {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg15() { super::$test(15).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn pg18() { super::$test(18).await }
            }
        )*
    };
}

/// Plan options for tests: 64-block ranges, pg_prewarm created where missing, 3 lock waits, only
/// the databases named.
pub fn plan_opts(dbs: &[&str]) -> pghydrate::catalog::PlanOptions {
    pghydrate::catalog::PlanOptions {
        range_blocks: 64,
        create_extension: true,
        lock_attempts: 3,
        include_databases: dbs.iter().map(|d| d.to_string()).collect(),
        ..Default::default()
    }
}

/// Run options for tests: `sessions` in `mode`, lock_timeout 2 s, a 1 s margin, 20 s of reconnecting,
/// no maintenance.
pub fn run_opts(sessions: u32, mode: pghydrate::warm::Mode) -> pghydrate::run::RunOptions {
    pghydrate::run::RunOptions {
        warm: pghydrate::warm::WarmOptions {
            sessions,
            mode,
            lock_timeout: std::time::Duration::from_secs(2),
            margin: std::time::Duration::from_secs(1),
            reconnect_for: std::time::Duration::from_secs(20),
            ..Default::default()
        },
        maintenance: pghydrate::maintain::Maintenance::None,
        maintenance_timeout: std::time::Duration::from_secs(60),
    }
}
