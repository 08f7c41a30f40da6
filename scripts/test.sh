#!/usr/bin/env bash
# Runs the test suite. Starts a real S3 server (SeaweedFS) on loopback for the S3 store tests
# and stops it afterwards. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STOA_VENV:-.venv}
. scripts/env.sh
s3dir=$(mktemp -d)
cleanup() { [ -n "${weed_pid:-}" ] && kill "$weed_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$s3dir"; }
trap cleanup EXIT
if [ -x "$VENV/bin/weed" ] && [ -z "${STOA_TEST_S3_ENDPOINT:-}" ]; then
  export AWS_ACCESS_KEY_ID=stoa-test AWS_SECRET_ACCESS_KEY=stoa-test-secret AWS_DEFAULT_REGION=us-east-1
  port=$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  # weed mini also opens fixed master/volume/filer ports; keep them off the common defaults.
  "$VENV/bin/weed" mini -dir="$s3dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -admin.ui=false \
      -s3.port="$port" -s3.port.iceberg=0 -s3.port.lance=0 >"$s3dir/weed.log" 2>&1 &
  weed_pid=$!
  for _ in $(seq 1 100); do
    if "$VENV/bin/python" -c "import socket,sys; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null; then break; fi
    sleep 0.2
  done
  export STOA_TEST_S3_ENDPOINT="http://127.0.0.1:$port"
  echo "[test] S3 server (SeaweedFS) at $STOA_TEST_S3_ENDPOINT"
fi
t0=$(date +%s)
"$VENV/bin/python" -m pytest "$@"
echo "[test] suite took $(( $(date +%s) - t0 )) s"
