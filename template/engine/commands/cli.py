"""The command line: LightningCLI with the project's defaults (``CLI``, ``build_cli``), and ``main``, which reports
every failure. What it adds to a Trainer is ``trainer_arguments``'; the predictions file ``predictions``'."""

from __future__ import annotations

import functools
import inspect
import json
import pkgutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

import template
from template.engine import errors, internals
from template.engine.commands import COMMANDS, PROGRAM, preflight
from template.engine.commands.predictions import PredictionWriter
from template.engine.commands.quiet import quiet_libraries
from template.engine.commands.trainer_arguments import (
    callbacks,
    listed,
    loggers,
    plugins,
    process_group_timeout,
    strategy,
)
from template.engine.errors import ConfigError, blame
from template.engine.jobs.preemption import command_ended, defer_signals, signal_handlers
from template.engine.jobs.processes import RankWatchdog, dead_rank, join_restarted_group
from template.engine.logs.console import ThroughputLog, first_lines
from template.engine.resume import checkpoints
from template.engine.resume.continuation import Run, continue_run
from template.engine.resume.states import ExactResume
from template.engine.runs import folder, run_dir
from template.engine.runs.folder import RunConfigCallback, RunFolders, RunOptions, newest_under, run_folder_arguments
from template.engine.runs.remote import is_remote
from template.engine.store import atomic_write, prove_writable
from template.engine.strategies import FSDP2Strategy, check_dp_trainer_config, devices, fsdp  # registers dp
from template.engine.strategies.compile import CompileNetwork
from template.engine.strategies.ema import EMAOptions
from template.engine.strategies.scaling import BatchScaling

# The example the command line runs unless a config names another LightningModule or DataModule.
EXAMPLE = {"model": f"{template.__name__}.model.Classifier", "data": f"{template.__name__}.data.DigitsDataModule"}
EXAMPLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"class_path": EXAMPLE["model"], "init_args": {"net": {"class_path": f"{template.__name__}.nets.MLP"}}},
    "data": {"class_path": EXAMPLE["data"]},
}
# The callbacks configured in sections of their own (--checkpoint.monitor, --scaling.batch_size...).
CALLBACK_SECTIONS: dict[str, type[Callback]] = {
    "checkpoint": checkpoints.ModelCheckpoint,
    "scaling": BatchScaling,
    "watchdog": RankWatchdog,
    "compile": CompileNetwork,
    "throughput": ThroughputLog,
}


