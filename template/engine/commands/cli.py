"""The command line: LightningCLI with the project's defaults, and ``main``, where every failure is reported.

What the command line adds to a Trainer is in ``wiring.py``; this module calls it from LightningCLI's hooks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import pkgutil
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsspec.utils import get_protocol
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

import template
from template.engine import internals
from template.engine.commands import preflight, wiring
from template.engine.commands.wiring import PredictionWriter, evaluate_best
from template.engine.errors import (
    TRACEBACK_VARIABLE,
    ConfigError,
    blame,
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
from template.engine.runs.remote import is_remote
from template.engine.store import prove_writable
from template.engine.strategies.compile import CompileNetwork
from template.engine.strategies.devices import add_gpu_arguments
from template.engine.strategies.ema import EMAOptions
from template.engine.strategies.fsdp import is_fsdp
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
    """Dumps a config without validating it again: the parse validated it, ``settle`` adds only the engine's values."""

    @override
    def dump(self, *args: Any, skip_validation: bool = True, **kwargs: Any) -> str:
        return super().dump(*args, skip_validation=skip_validation, **kwargs)

    @override
    def save(self, *args: Any, skip_validation: bool = True, **kwargs: Any) -> None:
        super().save(*args, skip_validation=skip_validation, **kwargs)


class CLI(LightningCLI):
    """The project's command line: ``python -m <package> {fit,validate,test,predict} --config configs/x.yaml``."""

    fit_run: Run | None = None  # what a fit continues (continuation.continue_run), found once by the parse

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only the parser of the subcommand the command line names first is built, not all four.
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
        kwargs.setdefault("exit_on_error", False)  # raise what it refuses: main reports it in one line
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
        # The example's classes; any LightningModule and LightningDataModule replace them by class_path.
        parser.set_defaults(
            {**EXAMPLE_DEFAULTS, "checkpoint.save_last": True, "checkpoint.auto_insert_metric_name": False}
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
        argv = sys.argv[1:] if args is None else [] if isinstance(args, (dict, Namespace)) else list(args)
        files = {value: preflight.read(value) for value in preflight.split(argv)[0]}  # a broken file, by its name
        print_config = internals.print_config_action()
        with print_config.skip_print_config():  # printed below, once the config is what the run will use
            # jsonargparse hands a newly chosen class the example's values for the arguments it shares (a user's
            # DataModule would train with the digits' batch_size); as the parser's default it gets its own. The
            # classes the command line names are the defaults of the parse; where it chose others, it runs again.
            named = _named_classes(argv, files) if (subcommand := self._only_subcommand) else {}
            if named:
                parser.set_defaults({f"{subcommand}.{key}": value for key, value in named.items()})
            self._parse(parser, args)
            subcommand = self.config.get("subcommand")
            chosen = _chosen_classes(_of_subcommand(self.config))
            if subcommand and chosen != named:
                parser.set_defaults(
                    {f"{subcommand}.{key}": chosen.get(key, EXAMPLE_DEFAULTS[key]) for key in {*chosen, *named}}
                )
                self._parse(parser, args)
        config = _of_subcommand(self.config)
        preflight.check_sections(files, self.sections, config)
        self.fit_run = settle(config, subcommand, self.folders)
        print_config.print_config_if_requested(parser, self.config)

    def _parse(self, parser: LightningArgumentParser, args: Any) -> None:
        # LightningCLI.parse_arguments without its warning that `args` and sys.argv are both given: `args` reach this
        # command line only from Python (a sweep building each trial's config, a test), where they are the ones meant.
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)

    @override
    def before_instantiate_classes(self) -> None:
        # Every class of the config is built by an Instantiator, so that a refusal names the option that built it:
        # these wrap the model and data instantiators Lightning has just registered, the last takes every other class.
        config = _of_subcommand(self.config)

        def instantiator(wrapped: Callable[..., Any] | None = None) -> blame.Instantiator:
            return blame.Instantiator(config, CALLBACK_SECTIONS, wrapped)

        # Lightning's model instantiator records every link in the hyper-parameters, also links jsonargparse did not
        # apply because a user's module has no such argument, and load_from_checkpoint then fails on a missing `net`.
        model = _AppliedLinksOnly(cli=self, key="model")
        self.parser.add_instantiator(instantiator(model), LightningModule, subclasses=True)
        data = internals.instantiator_class()(cli=self, key="data")
        self.parser.add_instantiator(instantiator(data), LightningDataModule, subclasses=True)
        self.parser.add_instantiator(instantiator(), object, subclasses=True)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        subcommand, config, built = self.subcommand or "", _of_subcommand(self.config), _of_subcommand(self.config_init)
        trainer_config = built.get("trainer") or {}
        run = self.fit_run or Run(None, None, None, resume=False)
        remote = self.folders.remote
        local = {"default_root_dir": str(remote.local)} if remote is not None else {}  # its local copy
        kwargs = {
            **wiring.loggers(trainer_config, run, built.get("trackers") or [], config.get("trackers") or [], remote),
            **wiring.plugins(trainer_config, remote),
            **wiring.strategy(trainer_config, config.get("trainer.strategy"), built.get("watchdog")),
            **wiring.callbacks(
                trainer_config,
                subcommand,
                run,
                config.get("checkpoint.monitor"),
                config.get("ema"),
                built.get("trackers"),
            ),
            **run_folder_arguments(run.directory, trainer_config, built.get("checkpoint")),
            **local,
            **kwargs,
        }
        try:
            wiring.check_devices(trainer_config)
            with wiring.process_group_timeout(built.get("watchdog")):
                trainer = super().instantiate_trainer(**kwargs)
            self.folders.trainer = trainer  # main asks it what ended the job, and whether training started
            wiring.after_trainer(trainer, built.get("float32_matmul_precision"), trainer_config.get("callbacks"))
        except (MisconfigurationException, ValueError, TypeError) as err:
            if isinstance(err, TypeError) and "devices" not in str(err):
                raise
            # Lightning's complaint about the Trainer's arguments, said here where their values are known.
            raise ConfigError(explain_trainer_error(one_line(err), trainer_config.get("devices"))) from None
        rank_zero_info(first_lines(trainer, fit=subcommand == "fit"))
        return trainer

    def before_fit(self) -> None:
        # Here, before Lightning launches the other DDP processes and calls the DataModule's hooks, a batch that
        # does not divide is reported once and the DataModule sees its per-process batch from the start.
        # Also before Lightning's process group: a torchrun restart needs one apart from the failed attempt's.
        subcommand, config = self.subcommand or "fit", _of_subcommand(self.config)
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


