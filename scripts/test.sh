#!/usr/bin/env bash
# Runs the test suite. Starts a real S3 server (SeaweedFS) on loopback for the S3 store tests
# and stops it afterwards. Extra arguments go to pytest (STOA_TEST_PROCS=1: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STOA_VENV:-.venv}
. scripts/env.sh
s3dir=$(mktemp -d)
cleanup() { [ -n "${weed_pid:-}" ] && kill "$weed_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$s3dir"; }
trap cleanup EXIT
if [ -x "$VENV/bin/weed" ] && [ -z "${STOA_TEST_S3_ENDPOINT:-}" ]; then
  # stoa.testing.seaweed picks free loopback ports (so concurrent runs coexist), starts weed mini,
  # prints the endpoint and credentials once S3 answers, and stops weed when it gets SIGTERM.
  "$VENV/bin/python" -m stoa.testing.seaweed --dir "$s3dir/data" >"$s3dir/env" 2>"$s3dir/weed.err" &
  weed_pid=$!
  for _ in $(seq 1 150); do
    { [ -s "$s3dir/env" ] || ! kill -0 "$weed_pid" 2>/dev/null; } && break
    sleep 0.2
  done
  if [ ! -s "$s3dir/env" ]; then echo "[test] SeaweedFS failed to start:"; tail -20 "$s3dir/weed.err"; exit 1; fi
  read -r endpoint access secret _ <"$s3dir/env"
  export "$endpoint" "$access" "$secret" AWS_DEFAULT_REGION=us-east-1
  echo "[test] S3 server (SeaweedFS) at $STOA_TEST_S3_ENDPOINT"
fi
t0=$(date +%s)
# Test files run in STOA_TEST_PROCS processes (pytest-xdist; each file stays in one process, in order).
"$VENV/bin/python" -m pytest --durations=15 -n "${STOA_TEST_PROCS:-2}" --dist loadfile "$@"
echo "[test] suite took $(( $(date +%s) - t0 )) s"
