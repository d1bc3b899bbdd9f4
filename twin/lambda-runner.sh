#!/usr/bin/env bash
# twin/lambda-runner.sh BINARY [ARGS...]: how the twin's `cargo lambda watch` starts a function process
# (cargo's target runner, set for the emulator only). As Lambda gives each function the session
# credentials of its own role in its environment, this gives the function's process the twin's
# credentials for that role (an access key id moto_ext.py maps to the role's policies: twin/iam.py), and
# the function's deployed name (AWS_LAMBDA_FUNCTION_NAME, from PGHYDRATE_TWIN_NAME_<BINARY>).
set -euo pipefail
fn=$(basename "$1")
upper=${fn^^}
export AWS_ACCESS_KEY_ID="ASIATWIN$upper" AWS_SECRET_ACCESS_KEY="twin-$fn" AWS_SESSION_TOKEN="twin-session-$fn"
name_var="PGHYDRATE_TWIN_NAME_$upper"
if [ -n "${!name_var:-}" ]; then export AWS_LAMBDA_FUNCTION_NAME="${!name_var}"; fi
exec "$@"
