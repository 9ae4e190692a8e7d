"""Command line: LightningCLI with the project's defaults, and mistakes reported in one line.

What the command line adds to a run is listed, in order, in ``engine/wiring.py``; this module only calls it from
LightningCLI's documented hooks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from fsspec.utils import get_protocol
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

import template
from template.engine import internals
from template.engine.commands import preflight, wiring
from template.engine.commands import preflight as config_files
from template.engine.commands.wiring import PredictionWriter, evaluate_best
from template.engine.errors import (
    TRACEBACK_VARIABLE,
    blame,
    config_error_in,
    disk_error_in,
    explain_parser_error,
    explain_trainer_error,
    full_traceback,
    one_line,
)
from template.engine.jobs.preemption import restore_signal_handlers, signal_handlers
from template.engine.jobs.processes import join_restarted_group
from template.engine.jobs.watchdog import HangWatchdog, dead_rank
from template.engine.logs.console import first_lines
from template.engine.logs.throughput import ThroughputLog
from template.engine.resume import checkpoints
from template.engine.resume.continuation import Run, continue_run
from template.engine.resume.states import RNGStateCheckpoint
from template.engine.runs import run_dir
from template.engine.runs.folder import (
    RunConfigCallback,
    RunFolders,
    RunOptions,
    newest_under,
    run_folder_arguments,
    run_name,
)
from template.engine.store import prove_writable
from template.engine.strategies.compile import CompileNetwork
from template.engine.strategies.devices import add_gpu_arguments
from template.engine.strategies.ema import EMAOptions
from template.engine.strategies.scaling import BatchScaling

PROGRAM = f"python -m {template.__name__}"

# The example the command line runs unless a config names another LightningModule or DataModule.
EXAMPLE = {"model": f"{template.__name__}.model.Classifier", "data": f"{template.__name__}.data.DigitsDataModule"}
# The parser's defaults for the model and data: the example's classes.
EXAMPLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"class_path": EXAMPLE["model"], "init_args": {"net": {"class_path": f"{template.__name__}.nets.MLP"}}},
    "data": {"class_path": EXAMPLE["data"]},
}
# The callbacks configured in sections of their own (--checkpoint.monitor, --scaling.batch_size...), by section.
CALLBACK_SECTIONS: dict[str, type[Callback]] = {
    "checkpoint": checkpoints.ModelCheckpoint,
    "scaling": BatchScaling,
    "watchdog": HangWatchdog,
    "compile": CompileNetwork,
    "throughput": ThroughputLog,
}
# What the example's best checkpoint is chosen by; a module chosen by class_path names its own (checkpoint.monitor).
EXAMPLE_MONITOR = {"checkpoint.monitor": "val_acc", "checkpoint.mode": "max"}


@dataclass(frozen=True)
class Command:
    """A subcommand: its line in ``--help``, and for one that is not LightningCLI's, ``module:function`` running it."""

    description: str
    runs: str | None = None


# Every subcommand, in the order --help lists them. A plain one (no Trainer) is one entry with `runs`.
COMMANDS: dict[str, Command] = {
    "fit": Command("Train (a named run continues from its newest checkpoint)"),
    "validate": Command("Evaluate a checkpoint on the validation data"),
    "test": Command("Evaluate a checkpoint on the test data"),
    "predict": Command("Write a checkpoint's predictions to a CSV file"),
    "export": Command("Write a checkpoint's network weights for plain PyTorch, or ONNX", f"{__package__}.export:main"),
    "tune": Command(
        "Find a learning rate or the largest batch (Lightning's Tuner): a config file", f"{__package__}.tune:main"
    ),
    "sweep": Command(
        "Search hyper-parameters with Optuna: each trial a fit in its own process (sweep: section)",
        f"{template.__name__}.engine.sweep:main",
    ),
    "cv": Command(
        "K-fold cross-validation, each fold a fit in its own process (--cv.folds)",
        f"{template.__name__}.engine.sweep:cv_main",
    ),
    "runs": Command(
        "List the runs under a folder in one table (status, best score, speed, config differences)",
        f"{template.__name__}.engine.runs.table:main",
    ),
}


