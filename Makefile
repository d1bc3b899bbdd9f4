# pghydrate: the two commands are `make demo` (hydrate a local sample database) and `make test`.
# Everything they need is installed by scripts/setup.sh (idempotent; cached under PGHYDRATE_HOME).

export PGHYDRATE_HOME ?= /var/tmp/pghydrate
# Build outside the clone so repeated runs (and CI) build incrementally.
export CARGO_TARGET_DIR ?= $(PGHYDRATE_HOME)/target
CARGO ?= cargo
SHELL := /bin/bash

.PHONY: setup build demo test e2e twin-up twin-down bench bench-matrix bench-workflow bench-capture bench-normal bench-plan unit check-infra bench-modes clean-demo

setup:
	bash scripts/setup.sh

build:
	$(CARGO) build --workspace --locked

## Creates a local PostgreSQL with a sample database (~300 MiB) on a simulated lazy volume (where FUSE
## mounts), times a query cold, hydrates, times it again.
demo: setup
	$(CARGO) build --release --locked -p pghydrate-cli -p pghydrate-lazyvol
	PGHYDRATE_BIN=$(CARGO_TARGET_DIR)/release/pghydrate bash scripts/demo.sh

## Every test: unit tests, property tests, the real-server tests on PostgreSQL 15, 16, 17, 18, the twin,
## the infra checks and sam build; each phase's wall time printed at the end (scripts/test.sh).
test: setup
	bash scripts/test.sh

unit:
	$(CARGO) test --locked -p pghydrate

clean-demo:
	rm -rf $(PGHYDRATE_HOME)/demo

## The state machine and SAM template, validated offline (asl-validator, cfn-lint).
check-infra:
	bash scripts/check-infra.sh

## The hydration benchmark: strategies side by side on a simulated lazy-loaded volume (FUSE, needs root).
## Prints a table; writes bench/results.json, bench/results.md, bench/hydration.svg. Options: BENCH_ARGS.
bench: setup
	$(CARGO) build --release --locked -p pghydrate-cli -p pghydrate-lazyvol
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench.py $(BENCH_ARGS)

## Planning at scale: 100,000 relations in 4 databases; wall time, peak memory, plan size (needs root).
## The matrix: defaults vs a sweep of fixed session counts and the recipe, on several simulated volumes.
bench-matrix: setup
	$(CARGO) build --release --locked -p pghydrate-cli -p pghydrate-lazyvol
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench-matrix.py $(BENCH_ARGS)

## The workflow's Lambda cost per TiB: the twin on a lazy volume (release builds, Lambda's CPU share), one call per session vs the defaults.
bench-workflow: setup
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench-workflow.py $(BENCH_ARGS)

## What `pghydrate capture` costs with full shared buffers (whole relations, and every other block cached).
bench-capture: setup
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench-capture.py $(BENCH_ARGS)

## Time to normal: an open-loop Zipfian lookup workload's p95 after a restore (2.3 GiB database), with no hydration, the recipe, pghydrate without and with a captured hot set. BENCH_ARGS="--rate 1000" for a busier application.
bench-normal: setup
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench-normal.py $(BENCH_ARGS)

bench-plan: setup
	$(CARGO) build --release --locked -p pghydrate-cli
	bash twin/up.sh --venv
	$(PGHYDRATE_HOME)/twinvenv/bin/python scripts/bench-plan.py $(BENCH_ARGS)

## Mode and range-size measurements behind docs/tuning.md (needs root: loop device, cgroup).
bench-modes:
	$(CARGO) build --release --locked -p pghydrate-cli
	bash scripts/bench-modes.sh

## The local twin: the real state machine, run by moto's ASL interpreter, drives the real Lambda
## binaries (cargo lambda watch) against a real PostgreSQL (twin/test_scenarios.py), and the scale
## scenarios at 20,000 and 100,000 relations (twin/test_scale.py).
e2e: setup
	bash twin/up.sh

## The twin left running (sample database, instance "orders-restored"); prints the commands to try it.
twin-up: setup
	bash twin/up.sh --up

twin-down:
	bash twin/up.sh --down
