"""Sweeps: an Optuna study whose trials are fit processes; it prunes, survives a SIGKILL, shares a study between
workers (journal file and a real PostgreSQL server) and reports bad input in one line."""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env

optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")

WAIT = 600  # seconds for a whole sweep of tiny trials on a loaded machine
TINY = [
    "--trainer.accelerator=cpu", "--trainer.deterministic=true", "--trainer.max_epochs=3",
    "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
]  # fmt: skip


LR = "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01, 0.003, 1.0e-6]}\n"


def _sweep_args(
    tmp_path: Path, n_trials: int = 3, extra: str = "", config: str = "default.yaml", space: str = LR
) -> list:
    """A tiny sweep of ``config`` with its sweep section (name ``s``) written in ``tmp_path``."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"sweep:\n  name: s\n  n_trials: {n_trials}\n  space:\n{space}{extra}")
    return ["sweep", "--config", CONFIGS / config, "--config", sweep, *TINY]


def _env() -> dict[str, str]:
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def _start(args: list, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *map(str, args)],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the test kills the driver and its trials together
    )


def _study(folder: Path, storage: str | None = None) -> optuna.Study:
    if storage is None:
        backend = optuna.storages.journal.JournalFileBackend(str(folder / "study.journal"))
        storage = optuna.storages.JournalStorage(backend)
    return optuna.load_study(study_name=folder.name, storage=storage)


def _states(study: optuna.Study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        if not t.user_attrs.get("surplus"):
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return counts


def _val_acc(run: Path) -> list[float]:
    with (run / "metrics.csv").open() as f:
        return [float(row["val_acc"]) for row in csv.DictReader(f) if row.get("val_acc")]


def _steps(run: Path) -> list[int]:
    with (run / "metrics.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]


# -- bad input: one line, nothing written ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = {
    "unknown option": ("space:\n  model.net.init_args.no_such: {type: float, low: 0.1, high: 0.2}", "no_such"),
    "low >= high": (
        "space:\n  model.net.init_args.dropout: {type: float, low: 0.5, high: 0.1}",
        "sweep.space['model.net.init_args.dropout']: `low <= high` must hold, but got (low=0.5, high=0.1)",
    ),
    "log low <= 0": (
        "space:\n  model.optimizer.init_args.lr: {type: float, low: 0, high: 0.1, log: true}",
        "sweep.space['model.optimizer.init_args.lr']: `low > 0` must hold for `log=True`, but got (low=0, high=0.1)",
    ),
    "empty choices": (
        "space:\n  data.batch_size: {type: categorical, choices: []}",
        "sweep.space['data.batch_size']: The `choices` must contain one or more elements",
    ),
    "n_trials < 1": ("n_trials: 0", "invalid value '0' for 'sweep.n_trials'; expected a value > 0"),
    # checkpoint.mode is val_acc's (max): the objective's direction is not its to say, nor is it moved to it.
    "objective without its direction": (
        "objective: val_loss",
        "sweep.objective=val_loss is not checkpoint.monitor, whose mode says nothing of it; "
        "set sweep.direction to minimize or maximize",
    ),
    "bad storage": ("storage: postgresql://u:secret@127.0.0.1:{port}/none", "cannot be reached"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_writes_nothing(case: str, run_main, tmp_path: Path) -> None:
    text, expected = BAD[case]
    (tmp_path / "bad.yaml").write_text("sweep:\n  " + text.replace("{port}", str(_free_port())).replace("\n", "\n  "))
    done = run_main("sweep", "--config", CONFIGS / "sweep.yaml", "--config", "bad.yaml")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "secret" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_objective_the_module_never_logs_is_named(run_cli, tmp_path: Path) -> None:
    args = _sweep_args(tmp_path, n_trials=1, extra="  objective: val_f1\n  direction: maximize\n")
    done = run_cli(*args, timeout=WAIT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(errors) == 1 and "'val_f1' is never logged" in errors[0] and "val_acc" in errors[0], errors


# -- the example sweep -------------------------------------------------------------------------------------------------
@pytest.mark.slow  # four fit processes
@pytest.mark.timeout(WAIT)
def test_example_sweep_with_pruning_and_best_yaml_reproduces_the_best_trial(run_cli, tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("sweep:\n  name: s\n  n_trials: 3\n")
    done = run_cli("sweep", "--config", CONFIGS / "sweep.yaml", "--config", "s.yaml", *TINY, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "s"
    study = _study(folder)
    assert sum(_states(study).get(s, 0) for s in ("COMPLETE", "PRUNED")) == 3, _states(study)
    assert "3/3 finished" in done.stdout and "best val_acc=" in done.stdout
    with (folder / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["state"] for r in rows] == [t.state.name.lower() for t in study.trials]
    for png in ("history.png", "parallel_coordinates.png"):
        assert (folder / png).stat().st_size > 1000
    best = study.best_trial
    # The best trial's score is its best validation value, as its own log has it.
    assert best.value == max(_val_acc(folder / best.user_attrs["folder"]))
    again = run_cli("fit", "--config", folder / "best.yaml", timeout=WAIT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert max(_val_acc(tmp_path / "lightning_logs" / "version_0")) == best.value


# -- slow: restarts, workers, DDP, failures ----------------------------------------------------------------------------
PACED = """trainer:
  callbacks:
    - class_path: step_marker.StepMarker
      init_args: {path: steps.txt, delay: 0.3}