def _described(method: Callable[..., Any], command: Command) -> Callable[..., Any]:
    """``method`` with the command's description as its docstring: LightningCLI's --help shows its first line."""

    @functools.wraps(method)
    def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    run.__doc__ = command.description
    return run


class DescribedTrainer(Trainer):
    """Lightning's Trainer, whose subcommand methods carry this command line's descriptions."""

    fit = _described(Trainer.fit, COMMANDS["fit"])
    validate = _described(Trainer.validate, COMMANDS["validate"])
    test = _described(Trainer.test, COMMANDS["test"])
    predict = _described(Trainer.predict, COMMANDS["predict"])


class ArgumentParser(LightningArgumentParser):
    """Reports a bad option or value as one ``error:`` line instead of usage text."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        print(f"error: {explain_parser_error(message)}", file=sys.stderr)
        self.exit(2)

    # A run dumps its parsed config twice (Lightning's hyper-parameters, config.yaml), each time validating it again
    # by default: ~30 ms each here, two thirds of a dump. The parse validated it; settle() adds only the engine's own.
    @override
    def dump(self, *args: Any, skip_validation: bool = True, **kwargs: Any) -> str:
        return super().dump(*args, skip_validation=skip_validation, **kwargs)

    @override
    def save(self, *args: Any, skip_validation: bool = True, **kwargs: Any) -> None:
        super().save(*args, skip_validation=skip_validation, **kwargs)


class CLI(LightningCLI):
    """The project's command line: ``python -m <package> {fit,validate,test,predict} --config configs/x.yaml``."""

    def __init__(self, *args: Any, started: list[CLI] | None = None, **kwargs: Any) -> None:
        # `started` gets this command line before it runs: its caller keeps it when the run raises.
        if started is not None:
            started.append(self)
        # The subcommand the command line names, if it names one first: only its parser is built (LightningCLI
        # builds a full parser for each of the four, three of them unused, a third of a second each here).
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        first = argv[0] if isinstance(argv, (list, tuple)) and argv else None
        self._only_subcommand = first if first in LightningCLI.subcommands() else None
        self.folders: RunFolders = kwargs.pop("folders", None) or RunFolders()  # what this command claims and creates
        super().__init__(*args, **kwargs)

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # a staticmethod in LightningCLI
        every = LightningCLI.subcommands()
        only = getattr(self, "_only_subcommand", None)
        return {only: every[only]} if only is not None else every

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        self.parser_class = ArgumentParser
        # argparse would otherwise take a misspelt prefix (--trainer.max_epoch) silently as the option it abbreviates.
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.sections = parser.groups  # trainer, model, data: `trainer:` in a config file must be a mapping
        for option, callback in CALLBACK_SECTIONS.items():
            parser.add_lightning_class_args(callback, option)
        add_gpu_arguments(parser)
        parser.add_class_arguments(RunOptions, "run", instantiate=False)
        parser.add_class_arguments(EMAOptions, "ema", instantiate=False)
        parser.add_argument(
            "--test_after_fit", type=bool, default=False, help="fit only: test the best checkpoint when fit ends"
        )
        parser.add_argument(
            "--trackers",
            type=list[Logger] | None,
            default=None,
            help="Experiment trackers (Lightning loggers, e.g. configs/mlflow.yaml) logging beside the CSV and "
            "TensorBoard logs",
        )
        parser.set_defaults(
            {
                # The example; any LightningModule and LightningDataModule replace them by class_path.
                **EXAMPLE_DEFAULTS,
                "checkpoint.save_last": True,
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        # The data knows its shapes: networks and metrics get them from it instead of hard-coding them. jsonargparse
        # applies a link only where the chosen model (and its `net`) has the argument.
        for attribute in ("num_classes", "input_shape"):
            parser.link_arguments(
                "data", f"model.init_args.net.init_args.{attribute}", _attribute(attribute), apply_on="instantiate"
            )
        parser.link_arguments("data", "model.init_args.num_classes", _attribute("num_classes"), apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # jsonargparse reports broken YAML without saying which file; name it first.
        args_list = sys.argv[1:] if args is None else list(args) if not isinstance(args, (dict, Namespace)) else []
        configs, options = config_files.split(args_list)
        files = {value: config_files.read(value) for value in configs}
        print_config = internals.print_config_action()
        # --print_config prints below, once the configuration is what the run will use.
        with print_config.skip_print_config():
            # jsonargparse hands a newly chosen class the example's values for the arguments it shares (a user's
            # DataModule would train with the digits' batch_size): with that class as the default it gets its own
            # signature's defaults and only what the configs set. The classes the configs and options name are made
            # the defaults before parsing; only where the parse chose others (a class named some other way) is the
            # command line parsed a second time, with those.
            named = _named_classes([*files.values()], options) if (subcommand := self._only_subcommand) else {}
            if named:
                parser.set_defaults({f"{subcommand}.{key}": value for key, value in named.items()})
            self._parse(parser, args)
            subcommand = self.config.get("subcommand")
            chosen = _chosen_classes(self.config[subcommand] if subcommand else self.config)
            if subcommand and chosen != named:
                parser.set_defaults(
                    {f"{subcommand}.{key}": chosen.get(key, EXAMPLE_DEFAULTS[key]) for key in {*chosen, *named}}
                )
                self._parse(parser, args)
        config_files.check_sections(files, self.sections, self.config[subcommand] if subcommand else self.config)
        settle(self.config[subcommand] if subcommand else self.config, subcommand)
        print_config.print_config_if_requested(parser, self.config)

    def _parse(self, parser: LightningArgumentParser, args: Any) -> None:
        # LightningCLI.parse_arguments without its warning that `args` and sys.argv are both given: `args` reach this
        # command line only from Python (a sweep building each trial's config, a test), where they are the ones meant.
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)

    @override
    def before_instantiate_classes(self) -> None:
        # Every class the parser builds is built through `self.builds`: a refusal names the option that built it.
        # Lightning registered its model and data instantiators for these types just before this hook; these replace
        # them, and the last one takes every other class (jsonargparse's default builds it the same way).
        self.builds = blame.Builds(self.config[self.subcommand] if self.subcommand else self.config, CALLBACK_SECTIONS)
        record = self.builds.recording
        # Lightning's model instantiator records every link in the hyper-parameters, also links jsonargparse did not
        # apply because a user's module has no such argument, and load_from_checkpoint then fails on a missing `net`.
        self.parser.add_instantiator(record(_AppliedLinksOnly(cli=self, key="model")), LightningModule, subclasses=True)
        data = internals.instantiator_class()(cli=self, key="data")
        self.parser.add_instantiator(record(data), LightningDataModule, subclasses=True)
        self.parser.add_instantiator(record(), object, subclasses=True)

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
            return
        except Exception as err:
            # jsonargparse wraps a ConfigError raised by a model or DataModule constructor in its own message.
            cause = config_error_in(err)
            if cause is not None:
                raise cause from None
            # A value a library refused while the parser built a class of the config (dropout=1.5, mode=maximum), or
            # a package it needs that is missing (a tracker's extra): one line naming the option that built it.
            built = self.builds.failure(err)
            config = self.config[self.subcommand] if self.subcommand else self.config
            values = built.values if built is not None else blame.leaves(config, "")
            refused = blame.refusal(err, built.option if built is not None else "the configuration", values)
            if refused is not None:
                raise refused from None
            # The user's own class refused its values: their exception and traceback, after a line naming the option.
            own = blame.users_exception(err) if built is not None else None
            if own is None:
                raise
        # Raised outside the except block, the user's exception is not chained to jsonargparse's wrapper around it.
        raise own

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        subcommand = self.subcommand or ""
        config = self.config[subcommand] if subcommand else self.config
        built = self.config_init[subcommand] if subcommand else self.config_init
        trainer_config = built.get("trainer") or {}
        run = continue_run(config) if subcommand == "fit" else Run(None, None, None, resume=False)
        kwargs = {
            **wiring.loggers(trainer_config, run, built.get("trackers") or [], config.get("trackers") or []),
            **wiring.plugins(trainer_config),
            **wiring.strategy(trainer_config, config.get("trainer.strategy"), built.get("watchdog")),
            **wiring.callbacks(
                trainer_config,
                subcommand,
                run,
                config.get("checkpoint.monitor"),
                config.get("ema"),
                built.get("trackers"),
            ),  # fmt: skip
            **run_folder_arguments(run.directory, trainer_config, built.get("checkpoint")),
            **kwargs,
        }

        def build() -> Trainer:
            wiring.check_devices(trainer_config)
            with wiring.process_group_timeout(built.get("watchdog")):
                trainer = super(CLI, self).instantiate_trainer(**kwargs)
            wiring.after_trainer(trainer, built.get("float32_matmul_precision"), trainer_config.get("callbacks"))
            rank_zero_info(first_lines(trainer, fit=subcommand == "fit"))
            return trainer

        return wiring.trainer_errors_as_config_errors(build, trainer_config)

    def before_fit(self) -> None:
        # Here, before Lightning launches the other DDP processes and calls the DataModule's hooks, a batch that
        # does not divide is reported once and the DataModule sees its per-process batch from the start.
        # Also before Lightning's process group: a torchrun restart needs one apart from the failed attempt's.
        subcommand = self.subcommand or "fit"
        config = self.config[subcommand] if self.subcommand else self.config
        preflight.check_trainer_counts(config)
        preflight.check_strategy(self.trainer, self.model)
        if subcommand == "fit":
            preflight.build_optimizers(config, self.model)
        elif config.get("ckpt_path") is None:
            print(
                f"warning: no --ckpt_path: {subcommand} runs on the module's untrained weights; pass a checkpoint "
                "(--ckpt_path FILE, or --ckpt_path last for the newest run's)",
                file=sys.stderr,
            )
        _claim_run_folder(self.folders, self.trainer, config, subcommand)
        if subcommand == "fit":
            checkpoints.resuming_in_place(self.trainer, config.get("ckpt_path"))
        join_restarted_group(self.trainer)
        for callback in self.trainer.callbacks:
            if isinstance(callback, BatchScaling):
                callback.apply_batch_size(self.trainer, self.datamodule)

    before_validate = before_test = before_fit

    def before_predict(self) -> None:
        self.before_fit()
        self.trainer.callbacks.append(PredictionWriter())

    def after_predict(self) -> None:
        writer = next(c for c in self.trainer.callbacks if isinstance(c, PredictionWriter))
        rank_zero_info(f"Predictions: {writer.path(self.trainer)}")

    def after_fit(self) -> None:
        if self._get(self.config, "test_after_fit"):
            evaluate_best(self.trainer, self.model, self.datamodule)
        line = wiring.best_checkpoint_line(self.trainer.checkpoint_callback)
        if line is not None:
            rank_zero_info(line)


def settle(config: Any, subcommand: str | None) -> None:
    """Make the subcommand's parsed config (in place) what the run will use; checkpoint paths are validated before
    anything reads them. Printed by --print_config and saved as config.yaml, so both show what the run uses.
    """
    if config.get("model.class_path") == EXAMPLE["model"] and config.get("checkpoint.monitor") is None:
        config["checkpoint.monitor"] = EXAMPLE_MONITOR["checkpoint.monitor"]
        if config.get("checkpoint.mode") == "min":  # ModelCheckpoint's default; a value of the user's stays theirs
            config["checkpoint.mode"] = EXAMPLE_MONITOR["checkpoint.mode"]
    monitor = config.get("checkpoint.monitor")
    if monitor is None and config.get("checkpoint.save_top_k") == 1:
        # Without a score, a second copy of last.ckpt under another name would be all "top k" keeps.
        config["checkpoint.save_top_k"] = 0
    if config.get("checkpoint.filename") is None and monitor:
        # The best checkpoint's name carries the score it was chosen by, whatever metric a module monitors.
        config["checkpoint.filename"] = f"best-{{epoch}}-{{{monitor}:.4f}}"
    ckpt_path = config.get("ckpt_path")
    if ckpt_path == "last":
        root = config.get("trainer.default_root_dir") or "."
        config["ckpt_path"] = ckpt_path = newest_under(root, config.get("checkpoint.dirpath"))
        rank_zero_info(f"Resuming from the newest checkpoint under '{root}': {ckpt_path}")
    if ckpt_path and ckpt_path not in checkpoints.SPECIAL_PATHS:
        # First: LightningCLI reads the file right after this hook, and a named run describes it.
        checkpoints.check(ckpt_path, strategy=config.get("trainer.strategy"))
    if subcommand == "fit":
        # The run's folder, and its newest checkpoint when the same command is started again.
        run = continue_run(config)
        config["ckpt_path"] = run.ckpt_path
        if (line := run.describe()) is not None:
            rank_zero_info(line)


def _claim_run_folder(folders: RunFolders, trainer: Trainer, config: Any, subcommand: str) -> None:
    """Create the run's folder (and a checkpoint folder of the user's), prove it writable and lock it for this process,
    before anything is written there."""
    dirpath = config.get("checkpoint.dirpath") if subcommand == "fit" else None
    if dirpath is not None and get_protocol(str(dirpath)) == "file":
        # The checkpoints' own folder, chosen by the user: a first checkpoint an epoch later must not be the one to
        # find it cannot be written. Remote stores (s3://...) are left to their own client.
        folders.prepare(dirpath, "--checkpoint.dirpath")
    name = run_name(config.get("run.name")) if subcommand == "fit" else None
    if name is None and (not trainer.loggers or trainer.log_dir is None):
        # Without a name or a logger there is no run folder of its own, only the root that checkpoints go to.
        prove_writable(config.get("trainer.default_root_dir") or ".", "--trainer.default_root_dir")
        return
    directory = run_dir(config.get("trainer.default_root_dir"), name) if name else trainer.log_dir
    folders.claim(directory, name, "--trainer.default_root_dir", trainer)


def _chosen_classes(config: Any) -> dict[str, dict[str, str]]:
    """The model and data classes a config names other than the example's, as parser defaults."""
    return {
        key: {"class_path": path}
        for key in ("model", "data")
        if (path := config.get(f"{key}.class_path")) is not None and path != EXAMPLE[key]
    }


def _named_classes(files: list[dict[str, Any]], options: list[str]) -> dict[str, dict[str, str]]:
    """The model and data classes other than the example's that the config files, then the other options on the
    command line, name by an importable ``class_path`` (the last one naming each wins), as parser defaults; a best
    guess, which the parse confirms."""
    named: dict[str, Any] = {}
    for content in files:
        for key in EXAMPLE:
            section = content.get(key)
            if isinstance(section, dict) and "class_path" in section:
                named[key] = section["class_path"]
            elif isinstance(section, str) or (section is None and key in content):
                named[key] = section
    for i, arg in enumerate(options):
        option, equals, value = arg.partition("=")
        if not equals and i + 1 < len(options):
            value = options[i + 1]
        for key in EXAMPLE:
            if option in (f"--{key}", f"--{key}.class_path"):
                named[key] = value
    return {
        key: {"class_path": path}
        for key, path in named.items()
        if isinstance(path, str) and path != EXAMPLE[key] and _is_class(path)
    }


def _is_class(path: str) -> bool:
    """Whether ``path`` (``package.module.Class``) names a class that imports."""
    module, _, name = path.rpartition(".")
    if not module or not name.isidentifier():
        return False
    try:
        return inspect.isclass(getattr(importlib.import_module(module), name, None))
    except Exception:
        return False  # the parse reports it


class _AppliedLinksOnly(internals.instantiator_class()):
    """Lightning's model instantiator, recording only the links that reached the model's arguments."""

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        applied = {k: v for k, v in applied_instantiation_links.items() if _reached(k, kwargs)}
        return super().__call__(class_type, *args, applied_instantiation_links=applied, **kwargs)


def _reached(link: str, kwargs: dict[str, Any]) -> bool:
    """Whether ``model.init_args.a`` or ``model.init_args.a.init_args.b`` is an argument of the built objects."""
    names = [name for name in link.split(".")[1:] if name != "init_args"]
    if not names or names[0] not in kwargs:
        return False
    if len(names) == 1:
        return True
    return len(names) == 2 and names[1] in inspect.signature(type(kwargs[names[0]])).parameters


class _attribute:  # noqa: N801 - used like a function in the links above
    """A link function reading ``name`` from the data module, or None when it has no such attribute.

    A class rather than a closure: ``ddp_spawn`` pickles the model, whose hyper-parameters hold the links.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, data: LightningDataModule) -> Any:
        value = getattr(data, self.name, None)
        return list(value) if isinstance(value, tuple) else value


class _NoAdvertisement(logging.Filter):
    """Drops Lightning's suggestions to install its cloud products; a run's output is about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip: For seamless cloud" not in record.getMessage()


def build_cli(
    args: list[str] | None = None,
    run: bool = True,
    cli_class: type[CLI] = CLI,
    started: list[CLI] | None = None,
    folders: RunFolders | None = None,
) -> CLI:
    """The command line as ``python -m <package>`` builds it: any LightningModule and DataModule by class_path;
    ``started`` gets the command line before it runs, ``folders`` holds the run folder it claims."""
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdvertisement) for f in rank_zero_log.filters):
        rank_zero_log.addFilter(_NoAdvertisement())
    return cli_class(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=1234,
        # Random states travel in every checkpoint so that a resumed run continues exactly.
        trainer_defaults={"callbacks": [RNGStateCheckpoint()]},
        # A restart of the same run keeps its config.yaml instead of refusing to start.
        save_config_callback=RunConfigCallback,
        trainer_class=DescribedTrainer,
        parser_kwargs={"prog": PROGRAM, "description": _plain_commands_help()},
        args=args,
        run=run,
        started=started,
        folders=folders,
    )


