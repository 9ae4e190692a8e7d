"""The ``sweep:`` section and the command line of ``python -m template sweep``: read, checked, split from the fit's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentParser
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from template.engine.commands import preflight as config_files
from template.engine.errors import ConfigError, explain_parser_error

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TYPES = ("float", "int", "categorical")


@dataclass
class Sweep:
    """The ``sweep`` section: a hyper-parameter search whose trials are ``fit`` runs of the rest of the config.

    Args:
        name: the study, and its folder ``lightning_logs/<name>/``.
        space: option -> ``{type: float|int, low, high, log, step}`` or ``{type: categorical, choices}``.
        n_trials: trials that finish (complete or pruned); failed ones are replaced.
        workers: trials at once in this process.
        trials_per_gpu: trials that share each GPU (worker slots in a row get the same GPUs); 1 gives each its own.
        gpu_memory_fraction: the share of each of its GPUs' memory one trial may allocate (its CUDA caching
            allocator's limit), so that one trial cannot starve the others on the GPU; null for no limit.
        storage: null for a journal file in the sweep folder, an Optuna database URL (``postgresql://...``,
            ``mysql://...``, ``sqlite:///...``) or the path of a journal file on a shared disk.
        objective: the metric a trial scores (its best value); default ``checkpoint.monitor``.
        direction: minimize or maximize the objective; default from ``checkpoint.mode``.
        sampler: Optuna's TPE or random sampler.
        seed: the proposals are a function of the seed and the trial number; null for fresh ones each start.
        pruner: Optuna's median or hyperband pruner on the value at each validation, or none.
        max_failures: failed trials in a row that stop the sweep.
        heartbeat: seconds between a running trial's heartbeats in a database storage; a trial silent for 4
            heartbeats (its worker died) is failed and run again from its checkpoint by the next worker.
        enqueue: values to try first (option -> value, as in ``space``), e.g. a known good configuration.
    """

    name: str
    space: dict[str, dict[str, Any]]
    n_trials: int = 20
    workers: int = 1
    trials_per_gpu: int = 1
    gpu_memory_fraction: float | None = None
    storage: str | None = None
    objective: str | None = None
    direction: Literal["minimize", "maximize"] | None = None
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = 0
    pruner: Literal["median", "hyperband", "none"] = "median"
    max_failures: int = 3
    heartbeat: float = 30.0
    enqueue: list[dict[str, Any]] | None = None


@dataclass
class Param:
    """One dimension of the search space."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    def example(self) -> Any:
        """A value of the space, to check that the fit parser takes the option."""
        if self.type == "categorical":
            return self.choices[0]
        return int(self.low) if self.type == "int" else float(self.low)

    def distribution(self) -> BaseDistribution:
        """Optuna's distribution of this dimension."""
        if self.type == "categorical":
            return CategoricalDistribution(self.choices)
        if self.type == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)


@dataclass
class Command:
    """``sweep`` arguments, split: the sweep's options, and the ``fit`` arguments every trial starts from."""

    sweep: Sweep
    space: list[Param]
    fit_args: list[str]
    folds: int = 0  # cv.folds: each trial a cross-validation of this many folds


def parse_command(argv: list[str]) -> Command:
    """Read the ``sweep:`` section of the ``--config`` files and the ``--sweep.*`` options; the rest is the fit's."""
    missing = "no sweep section; give a config with `sweep:` (name, space, ...), e.g. configs/sweep.yaml"
    folds = "\n--cv.folds=k (or a cv: section): each trial a k-fold cross-validation, scored by the mean\n"
    sweep, fit_args = parse_section(argv, "sweep", Sweep, missing, folds)
    return Command(sweep, check(sweep), fit_args)


def parse_section(
    argv: list[str], name: str, options: type, missing: str | None = None, more_help: str = ""
) -> tuple[Any, list[str]]:
    """``options`` from the ``name:`` sections of the ``--config`` files and ``--<name>.*``, and the fit's arguments;
    ``missing``, if given, is the error where neither sets any."""
    if "-h" in argv or "--help" in argv:
        _parser(name, options).print_help()
        print(more_help, end="")
        print(f"\nEvery other option is fit's: {_parser(name, options).prog.rsplit(' ', 1)[0]} fit --help")
        raise SystemExit(0)
    configs, rest = config_files.split(argv)
    own_args, fit_args = [], []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith(f"--{name}.") or arg == f"--{name}" or arg.startswith(f"--{name}="):
            own_args.append(arg)
            if "=" not in arg and i + 1 < len(rest):
                own_args.append(rest[i + 1])
                i += 1
        else:
            fit_args.append(arg)
        i += 1
    section: dict[str, Any] = {}
    texts = []
    for path in configs:
        content = config_files.read(path)
        part = content.pop(name, None)
        if part is not None and not isinstance(part, dict):
            raise ConfigError(f"the {name} section of '{path}' is not a mapping; write `{name}:` with its options")
        section = _merge(section, part or {})
        # The fit parser gets the file without this section, as YAML text (jsonargparse reads either).
        texts.append(yaml.safe_dump(content, sort_keys=False) if content else "{}")
    fit_args = [*(arg for text in texts for arg in ("--config", text)), *fit_args]
    if missing and not section and not own_args:
        raise ConfigError(missing)
    parser = _parser(name, options)
    try:
        parsed = parser.parse_args(["--section", yaml.safe_dump({name: section}), *own_args])
        chosen = getattr(parser.instantiate_classes(parsed), name)
    except Exception as err:  # jsonargparse's ArgumentError and friends; the message names the key
        raise ConfigError(explain_parser_error(str(err))) from None
    return chosen, fit_args