"""


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_sigkill_mid_trial_then_the_same_command_continues(tmp_path: Path) -> None:
    (tmp_path / "paced.yaml").write_text(PACED)
    args = _sweep_args(tmp_path, n_trials=3, extra="  pruner: none\n")
    args += ["--config", tmp_path / "paced.yaml"]
    folder = tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    deadline = time.monotonic() + WAIT
    # Killed in the second trial, after its first epoch's checkpoint.
    while not (folder / "trial-0001" / "checkpoints" / "last.ckpt").is_file():
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    again = _start(args, tmp_path)
    out, _ = again.communicate(timeout=WAIT)
    assert again.returncode == 0, out[-3000:]
    assert "trial 1 continues" in out
    study = _study(folder)
    assert _states(study) == {"COMPLETE": 3}, _states(study)
    assert len({tuple(t.params.values()) for t in study.trials}) == 3  # the three choices, none twice
    log = (folder / "trial-0001.log").read_text()
    resumed = re.search(r"resuming from .*\(epoch \d+, step (\d+)\)", log)
    assert resumed and int(resumed.group(1)) >= 4, log[-2000:]  # from its checkpoint, not from step 0
    # Every step from the checkpoint on once (3 epochs of 4); rows the killed run had not yet flushed before its
    # checkpoint are lost, as for any SIGKILLed run (the CSV log reaches the disk every 5 s).
    steps, first = _steps(folder / "trial-0001"), int(resumed.group(1))
    assert len(steps) == len(set(steps)) and steps[-(12 - first) :] == list(range(first, 12)), steps
    assert (folder / "trial-0000.log").read_text().count("starting from the beginning") == 1


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_two_worker_processes_share_the_embedded_study(tmp_path: Path) -> None:
    args = _sweep_args(tmp_path, n_trials=4, extra="  pruner: none\n")
    workers = [_start(args, tmp_path) for _ in range(2)]
    outs = [w.communicate(timeout=WAIT)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outs
    _check_shared(tmp_path / "lightning_logs" / "s", _study(tmp_path / "lightning_logs" / "s"), 4)


def _check_shared(folder: Path, study: optuna.Study, n: int) -> None:
    trials = [t for t in study.get_trials() if not t.user_attrs.get("surplus")]
    assert _states(study) == {"COMPLETE": n}, _states(study)
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both worked
    folders = [t.user_attrs["folder"] for t in trials]
    assert len(set(folders)) == n
    for name in folders:  # each trial ran once, from the beginning, to its end
        assert (folder / f"{name}.log").read_text().count("starting from the beginning") == 1
        assert len(_steps(folder / name)) == 12


def _postgres() -> tuple[Path, Path] | None:
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)  # Debian keeps them off PATH
    for bin_dir in (*debian, *(Path(p).parent for p in [shutil.which("initdb")] if p)):
        if (bin_dir / "initdb").is_file() and (bin_dir / "pg_ctl").is_file():
            return bin_dir / "initdb", bin_dir / "pg_ctl"
    return None


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
@pytest.mark.skipif(_postgres() is None, reason="PostgreSQL is not installed (apt-get install postgresql)")
def test_two_workers_on_a_postgresql_server(tmp_path: Path) -> None:
    initdb, pg_ctl = _postgres()
    # PostgreSQL refuses to run as root: as root the server runs as an unprivileged user, in a folder of its own
    # (pytest's temporary folders are private to root).
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    data, port = Path(tempfile.mkdtemp(prefix="sweep-pg-")), _free_port()
    if as_user:
        shutil.chown(data, "nobody")
    init = [*as_user, initdb, "-D", data, "-U", "sweep", "--auth=trust"]
    subprocess.run(init, check=True, capture_output=True, timeout=120, cwd=data)
    options = f"-k {data} -h 127.0.0.1 -p {port}"
    start = [*as_user, pg_ctl, "-D", data, "-o", options, "-w", "-t", "60", "-l", data / "log", "start"]
    subprocess.run(start, check=True, capture_output=True, timeout=90, cwd=data)
    try:
        url = f"postgresql://sweep@127.0.0.1:{port}/postgres"
        args = _sweep_args(tmp_path, n_trials=4, extra=f"  pruner: none\n  storage: {url}\n")
        workers = [_start(args, tmp_path) for _ in range(2)]
        outs = [w.communicate(timeout=WAIT)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outs
        _check_shared(tmp_path / "lightning_logs" / "s", optuna.load_study(study_name="s", storage=url), 4)
    finally:
        stop = [*as_user, pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"]
        subprocess.run(stop, capture_output=True, timeout=60, cwd=data)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_ddp_trial_is_pruned_with_a_checkpoint(tmp_path: Path, run_cli) -> None:
    # Trials 0 and 1 learn; trial 2 (lr 1e-6) is below their median at its first validation.
    lr = "model.optimizer.init_args.lr"
    lrs = f"[{{{lr}: 0.01}}, {{{lr}: 0.003}}, {{{lr}: 1.0e-6}}]"
    args = _sweep_args(tmp_path, n_trials=3, extra=f"  enqueue: {lrs}\n  n_startup_trials: 2\n", config="ddp_cpu.yaml")
    args[args.index("--trainer.max_epochs=3")] = "--trainer.max_epochs=6"
    done = run_cli(*args, timeout=WAIT, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "s"
    study = _study(folder)
    pruned = study.trials[2]
    assert pruned.state.name == "PRUNED", _states(study)
    assert (folder / "trial-0002" / "checkpoints" / "interrupted.ckpt").is_file()
    assert "Stopping on SIGTERM" in (folder / "trial-0002.log").read_text()
    assert len(_steps(folder / "trial-0002")) < 6 * 4
    # Its record and the runs table say it was pruned, not interrupted by a signal.
    listed = run_cli("runs", "--columns", "run,status", "--csv", "-")
    assert "s/trial-0002,pruned" in listed.stdout.splitlines(), listed.stdout


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_failing_trial_is_recorded_and_the_sweep_goes_on(tmp_path: Path, run_cli) -> None:
    dropout = "    model.net.init_args.dropout: {type: categorical, choices: [0.1, 2.0]}\n"
    enqueue = "  enqueue: [{model.net.init_args.dropout: 2.0}, {model.net.init_args.dropout: 0.1}]\n"
    args = _sweep_args(tmp_path, n_trials=1, extra=enqueue, space=dropout)
    done = run_cli(*args, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    study = _study(tmp_path / "lightning_logs" / "s")
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    assert "dropout probability has to be between 0 and 1" in study.trials[0].user_attrs["reason"]
    # Too many failures in a row stop the sweep with one line.
    shutil.rmtree(tmp_path / "lightning_logs")
    args = _sweep_args(tmp_path, n_trials=1, extra="  max_failures: 2\n", space=dropout.replace("0.1, ", ""))
    done = run_cli(*args, timeout=WAIT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 trials failed in a row" in errors[0] and "dropout probability" in errors[0], errors


def test_trials_at_once_get_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from template.engine.errors import ConfigError
    from template.engine.sweep.driver import slot_gpus

    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert slot_gpus({"devices": 2}, ["h.0", "h.1"], environ={}) == {"h.0": "0,1", "h.1": "2,3"}
    # A second sweep command on the machine holds slots 2 and 3; CUDA_VISIBLE_DEVICES renumbers.
    assert slot_gpus({"devices": "free:1"}, ["h.2"], environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"h.2": "6"}
    assert slot_gpus({"accelerator": "cpu", "devices": 2}, ["h.0", "h.1"], environ={}) == {}
    with pytest.raises(ConfigError, match="lower sweep.workers"):
        slot_gpus({"devices": 2}, ["h.0", "h.1", "h.2"], environ={})
    with pytest.raises(ConfigError, match="takes every GPU"):
        slot_gpus({"devices": "auto"}, ["h.0", "h.1"], environ={})


# -- proposals: a function of the seed and the trial number; never another trial's values ----------------------------
SPACE = {
    "lr": {"type": "float", "low": 1.0e-4, "high": 0.1, "log": True},
    "batch": {"type": "categorical", "choices": [32, 64, 128]},
}


def _worker(storage, space: dict, sampler: str = "tpe", seed: int = 0, pruner: str = "median") -> tuple:
    """A study as a sweep process opens it, and its space (the sweep's own code, no fit processes)."""
    from template.engine.sweep import Sweep
    from template.engine.sweep.options import search_space
    from template.engine.sweep.study import open_study

    sweep = Sweep(name="s", space=space, n_trials=6, sampler=sampler, seed=seed, pruner=pruner)
    sweep.direction = "minimize"
    return open_study(sweep, search_space(sweep), storage), search_space(sweep)


def _ask(study: optuna.Study, space: dict) -> optuna.trial.Trial:
    from template.engine.sweep.driver import _suggest

    trial = study.ask()
    for key, distribution in space.items():
        _suggest(trial, key, distribution)
    return trial


def _score(trial: optuna.trial.Trial) -> float:
    return abs(trial.params["lr"] - 0.01) + trial.params["batch"] / 1000


def _journal(tmp_path: Path, name: str = "j") -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / name)))


