"""Each trial's complete fit config, built by the real command-line parser from the user's configs and its values."""

from __future__ import annotations

import json
from typing import Any

import yaml
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from template.engine.commands.cli import CLI, build_cli
from template.engine.errors import ConfigError, explain_parser_error

REPORTER = "template.engine.sweep.reporter.ObjectiveReporter"


class _ParseOnly(CLI):
    """The fit command line, parsing configs without building anything."""

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs["exit_on_error"] = False
        return super().init_parser(**kwargs)

    @override
    def before_instantiate_classes(self) -> None:
        pass

    @override
    def instantiate_classes(self) -> None:
        pass


class FitConfigs:
    """Parses ``fit`` arguments plus option values into complete configs, reporting a bad one in one line."""

    def __init__(self, fit_args: list[str]) -> None:
        self.fit_args = list(fit_args)
        self._cli = self._parse(lambda: build_cli(self.fit_args, run=False, cli_class=_ParseOnly), "")

    def complete(self, values: dict[str, Any], what: str = "") -> dict[str, Any]:
        """The full config of the fit arguments with ``values`` (option -> value) set, as plain data."""
        args = [*self.fit_args, *(f"--{key}={json.dumps(value)}" for key, value in values.items())]
        cli = self._cli

        def parse() -> Any:
            cli.parse_arguments(cli.parser, args)
            return cli.config

        config = self._parse(parse, what)
        return yaml.safe_load(cli.parser.dump(config, skip_none=False))

    @staticmethod
    def _parse(parse: Any, what: str) -> Any:
        try:
            return parse()
        except (ArgumentError, ValueError, TypeError) as err:
            message = explain_parser_error(str(err))
            raise ConfigError(f"{what}{message}" if what else message) from None


def trial_config(config: dict[str, Any], run_name: str, monitor: str, sweep: str, trial: str) -> dict[str, Any]:
    """``config`` as a trial runs it: in its run folder, reporting ``monitor``, its trackers grouped by the sweep."""
    config = json.loads(json.dumps(config))
    config.setdefault("run", {})["name"] = run_name
    trainer = config.setdefault("trainer", {})
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    trainer["callbacks"] = [*callbacks, {"class_path": REPORTER, "init_args": {"monitor": monitor}}]
    for tracker in config.get("trackers") or []:
        kind = str(tracker.get("class_path", "")).rsplit(".", 1)[-1]
        init = tracker.setdefault("init_args", {})
        if kind == "MLFlowLogger":
            init.update(experiment_name=sweep, run_name=trial)
        elif kind == "WandbLogger":
            init.update(group=sweep, name=trial)
    return config


def reproduction(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's config as a plain fit: no reporter, a new run folder of its own, the DataModule's own split (the
    config of a trial's fold trains on all folds but one)."""
    config = json.loads(json.dumps(config))
    config.get("run", {})["name"] = None
    data = config.get("data", {}).get("init_args") or {}
    if "fold" in data:
        data["fold"] = None
    trainer = config.get("trainer", {})
    callbacks = [c for c in trainer.get("callbacks") or [] if c.get("class_path") != REPORTER]
    trainer["callbacks"] = callbacks or None
    return config