def _plain_commands_help() -> str | None:
    plain = {name: c for name, c in COMMANDS.items() if c.runs is not None}
    if not plain:
        return None
    listed = "; ".join(f"{name}: {c.description}" for name, c in plain.items())
    return f"Also: {listed}. Each subcommand has its own --help."


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m <package>`` and of the console script of the same name."""
    # Lightning 2.6 trips over its own deprecation in torch's pytree on every run; it is not the user's to fix.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # Evaluating a checkpoint logs into a new version folder; Lightning warns that the old folder is not reused.
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    # torchdata's StatefulDataLoader calls a torch API that torch deprecated; nothing for the user to change.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")
    argv = sys.argv[1:] if args is None else list(args)
    handlers = signal_handlers()
    started: list[CLI] = []  # the command line, kept when its run raises: its trainer knows what ended the job
    folders = RunFolders()
    try:
        command = COMMANDS.get(argv[0]) if argv else None
        if command is not None and command.runs is not None:
            # A command of its own: no LightningCLI (sweep starts fit processes).
            module, function = command.runs.split(":")
            code = getattr(importlib.import_module(module), function)(argv[1:])
            if code:
                sys.exit(code)
            return
        build_cli(args, started=started, folders=folders)
    except Exception as err:
        code, line = _verdict(err, getattr(started[0], "trainer", None) if started else None)
        if code is None:
            # The user's code, another library or the engine: the traceback is the report. Say first whose code it is.
            blame.print_user_code_line(err)
            raise
        if code in (2, 3):
            # A mistake or the disk: a folder this command created is removed again, unless training had started.
            folders.discard_unstarted()
        if full_traceback():
            traceback.print_exc()
        print(f"error: {line}", file=sys.stderr)
        sys.exit(code)
    finally:
        folders.release()
        if args is not None:
            # Called from Python, which goes on. Run as the program (argv), the process ends with the command: the
            # run's handlers stay, so that a signal during the interpreter's shutdown is reported, not silent.
            restore_signal_handlers(handlers)


def _verdict(err: Exception, trainer: Trainer | None) -> tuple[int | None, str]:
    """The exit code and the one line for a mistake (2), a failure of the disk (3) or a rank of the job that died
    (128 + its signal, or its exit code); (None, "") for anything else."""
    if (config := config_error_in(err)) is not None:
        return 2, str(config)
    if (disk := disk_error_in(err)) is not None:
        return 3, str(disk)
    if (dead := dead_rank(err, trainer)) is not None:
        return dead.exit_code, f"{dead.line()} ({TRACEBACK_VARIABLE}=1 shows this rank's traceback)"
    if blame.user_function_calling(err) is None and blame.refused_by(err, package="lightning") is not None:
        # Lightning alone refused a Trainer setting when it met the data (val_check_interval above an epoch's batches).
        return 2, explain_trainer_error(one_line(blame.root_cause(err)))
    return None, ""
