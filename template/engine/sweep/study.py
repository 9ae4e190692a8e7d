"""``sweep`` and ``cv`` from the command line to the results: every check, the Optuna study, the driver, the table,
``best.yaml`` and the plots."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import logging.handlers
import pydoc
import re
import signal
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import optuna
import yaml
from fsspec.utils import get_protocol
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from optuna.distributions import BaseDistribution, CategoricalDistribution, distribution_to_json
from optuna.trial import FrozenTrial, TrialState

from template.engine.commands import preflight as config_files
from template.engine.errors import SWEEP_EXTRA, ConfigError, config_error_in
from template.engine.logs import METRICS, read_metrics
from template.engine.runs import run_dir
from template.engine.runs.remote import COPIES, RemoteRoot, is_remote
from template.engine.runs.table import format_table
from template.engine.store import atomic_write
from template.engine.sweep import CV, SWEEP, Sweep, trial_environment
from template.engine.sweep.driver import STOPS, Driver, Life, claim_slots, slot_gpus
from template.engine.sweep.folds import FOLD, PROTOCOL, log
from template.engine.sweep.options import Configs, search_space
from template.engine.sweep.reporter import MEMORY_FRACTION, REPORTER
from template.engine.sweep.sampler import TrialSeeded

JOURNAL, TABLE, FOLDS, BEST = "study.journal", "trials.csv", "folds.csv", "best.yaml"
SPACE = "space"  # the study's user attribute that records sweep.space


def run(argv: list[str], command: str) -> int:
    """Run or continue the sweep, or the cross-validation (``cv``: a study whose trials are the folds)."""
    try:
        configs = Configs(argv, CV if command == "cv" else SWEEP)
    except ConfigError as err:
        if command == "sweep" and "required: sweep.name, sweep.space" in str(err):
            raise ConfigError(
                "no sweep section; give a config with `sweep:` (name, space, ...), e.g. configs/sweep.yaml"
            ) from None
        if command == "sweep" and re.match(r"unknown .*(--|')cv\.", str(err)):  # --cv.workers: sweep.workers
            raise ConfigError(f"{str(err).split(';')[0]}; in a sweep, cv takes folds and stratify only") from None
        raise
    cv = configs.options["cv"]
    if command == "sweep":
        sweep = configs.options["sweep"]
        if cv.folds:
            print(f"Sweep {sweep.name}: each trial {prepare(configs, cv.folds, cv.stratify)[0]}", flush=True)
        return run_study(sweep, configs, cv.folds or 0)
    split, base = prepare(configs, cv.folds, cv.stratify)
    stems = "-".join(Path(path).stem for path in config_files.split(argv)[0]) or "cv"
    name = cv.name or f"{stems}-cv{cv.folds}-{hashlib.sha256(json.dumps(base).encode()).hexdigest()[:8]}"
    print(f"CV {name}: {split}", flush=True)
    space = {FOLD: {"type": "categorical", "choices": list(range(cv.folds))}}
    # A failed fold would fail again: the cv stops, and the same command reruns it (the only fold no trial has).
    enqueue = [{FOLD: k} for k in range(cv.folds)]
    options = {"storage": cv.storage, "objective": cv.objective, "direction": cv.direction, "pruner": "none"}
    sweep = Sweep(name, space, cv.folds, cv.workers, max_failures=1, enqueue=enqueue, **options)
    return run_study(sweep, configs, cv=True)


def prepare(configs: Configs, k: int, stratify: bool) -> tuple[str, dict[str, Any]]:
    """Refuse a DataModule that cannot be split in ``k`` folds (fold 0's is set up here, so that its refusals come
    first), give every trial ``data.num_folds``; the split in words and the complete config."""
    data = configs.complete({})["data"]
    if not {"fold", "num_folds"} <= set(inspect.signature(pydoc.locate(data["class_path"])).parameters):
        raise ConfigError(
            f"{data['class_path']} cannot be cross-validated: its __init__ needs the arguments ({PROTOCOL}) and a "
            "split by template.engine.fold_indices (see docs/cv.md)"
        )
    configs.fixed["data.num_folds"] = k
    config = configs.complete({FOLD: 0})
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    splits, level = logging.handlers.BufferingHandler(capacity=1000), log.level  # what fold_indices logs
    log.addHandler(splits)
    log.setLevel(logging.DEBUG)
    try:
        module = parser.instantiate_classes(parser.parse_object({"data": config["data"]})).data
        module.prepare_data()
        module.setup("fit")
    except Exception as err:
        if (cause := config_error_in(err)) is not None:
            raise ConfigError(f"cv.folds={k}: {cause}") from None
        raise
    finally:
        log.removeHandler(splits)
        log.setLevel(level)
    split = splits.buffer[-1] if splits.buffer else None
    if stratify and (split is None or split.kind != "stratified by label"):
        raise ConfigError(
            f"cv.stratify=true, but {data['class_path']} gives fold_indices no labels; pass labels= to it, or drop "
            "cv.stratify for plain k-fold"
        )
    said = f"{split.samples} samples, {split.kind}" if split else f"its samples, split by {data['class_path']}"
    config["data"]["init_args"]["fold"] = None
    return f"{k} folds of {said}", config


def run_study(sweep: Sweep, configs: Configs, folds: int = 0, cv: bool = False) -> int:
    """Check the study against the fit config, then run (or continue) it and write its results; the exit code."""
    space = search_space(sweep)
    base = configs.complete({})
    sweep = scored(sweep, base.get("checkpoint", {}), "cv" if cv else "sweep")
    check_values(configs, space, sweep.enqueue or [])
    trainer = base.get("trainer", {})
    slot_gpus(trainer, [f"check.{n}" for n in range(sweep.workers)], sweep.trials_per_gpu)  # enough GPUs for all
    with contextlib.ExitStack() as stack:
        for signum, handler in {s: signal.getsignal(s) for s in STOPS}.items():  # the driver's, undone last
            stack.callback(signal.signal, signum, handler)
        folder, storage, env = stack.enter_context(home(sweep, space, folds, trainer, base.get("run", {})))
        slots = claim_slots(folder, sweep.workers)
        for lock in slots.values():
            stack.callback(lock.release)
        study = open_study(sweep, space, storage, folds)
        if sweep.enqueue and not study.get_trials(deepcopy=False):
            for values in sweep.enqueue:
                study.enqueue_trial(values)
        gpus = slot_gpus(trainer, list(slots), sweep.trials_per_gpu)
        title = f"{'CV' if cv else 'Sweep'} {sweep.name}"
        code = Driver(sweep, space, configs, storage, study, folder, list(slots), gpus, env, title, folds).run()
        if code == 0:
            write_results(study, folder, sweep.objective, cv)
            url = _without_password(sweep.storage) if sweep.storage else folder / JOURNAL
            print(f"Dashboard: pip install optuna-dashboard && optuna-dashboard {url}")
        return code


def check_values(configs: Configs, space: dict[str, BaseDistribution], enqueue: list[dict[str, Any]]) -> None:
    """Each choice of the space, or its lowest value, and each enqueued set of values, taken by the fit parser."""
    for key, d in space.items():
        for value in d.choices if isinstance(d, CategoricalDistribution) else [d.low]:
            configs.complete({key: value}, what=f"sweep.space['{key}']: ")
    for values in enqueue:
        configs.complete(values, what="sweep.enqueue: ")


def scored(sweep: Sweep, checkpoint: dict[str, Any], section: str) -> Sweep:
    """``sweep`` with its objective and direction: by default the checkpoint's monitor and mode."""
    objective = sweep.objective or checkpoint.get("monitor")
    if not objective:
        raise ConfigError(f"the {section} has no objective; set {section}.objective to a metric the module logs")
    if sweep.direction is None and objective != checkpoint.get("monitor"):  # checkpoint.mode is the monitor's
        why = f"{section}.objective={objective} is not checkpoint.monitor, whose mode says nothing of it"
        raise ConfigError(f"{why}; set {section}.direction to minimize or maximize")
    direction = sweep.direction or ("maximize" if checkpoint.get("mode", "min") == "max" else "minimize")
    return dataclasses.replace(sweep, objective=objective, direction=direction)


