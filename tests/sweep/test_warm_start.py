"""A sweep's trials start warm, forked from a server that imported torch, Lightning and the engine once, and each is
what a fresh ``python -m <package> fit`` is: its command line, output, exit code and signals, its exit handlers run,
and nothing left behind by the trial before it (environment, warnings, logging, signal handlers, open files, random
generators). A driver killed by SIGKILL stops its trial with a checkpoint; a trial killed by a signal fails alone.
Where there is no fork server, each trial starts a fresh interpreter, and the sweep says so in its first lines."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, finish, session_processes
from tests.sweep.test_sweep import PACED, TINY, _start, _states, _study

optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")

WAIT = 600
FORK_SERVER = "multiprocessing.forkserver"


def _probed(tmp_path: Path, n_trials: int = 2, kill: str | None = None) -> list:
    """A sweep of ``n_trials`` whose trials run tests/state_probe.py (the trial ``kill`` kills itself by SIGKILL)."""
    (tmp_path / "s.yaml").write_text(
        f"sweep:\n  name: s\n  n_trials: {n_trials}\n  pruner: none\n  space:\n"
        "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01, 0.003, 0.001]}\n"
        "trainer:\n  callbacks:\n  - class_path: state_probe.StateProbe\n"
        f"    init_args: {{record_dir: {tmp_path / 'probes'}, kill_run: {kill or 'null'}}}"
    )
    # Unseeded, as a fresh interpreter's generators are: each trial draws its own. A data loader worker: a process the
    # trial starts of its own.
    own = ["--seed_everything=false", "--data.num_workers=1"]
    return ["sweep", "--config", CONFIGS / "default.yaml", "--config", tmp_path / "s.yaml", *TINY, *own]


def _seen(tmp_path: Path, run: str) -> dict:
    return json.loads((tmp_path / "probes" / f"{run}.json").read_text())


def _as_fresh_ones(tmp_path: Path, seen: list[dict]) -> None:
    """Each trial ran the command a fresh interpreter would, into its own log; none saw what the one before left."""
    folder = tmp_path / "lightning_logs" / "s"
    for k, trial in enumerate(seen):
        config = f"lightning_logs/s/trial-{k:04d}.yaml"
        assert trial["orig_argv"] == [sys.executable, "-m", PACKAGE, "fit", "--config", config]
        assert trial["argv"] == trial["orig_argv"][3:] and trial["cwd"] == str(tmp_path)
        assert trial["stdout"] == [str(folder / f"trial-{k:04d}.log")] * 2
        (start,) = json.loads((folder / f"trial-{k:04d}" / "provenance.json").read_text())["starts"]
        assert start["command"] == shlex.join(trial["orig_argv"]) and start["pid"] == trial["pid"]
        assert (tmp_path / "probes" / f"trial-{k:04d}.exited").is_file(), "the exit handlers did not run"
    first, second = seen
    assert second["left"] is None, "an environment variable set by the trial before"
    for key in ("warnings", "handlers", "sigusr2"):
        assert second[key] == first[key], key
    assert [f.replace("trial-0001", "trial-0000") for f in second["files"]] == first["files"], "a file left open"
    for key in ("random", "numpy", "torch_seed"):
        assert second[key] != first[key], f"the {key} generator continues the one before"


@pytest.mark.slow  # two trials and a fork server
@pytest.mark.timeout(WAIT)
def test_each_trial_starts_warm_as_a_fresh_interpreter_and_sees_nothing_of_the_one_before(tmp_path: Path) -> None:
    driver = _start(_probed(tmp_path), tmp_path)
    assert finish(driver, WAIT, "the sweep") == 0, driver.stdout.read()[-3000:]
    assert "fresh interpreter" not in driver.stdout.read()
    seen = [_seen(tmp_path, f"trial-000{k}") for k in range(2)]
    for trial in seen:  # forked from the sweep's one fork server, a child of the driver
        assert FORK_SERVER in trial["parent"] and trial["ppid"] == seen[0]["ppid"] != driver.pid
    _as_fresh_ones(tmp_path, seen)


@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_without_a_fork_server_each_trial_starts_a_fresh_interpreter_and_the_sweep_says_so(
    run_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver runs here, on a platform without a fork server; its trials are started by it, each a new interpreter.
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.syspath_prepend(str(REPO / "tests"))  # the driver here reads the trials' callback too
    for key, value in cli_env(
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    ).items():
        monkeypatch.setenv(key, value)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        done = run_main(*_probed(tmp_path))
    finally:
        for signum, handler in handlers.items():  # the driver's own handlers end with it
            signal.signal(signum, handler)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Sweep s: each trial starts a fresh interpreter (no fork server on darwin)" in done.stdout.splitlines()[:3]
    seen = [_seen(tmp_path, f"trial-000{k}") for k in range(2)]
    assert [trial["ppid"] for trial in seen] == [os.getpid()] * 2  # started by the driver, not forked from a server
    _as_fresh_ones(tmp_path, seen)


@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_a_trial_killed_by_a_signal_fails_alone_and_the_next_is_forked_from_the_same_server(tmp_path: Path) -> None:
    driver = _start(_probed(tmp_path, n_trials=1, kill="trial-0000"), tmp_path)
    assert finish(driver, WAIT, "the sweep") == 0, driver.stdout.read()[-3000:]
    trials = _study(tmp_path / "lightning_logs" / "s").trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[0].user_attrs["reason"] == "exit code -9 (SIGKILL)"
    killed, next_one = _seen(tmp_path, "trial-0000"), _seen(tmp_path, "trial-0001")
    assert FORK_SERVER in next_one["parent"] and next_one["ppid"] == killed["ppid"]


@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_a_driver_killed_by_sigkill_stops_its_trial_with_a_checkpoint_and_leaves_no_process(tmp_path: Path) -> None:
    (tmp_path / "paced.yaml").write_text(PACED)
    args = [*_probed(tmp_path, n_trials=1), "--config", tmp_path / "paced.yaml"]
    run = tmp_path / "lightning_logs" / "s" / "trial-0000"
    driver = _start(args, tmp_path)
    deadline = time.monotonic() + WAIT
    while not (run / "checkpoints" / "last.ckpt").is_file():  # in its second epoch
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.1)
    os.kill(driver.pid, signal.SIGKILL)  # the driver only: no clean-up of its own runs
    driver.wait(timeout=60)
    while session_processes(driver.pid):  # the trial, the fork server and multiprocessing's resource tracker
        assert time.monotonic() < deadline, [
            Path(f"/proc/{p}/cmdline").read_text() for p in session_processes(driver.pid)
        ]
        time.sleep(0.2)
    assert (run / "checkpoints" / "interrupted.ckpt").is_file()
    assert "Stopping on SIGTERM" in (tmp_path / "lightning_logs" / "s" / "trial-0000.log").read_text()
    assert _states(_study(tmp_path / "lightning_logs" / "s")) == {"RUNNING": 1}  # the same command continues it
