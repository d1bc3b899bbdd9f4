//! Where and how to connect: a libpq-style URL or key=value string, the usual PG* environment
//! variables, and TLS with libpq's sslmode semantics (disable, prefer, require, verify-ca, verify-full)
//! implemented with rustls.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{describe, Error, Result};
use crate::sql::{SEARCH_PATH, SEARCH_PATH_OPTION};

/// libpq's sslmode values. `prefer` and `require` encrypt without verifying the certificate (as libpq
/// does); `verify-ca` checks the chain against the CA bundle; `verify-full` also checks the host name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl FromStr for TlsMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => TlsMode::Disable,
            "prefer" | "allow" => TlsMode::Prefer,
            "require" => TlsMode::Require,
            "verify-ca" => TlsMode::VerifyCa,
            "verify-full" => TlsMode::VerifyFull,
            other => {
                return Err(Error::InvalidInput(format!(
                    "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                )))
            }
        })
    }
}

impl TlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Disable => "disable",
            TlsMode::Prefer => "prefer",
            TlsMode::Require => "require",
            TlsMode::VerifyCa => "verify-ca",
            TlsMode::VerifyFull => "verify-full",
        }
    }
}

/// Everything needed to open sessions to any database of one server. Holds the password (if any) in
/// memory only; `target()` and `Debug` never show it.
#[derive(Clone)]
pub struct ConnectionSpec {
    config: Config,
    tls: TlsMode,
    ca_file: Option<PathBuf>,
    application_name: String,
    lock_timeout: Duration,
    statement_timeout: Duration,
    /// Startup options the user gave (PGOPTIONS, `options=`); the search path pin follows them.
    user_options: Option<String>,
    /// The TLS configuration, built (and the CA bundle read) once per spec, not once per session.
    tls_cache: Arc<std::sync::OnceLock<MakeRustlsConnect>>,
}

impl std::fmt::Debug for ConnectionSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionSpec").field("target", &self.target()).field("tls", &self.tls).finish()
    }
}