@contextlib.contextmanager
def home(
    sweep: Sweep, space: dict[str, BaseDistribution], folds: int, trainer: dict[str, Any], run: dict[str, Any]
) -> Iterator[tuple[Path, optuna.storages.BaseStorage, dict[str, str]]]:
    """Where the study lives while it runs: its folder (under a ``default_root_dir`` on object storage, a local copy
    the trials share, uploaded at the end), its storage, checked to hold the same space, and the trials' environment;
    Optuna says warnings only."""
    root = trainer.get("default_root_dir") or "."
    on_store = is_remote(sweep.storage) and get_protocol(sweep.storage) in fsspec.available_protocols()
    if on_store or (is_remote(root) and not is_remote(sweep.storage)):
        raise ConfigError(
            f"sweep.storage={sweep.storage}: a journal file needs appends and locks, which object storage (where "
            f"{'it' if on_store else 'trainer.default_root_dir=' + root} is) does not have; keep the study in a "
            "database the machines share, e.g. sweep.storage: postgresql://user@host/db"
        )
    with contextlib.ExitStack() as stack:
        remote = RemoteRoot(root, run.get("storage_options")) if is_remote(root) else None
        if remote is not None:
            stack.callback(remote.close)
        folder = run_dir(remote.local if remote else root, sweep.name)
        storage = open_storage(sweep.storage, folder)
        if storage is not None:
            check_space(storage, sweep.name, space, folds)
        folder.mkdir(parents=True, exist_ok=True)
        env = trial_environment()
        if sweep.gpu_memory_fraction is not None:
            env[MEMORY_FRACTION] = str(sweep.gpu_memory_fraction)  # the trial's reporter applies it on a GPU
        if remote is not None:  # the sweep's own files (trial configs and logs, results); each trial uploads its run
            remote.pull(folder, recursive=False)
            stack.callback(remote.flush)
            stack.callback(remote.sync, folder, recursive=False)
            env[COPIES] = json.dumps({remote.url: str(remote.local)})
        stack.callback(optuna.logging.set_verbosity, optuna.logging.get_verbosity())
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        yield folder, storage or _journal(folder / JOURNAL), env


