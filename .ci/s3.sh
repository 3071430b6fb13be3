# shellcheck shell=bash
# Sourced by .ci/run: an S3-compatible server on 127.0.0.1 for the object-store tests (tests/test_object_store.py).
#
# Starts moto's server (`python -m moto.server`, from the `test` extra in .venv: run after `make` has built it) on
# a free loopback port and exports
#   FEDHARNESS_TEST_S3_URL=http://127.0.0.1:PORT
# which the tests use (with dummy credentials, a fresh bucket per test) instead of starting their own. The server
# is stopped on exit (trap, after any exit trap set before). If FEDHARNESS_TEST_S3_URL is already set it is used
# as is. If the server cannot be started the S3 tests start their own or skip, unless FEDHARNESS_REQUIRE_S3=1,
# which makes that an error here and in the tests.

fedharness_s3_stop() {
    if [ -n "${FEDHARNESS_S3_PID:-}" ]; then
        kill "$FEDHARNESS_S3_PID" 2>/dev/null || true
        wait "$FEDHARNESS_S3_PID" 2>/dev/null || true
    fi
    if [ -n "${FEDHARNESS_S3_LOG:-}" ]; then rm -f "$FEDHARNESS_S3_LOG"; fi
}

fedharness_s3_start() {
    if [ -n "${FEDHARNESS_TEST_S3_URL:-}" ]; then
        echo "s3.sh: using the given FEDHARNESS_TEST_S3_URL" >&2; return 0
    fi
    local python=.venv/bin/python port i
    [ -x "$python" ] || { echo "s3.sh: no .venv (run make first)" >&2; return 1; }
    "$python" -c 'import moto.server' 2>/dev/null || { echo "s3.sh: moto[server] is not installed" >&2; return 1; }
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    FEDHARNESS_S3_LOG=$(mktemp /tmp/fedharness-s3.XXXXXX.log) || return 1
    local previous
    previous=$(trap -p EXIT | sed -E "s/^trap -- '(.*)' EXIT$/\1/")
    # shellcheck disable=SC2064  # expand the earlier trap now, so both run
    trap "fedharness_s3_stop; ${previous}" EXIT
    "$python" -m moto.server -H 127.0.0.1 -p "$port" >"$FEDHARNESS_S3_LOG" 2>&1 &
    FEDHARNESS_S3_PID=$!
    for i in $(seq 1 300); do
        if "$python" -c "import socket; socket.create_connection(('127.0.0.1', $port), timeout=1).close()" \
            2>/dev/null; then
            export FEDHARNESS_TEST_S3_URL="http://127.0.0.1:$port"
            echo "s3.sh: moto S3 server on 127.0.0.1:$port (pid $FEDHARNESS_S3_PID)" >&2
            return 0
        fi
        kill -0 "$FEDHARNESS_S3_PID" 2>/dev/null || break
        sleep 0.2
    done
    echo "s3.sh: the server did not start (after $i tries):" >&2; tail -n 20 "$FEDHARNESS_S3_LOG" >&2
    return 1
}

if ! fedharness_s3_start; then
    if [ "${FEDHARNESS_REQUIRE_S3:-0}" = 1 ]; then
        echo "s3.sh: an S3-compatible server is required (FEDHARNESS_REQUIRE_S3=1)" >&2; exit 1
    fi
    echo "s3.sh: WARNING: no S3 server started here; the object-store tests start their own or skip" >&2
fi