def test_the_median_pruner_waits_for_its_startup_trials_and_each_trials_warm_up(tmp_path: Path) -> None:
    from template.engine.sweep import Sweep
    from template.engine.sweep.options import search_space
    from template.engine.sweep.study import open_study

    def pruned(sweep: Sweep, done: int, step: int) -> bool:
        """Whether a trial far worse than ``done`` finished ones is pruned at its validation at ``step``."""
        study = open_study(sweep, search_space(sweep), _journal(tmp_path, f"{sweep.n_startup_trials}-{done}-{step}"))
        for _ in range(done):
            trial = _ask(study, search_space(sweep))
            for at in (10, 50):
                trial.report(0.1, at)
            study.tell(trial, 0.1)
        trial = _ask(study, search_space(sweep))
        trial.report(9.0, step)
        return trial.should_prune()

    default = Sweep(name="s", space=SPACE, direction="minimize")
    assert (default.n_startup_trials, default.n_warmup_steps) == (5, 0)  # Optuna's
    assert not pruned(default, done=4, step=10) and pruned(default, done=5, step=10)
    warm = Sweep(name="s", space=SPACE, direction="minimize", n_startup_trials=2, n_warmup_steps=20)
    assert not pruned(warm, done=2, step=10) and pruned(warm, done=2, step=50)


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_proposals_are_the_same_whether_the_sweep_ran_in_one_go_or_was_restarted(sampler: str, tmp_path: Path) -> None:
    def proposals(restart_after: int | None, name: str, seed: int = 0) -> list[dict]:
        storage = _journal(tmp_path, name)
        study, params = _worker(storage, SPACE, sampler, seed)
        for number in range(8):  # TPE: 2 random startup trials, then it conditions on the finished ones
            if number == restart_after:
                study, params = _worker(storage, SPACE, sampler, seed)  # as a new process opens it
            trial = _ask(study, params)
            study.tell(trial, _score(trial))
        return [t.params for t in study.trials]

    one_go = proposals(None, "a")
    for after in (1, 2, 5):
        assert proposals(after, f"restarted-{after}") == one_go, after
    assert len({tuple(p.values()) for p in one_go}) == 8
    assert proposals(None, "other-seed", seed=1) != one_go