/// Removes `key=value` from a URL query or a key=value string; returns the value (percent-decoded for URLs).
fn take_param(conn: &mut String, key: &str) -> Option<String> {
    let is_url = conn.starts_with("postgres://") || conn.starts_with("postgresql://");
    if is_url {
        let (base, query) = match conn.split_once('?') {
            Some((b, q)) => (b.to_string(), q.to_string()),
            None => return None,
        };
        let mut found = None;
        let kept: Vec<&str> = query
            .split('&')
            .filter(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                if k == key {
                    found = Some(percent_decode(v));
                    false
                } else {
                    true
                }
            })
            .collect();
        *conn = if kept.is_empty() { base } else { format!("{base}?{}", kept.join("&")) };
        found
    } else {
        let mut found = None;
        let kept: Vec<&str> = conn
            .split_whitespace()
            .filter(|kv| match kv.split_once('=') {
                Some((k, v)) if k.trim() == key => {
                    found = Some(v.trim_matches('\'').to_string());
                    false
                }
                _ => true,
            })
            .collect();
        *conn = kept.join(" ");
        found
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // Only two hex digits make an escape: anything else (a multibyte character after `%`, say) is
        // kept as it is, byte for byte.
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What a connection string and the PG* environment say, before pghydrate's defaults.
struct Settings {
    config: Config,
    tls: TlsMode,
    ca_file: Option<PathBuf>,
    user_options: Option<String>,
}

impl Settings {
    fn from_environment(env: &impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut config = Config::new();
        if let Some(h) = env("PGHOST") {
            for host in h.split(',') {
                config.host(host);
            }
        }
        if let Some(p) = env("PGPORT") {
            let port: u16 = p.parse().map_err(|_| Error::InvalidInput(format!("PGPORT {p:?} is not a port number")))?;
            config.port(port);
        }
        if let Some(u) = env("PGUSER") {
            config.user(&u);
        }
        if let Some(pw) = env("PGPASSWORD") {
            config.password(pw);
        }
        if let Some(d) = env("PGDATABASE") {
            config.dbname(&d);
        }
        if let Some(t) = env("PGCONNECT_TIMEOUT") {
            let secs: u64 = t
                .parse()
                .map_err(|_| Error::InvalidInput(format!("PGCONNECT_TIMEOUT {t:?} is not a number of seconds")))?;
            config.connect_timeout(Duration::from_secs(secs));
        }
        // verify-full unless told otherwise: a hydration runs with a privileged login against a
        // production server, so the server's identity is checked by default (libpq's default is prefer).
        let tls = match env("PGSSLMODE") {
            Some(m) => m.parse()?,
            None => TlsMode::VerifyFull,
        };
        Ok(Settings {
            config,
            tls,
            ca_file: env("PGSSLROOTCERT").map(PathBuf::from),
            user_options: env("PGOPTIONS").filter(|o| !o.trim().is_empty()),
        })
    }

    /// Lays a connection string (URL, key=value, or a bare database name as psql takes it) over
    /// these settings: what it names wins.
    fn overlay(&mut self, conn: &str) -> Result<()> {
        let mut s = conn.trim().to_string();
        if let Some(m) = take_param(&mut s, "sslmode") {
            self.tls = m.parse()?;
        }
        if let Some(f) = take_param(&mut s, "sslrootcert") {
            self.ca_file = Some(PathBuf::from(f));
        }
        let parsed = if s.is_empty() {
            Config::new()
        } else if !s.contains('=') && !s.contains("://") {
            let mut c = Config::new();
            c.dbname(&s);
            c
        } else {
            Config::from_str(&s)
                .map_err(|e| Error::InvalidInput(format!("connection string is not valid: {}", describe(&e))))?
        };
        let config = &mut self.config;
        if !parsed.get_hosts().is_empty() {
            *config = overlay_hosts(config.clone(), &parsed);
        }
        for p in parsed.get_ports() {
            config.port(*p);
        }
        if let Some(u) = parsed.get_user() {
            config.user(u);
        }
        if let Some(pw) = parsed.get_password() {
            config.password(pw);
        }
        if let Some(d) = parsed.get_dbname() {
            config.dbname(d);
        }
        if let Some(t) = parsed.get_connect_timeout() {
            config.connect_timeout(*t);
        }
        if let Some(o) = parsed.get_options().filter(|o| !o.trim().is_empty()) {
            self.user_options = Some(o.to_string());
        }
        Ok(())
    }

    /// libpq's defaults for what nothing named: localhost, the OS user, and a 10 s connect timeout.
    fn fill_defaults(&mut self, env: &impl Fn(&str) -> Option<String>) {
        let config = &mut self.config;
        if config.get_hosts().is_empty() {
            config.host("localhost");
        }
        if config.get_user().is_none() {
            let user = env("USER").unwrap_or_else(|| "postgres".into());
            config.user(&user);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
    }
}

impl ConnectionSpec {
    /// Builds the spec from an optional connection string (URL or key=value) over the PG* environment
    /// variables (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT,
    /// PGCONNECT_TIMEOUT, PGOPTIONS). Values in the string win over the environment, as in libpq.
    pub fn parse(conn: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut settings = Settings::from_environment(&env)?;
        if let Some(conn) = conn {
            settings.overlay(conn)?;
        }
        settings.fill_defaults(&env);
        let Settings { config, tls, ca_file, user_options } = settings;
        Ok(ConnectionSpec {
            config,
            tls,
            ca_file,
            application_name: "pghydrate".into(),
            lock_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(300),
            user_options,
            tls_cache: Arc::default(),
        })
    }

    /// Overrides the TLS mode (e.g. from a command-line option).
    pub fn with_tls(mut self, mode: TlsMode, ca_file: Option<PathBuf>) -> Self {
        self.tls = mode;
        if ca_file.is_some() {
            self.ca_file = ca_file;
        }
        self.tls_cache = Arc::default();
        self
    }

    /// The bound of opening one session: TCP connect, TLS handshake, authentication and the first
    /// statement together (libpq's connect_timeout; 10 s unless PGCONNECT_TIMEOUT or connect_timeout=).
    pub fn connect_timeout(&self) -> Duration {
        self.config.get_connect_timeout().copied().unwrap_or(Duration::from_secs(10))
    }

    /// Asks the server to cancel what `token`'s session is running, without waiting for it: the
    /// request opens a connection of its own, bounded by connect_timeout. Used when a statement gave
    /// no answer in time (the session itself may be half-open and is dropped).
    pub fn cancel_in_background(&self, token: tokio_postgres::CancelToken) {
        let Ok(tls) = self.tls_connector() else { return };
        let bound = self.connect_timeout();
        tokio::spawn(async move {
            match tokio::time::timeout(bound, token.cancel_query(tls)).await {
                Ok(Ok(())) => tracing::debug!("cancel request delivered"),
                Ok(Err(e)) => tracing::debug!(error = %describe(&e), "cancel request failed"),
                Err(_) => tracing::debug!("cancel request got no answer"),
            }
        });
    }

    /// lock_timeout and statement_timeout set on every session this spec opens (a statement may
    /// lower statement_timeout further, e.g. near a deadline).
    pub fn with_timeouts(mut self, lock_timeout: Duration, statement_timeout: Duration) -> Self {
        self.lock_timeout = lock_timeout;
        self.statement_timeout = statement_timeout;
        self
    }

    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    pub fn tls_mode(&self) -> TlsMode {
        self.tls
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or("")
    }

    /// The database named in the connection string, used to discover the others.
    pub fn initial_database(&self) -> &str {
        self.config.get_dbname().unwrap_or("postgres")
    }

    /// host:port as a user would recognise it; never contains the password.
    pub fn target(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        format!("{}@{host}:{port}", self.user())
    }

    /// Every host is a Unix-domain socket: TLS does not apply (as in libpq).
    pub fn is_local_socket(&self) -> bool {
        let hosts = self.config.get_hosts();
        !hosts.is_empty() && hosts.iter().all(|h| matches!(h, Host::Unix(_)))
    }

    fn tls_connector(&self) -> Result<MakeRustlsConnect> {
        if let Some(c) = self.tls_cache.get() {
            return Ok(c.clone());
        }
        let c = self.build_tls_connector()?;
        let _ = self.tls_cache.set(c.clone());
        Ok(c)
    }

    fn build_tls_connector(&self) -> Result<MakeRustlsConnect> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Tls { target: self.target(), reason: e.to_string() })?;
        let config = match self.tls {
            _ if self.is_local_socket() => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
                .with_no_client_auth(),
            TlsMode::Disable | TlsMode::Prefer | TlsMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
                .with_no_client_auth(),
            TlsMode::VerifyCa | TlsMode::VerifyFull => {
                let roots = self.load_roots()?;
                let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| Error::Tls { target: self.target(), reason: e.to_string() })?;
                let verifier: Arc<dyn ServerCertVerifier> =
                    if self.tls == TlsMode::VerifyCa { Arc::new(ChainOnly(inner)) } else { inner };
                builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth()
            }
        };
        Ok(MakeRustlsConnect::new(config))
    }

    fn load_roots(&self) -> Result<RootCertStore> {
        let path: PathBuf = match &self.ca_file {
            Some(p) => p.clone(),
            None => match std::env::var_os("HOME") {
                Some(h) if Path::new(&h).join(".postgresql/root.crt").exists() => {
                    Path::new(&h).join(".postgresql/root.crt")
                }
                _ => {
                    return Err(Error::InvalidInput(format!(
                    "sslmode {} (the default) needs a CA bundle: pass --ca-file (or sslrootcert=) with the server's \
                         CA certificates (for RDS, the region's bundle), or choose a weaker --tls explicitly",
                    self.tls.as_str()
                )))
                }
            },
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&path)
            .map_err(|e| Error::InvalidInput(format!("cannot read CA bundle {}: {e}", path.display())))?
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::InvalidInput(format!("CA bundle {} is not valid PEM: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(Error::InvalidInput(format!("CA bundle {} holds no certificate", path.display())));
        }
        let mut roots = RootCertStore::empty();
        let (added, _ignored) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(Error::InvalidInput(format!("CA bundle {} holds no usable certificate", path.display())));
        }
        Ok(roots)
    }

    /// Opens one session to `database`. The connection task runs on the current runtime and ends when
    /// the session is dropped (see [`Session`]). The session's search path is pinned before its first
    /// query (see [`crate::sql`]): the startup option comes after any the user gave, so it wins, and the
    /// first statement sets it again in case a pooler dropped the startup option.
    pub async fn connect(&self, database: &str) -> Result<Session> {
        let mut config = self.config.clone();
        config.dbname(database);
        config.application_name(&self.application_name);
        config.options(match &self.user_options {
            Some(o) => format!("{o} {SEARCH_PATH_OPTION}"),
            None => SEARCH_PATH_OPTION.to_string(),
        });
        config.ssl_mode(match self.tls {
            _ if self.is_local_socket() => SslMode::Disable,
            TlsMode::Disable => SslMode::Disable,
            TlsMode::Prefer => SslMode::Prefer,
            _ => SslMode::Require,
        });
        // A dead peer (failover, a dropped NAT entry) is noticed in about 30 s, not the kernel's two
        // hours: keepalives on an idle session, and a bound on unacknowledged data.
        config.keepalives(true);
        config.keepalives_idle(KEEPALIVE_IDLE);
        config.keepalives_interval(KEEPALIVE_INTERVAL);
        config.keepalives_retries(KEEPALIVE_RETRIES);
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
        let tls = self.tls_connector()?;
        let target = format!("{} database {database:?}", self.target());
        let bound = self.connect_timeout();
        match tokio::time::timeout(bound, self.open(config, tls, &target)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Connect {
                target,
                reason: format!(
                    "no answer within {} s (connect_timeout) while connecting, negotiating TLS or logging in",
                    bound.as_secs_f64()
                ),
                source: None,
            }),
        }
    }

    async fn open(&self, config: Config, tls: MakeRustlsConnect, target: &str) -> Result<Session> {
        let target = target.to_string();
        let (client, connection) = config.connect(tls).await.map_err(|e| classify_connect_error(&target, e))?;
        let (closing, dropped) = tokio::sync::oneshot::channel::<()>();
        let grace = self.connect_timeout();
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                r = &mut connection => r,
                _ = dropped => match tokio::time::timeout(grace, &mut connection).await {
                    Ok(r) => r,
                    Err(_) => {
                        // Dropping the connection closes the socket.
                        tracing::debug!(
                            grace_s = grace.as_secs_f64(),
                            "session dropped with a statement still unanswered: connection closed"
                        );
                        return;
                    }
                },
            };
            if let Err(e) = ended {
                tracing::debug!(error = %describe(&e), "session ended");
            }
        });
        let client = Session { client, _closing: closing };
        // The search path first (every name in this very statement is qualified), then: no statement
        // of this tool may wait on a lock or run without bound.
        client
            .query_one(
                "SELECT pg_catalog.set_config('search_path'::pg_catalog.text, $1::pg_catalog.text, false),
                        pg_catalog.set_config('lock_timeout'::pg_catalog.text, $2::pg_catalog.text, false),
                        pg_catalog.set_config('statement_timeout'::pg_catalog.text, $3::pg_catalog.text, false)",
                &[
                    &SEARCH_PATH,
                    &format!("{}ms", self.lock_timeout.as_millis().max(1)),
                    &format!("{}ms", self.statement_timeout.as_millis().max(1)),
                ],
            )
            .await
            .map_err(|e| classify_connect_error(&target, e))?;
        Ok(client)
    }
}

