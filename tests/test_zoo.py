"""A zoo of user projects through every command, checked the way their users check them.

Each project under ``tests/user_code/`` is written the way users write their own, unlike the example and unlike each
other (their module docstrings say how): an image model with two heads and augmentation inside DataLoader workers, a
text classifier with its own vocabulary, a tabular model with the example's argument names, a forecaster with a
chronological split, a prototype whose classes take no arguments, and Lightning's own demo classes. ``PROJECTS`` is
the table: how each user names their classes, what they watch, and, for each cell that does not apply to a project,
the reason. Each cell is a test run over the projects it applies to: fit; fit on 2 DDP processes
(``configs/ddp_cpu.yaml`` stacked); a SIGTERM to the whole process group mid-epoch in epoch 1, then the same command,
ending bit for bit where the uninterrupted run ends; validate; test; predict; export (the weights, and ONNX where it is
installed); tune lr; a 2-trial sweep and a 2-fold cv (where Optuna is installed). The fast suite runs fit and predict
of the image and the text projects; the rest is slow.

``fit_args``, ``reference_run`` and ``stop_and_continue`` are the exact-resume cells' machinery, for any project of
the table (the exact-resume matrix over workers, augmentation and DDP runs them on the image project).
"""

from __future__ import annotations

import csv
import inspect
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.demos import boring_classes
from torch import Tensor, nn

from tests.conftest import CONFIGS, PACKAGE, TESTS, ForkServer, finish, made_once
from tests.resume.test_exact_resume import Cell, _differences, _env, _last, _training_state
from tests.user_code import prototype, tabular, text, timeseries, vision

USER_CODE = TESTS / "user_code"
# What every command of the zoo adds to the user's own arguments: the CPU, no bar, no summary; a fit runs in
# lightning_logs/r.
COMMON = ("--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")
RUN = "--run.name=r"
CELLS = ("fit", "ddp", "stop", "validate", "test", "predict", "export", "onnx", "tune", "sweep", "cv")
NEEDS_OPTUNA = "the sweep extra is not installed: pip install -e '.[sweep]'"
# Seconds a command may take: a healthy fit takes 5-15 s here, one on 2 DDP processes 20-40 s, a sweep or cv of two
# fits 30-60 s. A command past it fails its test: a parse that never ends is a failure, not a wait.
WAIT, SWEEP_WAIT = 300, 600


def _bound(commands: int, sweeps: int = 0) -> pytest.MarkDecorator:
    """A test's own bound, past the waits of its ``commands`` (the project's shared fit among them) and ``sweeps``:
    a command that hangs is ended by its wait, not by the suite's timeout, which would leave it running."""
    return pytest.mark.timeout(commands * WAIT + sweeps * SWEEP_WAIT + 60)


@dataclass(frozen=True)
class Project:
    """A user's project and what its user checks."""

    args: tuple[str, ...]  # how its user names the classes: their config file, or options
    build: Callable[[Path], tuple[LightningModule, LightningDataModule]]  # the same classes, built here, in a folder
    steps: int  # the optimizer steps of its fit: every epoch trained
    stop_batch: int  # a batch in the middle of epoch 1
    metric: str | None = None  # what the user watches at validation; None: the module logs nothing
    monitored: bool = True  # the config names the metric as checkpoint.monitor: a best-*.ckpt beside last.ckpt
    good: float | None = None  # a value of it that says the fit learned (chance is far from it)
    mode: str = "max"
    test_metric: str | None = None
    test_good: float | None = None
    batch: int | None = None  # its DataModule's batch_size; None: fixed inside its DataLoader
    prefix: str = "net."  # the attribute holding its network (export --prefix); "": the whole module
    onnx_module: bool = False  # ONNX: the whole module's forward (export --module)
    lengths: bool = False  # its inputs vary in length (dimension 1) from batch to batch
    lr: str | None = None  # the option that sets its learning rate; None: written in configure_optimizers
    columns: tuple[str, ...] | int = 1  # predict_step's columns: a dict's keys, or how many
    seeded_data: bool = True  # the data is the same wherever it is built (predictions checked value by value)
    absent: dict[str, str] = field(default_factory=dict)  # cell: why it does not apply

    @property
    def direction(self) -> int:
        return 1 if self.mode == "max" else -1


def _config(name: str) -> tuple[str, ...]:
    return ("--config", str(USER_CODE / f"{name}.yaml"))