def settle(config: Any, subcommand: str | None, folders: RunFolders | None = None) -> Run | None:
    """Make the subcommand's parsed config (in place) what the run will use, as --print_config prints it and
    config.yaml saves it; the checkpoint is validated before anything reads it. For fit, the run it continues."""
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
    folders = folders or RunFolders()
    _refuse_what_object_storage_cannot_hold(config, subcommand)
    ckpt_path = config.get("ckpt_path")
    if ckpt_path == "last":
        root = config.get("trainer.default_root_dir") or "."
        config["ckpt_path"] = ckpt_path = newest_under(root, config.get("checkpoint.dirpath"))
        rank_zero_info(f"Resuming from the newest checkpoint under '{root}': {ckpt_path}")
    if is_remote(ckpt_path):
        ckpt_path = folders.download(ckpt_path, "--ckpt_path", config.get("run.storage_options"))
        config["ckpt_path"] = ckpt_path
    if ckpt_path and ckpt_path not in checkpoints.SPECIAL_PATHS:
        checkpoints.check(ckpt_path, strategy=config.get("trainer.strategy"))  # named for --ckpt_path
    if subcommand != "fit":
        return None
    # The run's folder, and its newest checkpoint when the same command is started again.
    run = continue_run(config, folders)
    config["ckpt_path"] = run.ckpt_path
    if (line := run.describe()) is not None:
        rank_zero_info(line)
    return run


def _refuse_what_object_storage_cannot_hold(config: Any, subcommand: str | None) -> None:
    """One line for a run on object storage that could not keep its guarantees there."""
    if is_remote(dirpath := config.get("checkpoint.dirpath")):
        raise ConfigError(
            f"checkpoint.dirpath={dirpath} is on object storage: set trainer.default_root_dir there instead, and the "
            "run's checkpoints go to its folder with the run's guarantees (uploads in order, the newest named last)"
        )
    root = config.get("trainer.default_root_dir")
    if not is_remote(root) or subcommand is None:  # None: a config parsed for a sweep's trials, not run
        return
    if subcommand != "fit":
        raise ConfigError(
            f"trainer.default_root_dir={root}: {subcommand} writes its logs into a new local folder; keep "
            "default_root_dir local (--ckpt_path may name a checkpoint on object storage)"
        )
    if run_name(config.get("run.name")) is None:
        raise ConfigError(
            f"trainer.default_root_dir={root} is on object storage: a run there needs a name (--run.name, or the "
            "scheduler's job id), by which the same command finds it again"
        )
    if config.get("checkpoint.save_last") == "link":
        raise ConfigError(
            "checkpoint.save_last=link makes last.ckpt a symbolic link, which object storage does not have; use "
            "checkpoint.save_last: true"
        )
    if is_fsdp(config.get("trainer.strategy")):
        raise ConfigError(
            f"strategy fsdp writes each checkpoint as a folder of shards, which trainer.default_root_dir={root} "
            "(object storage) cannot replace whole; train with strategy ddp there, or keep fsdp runs on a shared disk"
        )


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
    directory = run_dir(folders.root(config.get("trainer.default_root_dir")), name) if name else trainer.log_dir
    folders.claim(directory, name, "--trainer.default_root_dir", trainer)


def _of_subcommand(config: Any) -> Any:
    """The part of a parsed (or built) config that the subcommand being run reads."""
    return config[config["subcommand"]] if config.get("subcommand") else config


