"""cosmic-ray's test command: pytest in a child forked from a server that has already imported torch and the
other third-party packages, so each mutant pays for fedharness's imports and its tests only (torch's import
alone is 3 s of CPU, 10-20 s on this loaded 2-core machine; a mutant's tests take 1-5 s).

The child imports fedharness from the files on disk, where cosmic-ray has just applied the mutant: the server
imports no fedharness module. A client that goes away (cosmic-ray's timeout kills it) takes its child's
process group with it.

Each mutant runs in two stages. The server's first run (mutants.py's baseline, unmutated) records which tests call
each function of the mutated files. For a mutant, the server finds the changed line, the function around it, and
first runs only the tests that called that function, the fastest first: most mutants fail there, in a fraction of the selection's
time. If those pass, the rest of the selection runs (`--deselect` of the first stage's tests), so a mutant is
reported alive only when every test of the selection passed, as with one stage. A mutant outside any function
(run at import: a class body, a default, a constant) runs the whole selection at once.

    python mutation/forkserver.py serve SOCKET CONFIG.json   # mutation/mutants.py starts one per module
    python mutation/forkserver.py run SOCKET                 # exit status: pytest's (nonzero if any stage failed)

CONFIG: {"args": pytest's arguments (options, then the selection), "options": how many of them are options, "paths": the files mutated, relative to the
root, "calls": where the first run writes the tests of each function, "log": one line a run appended}.
"""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Imported once by the server. fedharness is not: the child must read the mutated file.
PRELOAD = ["numpy", "torch", "pytest", "pytest_timeout", "pandas", "pyarrow", "omegaconf", "hydra", "yaml",
           "optuna", "dp_accounting", "dp_accounting.rdp", "dp_accounting.pld", "sklearn"]
# pytest's statuses for a usage error and for no test collected: the first stage ran nothing, which is no kill
USAGE_ERROR, NO_TESTS = 4, 5
NOT_RUN = (USAGE_ERROR, NO_TESTS)
_child = 0  # the pid of the child running now, 0 between runs


class _Calls:
    """pytest plugin for the first, unmutated run: which test calls which function of the mutated files (a nested
    function or a lambda counts as the function it is defined in)."""

    def __init__(self, files: set[str]):
        self.files = files
        self.tests: dict[str, set[str]] = {}  # "path:qualname" -> node ids
        self.seconds: dict[str, float] = {}  # node id -> its setup, call and teardown time
        self._item = ""

    def _profile(self, frame, event, arg) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename in self.files:
            key = f"{code.co_filename}:{code.co_qualname.split('.<locals>')[0]}"
            self.tests.setdefault(key, set()).add(self._item)

    def pytest_runtest_logstart(self, nodeid, location) -> None:  # from before setup to after teardown: the
        self._item = nodeid                                           # calls of fixtures count too
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def functions_by_line(source: str) -> dict[int, str]:
    """Each line of a function's body -> the qualified name of the outermost function around it (methods as
    Class.method). Lines outside every body (signatures, decorators, class bodies, module code) are absent: they
    run at import, where every test sees them."""
    out: dict[int, str] = {}

    def visit(nodes, prefix: str) -> None:
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for line in range(node.body[0].lineno, node.end_lineno + 1):
                    out[line] = f"{prefix}{node.name}"

    visit(ast.parse(source).body, "")
    return out


def serve(path: str, config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    files = {str(ROOT / p): (ROOT / p).read_text() for p in config["paths"]}  # read before any mutant
    bodies = {f: functions_by_line(text) for f, text in files.items()}
    # no .pyc of a mutant: two mutants of one size applied within a second would share its mtime stamp
    sys.dont_write_bytecode = True
    # pytest's plugin autoload imported and assert-rewrote every installed plugin for each mutant: 10 of a
    # trivial test's 18 s here; the tests need none but pytest-timeout (its ini key), which the client names
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for name in PRELOAD:
        __import__(name)
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _stop)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    calls: dict[str, list[str]] | None = None
    while True:
        conn, _ = server.accept()
        with conn:
            conn.makefile().readline()
            started = time.monotonic()
            if calls is None:  # the first run, unmutated: it also records who calls what
                status = _pytest(server, conn, config["args"], _Calls(set(files)), config["calls"])
                calls = json.loads(Path(config["calls"]).read_text()) if status == 0 else {}
                stage, first = "baseline", []
            else:
                first = _first_stage(files, bodies, calls)
                status, stage = _run_mutant(server, conn, config, first)
            with open(config["log"], "a") as log:  # -1: the client was gone (cosmic-ray's timeout)
                log.write(f"{time.monotonic() - started:.2f} {status} {stage} {len(first)}\n")
            if status != -1:
                conn.sendall(f"\nexit {status}\n".encode())


