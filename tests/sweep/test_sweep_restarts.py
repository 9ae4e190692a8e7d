"""A sweep stopped at every moment of a trial's life (SIGKILL, SIGTERM, Ctrl-C), then the same command: exactly
``n_trials`` finished trials, no two with the same values, the interrupted trial taken up again.

The moments are found from outside, without hooks in the driver: the files it writes (a trial's config is written
just before its process starts; a checkpoint; the results table), and a driver frozen with SIGSTOP, so that a trial
that ends cannot be recorded before the test kills the driver (the trial, forked from the driver's fork server, ends
meanwhile)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import finish
from tests.resume.test_exact_resume import _differences, _training_state
from tests.sweep.test_sweep import PACED, _start, _states, _steps, _study, _sweep_args, _val_acc

optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")

LIMIT = 240  # seconds for one sweep command of three tiny trials on a loaded 2-core machine


def _wait(condition: Callable[[], bool], what: str, driver=None, timeout: float = LIMIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver is not None and driver.poll() is not None:
            pytest.fail(f"the sweep ended before {what}: {driver.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            if driver is not None:
                os.killpg(driver.pid, signal.SIGKILL)
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _trial_pid(driver) -> int | None:
    """The driver's trial process (the driver runs one trial at a time here): a child of the driver's fork server."""
    trials = [trial for child in _children(driver.pid) for trial in _children(child)]
    return trials[0] if trials else None


def _ended(pid: int) -> bool:
    """Whether ``pid`` has exited: collected by the fork server, or a zombie its stopped parent has not collected."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _again(args: list, tmp_path: Path) -> str:
    """The same command again, to its end; its output."""
    again = _start(args, tmp_path)
    code = finish(again, LIMIT, "the same command")
    out = again.stdout.read()
    assert code == 0, out[-3000:]
    return out


def _as_if_never_stopped(config: Path, run: Path, tmp_path: Path) -> None:
    """``run`` (a trial or fold that was stopped and continued) ended exactly where ``fit --config config`` run
    without a stop ends: weights, optimizer and RNG states bit for bit."""
    name = f"alone-{config.stem}"
    alone = _start(["fit", "--config", config, f"--run.name={name}"], tmp_path)
    assert finish(alone, LIMIT, f"{config.name} without a stop") == 0, alone.stdout.read()[-3000:]
    ends = [
        torch.load(r / "checkpoints" / "last.ckpt", weights_only=True)
        for r in (run, tmp_path / "lightning_logs" / name)
    ]
    assert _differences(*map(_training_state, ends)) == [], config.name


def _exact(folder: Path, n: int, failed: int = 0) -> optuna.Study:
    """Exactly ``n`` complete trials (and ``failed`` failed ones), no two with the same values."""
    study = _study(folder)
    expected = {"COMPLETE": n} | ({"FAIL": failed} if failed else {})
    assert _states(study) == expected, [(t.number, t.state.name, t.params, t.user_attrs) for t in study.trials]
    values = [tuple(t.params.values()) for t in study.trials if t.state.name == "COMPLETE"]
    assert len(set(values)) == n, values
    return study


