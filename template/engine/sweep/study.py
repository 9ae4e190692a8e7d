"""``sweep`` and ``cv`` from the command line to the results: every check, the Optuna study, the driver."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import fsspec
import optuna
from fsspec.utils import get_protocol
from optuna.distributions import BaseDistribution, CategoricalDistribution, distribution_to_json

from template.engine.commands import preflight as config_files
from template.engine.errors import ConfigError
from template.engine.runs import LOGS
from template.engine.runs.remote import COPIES, RemoteRoot, is_remote
from template.engine.sweep.devices import slot_gpus
from template.engine.sweep.driver import Driver, claim_slots
from template.engine.sweep.folds import FOLD, prepare
from template.engine.sweep.options import CV, SWEEP, Configs, Sweep, print_help, search_space
from template.engine.sweep.results import write_results
from template.engine.sweep.sampler import TrialSeeded

JOURNAL = "study.journal"
SPACE = "space"  # the study's user attribute that records sweep.space
MORE_HELP = "\n--cv.folds=k (or a cv: section): each trial a k-fold cross-validation, scored by the mean\n"


def run(argv: list[str], command: str) -> int:
    """Run or continue the sweep, or the cross-validation (``cv``: a study whose trials are the folds)."""
    if "-h" in argv or "--help" in argv:
        print_help(command, CV if command == "cv" else {"sweep": Sweep}, "" if command == "cv" else MORE_HELP)
        return 0
    configs = _configs(argv, command)
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
    folds = list(range(cv.folds))
    space = {FOLD: {"type": "categorical", "choices": folds}}
    # A failed fold would fail again: the cv stops, and the same command reruns it (the only fold no trial has).
    sweep = Sweep(name, space, cv.folds, cv.workers, storage=cv.storage, objective=cv.objective, pruner="none")
    sweep.max_failures, sweep.enqueue = 1, [{FOLD: k} for k in folds]
    return run_study(sweep, configs, cv=True)


def _configs(argv: list[str], command: str) -> Configs:
    try:
        return Configs(argv, CV if command == "cv" else SWEEP)
    except ConfigError as err:
        if command == "sweep" and "required: sweep.name, sweep.space" in str(err):
            raise ConfigError(
                "no sweep section; give a config with `sweep:` (name, space, ...), e.g. configs/sweep.yaml"
            ) from None
        if command == "sweep" and re.match(r"unknown .*(--|')cv\.", str(err)):  # --cv.workers: sweep.workers
            raise ConfigError(f"{str(err).split(';')[0]}; in a sweep, cv takes folds and stratify only") from None
        raise


def run_study(sweep: Sweep, configs: Configs, folds: int = 0, cv: bool = False) -> int:
    """Check the study against the fit config, then run (or continue) it and write its results; the exit code."""
    space = search_space(sweep)
    base = configs.complete({})
    sweep.objective = sweep.objective or base.get("checkpoint", {}).get("monitor")
    if not sweep.objective:
        raise ConfigError("the sweep has no objective; set sweep.objective or checkpoint.monitor to a logged metric")
    mode = base.get("checkpoint", {}).get("mode", "min")
    sweep.direction = sweep.direction or ("maximize" if mode == "max" else "minimize")
    for key, d in space.items():  # each choice, or the lowest value, taken by the fit parser
        for value in d.choices if isinstance(d, CategoricalDistribution) else [d.low]:
            configs.complete({key: value}, what=f"sweep.space['{key}']: ")
    for values in sweep.enqueue or []:
        configs.complete(values, what="sweep.enqueue: ")
    trainer = base.get("trainer", {})
    slot_gpus(trainer, [f"check.{n}" for n in range(sweep.workers)], sweep.trials_per_gpu)  # enough GPUs for all
    root, remote = trainer.get("default_root_dir") or ".", None
    on_store = is_remote(sweep.storage) and get_protocol(sweep.storage) in fsspec.available_protocols()
    if on_store or (is_remote(root) and (sweep.storage is None or "://" not in sweep.storage)):
        raise ConfigError(
            f"sweep.storage={sweep.storage}: a journal file needs appends and locks, which object storage (where "
            f"{'it' if on_store else 'trainer.default_root_dir=' + root} is) does not have; keep the study in a "
            "database the machines share, e.g. sweep.storage: postgresql://user@host/db"
        )
    if is_remote(root):  # trial folders on object storage: written in a local copy the trials share
        remote = RemoteRoot(root, base.get("run", {}).get("storage_options"))
        root = remote.local
    folder = Path(root) / LOGS / sweep.name
    storage = open_storage(sweep.storage, folder)
    if storage is not None:
        check_space(storage, sweep.name, space, folds)
    folder.mkdir(parents=True, exist_ok=True)
    storage = storage or _journal(folder / JOURNAL)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if remote is not None:
        remote.pull(folder, recursive=False)
        shared = os.environ.get(COPIES)
        os.environ[COPIES] = json.dumps({remote.url: str(remote.local)})
    slots = claim_slots(folder, sweep.workers)
    try:
        study = open_study(sweep, space, storage, folds)
        if sweep.enqueue and not study.get_trials(deepcopy=False):
            for values in sweep.enqueue:
                study.enqueue_trial(values)
        gpus = slot_gpus(trainer, list(slots), sweep.trials_per_gpu)
        title = f"{'CV' if cv else 'Sweep'} {sweep.name}"
        code = Driver(sweep, space, configs, storage, study, folder, list(slots), gpus, title, folds).run()
        if code == 0:
            write_results(study, folder, sweep.objective, cv)
            url = _without_password(sweep.storage) if sweep.storage else folder / JOURNAL
            print(f"Dashboard: pip install optuna-dashboard && optuna-dashboard {url}")
        return code
    finally:
        for fd in slots.values():
            os.close(fd)
        optuna.logging.set_verbosity(verbosity)
        if remote is not None:  # the sweep's own files (trial configs and logs, results); each trial uploads its run
            if shared is None:
                del os.environ[COPIES]
            else:
                os.environ[COPIES] = shared
            remote.sync(folder, recursive=False)
            remote.flush()
            remote.close()


def open_storage(url: str | None, folder: Path) -> optuna.storages.BaseStorage | None:
    """The study's storage for ``sweep.storage``; None for an embedded journal not yet made (made after every check)."""
    if url is None:
        return _journal(folder / JOURNAL) if (folder / JOURNAL).is_file() else None
    if "://" not in url:
        if not Path(url).parent.is_dir():
            raise ConfigError(f"sweep.storage={url!r}: folder {Path(url).parent} does not exist; create it first")
        return _journal(Path(url))
    try:
        return _rdb_storage(url)
    except Exception as err:  # SQLAlchemy's OperationalError, a missing driver module, a malformed URL...
        reason = " ".join(str(err).split()).split("(Background on this error")[0][:300]
        raise ConfigError(
            f"sweep.storage {_without_password(url)} cannot be reached ({reason}); check the URL and that the "
            "database server is running, or use storage: null for a file in the sweep folder"
        ) from None