def open_storage(url: str | None, folder: Path) -> optuna.storages.BaseStorage | None:
    """The study's storage for ``sweep.storage``; None for an embedded journal not yet made (made after every check)."""
    if url is None:
        return _journal(folder / JOURNAL) if (folder / JOURNAL).is_file() else None
    if not is_remote(url):  # a journal file; else a database URL
        if not Path(url).parent.is_dir():
            raise ConfigError(f"sweep.storage={url!r}: folder {Path(url).parent} does not exist; create it first")
        return _journal(Path(url))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _rdb_storage(url)
    except Exception as err:  # SQLAlchemy's OperationalError, a missing driver module, a malformed URL...
        reason = " ".join(str(err).split()).split("(Background on this error")[0][:300]
        raise ConfigError(
            f"sweep.storage {_without_password(url)} cannot be reached ({reason}); check the URL and that the "
            "database server is running, or use storage: null for a file in the sweep folder"
        ) from None


def _rdb_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDBStorage. Workers starting at once on a new database race to create its tables: a loser's CREATE
    fails with a duplicate, and it tries again."""
    import sqlalchemy.exc

    # A down server fails in seconds rather than after the driver's default TCP timeout.
    engine = {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}
    for attempt in range(1, 5):
        with contextlib.suppress(sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            return optuna.storages.RDBStorage(url, engine_kwargs=engine)
        time.sleep(0.5 * attempt)
    return optuna.storages.RDBStorage(url, engine_kwargs=engine)


def _without_password(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def _journal(path: Path) -> optuna.storages.JournalStorage:
    # Optuna's default lock (a symlink to the path as given) dangles for a relative path or another machine's mount
    # point, so a stale one left by a killed writer is never released; this one is.
    lock = optuna.storages.journal.JournalFileOpenLock(str(path))
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock))


def open_study(
    sweep: Sweep, space: dict[str, BaseDistribution], storage: optuna.storages.BaseStorage, folds: int = 0
) -> optuna.Study:
    """The sweep's study, created or loaded; it records its space (``check_space`` compares the next command's)."""
    startup = min(10, max(2, sweep.n_trials // 3))
    median = optuna.pruners.MedianPruner(n_startup_trials=sweep.n_startup_trials, n_warmup_steps=sweep.n_warmup_steps)
    pruner = {"median": median, "hyperband": optuna.pruners.HyperbandPruner()}
    study = optuna.create_study(
        storage=storage,
        sampler=TrialSeeded(storage, sweep.name, space, sweep.sampler, sweep.seed, startup),
        study_name=sweep.name,
        direction=sweep.direction,
        pruner=pruner.get(sweep.pruner, optuna.pruners.NopPruner()),
        load_if_exists=True,
    )
    if SPACE not in study.user_attrs:
        study.set_user_attr(SPACE, _recorded(space, folds))
    return study


def check_space(
    storage: optuna.storages.BaseStorage, name: str, space: dict[str, BaseDistribution], folds: int = 0
) -> None:
    """Refuse to continue a study with another search space (or another ``cv.folds``): its trials would mix two."""
    try:
        recorded = storage.get_study_user_attrs(storage.get_study_id_from_name(name))[SPACE]
    except KeyError:  # no such study yet, or its first worker was killed before it recorded the space
        return
    given = _recorded(space, folds)
    if differ := sorted(k for k in {*recorded, *given} if recorded.get(k) != given.get(k)):
        raise ConfigError(
            f"sweep '{name}' exists with another space (differs in: {', '.join(differ)}); "
            "use another --sweep.name or the same space"
        )


def _recorded(space: dict[str, BaseDistribution], folds: int) -> dict[str, Any]:
    return {**{key: distribution_to_json(d) for key, d in space.items()}, **({"cv.folds": folds} if folds else {})}


def write_results(study: optuna.Study, folder: Path, objective: str, cv: bool = False) -> None:
    """The table of a sweep's trials (and their folds' scores, as scikit-learn's ``cv_results_``) then ``best.yaml``,
    or of a cv's folds (each one's metrics at its best, their mean and deviation) then ``folds.md``; and the plots."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(Life.SURPLUS)]
    header, rows = (_folds if cv else _trials)(trials, folder, objective)
    text = io.StringIO(newline="")
    csv.writer(text).writerows([header, *rows])
    atomic_write(folder / (FOLDS if cv else TABLE), lambda f: f.write(text.getvalue().encode()))
    cells = [[f"{v:.6g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    print(format_table(header, cells))
    if cv:
        lines = ["| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *cells]]
        atomic_write(folder / "folds.md", lambda f: f.write("\n".join([*lines, ""]).encode()))
        plotted = _plots(folder, {"curves.png": "plot_intermediate_values"}, study)  # each fold at each validation
        print(f"Table: {folder / FOLDS}, folds.md" + (", plot: curves.png" if plotted else ""))
        print(f"CV {study.study_name}: {objective} {rows[-2][1]:.6g} +- {rows[-1][1]:.3g} over {len(rows) - 2} folds")
        return
    print(f"Table: {folder / TABLE}")
    if any(t.state == TrialState.COMPLETE for t in trials):
        best = study.best_trial
        run = best.user_attrs[Life.FOLDER] + ("/fold-0" if Life.FOLD_SCORES in best.user_attrs else "")
        config = reproduction(yaml.safe_load((folder / f"{run}.yaml").read_text()))
        atomic_write(folder / BEST, lambda f: f.write(yaml.safe_dump(config, sort_keys=False).encode()))
        print(f"Best: trial {best.number}, {objective}={best.value:.6g}; reproduce it with")
        print(f"  python -m {__package__.split('.')[0]} fit --config {folder / BEST}")
    names = ("history.png", "importances.png", "parallel_coordinates.png")
    kinds = ("plot_optimization_history", "plot_param_importances", "plot_parallel_coordinate")
    for name in _plots(folder, dict(zip(names, kinds, strict=True)), study):
        print(f"Plot: {folder / name}")


def _trials(trials: list[FrozenTrial], folder: Path, objective: str) -> tuple[list[str], list[list[Any]]]:
    keys = sorted({k for t in trials for k in t.params})
    folds = max((len(t.user_attrs.get(Life.FOLD_SCORES, [])) for t in trials), default=0)
    header = ["trial", *keys, objective, *(f"fold {k}" for k in range(folds)), *(["std"] if folds else [])]
    rows = []
    for t in trials:
        attrs = t.user_attrs
        scores = attrs.get(Life.FOLD_SCORES, [])
        std = [statistics.stdev(scores) if len(scores) == folds else ""] if folds else []
        rows.append(
            [t.number, *(t.params.get(k, "") for k in keys), "" if t.value is None else t.value]
            + [*scores, *[""] * (folds - len(scores)), *std]
            + [t.state.name.lower(), attrs.get(Life.SECONDS, ""), str(folder / attrs.get(Life.FOLDER, ""))]
            + [attrs.get(Life.REASON, "")]
        )
    return [*header, "state", "seconds", "folder", "reason"], rows


def _folds(trials: list[FrozenTrial], folder: Path, objective: str) -> tuple[list[str], list[list[Any]]]:
    done = sorted((t.params[FOLD], t) for t in trials if t.state == TrialState.COMPLETE)
    best = {k: _best_row(folder / f"fold-{k}", objective, t.value) for k, t in done}
    keys = [objective, *sorted({key for row in best.values() for key in row} - {objective})]
    rows: list[list[Any]] = [[k, *(row.get(key, "") for key in keys)] for k, row in best.items()]
    for what, stat in (("mean", statistics.mean), ("std", statistics.stdev)):
        columns = [[row[key] for row in best.values() if key in row] for key in keys]
        rows.append([what, *(stat(c) if len(c) == len(best) else "" for c in columns)])
    return ["fold", *keys], rows


def _best_row(run: Path, objective: str, best: float) -> dict[str, float]:
    """The metrics a fold logged at the validation where its objective was best (its ``metrics.csv`` row)."""
    rows = [row for row in read_metrics(run / METRICS)[0] if row.get(objective)]
    row = min(rows, key=lambda r: abs(float(r[objective]) - best), default={})
    values = {key: float(value) for key, value in row.items() if value and key not in ("epoch", "step")}
    return {**values, objective: best}  # the objective as the study scored it, the others from the same validation


def reproduction(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's config as a plain fit: no reporter, a new run folder of its own, the DataModule's own split."""
    config.get("run", {})["name"] = None
    data = config.get("data", {}).get("init_args") or {}
    if "fold" in data:
        data["fold"] = None
    trainer = config.get("trainer", {})
    trainer["callbacks"] = [c for c in trainer.get("callbacks") or [] if c.get("class_path") != REPORTER] or None
    return config


def _plots(folder: Path, plots: dict[str, str], study: optuna.Study) -> list[str]:
    """Each of Optuna's plots ``plots[name]`` of the study that can be drawn (too few trials for some), written as
    ``folder/<name>``; none without matplotlib, said in one line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as optuna_plots
    except ImportError:
        print(f"Plots need matplotlib: {SWEEP_EXTRA}")
        return []

    written = []
    for name, plot in plots.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = getattr(optuna_plots, plot)(study)
            except (ValueError, RuntimeError, ZeroDivisionError):
                continue
        atomic_write(folder / name, functools.partial(axes.figure.savefig, format="png", dpi=100, bbox_inches="tight"))
        plt.close(axes.figure)
        written.append(name)
    return written
