//! What SQL this engine executes, and where its text comes from.
//!
//! The tool logs in with the most powerful role on the instance, and every database may hold a user
//! who wants that role's privileges (CVE-2018-1058: an overload planted in a schema the user can
//! create in, such as `public` on databases created before PostgreSQL 15). Three rules keep that user's
//! code from running as ours:
//!
//! 1. **Every session pins its search path** to [`SEARCH_PATH`] (`pg_catalog, pg_temp`), as a startup
//!    option and again in the session's first statement, before anything else runs. `ALTER ROLE ...
//!    SET`, `ALTER DATABASE ... SET` and PGOPTIONS cannot loosen it: the startup option is applied
//!    after them, and the first statement sets it again for poolers that drop startup options. So
//!    every unqualified function, operator, aggregate and type in our SQL resolves in `pg_catalog`,
//!    where no one but a superuser can create anything.
//! 2. **Executed SQL text is a literal of this crate**, possibly completed with other literals of this
//!    crate chosen by server version, or it is a [`ServerSql`]: text that the server built, in the same
//!    session, from catalog rows found by oid (the pg_prewarm call, found by the extension's membership
//!    in `pg_depend`; a maintenance statement, built from the table's oid when it runs). Values from
//!    outside (names, oids, modes, roles) are only ever bound as parameters.
//! 3. **Nothing read from state is executed.** A plan, a continuation file, a work item or anything
//!    from S3 or Step Functions carries oids and data. Names in it are labels for the report; a role
//!    in it is a parameter of `set_config('role', $1)`. `ServerSql` has no public constructor, so no
//!    state can become one.
//!
//! To check by reading: every `query*`/`batch_execute` call in this crate takes a string literal, a
//! `format!` of literals, or `ServerSql::as_str()` (grep for `batch_execute(` and `format!("SELECT`).

use tokio_postgres::{Client, Row};

/// The search path of every session: the system catalog, then this session's own temporary schema
/// (last, so that not even a temporary object can shadow a catalog one).
pub const SEARCH_PATH: &str = "pg_catalog, pg_temp";

/// The startup option that pins [`SEARCH_PATH`] (spaces separate options, so none inside the value).
pub const SEARCH_PATH_OPTION: &str = "-c search_path=pg_catalog,pg_temp";

/// SQL text the server built in this session from catalog rows. Only this module makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSql(String);

impl ServerSql {
    fn from_row(row: &Row, idx: usize) -> Self {
        ServerSql(row.get(idx))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The function that is a member of the extension `pg_prewarm` with pg_prewarm's exact signature.
const PREWARM_FUNCTION: &str = "FROM pg_catalog.pg_extension e
         JOIN pg_catalog.pg_depend d ON d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
                                     AND d.refobjid = e.oid AND d.deptype = 'e'
                                     AND d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass
         JOIN pg_catalog.pg_proc p ON p.oid = d.objid
         JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
        WHERE e.extname = 'pg_prewarm' AND p.proname = 'pg_prewarm'
          AND p.proargtypes = '2205 25 25 20 20'::pg_catalog.oidvector  -- regclass, text, text, int8, int8
          AND p.prorettype = 'pg_catalog.int8'::pg_catalog.regtype";

/// pg_prewarm as its extension installed it: the function that is a member of the extension
/// `pg_prewarm` (pg_depend, deptype 'e') with pg_prewarm's exact signature. Never a lookup by name in
/// a schema, which may be writable. Returns the schema it lives in (a label) and the call, with every
/// argument cast to the exact parameter type so that no other overload in that schema can be a
/// better match.
pub(crate) async fn prewarm_call(client: &Client) -> Result<Option<(String, ServerSql)>, tokio_postgres::Error> {
    let find = format!(
        "SELECT n.nspname::text,
              format('SELECT %I.%I($1::pg_catalog.oid::pg_catalog.regclass, $2::pg_catalog.text, '
                     '$3::pg_catalog.text, $4::pg_catalog.int8, $5::pg_catalog.int8)', n.nspname, p.proname)
         {PREWARM_FUNCTION}"
    );
    Ok(client.query_opt(&find, &[]).await?.map(|row| (row.get(0), ServerSql::from_row(&row, 1))))
}

/// The same function as [`prewarm_call`], called once per element of arrays: `$1` oids, `$2` the mode,
/// `$3` forks, `$4` first and `$5` last blocks. Returns (ordinal, blocks read) rows, in order. Every
/// argument is cast to the exact parameter type; `unnest` is the catalog's (the multi-argument
/// `unnest(a, b)` is syntax that exists only unqualified, so the arrays are zipped by `ROWS FROM`).
pub(crate) async fn prewarm_batch_call(client: &Client) -> Result<Option<ServerSql>, tokio_postgres::Error> {
    let find = format!(
        "SELECT format('SELECT u.i, %I.%I(u.r::pg_catalog.regclass, $2::pg_catalog.text, u.f, u.a, u.b)
                FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.oid[]), pg_catalog.unnest($3::pg_catalog.text[]),
                                pg_catalog.unnest($4::pg_catalog.int8[]), pg_catalog.unnest($5::pg_catalog.int8[]))
                     WITH ORDINALITY AS u(r, f, a, b, i)
               ORDER BY u.i', n.nspname, p.proname)
         {PREWARM_FUNCTION}"
    );
    Ok(client.query_opt(&find, &[]).await?.map(|row| ServerSql::from_row(&row, 0)))
}

