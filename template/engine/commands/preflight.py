"""Mistakes found before a run writes anything: in the config files, each named by its file; then the Trainer's
counts Lightning leaves unchecked, and the optimizers and schedulers built over the module's parameters as
``configure_optimizers`` will build them (``cli.py`` claims the run's folder after these).
"""

from __future__ import annotations

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
from template.engine.strategies import FSDP2Strategy

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


def check_strategy(trainer: Any, model: LightningModule) -> None:
    """The strategy's demands on the module (fsdp: its layer names, no lazy layers), before processes start."""
    if isinstance(trainer.strategy, FSDP2Strategy):
        trainer.strategy.check_module(model)


def build_optimizers(config: Any, model: LightningModule) -> None:
    """Build every optimizer and learning-rate scheduler the config names (the module's own arguments and
    LightningCLI's ``optimizer``/``lr_scheduler``) over the module's parameters, then drop them: a value one refuses
    (a negative learning rate) or a module without parameters is one line here, not a traceback from inside fit."""
    optimizers, schedulers = optimizer_options(config)
    if not optimizers and not schedulers:
        return
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        networks = [f"{key}={path}" for key, path in _class_paths(config).items() if _is_network(path)]
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
    scheduler computes one step too, as some values fail only then (StepLR's step_size=0)."""
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


def _class_paths(config: Any) -> dict[str, str]:
    """Every ``class_path`` in the config, by the option that holds it."""
    return {
        k.removesuffix(".class_path"): v for k, v in config.items() if k.endswith(".class_path") and isinstance(v, str)
    }


def optimizer_options(config: Any) -> tuple[list[str], list[str]]:
    """The options of the config naming an optimizer class, and those naming a learning-rate scheduler."""
    optimizers, schedulers = [], []
    for option, path in _class_paths(config).items():
        cls = blame.located(path)
        if not isinstance(cls, type):
            continue
        if issubclass(cls, torch.optim.Optimizer):
            optimizers.append(option)
        elif issubclass(cls, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            schedulers.append(option)
    return optimizers, schedulers


def _is_network(path: str) -> bool:
    cls = blame.located(path)
    return isinstance(cls, type) and issubclass(cls, nn.Module) and not issubclass(cls, LightningModule)


CONFIG_OPTIONS = ("--config", "-c")


def split_options(argv: list[str], *options: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The arguments that set ``options``, as (option, value) in order (``--x v`` or ``--x=v``; an option ending in
    "." stands for every option under it: ``--sweep.`` for ``--sweep.n_trials 3``), and the other arguments."""
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
    """The values given to ``--config`` (``--config x``, ``-c x``, ``--config=x``) in order, and the other arguments."""
    taken, rest = split_options(argv, *CONFIG_OPTIONS)
    return [value for _, value in taken], rest


def read(value: str) -> dict[str, Any]:
    """The options a ``--config`` value holds: a file's, or YAML text (a sweep hands each trial's config to the fit
    parser as text; jsonargparse reads either). A ConfigError names the file that is missing, is not valid YAML, is
    empty or holds no mapping of options."""
    path = Path(value)
    if not path.is_file():
        # jsonargparse takes a value that is no file as YAML text; a path that is not there reads as a plain string.
        try:
            content = yaml.safe_load(value)
        except yaml.YAMLError:
            content = None
        if isinstance(content, dict):
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
    """A ConfigError for a config file whose section (``sections``: the parser's groups) is neither a mapping of
    options nor a class path where the option takes a class: jsonargparse takes ``trainer:`` written as a list as
    "no trainer options" and silently resets every setting an earlier file made."""
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