def test_workers_sharing_a_storage_propose_different_values(tmp_path: Path) -> None:
    # Two sweep processes on one storage (as on two machines, each with its own sweep folder), the same seed.
    storage = _journal(tmp_path)
    (a, params), (b, _) = _worker(storage, SPACE), _worker(storage, SPACE)
    for _ in range(4):
        first, second = _ask(a, params), _ask(b, params)  # both running at once
        a.tell(first, _score(first))
        b.tell(second, _score(second))
    values = [tuple(t.params.values()) for t in a.trials]
    assert len(values) == 8 and len(set(values)) == 8, values


@pytest.mark.parametrize("pruner", ["median", "hyperband"])  # hyperband shows the sampler one bracket's trials
def test_a_finite_space_repeats_values_only_once_every_point_is_taken(pruner: str, tmp_path: Path, capsys) -> None:
    space = {"a": {"type": "categorical", "choices": [1, 2, 3]}, "b": {"type": "int", "low": 0, "high": 1}}
    storage = _journal(tmp_path)
    (study, params), (other, _) = _worker(storage, space, pruner=pruner), _worker(storage, space, pruner=pruner)
    for number in range(6):
        if number == 3:  # a queued trial keeps its given value; the sampler chooses the other, not a taken one
            a = next(a for a in (1, 2, 3) if [t.params["a"] for t in study.trials].count(a) == 1)
            study.enqueue_trial({"a": a})
        worker = study if number % 2 else other
        trial = _ask(worker, params)
        for step in range(1, 10):  # hyperband makes its brackets (three) when asked about a trial of 9 steps
            trial.report(float(number), step)
            trial.should_prune()
        worker.tell(trial, float(number))
    assert len({tuple(t.params.values()) for t in study.trials}) == 6
    assert study.trials[3].params["a"] == a
    assert "repeats" not in capsys.readouterr().out
    _ask(study, params)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("Sweep s: trial 6 repeats the values of trial "), out
    assert out[0].endswith("(all 6 points of sweep.space are taken)"), out


