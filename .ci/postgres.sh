# shellcheck shell=bash
# Sourced by .ci/run: a throwaway PostgreSQL server on 127.0.0.1 for the tuning tests.
#
# Installs Debian's `postgresql` with apt-get if no server binaries are found, initialises a
# data dir under a fresh temp dir, starts the server on a free loopback port (no Unix socket
# outside that dir), creates a test user and database with a known password, and exports
#   FEDHARNESS_TEST_PG_URL=postgresql://fedharness:fedharness@127.0.0.1:PORT/fedharness_test
# The server is stopped and its dir removed on exit (trap). Each call makes its own server, so
# running .ci/run twice, or two at once, does not collide. If FEDHARNESS_TEST_PG_URL is already
# set it is used as is. If the server cannot be had the PostgreSQL tests skip (with the reason),
# unless FEDHARNESS_REQUIRE_PG=1, which makes that an error.

fedharness_pg_bin() {
    local dir
    dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$dir" ] && [ -x "$dir/pg_ctl" ]; then echo "$dir"; fi
}

fedharness_pg_install() {
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        if sudo -n true 2>/dev/null; then sudo="sudo -n"; else
            echo "postgres.sh: no PostgreSQL server and no root to install it" >&2; return 1
        fi
    fi
    echo "postgres.sh: installing postgresql from Debian" >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >&2
}

# Run a server binary as an unprivileged user: PostgreSQL refuses to run as root.
fedharness_pg_as() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

fedharness_pg_stop() {
    if [ -n "${FEDHARNESS_PG_DIR:-}" ] && [ -d "$FEDHARNESS_PG_DIR" ]; then
        fedharness_pg_as "$FEDHARNESS_PG_BIN/pg_ctl" -D "$FEDHARNESS_PG_DIR/data" -m immediate stop \
            >/dev/null 2>&1 || true
        rm -rf "$FEDHARNESS_PG_DIR"
    fi
}

fedharness_pg_start() {
    if [ -n "${FEDHARNESS_TEST_PG_URL:-}" ]; then
        echo "postgres.sh: using the given FEDHARNESS_TEST_PG_URL" >&2; return 0
    fi
    FEDHARNESS_PG_BIN=$(fedharness_pg_bin)
    if [ -z "$FEDHARNESS_PG_BIN" ]; then
        fedharness_pg_install || return 1
        FEDHARNESS_PG_BIN=$(fedharness_pg_bin)
        [ -n "$FEDHARNESS_PG_BIN" ] || { echo "postgres.sh: postgresql installed but no pg_ctl" >&2; return 1; }
    fi
    if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
        useradd --system --home-dir /nonexistent --shell /usr/sbin/nologin postgres || return 1
    fi
    FEDHARNESS_PG_DIR=$(mktemp -d /tmp/fedharness-pg.XXXXXX) || return 1
    trap fedharness_pg_stop EXIT
    local port pw="fedharness"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    printf '%s\n' "$pw" >"$FEDHARNESS_PG_DIR/pwfile"
    if [ "$(id -u)" = 0 ]; then chown -R postgres "$FEDHARNESS_PG_DIR"; fi
    fedharness_pg_as "$FEDHARNESS_PG_BIN/initdb" -D "$FEDHARNESS_PG_DIR/data" -U fedharness \
        --pwfile="$FEDHARNESS_PG_DIR/pwfile" --auth=scram-sha-256 -E UTF8 >"$FEDHARNESS_PG_DIR/initdb.log" 2>&1 ||
        { echo "postgres.sh: initdb failed:" >&2; cat "$FEDHARNESS_PG_DIR/initdb.log" >&2; return 1; }
    fedharness_pg_as "$FEDHARNESS_PG_BIN/pg_ctl" -D "$FEDHARNESS_PG_DIR/data" -l "$FEDHARNESS_PG_DIR/server.log" -w \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $FEDHARNESS_PG_DIR -c max_connections=100" start >/dev/null ||
        { echo "postgres.sh: server did not start:" >&2; cat "$FEDHARNESS_PG_DIR/server.log" >&2; return 1; }
    PGPASSWORD="$pw" "$FEDHARNESS_PG_BIN/createdb" -h 127.0.0.1 -p "$port" -U fedharness fedharness_test ||
        { echo "postgres.sh: createdb failed" >&2; return 1; }
    export FEDHARNESS_TEST_PG_URL="postgresql://fedharness:$pw@127.0.0.1:$port/fedharness_test"
    echo "postgres.sh: PostgreSQL on 127.0.0.1:$port (data in $FEDHARNESS_PG_DIR)" >&2
}

if ! fedharness_pg_start; then
    if [ "${FEDHARNESS_REQUIRE_PG:-0}" = 1 ]; then
        echo "postgres.sh: PostgreSQL is required (FEDHARNESS_REQUIRE_PG=1)" >&2; exit 1
    fi
    echo "postgres.sh: WARNING: no PostgreSQL server; the PostgreSQL tuning tests will be skipped" >&2
fi
