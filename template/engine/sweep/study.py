"""The sweep from the command to the results: checks every input, opens the Optuna study, runs the driver."""

from __future__ import annotations

import json
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna

from template.engine.errors import ConfigError
from template.engine.runs import LOGS
from template.engine.sweep.devices import slot_gpus
from template.engine.sweep.driver import Driver, claim_slots
from template.engine.sweep.fitconfig import FitConfigs
from template.engine.sweep.options import Command, Param, Sweep
from template.engine.sweep.results import write_results
from template.engine.sweep.sampler import TrialSeeded

JOURNAL = "study.journal"
SPACE = "space"  # the study's user attribute that records sweep.space


def run_study(
    command: Command, configs: FitConfigs, driver: type[Driver] = Driver, results: Callable = write_results
) -> int:
    """Check the study against the fit config, run (or continue) it with ``driver``, then ``results``; the exit code."""
    sweep = command.sweep
    base = configs.complete({})
    sweep.objective = sweep.objective or base.get("checkpoint", {}).get("monitor")
    if not sweep.objective:
        raise ConfigError("the sweep has no objective; set sweep.objective or checkpoint.monitor to a logged metric")
    mode = base.get("checkpoint", {}).get("mode", "min")
    sweep.direction = sweep.direction or ("maximize" if mode == "max" else "minimize")
    for param in command.space:
        for value in param.choices or [param.example()]:
            configs.complete({param.key: value}, what=f"sweep.space['{param.key}']: ")
    for values in sweep.enqueue or []:
        configs.complete(values, what="sweep.enqueue: ")
    checks = [f"check.{n}" for n in range(sweep.workers)]
    slot_gpus(base.get("trainer", {}), checks, sweep.trials_per_gpu)  # enough GPUs for them all
    root = Path(base.get("trainer", {}).get("default_root_dir") or ".")
    folder = root / LOGS / sweep.name
    storage = open_storage(sweep.storage, folder)
    if storage is not None:
        check_space(storage, sweep.name, command.space, command.folds)
    folder.mkdir(parents=True, exist_ok=True)
    storage = storage or _journal(folder / JOURNAL)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    slots = claim_slots(folder, sweep.workers)
    study = open_study(sweep, command.space, storage, command.folds)
    if sweep.enqueue and not study.get_trials(deepcopy=False):
        for values in sweep.enqueue:
            study.enqueue_trial(values)
    gpus = slot_gpus(base.get("trainer", {}), slots, sweep.trials_per_gpu)
    code = driver(sweep, command.space, configs, storage, study, folder, slots, gpus, command.folds).run()
    if code == 0:
        results(study, folder, sweep.objective)
        print(f"Dashboard: pip install optuna-dashboard && optuna-dashboard {_dashboard_url(sweep.storage, folder)}")
    return code


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

    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _engine_kwargs(url: str) -> dict[str, Any]:
    # A down server fails in seconds rather than after the driver's default TCP timeout.
    return {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}


def _without_password(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def _dashboard_url(url: str | None, folder: Path) -> str:
    return _without_password(url) if url else str(folder / JOURNAL)


def open_study(sweep: Sweep, space: list[Param], storage: optuna.storages.BaseStorage, folds: int = 0) -> optuna.Study:
    """The sweep's study, created or loaded; it records its space (``check_space`` compares the next command's)."""
    study = optuna.create_study(
        storage=storage,
        sampler=_sampler(sweep, space, storage),
        study_name=sweep.name,
        direction=sweep.direction,
        pruner=_pruner(sweep),
        load_if_exists=True,
    )
    if SPACE not in study.user_attrs:
        study.set_user_attr(SPACE, _space(space, folds))
    return study


def _sampler(sweep: Sweep, space: list[Param], storage: optuna.storages.BaseStorage) -> optuna.samplers.BaseSampler:
    distributions = {param.key: param.distribution() for param in space}
    startup = min(10, max(2, sweep.n_trials // 3))
    return TrialSeeded(storage, sweep.name, distributions, sweep.sampler, sweep.seed, startup)


def check_space(storage: optuna.storages.BaseStorage, name: str, space: list[Param], folds: int = 0) -> None:
    """Refuse to continue a study with another search space: its trials would mix two searches."""
    try:
        recorded = storage.get_study_user_attrs(storage.get_study_id_from_name(name)).get(SPACE)
    except KeyError:  # no such study yet
        return
    if recorded is None:  # a study from before the space was recorded
        return
    given = _space(space, folds)
    differ = sorted(k for k in {*recorded, *given} if recorded.get(k) != given.get(k))
    if differ:
        raise ConfigError(
            f"sweep '{name}' exists with another space (differs in: {', '.join(differ)}); "
            "use another --sweep.name or the same space"
        )


def _space(space: list[Param], folds: int) -> dict[str, Any]:
    """The space as the study records it (JSON), every field filled in, so that equal spaces compare equal; with
    ``cv.folds``, that too (trials scored over folds do not mix with others)."""
    recorded = {p.key: {k: v for k, v in asdict(p).items() if k != "key"} for p in space}
    return json.loads(json.dumps({**recorded, **({"cv.folds": folds} if folds else {})}))


def _journal(path: Path) -> optuna.storages.JournalStorage:
    # A worker killed while it writes leaves the journal's lock behind; Optuna releases a stale lock after its grace
    # period, but only one whose mtime it can read. Its default lock is a symlink to the journal's path as given: a
    # relative path (or another machine's mount point) dangles, and every later writer waits on it forever.
    journal = str(path)
    lock = optuna.storages.journal.JournalFileOpenLock(journal)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal, lock_obj=lock))


def _pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    if sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2)
    if sweep.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()
