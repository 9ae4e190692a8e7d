"""Mistakes found before a run writes anything: in the config files (each named by its file), the Trainer's counts
Lightning leaves unchecked, and the optimizers built over the module's parameters as ``configure_optimizers`` will."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import instantiate_class
from torch import nn

from template.engine.errors import ConfigError, blame, one_line

CONFIG_OPTIONS = ("--config", "-c")
SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
# Trainer options Lightning takes without a check and fails on deep inside fit (ZeroDivisionError, a silent no-op).
TRAINER_COUNTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "accumulate_grad_batches": (lambda v: v >= 1, "a number of batches >= 1, e.g. 4"),
    "log_every_n_steps": (lambda v: v is None or v >= 1, "a number of steps >= 1, e.g. 50"),
    "check_val_every_n_epoch": (lambda v: v is None or v >= 1, "a number of epochs >= 1, or null"),
    "val_check_interval": (
        lambda v: v is None or (isinstance(v, int) and v >= 1) or (isinstance(v, float) and 0 < v <= 1),
        "a number of batches >= 1, or a fraction of the epoch in (0, 1]",
    ),
    "num_sanity_val_steps": (lambda v: v is None or v >= -1, "a number of batches >= 0, or -1 for all"),
    "min_epochs": (lambda v: v is None or v >= 0, "a number of epochs >= 0, or null"),
    "min_steps": (lambda v: v is None or v >= 0, "a number of steps >= 0, or null"),
    "gradient_clip_val": (lambda v: v is None or v >= 0, "a threshold >= 0, or null for no clipping"),
}


def check_trainer_counts(config: Any) -> None:
    """A ConfigError for the first Trainer option in ``TRAINER_COUNTS`` outside its range."""
    for name, (valid, expected) in TRAINER_COUNTS.items():
        value = config.get(f"trainer.{name}")
        if not valid(value):
            raise ConfigError(f"trainer.{name}={value!r} is out of range; use {expected}")


def build_optimizers(config: Any, model: LightningModule) -> None:
    """Build every optimizer and scheduler the config names over the module's parameters, then drop them: a value one
    refuses (a negative learning rate) or a module without parameters is one line here, not a traceback in fit."""
    optimizers, schedulers = optimizer_options(config)
    if not optimizers and not schedulers:
        return
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        networks = [
            f"{option}={path}"
            for option, (path, cls) in _classes(config).items()
            if issubclass(cls, nn.Module) and not issubclass(cls, LightningModule)
        ]
        named = f" ({', '.join(networks)})" if networks else ""
        raise ConfigError(
            f"{type(model).__name__} has no trainable parameters for {', '.join(optimizers or schedulers)} to "
            f"optimize{named}; choose a network with parameters"
        )
    built = None
    for option in optimizers:
        built = _build(config, option, parameters)
    for option in schedulers:
        _build(config, option, built if built is not None else torch.optim.SGD(parameters, lr=0.1))


def _build(config: Any, option: str, over: Any) -> Any:
    """The class of ``option`` built over ``over`` (parameters, or an optimizer); a value it refuses, one line. A
    scheduler steps once too: some values fail only then (StepLR's step_size=0)."""
    init_args = config.get(f"{option}.init_args")
    init = {"class_path": config.get(f"{option}.class_path"), "init_args": init_args.as_dict() if init_args else {}}
    try:
        built = instantiate_class((over,), init)
        if not isinstance(built, (torch.optim.Optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
                built.step()
        return built
    except Exception as err:
        refused = blame.refusal(err, option, blame.flat(init_args, f"{option}.init_args."))
        if refused is None:
            raise
        raise refused from None


def _classes(config: Any) -> dict[str, tuple[str, type]]:
    """Every class the config names by ``class_path``, with its path, by the option naming it."""
    paths = {k.removesuffix(".class_path"): v for k, v in config.items() if k.endswith(".class_path")}
    return {option: (path, cls) for option, path in paths.items() if isinstance(cls := blame.located(path), type)}


def optimizer_options(config: Any) -> tuple[list[str], list[str]]:
    """The options of the config naming an optimizer class, and those naming a learning-rate scheduler."""
    classes = _classes(config)
    optimizers = [option for option, (_, cls) in classes.items() if issubclass(cls, torch.optim.Optimizer)]
    return optimizers, [option for option, (_, cls) in classes.items() if issubclass(cls, SCHEDULERS)]


def split_options(argv: list[str], *options: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The arguments that set ``options`` as (option, value) in order (``--x v`` or ``--x=v``; ``--sweep.`` stands for
    every option under it), and the other arguments."""
    taken, rest = [], []
    under = tuple(option for option in options if option.endswith("."))
    args = iter(argv)
    for arg in args:
        option, equals, value = arg.partition("=")
        if option not in options and not option.startswith(under):
            rest.append(arg)
        elif equals or (value := next(args, None)) is not None:
            taken.append((option, value))
        else:
            rest.append(arg)  # no value: the parser says so
    return taken, rest


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The values given to ``--config`` (or ``-c``) in order, and the other arguments."""
    taken, rest = split_options(argv, *CONFIG_OPTIONS)
    return [value for _, value in taken], rest


def read(value: str) -> dict[str, Any]:
    """The options a ``--config`` value holds: a file's, or YAML text (as jsonargparse reads it). A ConfigError names
    the file that is missing, is not valid YAML, is empty or holds no mapping of options."""
    path = Path(value)
    if not path.is_file():
        with contextlib.suppress(yaml.YAMLError):  # a path that is not there reads as a plain string
            if isinstance(content := yaml.safe_load(value), dict):
                return content
        raise ConfigError(f"config file {value} does not exist; check the path given to --config")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or one_line(str(err))
        raise ConfigError(f"config file '{value}' is not valid YAML: {problem}{where}; fix the syntax there") from None
    if content is None:
        # jsonargparse refuses it with "Unexpected config:", naming no file.
        raise ConfigError(
            f"config file '{value}' is empty (or only comments); write its options in it as `key: value` lines "
            "(e.g. `trainer:` then `  max_epochs: 10`), or leave it out of the command"
        )
    if not isinstance(content, dict):
        raise ConfigError(
            f"config file '{value}' holds a {_kind(content)}, not options; write `key: value` lines such as "
            "`trainer:` followed by its options"
        )
    return content


def check_sections(files: dict[str, dict[str, Any]], sections: Any, config: Any) -> None:
    """A ConfigError for a config file's section (``sections``: the parser's groups) that is neither options nor a
    class path: jsonargparse takes a list as "no options" and silently drops every setting an earlier file made."""
    for path, content in files.items():
        for key, value in content.items():
            if key not in sections or value is None or isinstance(value, dict):
                continue
            if isinstance(value, str) and config.get(f"{key}.class_path") is not None:
                continue  # `model: my_project.MyModel` names the class
            raise ConfigError(
                f"config file '{path}': `{key}:` holds a {_kind(value)} but is a section of options; write its "
                f"options indented below it (`{key}:` then `  name: value` lines), not as a list"
            )


def _kind(value: Any) -> str:
    return "list" if isinstance(value, list) else f"single value ({value!r})"
