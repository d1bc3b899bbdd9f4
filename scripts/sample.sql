-- pghydrate's sample database: every kind of relation with storage that a restored database holds.
-- Size scales with the custom setting pghydrate.scale (about 12 MiB per unit):
--   PGOPTIONS='-c pghydrate.scale=25' psql -f scripts/sample.sql
-- Used by the demo (make demo) and by the integration tests (scale 1).

CREATE TEMP TABLE scale AS SELECT coalesce(nullif(current_setting('pghydrate.scale', true), ''), '1')::int AS n;

-- A plain table with several index access methods (btree, hash, gin, brin) and a sequence.
CREATE SEQUENCE order_numbers;
CREATE TABLE customers (
    id      bigint PRIMARY KEY,
    name    text NOT NULL,
    email   text,
    created timestamptz NOT NULL,
    profile jsonb
);
INSERT INTO customers
SELECT g, 'customer ' || g, 'c' || g || '@example.com',
       timestamptz '2026-01-01' - g * interval '1 minute',
       jsonb_build_object('tier', g % 5, 'tags', jsonb_build_array('a' || g % 7, 'b' || g % 11))
  FROM generate_series(1, 20000 * (SELECT n FROM scale)) g;
CREATE INDEX customers_email_hash ON customers USING hash (email);
CREATE INDEX customers_profile_gin ON customers USING gin (profile);
CREATE INDEX customers_created_brin ON customers USING brin (created);
SELECT setval('order_numbers', 1000);

-- Large values go to TOAST (a TOAST table and its index).
CREATE TABLE documents (id int PRIMARY KEY, title text, body text);
ALTER TABLE documents ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO documents
SELECT g, 'document ' || g,
       (SELECT string_agg(md5(i::text || '/' || g), '') FROM generate_series(1, 250) i)
  FROM generate_series(1, 500 * (SELECT n FROM scale)) g;

-- A partitioned table: the parent has no storage, each partition and partition index has.
CREATE TABLE events (id bigint, at date NOT NULL, kind text, payload text) PARTITION BY RANGE (at);
CREATE TABLE events_2025 PARTITION OF events FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
CREATE INDEX events_at_kind ON events (at, kind);
INSERT INTO events
SELECT g, date '2025-01-01' + (g % 700), (ARRAY['click', 'view', 'buy'])[1 + g % 3], md5(g::text)
  FROM generate_series(1, 30000 * (SELECT n FROM scale)) g;

-- Geometry with GiST and SP-GiST indexes.
CREATE TABLE places (id int PRIMARY KEY, pos point, area box);
INSERT INTO places
SELECT g, point(g % 1000, g / 1000), box(point(g % 1000, g / 1000), point(g % 1000 + 1, g / 1000 + 1))
  FROM generate_series(1, 5000 * (SELECT n FROM scale)) g;
CREATE INDEX places_area_gist ON places USING gist (area);
CREATE INDEX places_pos_spgist ON places USING spgist (pos);

-- A materialized view with an index.
CREATE MATERIALIZED VIEW customer_tiers AS
SELECT (profile ->> 'tier')::int AS tier, count(*) AS customers FROM customers GROUP BY 1;
CREATE UNIQUE INDEX customer_tiers_tier ON customer_tiers (tier);

-- An unlogged table: its index has an init fork.
CREATE UNLOGGED TABLE session_cache (key text PRIMARY KEY, value text);
INSERT INTO session_cache SELECT 'k' || g, repeat('v', 50) FROM generate_series(1, 2000 * (SELECT n FROM scale)) g;

-- Identifiers that must never be pasted into SQL: quotes, spaces, a semicolon, $$, a backslash,
-- a newline and non-ASCII letters.
CREATE SCHEMA "Sales ""EU"" ü";
CREATE TABLE "Sales ""EU"" ü"."order; DROP TABLE customers;--" (
    id int PRIMARY KEY,
    "naïve $$ \ col" text
);
INSERT INTO "Sales ""EU"" ü"."order; DROP TABLE customers;--"
SELECT g, repeat('x', 100) FROM generate_series(1, 1000 * (SELECT n FROM scale)) g;
CREATE INDEX "idx
with newline" ON "Sales ""EU"" ü"."order; DROP TABLE customers;--" ("naïve $$ \ col");

-- A tiny table, handy as a first priority.
CREATE TABLE tiny (id int PRIMARY KEY, note text);
INSERT INTO tiny VALUES (1, 'one'), (2, 'two');

-- Relations without storage: listed nowhere, read by nobody.
CREATE VIEW big_customers AS SELECT * FROM customers WHERE id > 100;
