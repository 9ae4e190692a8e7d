"""The ``sweep`` and ``cv`` sections, read with the rest of the command line by the fit parser; the search space."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveFloat, PositiveInt, restricted_number_type
from lightning.pytorch.cli import LightningArgumentParser
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from typing_extensions import override

from template.engine.commands.cli import CLI, PROGRAM, build_cli
from template.engine.errors import ConfigError

Fraction = restricted_number_type("Fraction", float, [(">", 0), ("<=", 1)])
Folds = restricted_number_type("Folds", int, (">=", 2))
KINDS = {"float": FloatDistribution, "int": IntDistribution, "categorical": CategoricalDistribution}


@dataclass
class Sweep:
    """The ``sweep`` section: a hyper-parameter search whose trials are ``fit`` runs of the rest of the config.

    Args:
        name: the study, and its folder ``lightning_logs/<name>/``.
        space: option -> ``{type: float|int, low, high, log, step}`` or ``{type: categorical, choices}``.
        n_trials: trials that finish (complete or pruned); failed ones are replaced.
        workers: trials at once in this process.
        trials_per_gpu: trials that share each GPU (worker slots in a row get the same GPUs); 1 gives each its own.
        gpu_memory_fraction: the share of its GPUs' memory one trial may allocate, so it cannot starve the others.
        storage: null for a journal file in the sweep folder, an Optuna database URL (``postgresql://...``) or the
            path of a journal file on a shared disk.
        objective: the metric a trial scores (its best value); default ``checkpoint.monitor``, which it leaves as it is.
        direction: minimize or maximize the objective; default from ``checkpoint.mode`` where the objective is the
            monitor's.
        sampler: Optuna's TPE or random sampler.
        seed: the proposals are a function of the seed and the trial number; null for fresh ones each start.
        pruner: Optuna's median or hyperband pruner on the value at each validation, or none.
        max_failures: failed trials in a row that stop the sweep.
        heartbeat: seconds between a trial's heartbeats; one silent for 4 (its worker died) is continued by another.
        enqueue: values to try first (option -> value, as in ``space``), e.g. a known good configuration.
    """

    name: str
    space: dict[str, Any]
    n_trials: PositiveInt = 20
    workers: PositiveInt = 1
    trials_per_gpu: PositiveInt = 1
    gpu_memory_fraction: Fraction | None = None
    storage: str | None = None
    objective: str | None = None
    direction: Literal["minimize", "maximize"] | None = None
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = 0
    pruner: Literal["median", "hyperband", "none"] = "median"
    max_failures: PositiveInt = 3
    heartbeat: PositiveFloat = 30.0
    enqueue: list[dict[str, Any]] | None = None


@dataclass
class CrossValidation:
    """The ``cv`` section: k-fold cross-validation of the rest of the config, each fold a ``fit`` run.

    Args:
        folds: the number of folds; each trains on the others and validates on its own.
        name: its folder ``lightning_logs/<name>/``; default: the configs' names and a hash of the complete config.
        workers: folds at once in this process.
        storage: as ``sweep.storage``: null for a journal file in the folder, a database URL or a journal path.
        objective: the metric each fold scores (its best value); default ``checkpoint.monitor``.
        direction: as ``sweep.direction``: which of the fold's values is its best.
        stratify: refuse a DataModule that gives the split no labels (folds are stratified whenever it gives them).
    """

    folds: Folds = 5
    name: str | None = None
    workers: PositiveInt = 1
    storage: str | None = None
    objective: str | None = None
    direction: Literal["minimize", "maximize"] | None = None
    stratify: bool = False


@dataclass
class TrialFolds:
    """The ``cv`` section of a ``sweep``: each trial a cross-validation, its value the mean over its folds.

    Args:
        folds: each trial's folds, run one after another, the pruner deciding after each on the running mean;
            null: each trial is one fit on the DataModule's own split.
        stratify: as ``cv.stratify``.
    """

    folds: Folds | None = None
    stratify: bool = False


SWEEP = {"sweep": Sweep, "cv": TrialFolds}
CV = {"cv": CrossValidation}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class _Parse(CLI):
    """The fit command line with the command's sections added; it parses and builds nothing."""

    def __init__(self, sections: dict[str, type], *args: Any, **kwargs: Any) -> None:
        self.own_sections = sections
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        for name, options in self.own_sections.items():
            parser.add_class_arguments(options, name)

    @override
    def before_instantiate_classes(self) -> None:
        pass

    instantiate_classes = before_instantiate_classes


class Configs:
    """The command's arguments read once by the fit parser with its sections (``SWEEP`` or ``CV``); each trial's
    complete fit config, the sections left out."""

    def __init__(self, argv: list[str], sections: dict[str, type]) -> None:
        self.argv, self.sections = list(argv), sections
        self.fixed: dict[str, Any] = {}  # values every trial gets (``data.num_folds`` in a cross-validation)
        self.cli = build_cli(self.argv, run=False, cli_class=functools.partial(_Parse, sections))  # refusals: 1 line
        self.options = {name: options(**self.cli.config[name].as_dict()) for name, options in sections.items()}

    def complete(self, values: dict[str, Any], what: str = "") -> dict[str, Any]:
        """The full fit config of the arguments with ``values`` (option -> value) set, as plain data."""
        args = [*self.argv, *(f"--{key}={json.dumps(value)}" for key, value in {**self.fixed, **values}.items())]
        try:
            self.cli.parse_arguments(self.cli.parser, args)
        except ConfigError as err:  # the parser's refusals too
            raise ConfigError(f"{what}{err}") from None
        config = yaml.safe_load(self.cli.parser.dump(self.cli.config, skip_none=False))
        return {key: value for key, value in config.items() if key not in self.sections}


def print_help(command: str, sections: dict[str, type], more: str = "") -> None:
    """The command's own options; every other one is fit's."""
    parser = ArgumentParser(prog=f"{PROGRAM} {command}", default_config_files=[])
    for name, options in sections.items():
        parser.add_class_arguments(options, name)
    parser.print_help()
    print(f"{more}\nEvery other option is fit's: {PROGRAM} fit --help")


def search_space(sweep: Sweep) -> dict[str, BaseDistribution]:
    """Optuna's distributions for ``sweep.space``; a mistake in the options that needs no fit config, in one line."""
    if not _NAME.fullmatch(sweep.name):
        raise ConfigError(
            f"sweep.name={sweep.name!r} is not a folder name; use letters, digits, '.', '_' and '-', e.g. digits-lr"
        )
    if sweep.gpu_memory_fraction is not None and sweep.trials_per_gpu * sweep.gpu_memory_fraction > 1 + 1e-9:
        raise ConfigError(
            f"sweep.trials_per_gpu={sweep.trials_per_gpu} trials with sweep.gpu_memory_fraction="
            f"{sweep.gpu_memory_fraction} each would need {sweep.trials_per_gpu * sweep.gpu_memory_fraction:.0%} of "
            f"a GPU's memory; lower one of them (e.g. gpu_memory_fraction: {int(100 / sweep.trials_per_gpu) / 100})"
        )
    if not sweep.space:
        raise ConfigError("sweep.space is empty; add the options to search, e.g. model.optimizer.init_args.lr")
    for values in sweep.enqueue or []:
        if unknown := sorted(set(values) - set(sweep.space)):
            raise ConfigError(f"sweep.enqueue sets {', '.join(unknown)}, not in sweep.space; add it there")
    return {key: _distribution(key, spec) for key, spec in sweep.space.items()}


def _distribution(key: str, spec: Any) -> BaseDistribution:
    # Optuna checks the ranges; this, what it would take silently.
    where = f"sweep.space['{key}']"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} is {spec!r}; write {{type: float, low: ..., high: ...}} or {{type: categorical}}")
    kind, fields = spec.get("type"), {k: v for k, v in spec.items() if k != "type" and v is not None}
    if kind not in KINDS:
        raise ConfigError(f"{where} has type {kind!r}; use one of: {', '.join(KINDS)}")
    allowed = ["choices"] if kind == "categorical" else ["low", "high", "log", "step"]
    if extra := sorted(set(fields) - set(allowed)):
        raise ConfigError(f"{where} has unknown field(s) {', '.join(extra)} for type {kind}; use {allowed}")
    if not isinstance(fields.get("log", False), bool):
        raise ConfigError(f"{where}.log is {fields['log']!r}; use true or false")
    number = int if kind == "int" else (int, float)
    for name in ("low", "high", "step"):
        value = fields.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            raise ConfigError(f"{where}.{name} is {value!r}; give a finite {'integer' if kind == 'int' else 'number'}")
    try:
        return KINDS[kind](**fields)
    except (ValueError, TypeError) as err:  # Optuna's checks: low <= high, log with low > 0, step > 0, choices...
        raise ConfigError(f"{where}: {str(err).rstrip('.')}; fix that entry of sweep.space") from None