/// One open session: the driver's client, and the end of the task that carries its connection.
/// Dropping it ends that task: at once when nothing is in flight (the protocol's goodbye), and at most
/// connect_timeout later when a statement is still unanswered (dropped after no answer, or cut by a
/// deadline), which is the time its cancel request has to arrive. Without that bound the task of a
/// half-open connection waited for the statement's answer until TCP keepalive gave up on the socket,
/// and forever on a path that still acknowledges (a proxy holding it): each held its socket and its
/// memory, and on the server the slot of a session nobody would use again.
pub struct Session {
    client: Client,
    _closing: tokio::sync::oneshot::Sender<()>,
}

impl std::ops::Deref for Session {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl std::ops::DerefMut for Session {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// TCP keepalive and user timeout of every session: see [`ConnectionSpec::connect`].
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const KEEPALIVE_RETRIES: u32 = 3;
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

fn overlay_hosts(mut base: Config, parsed: &Config) -> Config {
    let mut fresh = Config::new();
    for h in parsed.get_hosts() {
        match h {
            Host::Tcp(s) => {
                fresh.host(s);
            }
            Host::Unix(p) => {
                fresh.host_path(p);
            }
        }
    }
    // Carry everything else over from the environment-based config.
    if let Some(u) = base.get_user() {
        fresh.user(u);
    }
    if let Some(pw) = base.get_password() {
        fresh.password(pw);
    }
    if let Some(d) = base.get_dbname() {
        fresh.dbname(d);
    }
    for p in base.get_ports() {
        fresh.port(*p);
    }
    if let Some(t) = base.get_connect_timeout() {
        fresh.connect_timeout(*t);
    }
    base = fresh;
    base
}

fn classify_connect_error(target: &str, e: tokio_postgres::Error) -> Error {
    let reason = describe(&e);
    let code = e.code().map(|c| c.code().to_string()).unwrap_or_default();
    if code == "28P01" || code == "28000" || reason.contains("password missing") {
        return Error::Authentication { target: target.into(), reason, source: Some(e) };
    }
    // A connection cut while TLS was being negotiated (a server restarting, a proxy or a failover
    // dropping it) is a network failure, retried like any other, not a TLS problem to fix.
    let cut = connection_cut(&e);
    if !cut && (reason.contains("TLS") || reason.contains("certificate") || reason.contains("tls")) {
        let reason = if reason.contains("server does not support TLS") {
            format!("{reason} (connecting unencrypted takes an explicit --tls disable)")
        } else {
            reason
        };
        return Error::Tls { target: target.into(), reason };
    }
    Error::Connect { target: target.into(), reason, source: Some(e) }
}

/// Whether an error's cause is the connection itself ending or stalling (end of file, reset, abort,
/// broken pipe, timeout), at any depth of its chain.
fn connection_cut(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::*;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(io.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | TimedOut) {
                return true;
            }
        }
        next = err.source();
    }
    false
}

