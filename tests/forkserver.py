"""Start ``python -m <package> ...`` commands by forking one process that has imported the package already.

The matrix of tests/resume/test_exact_resume.py starts the command line about 300 times; importing torch and
Lightning is most of each start. This server imports them once and forks a child per command. A child leaves the
server's state behind (session, folder, environment, streams, signal handlers) and runs the package as ``python -m``
does, then ends as an interpreter does (atexit handlers, its own exit code or signal).

Protocol, one JSON object per line: a request ``{"args", "cwd", "env", "log"}`` on stdin is answered on stdout with
``{"pid": ...}`` when the child started, then ``{"returncode": ...}`` (negative: the signal that ended it) when it
ended. End of stdin ends the server.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys


def _become(package: str, request: dict) -> None:
    """Turn this forked child into a fresh ``python -m <package> *args`` run."""
    os.setsid()  # its own process group: a test's timeout kills the run and its children together
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    if request["env"].get("PYTHONFAULTHANDLER"):  # read by an interpreter only as it starts
        faulthandler.enable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    sys.argv = [sys.argv[0], *request["args"]]  # runpy puts the module's path first, as `python -m` does


def main() -> None:
    package = sys.argv[1]
    __import__(f"{package}.engine.commands.cli")  # what each run would import first: torch, Lightning, jsonargparse
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become(package, request)
            runpy.run_module(package, run_name="__main__", alter_sys=True)
            return  # the interpreter exits: 0, or the SystemExit the command line raised
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
