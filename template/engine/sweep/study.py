"""The sweep from the command to the results: checks every input, opens the Optuna study, runs the driver."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

from template.engine.errors import ConfigError
from template.engine.run import LOGS
from template.engine.sweep.devices import slot_gpus
from template.engine.sweep.driver import Driver, claim_slots
from template.engine.sweep.fitconfig import FitConfigs
from template.engine.sweep.options import Sweep, parse_command
from template.engine.sweep.results import write_results

JOURNAL = "study.journal"


def run_sweep(argv: list[str]) -> int:
    """Check everything, then run (or continue) the sweep; the exit code."""
    command = parse_command(argv)
    sweep = command.sweep
    configs = FitConfigs(command.fit_args)
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
    slot_gpus(base.get("trainer", {}), [f"check.{n}" for n in range(sweep.workers)])  # enough GPUs for them all
    root = Path(base.get("trainer", {}).get("default_root_dir") or ".")
    folder = root / LOGS / sweep.name
    storage = open_storage(sweep.storage, folder)
    folder.mkdir(parents=True, exist_ok=True)
    if storage is None:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / JOURNAL)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    slots = claim_slots(folder, sweep.workers)
    study = _study(sweep, storage, _sampler(sweep, offset=int(slots[0].rsplit(".", 1)[1])))
    if sweep.enqueue and not study.get_trials(deepcopy=False):
        for values in sweep.enqueue:
            study.enqueue_trial(values)
    gpus = slot_gpus(base.get("trainer", {}), slots)
    code = Driver(sweep, command.space, configs, storage, study, folder, slots, gpus).run()
    if code == 0:
        write_results(study, folder, sweep.objective)
        print(f"Dashboard: pip install optuna-dashboard && optuna-dashboard {_dashboard_url(sweep.storage, folder)}")
    return code


def open_storage(url: str | None, folder: Path) -> optuna.storages.BaseStorage | None:
    """The study's storage for ``sweep.storage``; None for the embedded journal (created after every check)."""
    if url is None:
        return None
    if "://" not in url:
        if not Path(url).parent.is_dir():
            raise ConfigError(f"sweep.storage={url!r}: folder {Path(url).parent} does not exist; create it first")
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))
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


def _study(sweep: Sweep, storage: optuna.storages.BaseStorage, sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    return optuna.create_study(
        storage=storage,
        sampler=sampler,
        study_name=sweep.name,
        direction=sweep.direction,
        pruner=_pruner(sweep),
        load_if_exists=True,
    )


def _sampler(sweep: Sweep, offset: int) -> optuna.samplers.BaseSampler:
    # Each worker process draws its own sequence: the same seed everywhere would propose the same trials at once.
    seed = None if sweep.seed is None else sweep.seed + offset
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, sweep.n_trials // 3)))


def _pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    if sweep.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2)
    if sweep.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()