def _args(tmp_path: Path, n_trials: int = 3, extra: str = "", paced: bool = False) -> list:
    args = _sweep_args(tmp_path, n_trials=n_trials, extra="  pruner: none\n" + extra)
    if paced:
        (tmp_path / "paced.yaml").write_text(PACED)
        args += ["--config", tmp_path / "paced.yaml"]
    return args


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_ctrl_c_before_a_trial_starts(tmp_path: Path) -> None:
    args, folder = _args(tmp_path), tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    # Trial 1's config is written just before its process starts; Python takes seconds to import Lightning.
    _wait(lambda: (folder / "trial-0001.yaml").is_file(), "trial 1", driver)
    os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    assert finish(driver, LIMIT, "the stopped sweep") == 128 + signal.SIGINT, driver.stdout.read()[-3000:]
    assert not (folder / "trial-0001" / "checkpoints").exists()  # it had not begun
    _again(args, tmp_path)
    _exact(folder, 3)
    assert (folder / "trial-0001.log").read_text().count("starting from the beginning") == 1


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_a_worker_killed_right_after_optuna_created_its_trial(tmp_path: Path) -> None:
    # What a driver SIGKILLed between Optuna's ask and its first write leaves: a running trial and nothing else.
    folder = tmp_path / "lightning_logs" / "s"
    folder.mkdir(parents=True)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.journal")))
    optuna.create_study(storage=storage, study_name="s", direction="maximize").ask()
    # Nobody's trial: after 4 heartbeats without one, it is failed and another takes its place.
    _again(_args(tmp_path, n_trials=2, extra="  heartbeat: 1\n"), tmp_path)
    study = _exact(folder, 2, failed=1)
    assert study.trials[0].user_attrs["reason"] == "worker that asked for it stopped"


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_sigterm_while_a_trial_runs(tmp_path: Path) -> None:
    args, folder = _args(tmp_path, n_trials=2, paced=True), tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    _wait(lambda: (folder / "trial-0001" / "checkpoints" / "last.ckpt").is_file(), "trial 1's checkpoint", driver)
    driver.send_signal(signal.SIGTERM)  # to the driver only: it stops its trial with a checkpoint
    assert finish(driver, LIMIT, "the stopped sweep") == 128 + signal.SIGTERM, driver.stdout.read()[-3000:]
    out = _again(args, tmp_path)
    assert "trial 1 continues" in out
    _exact(folder, 2)
    resumed = re.search(r"resuming from .*\(epoch \d+, step (\d+)\)", (folder / "trial-0001.log").read_text())
    assert resumed and int(resumed.group(1)) >= 4  # from its checkpoint, not from step 0


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_after_a_trial_ended_before_it_was_recorded(signum: int, tmp_path: Path) -> None:
    args, folder = _args(tmp_path), tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    _wait(lambda: (folder / "trial-0001.yaml").is_file() and _trial_pid(driver) is not None, "trial 1", driver)
    os.kill(driver.pid, signal.SIGSTOP)  # the driver cannot record the trial's end
    pid = _trial_pid(driver)
    _wait(lambda: _ended(pid), "end of trial 1")
    assert _study(folder).trials[1].state.name == "RUNNING"
    if signum == signal.SIGKILL:
        os.killpg(driver.pid, signal.SIGKILL)
    else:
        driver.send_signal(signal.SIGTERM)
        driver.send_signal(signal.SIGCONT)
    finish(driver, LIMIT, "the stopped sweep")
    out = _again(args, tmp_path)
    assert "trial 1 continues" in out
    study = _exact(folder, 3)
    # Started again, it ended at once from its last checkpoint; its score is its best validation value.
    log = (folder / "trial-0001.log").read_text()
    assert log.count("starting from the beginning") == 1 and "resuming from" in log
    assert study.trials[1].value == max(_val_acc(folder / "trial-0001"))
    assert len(_steps(folder / "trial-0001")) == 12


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_sigkill_while_the_results_are_written(tmp_path: Path) -> None:
    args, folder = _args(tmp_path, n_trials=2), tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    _wait(lambda: (folder / "trials.csv").is_file(), "results table", driver)  # the plots come after it
    os.killpg(driver.pid, signal.SIGKILL)
    finish(driver, LIMIT, "the killed sweep")
    out = _again(args, tmp_path)
    assert " starts " not in out and " continues " not in out, out[-3000:]
    _exact(folder, 2)
    for name in ("trials.csv", "best.yaml", "history.png"):
        assert (folder / name).stat().st_size > 0, name


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_sigkill_while_the_journal_is_written(tmp_path: Path) -> None:
    # The journal's lock exists only while a worker appends to it (heartbeats, reports): milliseconds at a time.
    args, folder = _args(tmp_path, n_trials=2, extra="  heartbeat: 1\n", paced=True), tmp_path / "lightning_logs" / "s"
    lock = folder / "study.journal.lock"
    driver = _start(args, tmp_path)
    _wait(lambda: (folder / "trial-0000.yaml").is_file(), "trial 0", driver)
    deadline = time.monotonic() + LIMIT
    while True:
        if os.path.lexists(lock):
            os.killpg(driver.pid, signal.SIGSTOP)
            if os.path.lexists(lock):  # frozen while writing
                break
            os.killpg(driver.pid, signal.SIGCONT)
        if driver.poll() is not None or time.monotonic() > deadline:
            os.killpg(driver.pid, signal.SIGKILL)
            pytest.fail(f"no write to the journal caught within {LIMIT} s")
    os.killpg(driver.pid, signal.SIGKILL)
    finish(driver, LIMIT, "the killed sweep")
    assert os.path.lexists(lock)  # what a worker killed while writing leaves
    out = _again(args, tmp_path)
    assert "Forcibly releasing the lock file" in out, out[-3000:]  # Optuna's words, after its 30 s grace period
    _exact(folder, 2)
    for k in range(2):
        _as_if_never_stopped(folder / f"trial-{k:04d}.yaml", folder / f"trial-{k:04d}", tmp_path)
