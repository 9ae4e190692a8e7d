"""The ``sweep`` and ``cv`` sections (defined in ``sweep/__init__.py``), read with the rest of the command line by the
fit parser; the search space."""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import yaml
from lightning.pytorch.cli import LightningArgumentParser
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from typing_extensions import override

from template.engine.commands.cli import CLI, build_cli
from template.engine.errors import ConfigError
from template.engine.sweep import Sweep

KINDS = {"float": FloatDistribution, "int": IntDistribution, "categorical": CategoricalDistribution}


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


def search_space(sweep: Sweep) -> dict[str, BaseDistribution]:
    """Optuna's distributions for ``sweep.space``; a mistake in the options that needs no fit config, in one line."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", sweep.name):
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
    for name in ("low", "high", "step"):
        _refuse_unless_finite(f"{where}.{name}", fields.get(name, 1), integer=kind == "int")
    try:
        return KINDS[kind](**fields)
    except (ValueError, TypeError) as err:  # Optuna's checks: low <= high, log with low > 0, step > 0, choices...
        raise ConfigError(f"{where}: {str(err).rstrip('.')}; fix that entry of sweep.space") from None


def _refuse_unless_finite(where: str, value: Any, integer: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where} is {value!r}; give a finite {'integer' if integer else 'number'}")