/// libpq's `require`/`prefer`: encrypted, certificate not checked. Signatures are still verified so the
/// handshake itself is sound.
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// libpq's `verify-ca`: the chain must lead to a trusted CA; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that wraps another, as tokio-postgres wraps the TLS stream's io::Error.
    #[derive(Debug)]
    struct Wrapped(std::io::Error);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error performing TLS handshake")
        }
    }
    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// A handshake cut by the network is retried as a connection failure; a certificate the
    /// verifier refused (an io::Error of kind InvalidData from rustls) stays a TLS error.
    #[test]
    fn a_connection_cut_during_the_handshake_is_not_a_tls_problem() {
        use std::io::{Error as Io, ErrorKind};
        for kind in [
            ErrorKind::UnexpectedEof,
            ErrorKind::ConnectionReset,
            ErrorKind::ConnectionAborted,
            ErrorKind::BrokenPipe,
            ErrorKind::TimedOut,
        ] {
            assert!(connection_cut(&Wrapped(Io::new(kind, "cut"))), "{kind:?}");
        }
        assert!(!connection_cut(&Wrapped(Io::new(ErrorKind::InvalidData, "invalid peer certificate: UnknownIssuer"))));
        assert!(!connection_cut(&Io::other("no route")));
    }

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn url_wins_over_environment_and_hides_password() {
        let spec = ConnectionSpec::parse(
            Some("postgresql://alice:s3cret@db.example:6543/app?sslmode=require"),
            env(&[("PGHOST", "other"), ("PGUSER", "bob"), ("PGPASSWORD", "envpw")]),
        )
        .unwrap();
        assert_eq!(spec.target(), "alice@db.example:6543");
        assert_eq!(spec.tls_mode(), TlsMode::Require);
        assert_eq!(spec.initial_database(), "app");
        assert!(!format!("{spec:?}").contains("s3cret"));
    }

    #[test]
    fn environment_alone_is_enough() {
        let spec = ConnectionSpec::parse(
            None,
            env(&[("PGHOST", "h"), ("PGPORT", "7000"), ("PGUSER", "u"), ("PGSSLMODE", "verify-full")]),
        )
        .unwrap();
        assert_eq!(spec.target(), "u@h:7000");
        assert_eq!(spec.tls_mode(), TlsMode::VerifyFull);
    }

    #[test]
    fn verify_modes_are_taken_out_before_the_driver_sees_them() {
        let spec =
            ConnectionSpec::parse(Some("host=h port=1 user=u sslmode=verify-ca sslrootcert=/tmp/ca.pem"), env(&[]))
                .unwrap();
        assert_eq!(spec.tls_mode(), TlsMode::VerifyCa);
        assert_eq!(spec.ca_file.as_deref(), Some(Path::new("/tmp/ca.pem")));
    }

    #[test]
    fn a_percent_sign_before_a_multibyte_character_is_kept_not_a_panic() {
        assert_eq!(percent_decode("p%ä%41x"), "p%äAx");
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("ab%4"), "ab%4");
        assert_eq!(percent_decode("%e2%82%ac"), "€");
        let spec =
            ConnectionSpec::parse(Some("postgresql://u@h/db?sslmode=require&sslrootcert=/tmp/c%ä%.pem"), env(&[]))
                .unwrap();
        assert_eq!(spec.ca_file.as_deref(), Some(Path::new("/tmp/c%ä%.pem")));
    }

    #[test]
    fn bad_values_are_named() {
        let e = ConnectionSpec::parse(Some("postgresql://h/db?sslmode=maybe"), env(&[])).unwrap_err();
        assert!(e.to_string().contains("sslmode \"maybe\""), "{e}");
        let e = ConnectionSpec::parse(None, env(&[("PGPORT", "abc")])).unwrap_err();
        assert!(e.to_string().contains("PGPORT"), "{e}");
    }
}