/// A table to maintain as the server sees it now, looked up by oid.
pub(crate) struct MaintenanceStatement {
    pub sql: ServerSql,
    pub action: &'static str,
    /// The login role may maintain it (owner, MAINTAIN privilege, database owner or superuser).
    pub allowed: bool,
}

/// Builds `ANALYZE schema.table`, `VACUUM ANALYZE schema.table` or (`vacuum_only`: a partition whose
/// partitioned parent's ANALYZE covers it) `VACUUM schema.table` for `oid`, quoted by the server, from
/// the catalog as it is now. None: no such table any more (dropped, or not a table).
pub(crate) async fn maintenance_statement(
    client: &Client,
    oid: u32,
    vacuum: bool,
    vacuum_only: bool,
    server_version_num: i32,
) -> Result<Option<MaintenanceStatement>, tokio_postgres::Error> {
    const BEFORE_17: &str = "SELECT format('%s %I.%I',
                    CASE WHEN $2 AND c.relkind <> 'p' THEN (CASE WHEN $3 THEN 'VACUUM' ELSE 'VACUUM ANALYZE' END)
                         ELSE 'ANALYZE' END, n.nspname, c.relname),
                  $2 AND c.relkind <> 'p',
                  pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')
                    OR (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user)
             FROM pg_catalog.pg_class c
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
             JOIN pg_catalog.pg_database d ON d.datname = current_database()
            WHERE c.oid = $1 AND c.relkind IN ('r', 'p', 'm') AND c.relpersistence <> 't'";
    const FROM_17: &str = "SELECT format('%s %I.%I',
                    CASE WHEN $2 AND c.relkind <> 'p' THEN (CASE WHEN $3 THEN 'VACUUM' ELSE 'VACUUM ANALYZE' END)
                         ELSE 'ANALYZE' END, n.nspname, c.relname),
                  $2 AND c.relkind <> 'p',
                  has_table_privilege(c.oid, 'MAINTAIN')
             FROM pg_catalog.pg_class c
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
            WHERE c.oid = $1 AND c.relkind IN ('r', 'p', 'm') AND c.relpersistence <> 't'";
    let sql = if server_version_num >= 170000 { FROM_17 } else { BEFORE_17 };
    let Some(row) = client.query_opt(sql, &[&oid, &vacuum, &vacuum_only]).await? else { return Ok(None) };
    // The privilege functions answer NULL for a table dropped after this statement's snapshot found it.
    let Some(allowed) = row.get::<_, Option<bool>>(2) else { return Ok(None) };
    Ok(Some(MaintenanceStatement {
        sql: ServerSql::from_row(&row, 0),
        action: match (row.get::<_, bool>(1), vacuum_only) {
            (true, true) => "VACUUM",
            (true, false) => "VACUUM ANALYZE",
            _ => "ANALYZE",
        },
        allowed,
    }))
}

/// The hot-set capture's one read of the buffer cache ([`crate::hotset`]): pg_buffercache's view as its
/// extension installed it (a member of the extension `pg_buffercache` in pg_depend, never a lookup by
/// name), summarized on the server into runs of consecutive cached blocks per relation fork: database,
/// tablespace, filenode, fork number, first and last block, buffers, summed usage count. Shared
/// catalogs (database 0) and unused buffers are left out. None: pg_buffercache is not installed here.
pub(crate) async fn buffercache_runs(client: &Client) -> Result<Option<ServerSql>, tokio_postgres::Error> {
    let find = "SELECT format('SELECT r.db, r.ts, r.fn, r.fork, pg_catalog.min(r.blk), pg_catalog.max(r.blk),
                       pg_catalog.count(*), pg_catalog.sum(r.usage)::pg_catalog.int8
                  FROM (SELECT b.*, b.blk - pg_catalog.row_number() OVER (PARTITION BY b.db, b.ts, b.fn, b.fork ORDER BY b.blk) AS grp
                          FROM (SELECT v.reldatabase::pg_catalog.oid AS db, v.reltablespace::pg_catalog.oid AS ts,
                                       v.relfilenode::pg_catalog.oid AS fn, v.relforknumber::pg_catalog.int4 AS fork,
                                       v.relblocknumber::pg_catalog.int8 AS blk, coalesce(v.usagecount, 0)::pg_catalog.int8 AS usage
                                  FROM %I.%I v
                                 WHERE v.reldatabase IS NOT NULL AND v.reldatabase <> 0 AND v.relblocknumber IS NOT NULL) b) r
                 GROUP BY r.db, r.ts, r.fn, r.fork, r.grp', n.nspname, c.relname)
         FROM pg_catalog.pg_extension e
         JOIN pg_catalog.pg_depend d ON d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
                                     AND d.refobjid = e.oid AND d.deptype = 'e'
                                     AND d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
         JOIN pg_catalog.pg_class c ON c.oid = d.objid
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE e.extname = 'pg_buffercache' AND c.relname = 'pg_buffercache' AND c.relkind = 'v'";
    Ok(client.query_opt(find, &[]).await?.map(|row| ServerSql::from_row(&row, 0)))
}