def _rdb_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's RDBStorage; several workers starting at once on a new database race to create its tables, and the
    losers' CREATE fails with a duplicate: they try again and find the tables made."""
    import sqlalchemy.exc

    # A down server fails in seconds rather than after the driver's default TCP timeout.
    engine = {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}
    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return optuna.storages.RDBStorage(url, engine_kwargs=engine)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _without_password(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def open_study(
    sweep: Sweep, space: dict[str, BaseDistribution], storage: optuna.storages.BaseStorage, folds: int = 0
) -> optuna.Study:
    """The sweep's study, created or loaded; it records its space (``check_space`` compares the next command's)."""
    startup = min(10, max(2, sweep.n_trials // 3))
    pruner = {"median": optuna.pruners.MedianPruner(n_startup_trials=2), "hyperband": optuna.pruners.HyperbandPruner()}
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
        recorded = storage.get_study_user_attrs(storage.get_study_id_from_name(name)).get(SPACE)
    except KeyError:  # no such study yet
        return
    if recorded is None:  # its first worker was killed before it recorded the space
        return
    given = _recorded(space, folds)
    if differ := sorted(k for k in {*recorded, *given} if recorded.get(k) != given.get(k)):
        raise ConfigError(
            f"sweep '{name}' exists with another space (differs in: {', '.join(differ)}); "
            "use another --sweep.name or the same space"
        )


def _recorded(space: dict[str, BaseDistribution], folds: int) -> dict[str, Any]:
    return {**{key: distribution_to_json(d) for key, d in space.items()}, **({"cv.folds": folds} if folds else {})}


def _journal(path: Path) -> optuna.storages.JournalStorage:
    # A worker killed while it writes leaves the journal's lock behind; Optuna releases a stale lock after its grace
    # period, but only one whose mtime it can read: its default lock, a symlink to the journal's path as given,
    # dangles for a relative path (or another machine's mount point) and every later writer waits on it forever.
    lock = optuna.storages.journal.JournalFileOpenLock(str(path))
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path), lock_obj=lock))
