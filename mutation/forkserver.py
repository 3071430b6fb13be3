"""cosmic-ray's test command: pytest in a child forked from a server that has already imported torch and the
other third-party packages, so each mutant pays for fedharness's imports and its tests only (torch's import
alone is 3 s of CPU, 10-20 s on this loaded 2-core machine; a mutant's tests take 1-5 s).

The child imports fedharness from the files on disk, where cosmic-ray has just applied the mutant: the server
imports no fedharness module. A client that goes away (cosmic-ray's timeout kills it) takes its child's
process group with it.

    python mutation/forkserver.py serve SOCKET                   # mutation/mutants.py starts one per module
    python mutation/forkserver.py run SOCKET PYTEST_ARGS...      # exit status: pytest's
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

# Imported once by the server. fedharness is not: the child must read the mutated file.
PRELOAD = ["numpy", "torch", "pytest", "pytest_timeout", "pandas", "pyarrow", "omegaconf", "hydra", "yaml",
           "optuna", "dp_accounting", "dp_accounting.rdp", "dp_accounting.pld", "sklearn"]
_child = 0  # the pid of the child running now, 0 between runs


def serve(path: str) -> None:
    # no .pyc of a mutant: two mutants of one size applied within a second would share its mtime stamp
    sys.dont_write_bytecode = True
    # pytest's plugin autoload imported and assert-rewrote every installed plugin for each mutant: 10 of a
    # trivial test's 18 s here; the tests need none but pytest-timeout (its ini key), which the client names
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for name in PRELOAD:
        __import__(name)
    import pytest
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _stop)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        with conn:
            args = json.loads(conn.makefile().readline())
            global _child
            pid = _child = os.fork()
            if pid == 0:  # the child: pytest's output goes to the client
                server.close()
                os.setpgrp()
                os.dup2(conn.fileno(), 1)
                os.dup2(conn.fileno(), 2)
                os._exit(int(pytest.main(args)))
            status = _wait(pid, conn)
            _child = 0
            if status != -1:  # -1: the client is gone, nobody to tell
                conn.sendall(f"\nexit {status}\n".encode())


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


def run(path: str, args: list[str]) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.sendall((json.dumps(args) + "\n").encode())
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    output, _, last = received.decode(errors="replace").rstrip().rpartition("\n")
    sys.stdout.write(output + "\n")
    return int(last.split()[1]) if last.startswith("exit ") else 3


if __name__ == "__main__":
    command, socket_path, *pytest_args = sys.argv[1:]
    if command == "serve":
        serve(socket_path)
    else:
        sys.exit(run(socket_path, pytest_args))