def _parser(name: str, options: type) -> ArgumentParser:
    """The ``<name>.*`` options (the signature of ``options``), read from the configs' sections and the command line."""
    parser = ArgumentParser(prog=f"python -m template {name}", exit_on_error=False, default_config_files=[])
    parser.add_argument("--section", action="config", help=f"the merged {name}: sections of the --config files")
    parser.add_class_arguments(options, name, instantiate=True)
    return parser


def check(sweep: Sweep) -> list[Param]:
    """Every mistake in the sweep's options that needs no fit config, as one line; the search space."""
    if not _NAME.fullmatch(sweep.name):
        raise ConfigError(
            f"sweep.name={sweep.name!r} is not a folder name; use letters, digits, '.', '_' and '-', e.g. digits-lr"
        )
    for key, least in (("n_trials", 1), ("workers", 1), ("trials_per_gpu", 1), ("max_failures", 1)):
        if getattr(sweep, key) < least:
            raise ConfigError(f"sweep.{key}={getattr(sweep, key)} must be >= {least}")
    fraction = sweep.gpu_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"sweep.gpu_memory_fraction={fraction} must be in (0, 1], e.g. 0.3; or null for no limit")
    if fraction is not None and sweep.trials_per_gpu * fraction > 1 + 1e-9:
        raise ConfigError(
            f"sweep.trials_per_gpu={sweep.trials_per_gpu} trials with sweep.gpu_memory_fraction={fraction} each "
            f"would need {sweep.trials_per_gpu * fraction:.0%} of a GPU's memory; lower one of them (e.g. "
            f"gpu_memory_fraction: {math.floor(100 / sweep.trials_per_gpu) / 100})"
        )
    if not sweep.heartbeat > 0:
        raise ConfigError(f"sweep.heartbeat={sweep.heartbeat} must be a number of seconds > 0")
    if not sweep.space:
        raise ConfigError("sweep.space is empty; add the options to search, e.g. model.optimizer.init_args.lr")
    space = [_param(key, spec) for key, spec in sweep.space.items()]
    for values in sweep.enqueue or []:
        if unknown := sorted(set(values) - set(sweep.space)):
            raise ConfigError(f"sweep.enqueue sets {', '.join(unknown)}, not in sweep.space; add it there")
    return space


def _param(key: str, spec: Any) -> Param:
    where = f"sweep.space['{key}']"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} is {spec!r}; write {{type: float, low: ..., high: ...}} or {{type: categorical}}")
    kind = spec.get("type")
    if kind not in _TYPES:
        raise ConfigError(f"{where} has type {kind!r}; use one of: {', '.join(_TYPES)}")
    allowed = {"type", "choices"} if kind == "categorical" else {"type", "low", "high", "log", "step"}
    if extra := sorted(set(spec) - allowed):
        raise ConfigError(f"{where} has unknown field(s) {', '.join(extra)} for type {kind}; use {sorted(allowed)}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where} has no choices; list at least one, e.g. choices: [32, 64]")
        return Param(key, kind, choices=choices)
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    for name, value in (("low", low), ("high", high)):
        number = int if kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            raise ConfigError(f"{where}.{name} is {value!r}; give a finite {'integer' if kind == 'int' else 'number'}")
    if low >= high:
        raise ConfigError(f"{where} has low={low} >= high={high}; low must be below high")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log is {log!r}; use true or false")
    if log and low <= 0:
        raise ConfigError(f"{where} has log: true with low={low}; a log scale needs low > 0")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0):
        raise ConfigError(f"{where}.step is {step!r}; give a number > 0, or leave it out")
    if step is not None and log:
        raise ConfigError(f"{where} has both step and log: true; Optuna takes one of them")
    return Param(key, kind, low=low, high=high, log=log, step=step)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A later config's sweep section wins key by key (``space`` entries too)."""
    merged = dict(base)
    for key, value in update.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both else value
    return merged