def test_a_sweep_name_reused_with_another_space_is_refused_before_anything_is_written(run_main, tmp_path: Path) -> None:
    folder = tmp_path / "lightning_logs" / "s"
    folder.mkdir(parents=True)
    lr = {"type": "categorical", "choices": [0.01, 0.003, 1.0e-6]}
    _worker(_journal(folder, "study.journal"), {"model.optimizer.init_args.lr": lr})  # as the first command made it
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    space = "    model.optimizer.init_args.lr: {type: float, low: 0.001, high: 0.1}\n"
    space += "    model.net.init_args.dropout: {type: float, low: 0.0, high: 0.5}\n"
    done = run_main(*_sweep_args(tmp_path, space=space))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert errors[0] == (
        "error: sweep 's' exists with another space (differs in: model.net.init_args.dropout, "
        "model.optimizer.init_args.lr); use another --sweep.name or the same space"
    )
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "s.yaml"} == before


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_sweeps_trials_are_fsdp_runs(tmp_path: Path, run_cli) -> None:
    args = _sweep_args(tmp_path, n_trials=2, config="fsdp_cpu.yaml")
    done = run_cli(*args, timeout=WAIT, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "lightning_logs" / "s"
    assert [t.state.name for t in _study(folder).trials] == ["COMPLETE", "COMPLETE"]
    for trial in ("trial-0000", "trial-0001"):  # strategy fsdp's checkpoints: folders of shards
        assert (folder / trial / "checkpoints" / "last.ckpt" / ".metadata").is_file()
        assert "fsdp: sharded net.layers.1, net.layers.4, net.layers.7" in (folder / f"{trial}.log").read_text()