def _run_mutant(server: socket.socket, conn: socket.socket, config: dict, first: list[str]) -> tuple[int, str]:
    """pytest's status for the mutant on disk and the stage that decided it: "first" (the tests that call the
    mutated function failed), "rest" (they passed: the rest of the selection ran) or "all" (no first stage)."""
    if first:
        status = _pytest(server, conn, [*_options(config), *first])
        if status == 0:
            rest = _pytest(server, conn, [*config["args"], *(a for test in first for a in ("--deselect", test))])
            return (0 if rest == NO_TESTS else rest), "rest"  # none left: the first stage ran the whole selection
        if status not in NOT_RUN:
            return status, "first"
    return _pytest(server, conn, config["args"]), "all"


def _options(config: dict) -> list[str]:
    """pytest's options without the selection (file paths, node ids, -k): the first stage names its tests."""
    return config["args"][: config["options"]]


def _first_stage(files: dict[str, str], bodies: dict[str, dict[int, str]], calls: dict[str, list[str]]) -> list[str]:
    """The node ids of the tests that called the function around the mutated line (as recorded: the fastest
    first); [] for a line run at import
    (or no file changed): the whole selection then runs at once."""
    for f, original in files.items():
        now = Path(f).read_text()
        if now == original:
            continue
        old_lines, new_lines = original.splitlines(), now.splitlines()
        line = next((i + 1 for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b),
                    min(len(old_lines), len(new_lines)) + 1)
        function = bodies[f].get(line)
        return calls.get(f"{f}:{function}", []) if function else []
    return []


def _pytest(server: socket.socket, conn: socket.socket, args: list[str], plugin: _Calls | None = None,
            calls_path: str = "") -> int:
    """pytest.main(args) in a forked child whose output goes to the client; its exit status (-1: client gone)."""
    global _child
    pid = _child = os.fork()
    if pid == 0:
        import pytest

        server.close()
        os.setpgrp()
        os.dup2(conn.fileno(), 1)
        os.dup2(conn.fileno(), 2)
        status = int(pytest.main(args, plugins=[plugin] if plugin else []))
        if plugin is not None and status == 0:
            # the fastest first: with -x a mutant stops at its first failing test
            fastest = {k: sorted(v, key=lambda t: (plugin.seconds.get(t, 0.0), t)) for k, v in plugin.tests.items()}
            Path(calls_path).write_text(json.dumps(fastest, indent=0))
        os._exit(status)
    status = _wait(pid, conn)
    _child = 0
    return status


def _stop(signum, frame) -> None:
    """SIGTERM (the driver is done or interrupted): the running child's group goes too."""
    if _child:
        os.killpg(_child, signal.SIGKILL)
    os._exit(0)


def _wait(pid: int, conn: socket.socket) -> int:
    """The child's exit status; -1 if the client hung up first (the child's group is then killed)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if select.select([conn], [], [], 0.2)[0]:  # readable: the client closed its end
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1


def run(path: str) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall(b"run\n")
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    output, _, last = received.decode(errors="replace").rstrip().rpartition("\n")
    sys.stdout.write(output + "\n")
    return int(last.split()[1]) if last.startswith("exit ") else 3


if __name__ == "__main__":
    command, socket_path, *rest = sys.argv[1:]
    if command == "serve":
        serve(socket_path, rest[0])
    else:
        sys.exit(run(socket_path))