BORING = "lightning.pytorch.demos.boring_classes."
NO_ARGUMENTS = "no argument of theirs to search: every size is written in the code"
PROJECTS: dict[str, Project] = {
    "vision": Project(
        _config("vision"),
        lambda work: (vision.TwoHeads(), vision.ShapesData(data_dir=str(work / "shapes"))),
        steps=3 * 14, stop_batch=7, metric="val_acc", good=0.6, test_metric="test_acc", test_good=0.6, batch=32,
        prefix="", onnx_module=True, lr="model.init_args.lr", columns=("shape", "area"),
    ),
    "text": Project(
        _config("text"),
        lambda work: (text.ReviewClassifier(), text.Reviews()),
        steps=3 * 23, stop_batch=11, metric="val_f1", good=0.75, test_metric="test_f1", test_good=0.75, batch=32,
        prefix="encoder.", lengths=True, lr="model.init_args.lr",
    ),
    "tabular": Project(
        (
            "--model=user_code.tabular.TabularClassifier", "--model.net=user_code.tabular.TabularNet",
            "--data=user_code.tabular.TabularData", "--model.optimizer=torch.optim.SGD",
            "--model.optimizer.init_args.lr=0.05", "--model.optimizer.init_args.momentum=0.9",
            "--trainer.max_epochs=3", "--checkpoint.monitor=val_acc", "--checkpoint.mode=max",
        ),
        lambda work: (tabular.TabularClassifier(tabular.TabularNet((6,), 2)), tabular.TabularData()),
        steps=3 * 11, stop_batch=5, metric="val_acc", good=0.8, test_metric="test_acc", test_good=0.8, batch=24,
        lr="model.init_args.optimizer.init_args.lr",
    ),
    "timeseries": Project(
        _config("timeseries"),
        lambda work: (timeseries.Forecaster(), timeseries.SensorWindows()),
        steps=3 * 22, stop_batch=11, metric="val_mae", good=0.5, mode="min", test_metric="test_mae", test_good=0.5,
        batch=48, prefix="model.", lr="model.init_args.lr", columns=6,
        absent={"cv": "a chronological split: k folds would validate on readings older than those they train on"},
    ),
    "prototype": Project(
        _config("prototype"),
        lambda work: (prototype.Prototype(), prototype.Spirals()),
        steps=3 * 40, stop_batch=20, metric="val_acc", good=0.8, monitored=False, prefix="layers.", columns=2,
        absent={"test": "no test_step: nothing is tested yet", "sweep": NO_ARGUMENTS},
    ),
    "boring": Project(
        (f"--model={BORING}BoringModel", f"--data={BORING}BoringDataModule", "--trainer.max_epochs=2"),
        lambda work: (boring_classes.BoringModel(), boring_classes.BoringDataModule()),
        steps=2 * 64, stop_batch=30, prefix="layer.", columns=2,
        # BoringDataModule draws its samples from torch's global generator when it is built.
        seeded_data=False,
        absent={"sweep": NO_ARGUMENTS},
    ),
}  # fmt: skip
FAST = {("fit", "vision"), ("fit", "text"), ("predict", "vision"), ("predict", "text")}


def _cells(cell: str) -> list[Any]:
    """The projects ``cell`` applies to, each a pytest param (slow unless the fast suite runs it)."""
    return [
        pytest.param(name, id=name, marks=[] if (cell, name) in FAST else [pytest.mark.slow])
        for name, project in PROJECTS.items()
        if cell not in project.absent
    ]


# -- running commands -------------------------------------------------------------------------------------------------
def fit_args(name: str, *extra: str, ddp: bool = False) -> list[str]:
    """The arguments of ``python -m template`` for the fit of project ``name`` in ``lightning_logs/r``; ``ddp``:
    ``configs/ddp_cpu.yaml`` stacked after the user's own (2 processes over gloo)."""
    stacked = ("--config", str(CONFIGS / "ddp_cpu.yaml")) if ddp else ()
    return ["fit", *PROJECTS[name].args, *stacked, *COMMON, RUN, *extra]


def run(work: Path, args: list[str], server: ForkServer | None = None, wait: float = WAIT) -> tuple[int, str]:
    """Run ``python -m template *args`` in ``work`` (a forked child of ``server``, else a fresh interpreter in a session
    of its own), failing the test after ``wait`` s: its exit code and output (also appended to ``work/run.log``)."""
    log = work / "run.log"
    before = log.stat().st_size if log.exists() else 0
    env = _env(work)  # the tests' helpers and user code on the path, a free port for DDP
    if server is not None:
        code = server.run(list(map(str, args)), work, env, log, wait)
    else:
        with log.open("a") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", PACKAGE, *map(str, args)], cwd=work, env=env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        code = finish(proc, wait, log=log)
    with log.open("rb") as f:
        f.seek(before)
        return code, f.read().decode(errors="replace")


