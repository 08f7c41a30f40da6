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
  # weed mini opens an http port and a grpc port (http + 10000, which its admin worker assumes)
  # for each of s3/master/volume/filer/admin; pick all five pairs free so concurrent runs coexist.
  read -r port master volume filer admin < <("$VENV/bin/python" - <<'PY'
import random, socket
held, picked = [], []
while len(picked) < 5:
    p = random.randrange(20000, 55000)
    try:
        pair = [socket.socket(), socket.socket()]
        for s, q in zip(pair, (p, p + 10000)):
            s.bind(("127.0.0.1", q))
    except OSError:
        continue
    held += pair
    picked.append(p)
print(*picked)
PY
)
  "$VENV/bin/weed" mini -dir="$s3dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -admin.ui=false -webdav=false \
      -master.telemetry=false -s3.port="$port" -master.port="$master" -volume.port="$volume" \
      -filer.port="$filer" -admin.port="$admin" -s3.port.iceberg=0 -s3.port.lance=0 \
      -s3.localSocket="$s3dir/s3.sock" -filer.localSocket="$s3dir/filer.sock" >"$s3dir/weed.log" 2>&1 &
  weed_pid=$!
  for _ in $(seq 1 100); do
    if "$VENV/bin/python" -c "import socket,sys; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null; then break; fi
    sleep 0.2
  done
  if ! kill -0 "$weed_pid" 2>/dev/null; then echo "[test] SeaweedFS failed to start:"; tail -20 "$s3dir/weed.log"; exit 1; fi
  export STOA_TEST_S3_ENDPOINT="http://127.0.0.1:$port"
  echo "[test] S3 server (SeaweedFS) at $STOA_TEST_S3_ENDPOINT"
fi
t0=$(date +%s)
"$VENV/bin/python" -m pytest "$@"
echo "[test] suite took $(( $(date +%s) - t0 )) s"