def _described(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with its command's description as the docstring's first line, which LightningCLI's --help shows; its
    arguments' lines (``Args:``) follow."""

    @functools.wraps(method)
    def run(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    run.__doc__ = f"{COMMANDS[method.__name__].description}\n\n{inspect.cleandoc(method.__doc__ or '')}"
    return run


class DescribedTrainer(Trainer):
    """Lightning's Trainer, whose subcommand methods carry this command line's descriptions."""

    def predict(self, *args: Any, predictions: str | None = None, **kwargs: Any) -> Any:
        """Lightning's ``predict``, writing the predictions to a CSV file, one row per sample in the input's order.

        Args:
            predictions: the CSV file to write (default: predictions.csv in the log folder)
        """
        self.callbacks.append(PredictionWriter(predictions))
        return super().predict(*args, **kwargs)

    fit = _described(Trainer.fit)
    validate = _described(Trainer.validate)
    test = _described(Trainer.test)
    predict = _described(predict)


class ArgumentParser(LightningArgumentParser):
    """Dumps a config without validating it again: the parse validated it; ``parse_arguments`` adds only the engine's
    values."""

    dump = functools.partialmethod(LightningArgumentParser.dump, skip_validation=True)
    save = functools.partialmethod(LightningArgumentParser.save, skip_validation=True)


class CLI(LightningCLI):
    """The project's command line: ``python -m <package> {fit,validate,test,predict} --config configs/x.yaml``."""

    fit_run: Run | None = None  # what a fit continues, found once by the parse

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only the parser of the subcommand the command line names first is built, not all four.
        given = kwargs.get("args")
        argv = sys.argv[1:] if given is None else list(given) if isinstance(given, (list, tuple)) else []
        self._only_subcommand = argv[0] if argv and argv[0] in LightningCLI.subcommands() else None
        self.folders: RunFolders = kwargs.pop("folders", None) or RunFolders()  # what this command claims and creates
        super().__init__(*args, **kwargs)

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # a staticmethod in LightningCLI
        every = LightningCLI.subcommands()
        return {self._only_subcommand: every[self._only_subcommand]} if self._only_subcommand else every

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # argparse would otherwise take a misspelt prefix (--trainer.max_epoch) silently as the option it abbreviates.
        return super().init_parser(**{"allow_abbrev": False, "exit_on_error": False, **kwargs})

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.parsers = [*getattr(self, "parsers", []), parser]  # one per subcommand built (or the only one)
        for option, callback in CALLBACK_SECTIONS.items():
            parser.add_lightning_class_args(callback, option)
        devices.add_gpu_arguments(parser)
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
            {**EXAMPLE_DEFAULTS, "checkpoint.save_last": True, "checkpoint.auto_insert_metric_name": False}
        )
        # The data knows its shapes: networks and metrics get them from it. jsonargparse applies a link only where the
        # chosen model (and its `net`) has the argument.
        for target in ("net.init_args.num_classes", "net.init_args.input_shape", "num_classes"):
            read = functools.partial(_attribute, target.split(".")[-1])
            parser.link_arguments("data", f"model.init_args.{target}", read, apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        argv = sys.argv[1:] if args is None else [] if isinstance(args, (dict, Namespace)) else list(args)
        files = {value: preflight.read(value) for value in preflight.split(argv)[0]}  # a broken file, by its name
        print_config = internals.print_config_action()
        with print_config.skip_print_config():  # printed below, once the config is what the run will use
            # jsonargparse hands a class chosen in place of another (the example's, a signature's default) that one's
            # values for the arguments they share. The model and data the files and options name are the defaults of
            # the first parse; where it chose a class in place of another at any depth, the classes chosen are the
            # defaults of a second, the last: each gets its own signature's defaults, for every command.
            self._parse(parser, args, _named_classes(argv, files), files)
            chosen = _class_paths(_of_subcommand(self.config))
            replaced = _class_paths(self.parsers[-1].get_defaults(skip_validation=True))
            # Compared as classes: a default's path is the shortest (lightning.pytorch.demos.BoringModel).
            if any(blame.located(replaced.get(key, "")) not in (None, blame.located(p)) for key, p in chosen.items()):
                self._parse(parser, args, Namespace(chosen).as_dict(), files)
        config = _of_subcommand(self.config)
        preflight.check_sections(files, self.parsers[-1].groups, config)  # trainer, model, data: each a mapping
        # What the run will use, as --print_config prints it and config.yaml saves it.
        subcommand = self.config.get("subcommand")
        checkpoint_defaults(config)
        folder.refuse_what_object_storage_cannot_hold(config, subcommand)
        resolve_ckpt_path(config, self.folders)
        if subcommand == "fit":  # the run's folder, and its newest checkpoint when the same command restarts
            self.fit_run = continue_run(config, self.folders)
            config["ckpt_path"] = self.fit_run.ckpt_path
            if (line := self.fit_run.describe()) is not None:
                rank_zero_info(line)
        print_config.print_config_if_requested(parser, self.config)

    def _parse(self, parser: LightningArgumentParser, args: Any, defaults: dict[str, Any], files: dict) -> None:
        """Parse with ``defaults`` for the model and data; a refusal is named with the config file that set the
        option, where one did. LightningCLI's parse, without its warning that ``args`` and sys.argv are both given:
        from Python ``args`` are meant."""
        for each in self.parsers:
            each.set_defaults(defaults)
        try:
            self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        except ArgumentError as err:
            raise errors.parser_error(err, files=files) from None

    @override
    def before_instantiate_classes(self) -> None:
        # Every class is built by a blame.Instantiator, so that a refusal names the option that built it. Lightning's
        # model instantiator records even links jsonargparse did not apply, which load_from_checkpoint then misses.
        config = _of_subcommand(self.config)
        if (path := config.get("predictions")) is not None and Path(path).is_dir():
            raise ConfigError(f"--predictions={path} is a folder; name a file, e.g. --predictions={path}/new.csv")
        model = _AppliedLinksOnly(cli=self, key="model")
        data = internals.instantiator_class()(cli=self, key="data")
        for wrapped, cls in ((model, LightningModule), (data, LightningDataModule), (None, object)):
            self.parser.add_instantiator(blame.Instantiator(config, CALLBACK_SECTIONS, wrapped), cls, subclasses=True)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        subcommand, config, built = self.subcommand or "", _of_subcommand(self.config), _of_subcommand(self.config_init)
        trainer_config, watchdog, trackers = built.get("trainer") or {}, built.get("watchdog"), built.get("trackers")
        run = self.fit_run or Run(None, None, None, resume=False)
        remote = self.folders.remote
        local = {"default_root_dir": str(remote.local)} if remote is not None else {}  # its local copy
        kwargs = {
            **loggers(trainer_config, run, trackers or [], config, remote, subcommand),
            **plugins(trainer_config, remote),
            **strategy(trainer_config, config.get("trainer.strategy"), watchdog),
            **callbacks(trainer_config, subcommand, run, config.get("checkpoint.monitor"), config.get("ema"), trackers),
            **run_folder_arguments(run.directory, trainer_config, built.get("checkpoint")),
            **local,
            **kwargs,
        }
        try:
            # Before Lightning's less helpful checks.
            devices.hide_gpus_from_cpu_run(trainer_config)
            devices.resolve_free_devices(trainer_config)
            check_dp_trainer_config(trainer_config)
            fsdp.check_fsdp_trainer_config(trainer_config)
            with process_group_timeout(watchdog):
                trainer = super().instantiate_trainer(**kwargs)
            self.folders.trainer = trainer  # main asks it what ended the job, and whether training started
            devices.apply_matmul_precision(built.get("float32_matmul_precision"), trainer)
            users = {id(c) for c in listed(trainer_config.get("callbacks"))}
            for callback in trainer.callbacks:
                if id(callback) not in users:
                    internals.skip_idle_step_hooks(callback)
            # Lightning compares devices x num_nodes with what torchrun or SLURM started only inside fit, with a
            # traceback from every process: here the mismatch is one line.
            launcher = getattr(trainer.strategy, "launcher", None)
            if getattr(launcher, "cluster_environment", None) is not None:
                launcher.cluster_environment.validate_settings(launcher.num_processes, launcher.num_nodes)
        except (MisconfigurationException, ValueError, TypeError) as err:
            if isinstance(err, TypeError) and "devices" not in str(err):
                raise
            # Lightning's complaint about the Trainer's arguments, said here where their values are known.
            raise ConfigError(
                errors.explain_trainer_error(errors.one_line(err), trainer_config.get("devices"))
            ) from None
        rank_zero_info(first_lines(trainer, fit=subcommand == "fit"))
        return trainer

    def before_fit(self) -> None:
        # Before Lightning launches the other DDP processes and calls the DataModule's hooks (a batch that does not
        # divide is reported once), and before its process group (a torchrun restart needs one of its own).
        subcommand, config = self.subcommand or "fit", _of_subcommand(self.config)
        preflight.check_trainer_counts(config)
        if isinstance(self.trainer.strategy, FSDP2Strategy):
            self.trainer.strategy.check_module(self.model)
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
        if (path := _of_subcommand(self.config).get("predictions")) is not None:
            self.folders.prepare(Path(path).absolute().parent, "--predictions")  # not found unwritable at the end

    def after_predict(self) -> None:
        writer = next(c for c in self.trainer.callbacks if isinstance(c, PredictionWriter))
        rank_zero_info(f"Predictions: {writer.path(self.trainer)}")

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        if _of_subcommand(self.config).get("test_after_fit"):
            # The best checkpoint (else the last weights), logged into the run's logs and to its test-results.json.
            best = getattr(checkpoint, "best_model_path", "") or None
            rank_zero_info(f"Testing {best or 'the final weights (no best checkpoint: checkpoint.monitor is unset)'}")
            results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path="best" if best else None)
            log_dir = self.trainer.log_dir  # on every rank: Lightning broadcasts it from rank 0
            if self.trainer.is_global_zero and log_dir is not None:
                text = json.dumps({"checkpoint": best, "results": results}, indent=1)
                atomic_write(Path(log_dir) / "test-results.json", lambda f: f.write(text.encode()))
        # A user's extra ModelCheckpoint without a monitor can come first: it has a path but no score.
        if checkpoint is not None and checkpoint.best_model_path and checkpoint.best_model_score is not None:
            score = float(checkpoint.best_model_score)
            rank_zero_info(f"Best checkpoint: {checkpoint.best_model_path} ({checkpoint.monitor}={score:.4f})")


def checkpoint_defaults(config: Any) -> None:
    """The checkpoint options that follow from the others, set in the parsed config (as --print_config prints it and
    config.yaml saves it): the example's monitor, no "best" copy without a score, a file name naming the score."""
    if config.get("model.class_path") == EXAMPLE["model"] and config.get("checkpoint.monitor") is None:
        config["checkpoint.monitor"] = "val_acc"  # what the example's best checkpoint is chosen by
        if config.get("checkpoint.mode") == "min":  # ModelCheckpoint's default; a value of the user's stays theirs
            config["checkpoint.mode"] = "max"
    monitor = config.get("checkpoint.monitor")
    if monitor is None and config.get("checkpoint.save_top_k") == 1:
        # Without a score, a second copy of last.ckpt under another name would be all "top k" keeps.
        config["checkpoint.save_top_k"] = 0
    if config.get("checkpoint.filename") is None and monitor:
        config["checkpoint.filename"] = f"best-{{epoch}}-{{{monitor}:.4f}}"


def resolve_ckpt_path(config: Any, folders: RunFolders) -> None:
    """--ckpt_path made the local file the run reads (``last``: the newest under the root; a remote one downloaded)
    and checked before anything reads it."""
    ckpt_path = config.get("ckpt_path")
    if ckpt_path == "last":
        root = config.get("trainer.default_root_dir") or "."
        config["ckpt_path"] = ckpt_path = newest_under(root, config.get("checkpoint.dirpath"))
        rank_zero_info(f"Resuming from the newest checkpoint under '{root}': {ckpt_path}")
    if is_remote(ckpt_path):
        config["ckpt_path"] = ckpt_path = folders.download(ckpt_path, "--ckpt_path", config.get("run.storage_options"))
    if ckpt_path and ckpt_path not in checkpoints.SPECIAL_PATHS:
        checkpoints.check(ckpt_path, strategy=config.get("trainer.strategy"))  # named for --ckpt_path


def _claim_run_folder(folders: RunFolders, trainer: Trainer, config: Any, subcommand: str) -> None:
    """Create the run's folder (and the user's checkpoint folder), prove it writable and lock it, before any write."""
    dirpath = config.get("checkpoint.dirpath") if subcommand == "fit" else None
    if dirpath is not None and not is_remote(str(dirpath)):
        # Not found unwritable by the first checkpoint an epoch later; remote stores (s3://) are their client's.
        folders.prepare(dirpath, "--checkpoint.dirpath")
    name = folder.run_name(config.get("run.name")) if subcommand == "fit" else None
    if name is None and (not trainer.loggers or trainer.log_dir is None):
        # Without a name or a logger there is no run folder, only the root that checkpoints go to.
        prove_writable(config.get("trainer.default_root_dir") or ".", "--trainer.default_root_dir")
        return
    directory = run_dir(folders.root(config.get("trainer.default_root_dir")), name) if name else trainer.log_dir
    folders.claim(directory, name, "--trainer.default_root_dir")


def _of_subcommand(config: Any) -> Any:
    return config[config["subcommand"]] if config.get("subcommand") else config


def _named_classes(argv: list[str], files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The model and data classes ``argv`` names in a config file (``files``) or by ``--model``/``--data``, else the
    example's, as parser defaults."""
    named: dict[str, Any] = {}
    options = [f"--{key}{end}" for key in EXAMPLE for end in ("", ".class_path")]
    for option, value in preflight.split_options(argv, *preflight.CONFIG_OPTIONS, *options)[0]:
        sections = files[value] if option in preflight.CONFIG_OPTIONS else {option[2:].split(".")[0]: value}
        for key, section in sections.items():
            if key in EXAMPLE:  # null (or a list, refused later): the example's again
                named[key] = section.get("class_path", named.get(key)) if isinstance(section, dict) else section
    chosen = {
        k: p for k, p in named.items() if isinstance(p, str) and p != EXAMPLE[k] and inspect.isclass(blame.located(p))
    }
    return {key: {"class_path": chosen[key]} if key in chosen else EXAMPLE_DEFAULTS[key] for key in EXAMPLE}


def _class_paths(config: Namespace) -> dict[str, str]:
    """The class paths of the model and data in ``config``, at every depth, by their dotted keys."""
    return {k: v for k, v in config.items() if k.endswith(".class_path") and k.split(".")[0] in EXAMPLE}


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
    built = kwargs[names[0]]  # None where the user's `net: nn.Module | None = None` is left unset
    return (
        len(names) == 1
        or len(names) == 2
        and built is not None
        and names[1] in inspect.signature(type(built)).parameters
    )


def _attribute(name: str, data: LightningDataModule) -> Any:
    """The data module's ``name``, if it has one: a link (a partial, not a closure: ``ddp_spawn`` pickles links)."""
    value = getattr(data, name, None)
    return list(value) if isinstance(value, tuple) else value


def build_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[CLI] = CLI, folders: RunFolders | None = None
) -> CLI:
    """The command line; ``folders`` (the command's) holds the run folder it claims and the trainer it builds."""
    plain = "; ".join(f"{name}: {c.description}" for name, c in COMMANDS.items() if c.runs is not None)
    return cli_class(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=1234,
        trainer_defaults={"callbacks": [ExactResume()]},  # random states travel in every checkpoint
        save_config_callback=RunConfigCallback,  # a restart of the same run keeps its config.yaml
        trainer_class=DescribedTrainer,
        parser_class=ArgumentParser,
        parser_kwargs={"prog": PROGRAM, "description": f"Also: {plain}. Each subcommand has its own --help."},
        args=args,
        run=run,
        folders=folders,
    )


def main(args: list[str] | None = None) -> None:
    """``python -m <package>``: every failure is reported here, as one ``error:`` line and its exit code
    (``blame.verdict``), or as the user's exception with its traceback."""
    argv = sys.argv[1:] if args is None else list(args)
    handlers = signal_handlers()
    if argv[:1] == ["fit"]:
        defer_signals()  # a signal while the fit starts stops it at its first safe point
    folders = RunFolders()
    own: BaseException | None = None
    reported = finished = False
    try:
        with quiet_libraries(), devices.settings_restored():  # the process as it was, once the command ends
            command = COMMANDS.get(argv[0]) if argv else None
            if command is None or command.runs is None:
                build_cli(argv, folders=folders)
                finished = True
            elif code := pkgutil.resolve_name(command.runs)(argv[1:]):  # a command of its own, without LightningCLI
                sys.exit(code)
    except Exception as err:
        reported = True
        own = _report(err, folders)
        if own is err:
            raise
    finally:
        failure = folders.release()  # on object storage: the run's last uploads, waited for here
        # Called from Python, which goes on, the handlers come back; a program ignores signals while it exits.
        command_ended(handlers if args is not None else None, folders.trainer, finished and failure is None)
        if failure is not None and not reported:
            print(f"error: {failure}", file=sys.stderr)
            sys.exit(getattr(failure, "exit_code", 3))
    if own is not None:
        raise own  # the user's, unwrapped from the parser's message: its traceback is theirs


def _report(err: Exception, folders: RunFolders) -> BaseException:
    """Print the line of a mistake (2), the disk (3) or a dead rank and exit; else the exception to raise."""
    folders.failed(err)  # a start that failed before its record: listed by `runs` with its line
    found = blame.verdict(err, dead=lambda e: _dead_rank(e, folders.trainer))
    if found is None:
        if (line := blame.user_code_line(err)) is not None:
            print(line, file=sys.stderr, flush=True)
        return blame.users_exception(err)
    code, line = found
    if code in (2, 3):
        folders.discard_unstarted()  # a folder this command created goes again, unless training had started
    if errors.full_traceback():
        traceback.print_exception(err)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(code)


def _dead_rank(err: BaseException, trainer: Trainer | None) -> tuple[int, str] | None:
    """The exit code and the line for the rank whose death made this process fail with ``err``."""
    if (dead := dead_rank(err, trainer)) is None:
        return None
    return dead.exit_code, f"{dead.line()} ({errors.TRACEBACK_VARIABLE}=1 shows this rank's traceback)"