def _failed_marker(factory: pytest.TempPathFactory, key: str) -> Path:
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # made_once's folder, shared by the workers
    return root / f"once-{key}.failed"


def _once(factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """``made_once``, except that a make that failed fails every later test asking for it at once, with its reason
    (a hung command is not waited for again)."""
    failed = _failed_marker(factory, key)

    def attempt(folder: Path) -> None:
        if failed.exists():
            pytest.fail(f"failed earlier in this session: {failed.read_text()}")
        try:
            make(folder)
        except BaseException as err:  # pytest.fail's too
            message = str(err)  # its first line says what happened, its end the command's last lines
            failed.write_text(message if len(message) < 4000 else f"{message[:1000]}\n...\n{message[-3000:]}")
            raise

    return made_once(factory, key, attempt)


def _fitted(name: str, factory: pytest.TempPathFactory, server: ForkServer) -> Path:
    """The folder of project ``name``'s fit (made once a session, by the fork server): ``lightning_logs/r``, its data,
    ``run.log``."""

    def make(work: Path) -> None:
        code, output = run(work, fit_args(name), server)
        assert code == 0, f"the fit ended with {code}:\n{output[-4000:]}"

    return _once(factory, f"zoo-fit-{name}", make)


def _parses(name: str, factory: pytest.TempPathFactory, server: ForkServer) -> None:
    """Fails at once when project ``name``'s fit did not end: every command reads the same classes the same way (a
    parse that hangs would hang each cell for the whole bound)."""
    try:
        _fitted(name, factory, server)
    except pytest.fail.Exception as failure:
        if "did not end within" in str(failure):
            pytest.fail(f"the fit of {name} did not end, so no command of it is tried again: {str(failure)[:2000]}")


def _copy_of_fit(name: str, work: Path, factory: pytest.TempPathFactory, server: ForkServer) -> Path:
    """Project ``name``'s fitted run copied into ``work`` (so that a command writing beside it writes in the test's own
    folder): the path of its ``last.ckpt``, relative to ``work``."""
    fitted = _fitted(name, factory, server)
    for item in fitted.iterdir():
        if item.is_dir():
            shutil.copytree(item, work / item.name)
    return Path("lightning_logs/r/checkpoints/last.ckpt")


def reference_run(factory: pytest.TempPathFactory, key: str, args: list[str]) -> Path:
    """The folder of ``python -m template *args`` run once without a stop, in a fresh interpreter (made once a session
    under ``key``): what a stopped and continued run must end at."""

    def make(work: Path) -> None:
        code, output = run(work, args)
        assert code == 0, f"the uninterrupted run ended with {code}:\n{output[-4000:]}"

    return _once(factory, key, make)


def _logged(work: Path) -> dict[tuple[str, str], str]:
    """Every value of ``lightning_logs/r/metrics.csv`` by (step, column), throughput (a time) aside."""
    path = work / "lightning_logs" / "r" / "metrics.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {(r["step"], c): v for r in rows for c, v in r.items() if v and c != "step" and "throughput" not in c}


def stop_and_continue(args: list[str], cell: Cell, work: Path, reference: Path, server: ForkServer | None) -> None:
    """Run ``python -m template *args`` in ``work``, stopped at ``cell``'s moment by ``cell.signal`` to its whole
    process group (sent by the lowest of ``cell.ranks``, tests/fault.py), then the same command again: the second start
    ends where ``reference`` (``reference_run`` of the same arguments) ended, bit for bit. Compared: the step, every
    tensor of the weights, the optimizer and scheduler states, the random states, and every value of ``metrics.csv``."""
    ranks = ", ".join(map(str, cell.ranks))
    (work / "fault.yaml").write_text(
        "class_path: fault.Fault\ninit_args: {"
        f"moment: {cell.moment}, signal: {cell.signal}, epoch: {cell.epoch}, batch: {cell.batch}, nth: {cell.nth}, "
        f"ranks: [{ranks}], group: true}}\n"
    )
    stopped = [*args, "--trainer.callbacks+=fault.yaml"]  # appended: the user's own callbacks stay
    code, output = run(work, stopped, server)
    assert (work / "fault.fired").is_file(), f"the stop never came (exit {code}):\n{output[-3000:]}"
    signum = int(getattr(signal, cell.signal))
    assert code == 128 + signum, f"exit code {code}, expected {128 + signum}:\n{output[-3000:]}"
    assert f"Stopping on {cell.signal}" in output and "run the same command to continue" in output, output[-3000:]
    assert "Traceback" not in output, output[-4000:]

    code, output = run(work, stopped, server)
    assert code == 0, f"the same command again ended with {code}:\n{output[-4000:]}"
    differences = _differences(_training_state(_last(reference)), _training_state(_last(work)))
    logged, expected = _logged(work), _logged(reference)
    differences += [
        f"metrics.csv step {step} {column}: {logged.get((step, column))} != {expected.get((step, column))}"
        for step, column in sorted(expected.keys() | logged.keys())
        if logged.get((step, column)) != expected.get((step, column))
    ]
    assert not differences, "the continued run differs from the uninterrupted one:\n" + "\n".join(differences[:12])


# -- what the user reads back -----------------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _values(path: Path, column: str) -> list[float]:
    return [float(r[column]) for r in _rows(path) if r.get(column)]


def _best(project: Project, path: Path) -> float:
    """The best value of the project's metric in a metrics.csv, the way the checkpoint's monitor chooses it."""
    values = _values(path, project.metric)
    assert values, f"{project.metric} was never logged in {path}"
    return max(values) if project.mode == "max" else min(values)


def _learned(project: Project, value: float, good: float | None, what: str) -> None:
    assert (value - good) * project.direction >= 0, f"{what} is {value:.4g}; a model that learned reaches {good}"


def _signature_defaults(cls: type) -> dict[str, Any]:
    """The plain defaults (numbers, strings, sequences) of ``cls.__init__``, as a YAML config holds them."""
    plain = (int, float, str, bool, type(None), tuple, list)
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {
        p.name: list(p.default) if isinstance(p.default, tuple) else p.default
        for p in parameters
        if p.default is not inspect.Parameter.empty and isinstance(p.default, plain)
    }


def _check_users_defaults(name: str, config: dict, work: Path, *searched: str) -> None:
    """The saved config names the user's classes, each with its own defaults (not the example's), but what the
    project's arguments or a search set."""
    model, data = PROJECTS[name].build(work)
    for section, obj in (("model", model), ("data", data)):
        cls = type(obj)
        assert config[section]["class_path"] == f"{cls.__module__.removeprefix('tests.')}.{cls.__qualname__}", config
        saved = config[section].get("init_args") or {}
        for key, default in _signature_defaults(cls).items():
            if f"{section}.{key}" not in searched and f"--{section}.{key}=" not in " ".join(PROJECTS[name].args):
                assert saved.get(key, default) == default, f"{section}.{key}: {saved.get(key)} != {default}"


def _flat(output: Any) -> list[Tensor]:
    """A network's outputs as a list of tensors: a tensor, a tuple or list of them, or a dict's values in order."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        return list(output.values())
    return list(output)


def _table(outputs: list[Any]) -> tuple[list[str] | None, list[list[Any]]]:
    """What ``predict_step`` returned for each batch as the rows a user expects, one per sample: a dict's keys are its
    columns (their names), a tensor's dimensions after the first its columns, a list one column."""

    def columns(output: Any) -> list[list[Any]]:
        if isinstance(output, dict):
            return [value for part in output.values() for value in columns(part)]
        if isinstance(output, Tensor):
            return output.reshape(len(output), -1).T.tolist()
        return [list(output)]

    names = list(outputs[0]) if isinstance(outputs[0], dict) else None
    rows = [list(row) for output in outputs for row in zip(*columns(output), strict=True)]
    return names, rows


def _same(got: str, expected: Any) -> bool:
    if isinstance(expected, str):
        return got == expected
    return math.isclose(float(got), float(expected), rel_tol=1e-5, abs_tol=1e-6)


def _in_process(
    name: str, work: Path, checkpoint: Path, stage: str = "predict"
) -> tuple[LightningModule, LightningDataModule]:
    """The project's module with the checkpoint's weights and its DataModule with the checkpoint's state, set up for
    ``stage``, as the user builds them in a notebook."""
    module, data = PROJECTS[name].build(work)
    saved = torch.load(work / checkpoint, weights_only=True)
    module.load_state_dict(saved["state_dict"])
    if type(data).__qualname__ in saved:  # what the DataModule keeps in state_dict (a vocabulary)
        data.load_state_dict(saved[type(data).__qualname__])
    data.prepare_data()
    data.setup(stage)
    return module.eval(), data


# -- the cells ---------------------------------------------------------------------------------------------------------
@_bound(1)
@pytest.mark.parametrize("name", _cells("fit"))
def test_fit(name: str, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer) -> None:
    project = PROJECTS[name]
    work = _fitted(name, tmp_path_factory, fork_server)
    run_dir = work / "lightning_logs" / "r"
    output = (work / "run.log").read_text()
    assert "Traceback" not in output and not re.search(r"^error:", output, re.MULTILINE), output[-3000:]
    assert _last(work)["global_step"] == project.steps, "every epoch trained"
    if project.metric:
        _learned(project, _values(run_dir / "metrics.csv", project.metric)[-1], project.good, project.metric)
    best = list((run_dir / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == (project.metric is not None and project.monitored), best
    _check_users_defaults(name, yaml.safe_load((run_dir / "config.yaml").read_text()), work)


@_bound(2)
@pytest.mark.parametrize("name", _cells("ddp"))
def test_fit_on_2_ddp_processes(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    project = PROJECTS[name]
    _parses(name, tmp_path_factory, fork_server)
    code, output = run(tmp_path, fit_args(name, ddp=True), fork_server)
    assert code == 0, f"exit {code}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    line = next((line for line in output.splitlines() if line.startswith("Run:")), "")
    batch = re.search(r"batch (\d+)/process .* x 2 process\(es\) x 1 accumulation = (\d+) per optimizer step", line)
    assert batch and "world size 2" in line, line or output[-3000:]
    per_process, global_batch = map(int, batch.groups())
    if project.batch:  # the user's batch stays the batch of one optimizer step, split over the processes
        assert (per_process, global_batch) == (project.batch // 2, project.batch), line
        assert _last(tmp_path)["global_step"] == project.steps
    else:  # a batch written in the DataLoader: each process reads it
        assert global_batch == 2 * per_process, line
        assert _last(tmp_path)["global_step"] == project.steps // 2
    if project.metric:
        metrics = tmp_path / "lightning_logs" / "r" / "metrics.csv"
        _learned(project, _values(metrics, project.metric)[-1], project.good, project.metric)


@_bound(4)
@pytest.mark.parametrize("name", _cells("stop"))
def test_a_sigterm_to_the_group_mid_epoch_then_the_same_command_ends_exactly(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    _parses(name, tmp_path_factory, fork_server)
    args = fit_args(name)
    reference = reference_run(tmp_path_factory, f"zoo-reference-{name}", args)
    cell = Cell(name, "train_batch", "SIGTERM", epoch=1, batch=PROJECTS[name].stop_batch)
    stop_and_continue(args, cell, tmp_path, reference, fork_server)


@_bound(2)
@pytest.mark.parametrize("name", _cells("validate"))
def test_validate(name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer) -> None:
    project = PROJECTS[name]
    checkpoint = _copy_of_fit(name, tmp_path, tmp_path_factory, fork_server)
    code, output = run(tmp_path, ["validate", *project.args, *COMMON, "--ckpt_path", checkpoint], fork_server)
    assert code == 0 and "Traceback" not in output, f"exit {code}:\n{output[-4000:]}"
    logged = tmp_path / "lightning_logs" / "r" / "validate" / "version_0" / "metrics.csv"
    if project.metric:  # the checkpoint scores what the fit logged at its last validation
        fit = [row for row in _rows(tmp_path / "lightning_logs" / "r" / "metrics.csv") if row.get(project.metric)][-1]
        (validated,) = _rows(logged)
        for key in (k for k in fit if k.startswith("val_") and fit[k]):
            assert math.isclose(float(validated[key]), float(fit[key]), rel_tol=1e-6), (key, validated, fit)


@_bound(2)
@pytest.mark.parametrize("name", _cells("test"))
def test_test(name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer) -> None:
    project = PROJECTS[name]
    checkpoint = _copy_of_fit(name, tmp_path, tmp_path_factory, fork_server)
    code, output = run(tmp_path, ["test", *project.args, *COMMON, "--ckpt_path", checkpoint], fork_server)
    assert code == 0 and "Traceback" not in output, f"exit {code}:\n{output[-4000:]}"
    logged = tmp_path / "lightning_logs" / "r" / "test" / "version_0" / "metrics.csv"
    if project.test_metric:
        (tested,) = _values(logged, project.test_metric)
        _learned(project, tested, project.test_good, project.test_metric)


# Each project's predictions, and the two heads' on 2 DDP processes (each predicts a share; rank 0 writes them all).
PREDICT = [pytest.param(*p.values, False, id=p.id, marks=p.marks) for p in _cells("predict")]
PREDICT += [pytest.param("vision", True, id="vision-ddp", marks=pytest.mark.slow)]


@_bound(2)
@pytest.mark.parametrize(("name", "ddp"), PREDICT)
def test_predict(
    name: str, ddp: bool, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    project = PROJECTS[name]
    checkpoint = _copy_of_fit(name, tmp_path, tmp_path_factory, fork_server)
    stacked = ("--config", str(CONFIGS / "ddp_cpu.yaml")) if ddp else ()
    args = ["predict", *project.args, *stacked, *COMMON, "--ckpt_path", checkpoint, "--predictions", "predictions.csv"]
    code, output = run(tmp_path, args, fork_server)
    assert code == 0 and "Traceback" not in output, f"exit {code}:\n{output[-4000:]}"
    with (tmp_path / "predictions.csv").open(newline="") as f:
        header, *rows = list(csv.reader(f))

    module, data = _in_process(name, tmp_path, checkpoint)
    with torch.no_grad():
        outputs = [module.predict_step(batch, i) for i, batch in enumerate(data.predict_dataloader())]
    names, expected = _table(outputs)
    assert header[0] == "index", header
    if names is not None:  # one column per key, named by it
        assert sorted(header[1:]) == sorted(names) and len(header) == 1 + len(names), header
        order = [header.index(key) for key in names]
    else:
        assert len(header) == 1 + project.columns, header
        order = list(range(1, len(header)))
    assert [int(row[0]) for row in rows] == list(range(len(expected))), "one row per sample, in the input's order"
    for row, want in zip(rows, expected, strict=True):
        got = [row[i] for i in order]
        if project.seeded_data:
            assert all(map(_same, got, want)), (row, want)
        else:
            assert all(math.isfinite(float(value)) for value in got), row


def _fresh_net(name: str, work: Path) -> nn.Module:
    """The network a user loads exported weights into: a new one, of the project's own classes."""
    module, _ = PROJECTS[name].build(work)
    prefix = PROJECTS[name].prefix
    return module.get_submodule(prefix.rstrip(".")) if prefix else module


@_bound(2)
@pytest.mark.parametrize("name", _cells("export"))
def test_export_weights_load_into_the_net(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    project = PROJECTS[name]
    checkpoint = _copy_of_fit(name, tmp_path, tmp_path_factory, fork_server)
    args = ["export", checkpoint, "--output", "net.pt", f"--prefix={project.prefix}"]
    code, output = run(tmp_path, args, fork_server)
    assert code == 0 and "Wrote net.pt" in output, f"exit {code}:\n{output[-3000:]}"
    exported = torch.load(tmp_path / "net.pt", weights_only=True)
    net = _fresh_net(name, tmp_path)
    net.load_state_dict(exported)  # strict: every tensor of the net, nothing else
    trained = torch.load(tmp_path / checkpoint, weights_only=True)["state_dict"]
    for key, tensor in net.state_dict().items():
        assert torch.equal(tensor, trained[project.prefix + key]), key


def _inputs(name: str, data: LightningDataModule) -> list[Tensor]:
    """Inputs of the shapes the data gives, other than the one the export traces (its first validation batch): other
    batch sizes and, where the lengths vary, other lengths."""
    batches = iter(data.val_dataloader())
    x = next(batches)
    x = x[0] if isinstance(x, (list, tuple)) else x
    while len(x) < 3:  # a loader of single samples
        more = next(batches)
        x = torch.cat([x, more[0] if isinstance(more, (list, tuple)) else more])
    shapes = [x[:1], x[:3]]
    if PROJECTS[name].lengths:
        shapes += [x[:3, :5], torch.cat([x[:2], torch.zeros(2, 9, dtype=x.dtype)], 1)]
    return shapes


@_bound(2)
@pytest.mark.parametrize("name", _cells("onnx"))
def test_export_onnx_checks_every_output(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    for extra in ("onnxruntime", "onnxscript", "onnx"):
        pytest.importorskip(extra, reason="needs the onnx extra: pip install -e '.[onnx]'")
    import onnxruntime

    project = PROJECTS[name]
    checkpoint = _copy_of_fit(name, tmp_path, tmp_path_factory, fork_server)
    target = ["--module"] if project.onnx_module else [f"--prefix={project.prefix}"]
    args = ["export", checkpoint, "--format", "onnx", "--output", "net.onnx", *target]
    code, output = run(tmp_path, args, fork_server)
    assert code == 0 and "Wrote net.onnx" in output, f"exit {code}:\n{output[-3000:]}"
    if name == "vision":  # its AdaptiveMaxPool2d takes any image size in PyTorch, one only in torch.onnx's graph
        assert "dimensions 2, 3 fixed (ONNX Runtime refused other sizes PyTorch takes)" in output, output[-2000:]

    module, data = _in_process(name, tmp_path, checkpoint, "validate")
    net = module if project.onnx_module else module.get_submodule(project.prefix.rstrip("."))
    session = onnxruntime.InferenceSession(str(tmp_path / "net.onnx"), providers=["CPUExecutionProvider"])
    (feed,) = [i.name for i in session.get_inputs()]
    for x in _inputs(name, data):
        with torch.no_grad():
            expected = _flat(net(x))
        got = session.run(None, {feed: x.numpy()})
        assert len(got) == len(expected), f"the graph has {len(got)} outputs, the net returns {len(expected)}"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert a.shape == tuple(b.shape) and abs(a - b.numpy()).max() <= 1e-4 + 1e-3 * abs(b.numpy()).max(), (
                f"output {i} at input shape {tuple(x.shape)}"
            )


def _at(config: dict, option: str) -> Any:
    for key in option.split("."):
        config = config[key]
    return config


@_bound(3)
@pytest.mark.parametrize("name", _cells("tune"))
def test_tune_lr_writes_a_rate_that_trains_or_one_line_saying_no_option_sets_it(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    """A module whose rate no option sets is refused in one line; one that trains at its own rate has a stretch of
    the finder's range where its loss falls, so the finder's defaults suggest a rate there, which trains as well."""
    pytest.importorskip("matplotlib", reason=NEEDS_OPTUNA)
    project = PROJECTS[name]
    _parses(name, tmp_path_factory, fork_server)
    code, output = run(tmp_path, ["tune", "lr", *project.args, *COMMON], fork_server)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    if project.lr is None:
        assert code == 2 and len(errors) == 1 and "Traceback" not in output, f"exit {code}:\n{output[-3000:]}"
        assert "not one option sets the learning rate" in errors[0], errors[0]
        assert not (tmp_path / "tune-lr.yaml").exists()
        return
    assert code == 0, f"exit {code}; the module trains at its own rate, the finder suggested none:\n{output[-3000:]}"
    found = re.search(r"Suggested learning rate: \S+ \((\S+)\)", output)
    assert found and found[1] == project.lr, output[-3000:]
    assert (tmp_path / "tune-lr.png").is_file(), "the finder's curve, the suggestion marked on it"
    lr = _at(yaml.safe_load((tmp_path / "tune-lr.yaml").read_text()), project.lr)

    # The suggestion trains as well as the user's own rate, in as many epochs.
    code, output = run(tmp_path, [*fit_args(name), "--config", "tune-lr.yaml"], fork_server)
    assert code == 0, f"the fit with the suggestion ended with {code}:\n{output[-3000:]}"
    assert _at(yaml.safe_load((tmp_path / "lightning_logs" / "r" / "config.yaml").read_text()), project.lr) == lr
    tuned = _best(project, tmp_path / "lightning_logs" / "r" / "metrics.csv")
    default = _best(project, _fitted(name, tmp_path_factory, fork_server) / "lightning_logs" / "r" / "metrics.csv")
    enough = 0.9 * default if project.mode == "max" else default / 0.9
    _learned(project, tuned, enough, f"{project.metric} at the suggested {lr:.3g} ({default:.4g} at the user's)")


@_bound(1, sweeps=1)
@pytest.mark.parametrize("name", _cells("sweep"))
def test_a_2_trial_sweep_keeps_the_users_defaults_in_every_trial(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    pytest.importorskip("optuna", reason=NEEDS_OPTUNA)
    project = PROJECTS[name]
    fitted = _fitted(name, tmp_path_factory, fork_server)
    lr = _at(yaml.safe_load((fitted / "lightning_logs" / "r" / "config.yaml").read_text()), project.lr)
    space = {project.lr: {"type": "float", "low": lr / 10, "high": lr * 3, "log": True}}
    # The user's own rate first: that trial is the fit, to the same score.
    sweep = {"name": "s", "n_trials": 2, "space": space, "enqueue": [{project.lr: lr}, {project.lr: lr / 3}]}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({"sweep": sweep}))
    code, output = run(tmp_path, ["sweep", *project.args, *COMMON, "--config", "sweep.yaml"], fork_server, SWEEP_WAIT)
    assert code == 0 and "Traceback" not in output, f"exit {code}:\n{output[-4000:]}"
    folder = tmp_path / "lightning_logs" / "s"
    trials = _rows(folder / "trials.csv")
    assert [t["state"] for t in trials] == ["complete", "complete"], trials
    scores = []
    for trial, tried in zip(trials, (lr, lr / 3), strict=True):
        config = yaml.safe_load((tmp_path / f"{trial['folder']}.yaml").read_text())
        assert math.isclose(_at(config, project.lr), tried), config
        _check_users_defaults(name, config, tmp_path, project.lr.replace(".init_args", ""))
        scores.append(_best(project, tmp_path / trial["folder"] / "metrics.csv"))  # the trial's score: its best
        assert math.isclose(float(trial[project.metric]), scores[-1], rel_tol=1e-6), trial
    assert math.isclose(scores[0], _best(project, fitted / "lightning_logs" / "r" / "metrics.csv"), rel_tol=1e-6)
    best = yaml.safe_load((folder / "best.yaml").read_text())
    winner = max(range(2), key=lambda i: scores[i] * project.direction)
    assert math.isclose(_at(best, project.lr), (lr, lr / 3)[winner]), best
    _check_users_defaults(name, best, tmp_path, project.lr.replace(".init_args", ""))


@_bound(1, sweeps=1)
@pytest.mark.parametrize("name", _cells("cv"))
def test_a_2_fold_cv_or_one_line_saying_what_the_datamodule_lacks(
    name: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServer
) -> None:
    pytest.importorskip("optuna", reason=NEEDS_OPTUNA)
    project = PROJECTS[name]
    _parses(name, tmp_path_factory, fork_server)
    code, output = run(tmp_path, ["cv", *project.args, *COMMON, "--cv.folds=2", "--cv.name=c"], fork_server, SWEEP_WAIT)
    _, data = project.build(tmp_path)
    if not {"fold", "num_folds"} <= set(inspect.signature(type(data).__init__).parameters):
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in output, f"exit {code}:\n{output[-3000:]}"
        assert "cannot be cross-validated" in errors[0] and "fold" in errors[0], errors[0]
        assert not (tmp_path / "lightning_logs").exists(), "nothing is written before the line"
        return
    assert code == 0 and "Traceback" not in output, f"exit {code}:\n{output[-4000:]}"
    folder = tmp_path / "lightning_logs" / "c"
    summary = {row["fold"]: row for row in _rows(folder / "folds.csv")}
    assert set(summary) == {"0", "1", "mean", "std"}, summary
    for fold in (0, 1):
        config = yaml.safe_load((folder / f"fold-{fold}" / "config.yaml").read_text())
        assert config["data"]["init_args"]["fold"] == fold and config["data"]["init_args"]["num_folds"] == 2, config
        _check_users_defaults(name, config, tmp_path, "data.fold", "data.num_folds")
        scored = float(summary[str(fold)][project.metric])
        assert math.isclose(scored, _best(project, folder / f"fold-{fold}" / "metrics.csv"), rel_tol=1e-6)
        _learned(project, scored, project.good, f"fold {fold}'s {project.metric}")
    mean = sum(float(summary[str(f)][project.metric]) for f in (0, 1)) / 2
    assert math.isclose(float(summary["mean"][project.metric]), mean, rel_tol=1e-6), summary


def test_the_zoo_says_why_each_missing_cell_is_missing() -> None:
    """Every project has every cell, or a reason in the table; the zoo keeps each kind of user project."""
    for name, project in PROJECTS.items():
        assert set(project.absent) <= set(CELLS), (name, project.absent)
        assert all(reason.strip() for reason in project.absent.values()), name
        assert (project.lr is None) == ("sweep" in project.absent), f"{name}: a sweep searches the learning rate"
    assert {"vision", "text", "tabular", "timeseries", "prototype", "boring"} <= set(PROJECTS)
    assert {cell for cell, _ in FAST} == {"fit", "predict"}
