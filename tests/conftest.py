"""Shared fixtures: run the real command line in a subprocess, in a scratch folder.

``python -m pytest`` runs the fast suite; ``python -m pytest --slow`` adds the tests marked ``slow``
(several processes, launchers, signal simulations, whole suites in fresh environments).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

import template

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TESTS = REPO / "tests"
PACKAGE = template.__name__
# Left in the project by tools, not by tests: caches, environments, installs (matched per path part).
UNWATCHED = (".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow: several processes (DDP, torchrun), SLURM and signal simulations, "
        "whole suites in fresh virtual environments",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: minutes of work or several processes; deselected unless --slow")
    config.addinivalue_line(
        "markers", "gpu(n=1): needs n CUDA GPUs; skipped, with the count named, where fewer are visible"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.gpu(n)``: skip where fewer than n CUDA GPUs are visible (``python -m pytest -m gpu`` runs them).

    The count is read only for such tests: a CPU-only test session never asks CUDA anything.
    """
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    needed = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    import torch

    visible = torch.cuda.device_count()
    if visible < needed:
        pytest.skip(f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, {visible} visible")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow") or config.option.markexpr:  # `-m slow` or `-m "not slow"` choose for themselves
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_report_header(config: pytest.Config) -> str:
    return "slow tests: " + ("included" if config.getoption("--slow") else "deselected; add --slow to run them")


def project_files(root: Path = REPO) -> set[str]:
    """Every path under ``root``, ignored files included, except tool caches and environments."""
    found = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in UNWATCHED and not d.endswith(".egg-info")]
        rel = Path(folder).relative_to(root)
        found.update(str(rel / name) for name in [*dirs, *files])
    return found


@pytest.fixture(scope="session", autouse=True)
def _nothing_written_into_the_project():  # noqa: ANN202
    """Tests write under tmp_path only: a file left in the project (e.g. a Trainer's ``checkpoints/`` without
    ``default_root_dir``) would be hidden by .gitignore and shipped by no one, so it fails the session."""
    before = project_files()
    yield
    new = sorted(project_files() - before)
    assert not new, f"the tests wrote into the project {REPO}: {', '.join(new[:10])}" + (
        f" and {len(new) - 10} more" if len(new) > 10 else ""
    )


def finish(proc: subprocess.Popen, timeout: float, what: str = "the run", log: Path | None = None) -> int:
    """``proc``'s exit code; if it has not ended within ``timeout`` s, its whole process group is killed and the test
    fails (children started with ``start_new_session=True``), showing the end of its ``log``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_hung(proc.pid)
        proc.kill()  # one started without a session of its own
        proc.wait(timeout=10)
        pytest.fail(
            f"{what} did not end within {timeout} s" + (f"; its log ends:\n{log.read_text()[-8000:]}" if log else "")
        )


def end_hung(sid: int) -> None:
    """End the session of a run that outlived its test: SIGABRT to each process, newest first and one at a time, on
    which one with faulthandler on (``PYTHONFAULTHANDLER=1``, as the resume matrix sets) prints where its threads
    were into the run's log; then SIGKILL to whatever is left."""
    for pid in sorted(session_processes(sid), reverse=True):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)


def session_processes(sid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in session ``sid``: every process the job started stays in it."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder that ``make`` fills once per test session, shared by pytest-xdist's workers (the way its docs show):
    e.g. an uninterrupted run that many tests compare with."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder all workers of this session share
    folder = root / f"once-{name}"
    with FileLock(f"{folder}.lock"):
        if not (folder / ".made").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


class ForkServer:
    """Runs ``python -m <package> *args`` as tests/forkserver.py's forked children: the same command, the same exit
    codes and signals, without importing torch and Lightning again for each run."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "forkserver.py"), PACKAGE], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, start_new_session=True,
        )  # fmt: skip
        self.pending = b""  # what was read of the server's replies past the last whole line

    def _reply(self, timeout: float) -> dict | None:
        """The server's next reply, or None if none came within ``timeout`` s."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)  # unbuffered: select sees everything not yet read
            assert chunk, f"the fork server ended (exit {self.proc.poll()})"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float) -> int:
        """The exit code of the command (negative: the signal that ended it); the test fails after ``timeout`` s."""
        request = {"args": args, "cwd": str(cwd), "env": env, "log": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self._reply(30)
        assert started, "the fork server did not start the run within 30 s"
        ended = self._reply(timeout)
        if ended is None:
            end_hung(started["pid"])
            self._reply(10)
            pytest.fail(f"the run did not end within {timeout} s; its log ends:\n{log.read_text()[-8000:]}")
        return ended["returncode"]

    def close(self) -> None:
        self.proc.stdin.close()
        finish(self.proc, 30, "the fork server")


@pytest.fixture(scope="session")
def fork_server() -> ForkServer:
    """One ForkServer per test session (per pytest-xdist worker)."""
    server = ForkServer(cli_env(PYTHONPATH=pythonpath(REPO / "tests")))
    yield server
    server.close()


def pythonpath(*folders: Path | str) -> str:
    """A child's ``PYTHONPATH``: ``folders`` first, then this session's own, where the package may be importable only
    through ``PYTHONPATH`` (a copy of the repository on a machine that cannot install it)."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join([*map(str, folders), *filter(None, inherited)])


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a child run: quiet, single-threaded per process, nothing from the outer session leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _restore_matmul_precision():  # noqa: ANN202
    """The command line sets torch's global float32 matmul precision on (faked) CUDA runs: undo it after each test."""
    import torch

    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(autouse=True)
def _restore_visible_gpus():  # noqa: ANN202
    """A CPU run built in process hides the GPUs from the process (strategies/devices.py): the tests after see them."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    if before is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = before


@pytest.fixture(autouse=True)
def _restore_rank_zero():  # noqa: ANN202
    """A Trainer built in process under a faked rank (torchrun, SLURM variables) sets the process-wide rank that
    Lightning's rank-zero-only writes check: loggers of every later test here would stop writing."""
    from lightning.pytorch.utilities import rank_zero_only

    before = getattr(rank_zero_only, "rank", 0)
    yield
    leaked = getattr(rank_zero_only, "rank", 0)
    rank_zero_only.rank = before
    assert leaked == before, f"the test left Lightning's process-wide rank at {leaked}"


@pytest.fixture
def run_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """Run ``python -m <package> *args`` in ``tmp_path`` with a hard timeout; returns the completed process."""

    def run(*args: str, timeout: float = 180, cwd: Path | None = None, env: dict[str, str] | None = None):
        return subprocess.run(
            [sys.executable, "-m", PACKAGE, *map(str, args)],
            cwd=cwd or tmp_path,
            env=env or cli_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    return run


@pytest.fixture
def run_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Run the command line inside this process, in ``tmp_path``: no interpreter start-up, for runs that stop early."""
    from template.engine.commands import main

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [PACKAGE])
        code = 0
        try:
            main(list(map(str, args)))
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run