def _chosen_classes(config: Any) -> dict[str, dict[str, str]]:
    """The model and data classes a parsed config names other than the example's, as parser defaults."""
    return {
        key: {"class_path": path}
        for key in EXAMPLE
        if (path := config.get(f"{key}.class_path")) is not None and path != EXAMPLE[key]
    }


def _named_classes(argv: list[str], files: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The model and data classes other than the example's that the command line names by an importable class
    path, in a config file (``files``: each one's options) or by ``--model``/``--data``, the last naming each
    winning, as parser defaults: a guess, which the parse confirms."""
    named: dict[str, Any] = {}
    options = [f"--{key}{end}" for key in EXAMPLE for end in ("", ".class_path")]
    for option, value in preflight.split_options(argv, *preflight.CONFIG_OPTIONS, *options)[0]:
        if option not in preflight.CONFIG_OPTIONS:
            named[option[2:].split(".")[0]] = value
            continue
        for key, section in files[value].items():
            if key in EXAMPLE and (section is None or isinstance(section, (str, dict))):  # null: the example's again
                named[key] = section.get("class_path", named.get(key)) if isinstance(section, dict) else section
    return {
        key: {"class_path": path}
        for key, path in named.items()
        if isinstance(path, str) and path != EXAMPLE[key] and inspect.isclass(blame.located(path))
    }


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
    """A link function reading ``name`` from the data module (None when it has none). A class, not a closure:
    ``ddp_spawn`` pickles the model, whose hyper-parameters hold the links."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, data: LightningDataModule) -> Any:
        value = getattr(data, self.name, None)
        return list(value) if isinstance(value, tuple) else value


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Library warnings and tips that are nothing for the user to act on, silenced while the command runs: Lightning's
    suggestions to install its cloud products among them (a run's output is about the run)."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.addFilter(advertisement := lambda record: "Tip: For seamless cloud" not in record.getMessage())
    try:
        with warnings.catch_warnings():
            # Lightning trips over its own deprecation in torch's pytree; torchdata's StatefulDataLoader calls a
            # torch API that torch deprecated; evaluating a checkpoint logs into a new version folder, and Lightning
            # warns that the old folder is not reused.
            for message in (
                r".*isinstance\(treespec, LeafSpec\)",
                r"'set_vital' is deprecated",
                "The dirpath has changed from",
            ):
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        rank_zero.removeFilter(advertisement)


def build_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[CLI] = CLI, folders: RunFolders | None = None
) -> CLI:
    """The command line as ``python -m <package>`` builds it: any LightningModule and DataModule by class_path;
    ``folders`` (the command's) holds the run folder it claims and the trainer it builds."""
    plain = "; ".join(f"{name}: {c.description}" for name, c in COMMANDS.items() if c.runs is not None)
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
        parser_kwargs={"prog": PROGRAM, "description": f"Also: {plain}. Each subcommand has its own --help."},
        args=args,
        run=run,
        folders=folders,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m <package>`` and of the console script of the same name. Every failure is reported
    here: one ``error:`` line and its exit code (``blame.verdict``), or the user's exception with its traceback."""
    argv = sys.argv[1:] if args is None else list(args)
    handlers = signal_handlers()
    folders = RunFolders()
    own: BaseException | None = None
    reported = False
    try:
        with _quiet_libraries():
            command = COMMANDS.get(argv[0]) if argv else None
            if command is None or command.runs is None:
                build_cli(argv, folders=folders)
            elif code := pkgutil.resolve_name(command.runs)(argv[1:]):  # a command of its own, without LightningCLI
                sys.exit(code)
    except Exception as err:
        reported = True
        own = _report(err, folders)
        if own is err:
            raise
    finally:
        failure = folders.release()  # on object storage: the run's last uploads, waited for here
        if args is not None:
            # Called from Python, which goes on. Run as the program (argv), the process ends with the command: the
            # run's handlers stay, so that a signal during the interpreter's shutdown is reported, not silent.
            restore_signal_handlers(handlers)
        if failure is not None and not reported:
            print(f"error: {failure}", file=sys.stderr)
            sys.exit(3)
    if own is not None:
        raise own  # the user's, unwrapped from the parser's message: its traceback is theirs


def _report(err: Exception, folders: RunFolders) -> BaseException:
    """A mistake (2), the disk (3) or a dead rank: its line, and the process ends with its exit code. Else the line
    naming the user's function that raised, and the exception to raise with its traceback."""
    found = blame.verdict(err, dead=lambda e: _dead_rank(e, folders.trainer))
    if found is None:
        if (line := blame.user_code_line(err)) is not None:
            print(line, file=sys.stderr, flush=True)
        return blame.users_exception(err)
    code, line = found
    if code in (2, 3):
        folders.discard_unstarted()  # a folder this command created is removed again, unless training had started
    if full_traceback():
        traceback.print_exception(err)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(code)


def _dead_rank(err: BaseException, trainer: Trainer | None) -> tuple[int, str] | None:
    """The exit code and the line for the rank of the job whose death made this process fail with ``err``."""
    dead = dead_rank(err, trainer)
    if dead is None:
        return None
    return dead.exit_code, f"{dead.line()} ({TRACEBACK_VARIABLE}=1 shows this rank's traceback)"
