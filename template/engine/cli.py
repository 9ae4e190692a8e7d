"""Command line: LightningCLI with the project's defaults, and mistakes reported in one line."""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from jsonargparse._actions import _ActionPrintConfig
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info

from template.engine import stateful_data  # noqa: F401 - the import lets Lightning split StatefulDataLoaders
from template.engine.cadence import LogCadence
from template.engine.checkpoint_io import AtomicCheckpointIO
from template.engine.compile import CompileNetwork
from template.engine.elastic import join_restarted_group
from template.engine.errors import (
    ConfigError,
    DiskError,
    config_error_in,
    explain_parser_error,
    explain_trainer_error,
    one_line,
)
from template.engine.gpus import add_gpu_arguments, apply_matmul_precision, resolve_free_devices
from template.engine.loggers import default_loggers
from template.engine.predictions import PredictionWriter
from template.engine.preemption import Preemption
from template.engine.resume import RNGStateCheckpoint, find_last_checkpoint
from template.engine.run import RunConfigCallback, RunOptions, continue_run, periodic_checkpoint
from template.engine.scaling import BatchScaling
from template.engine.strategies import check_dp_trainer_config  # the import registers strategy "dp" with Lightning
from template.engine.watchdog import HangWatchdog

# The example the command line runs unless a config names another LightningModule or DataModule.
EXAMPLE = {"model": "template.model.Classifier", "data": "template.data.DigitsDataModule"}

# Lightning resolves these names itself instead of reading a file.
_SPECIAL_CKPT_PATHS = {"best", "last", "hpc", "registry"}


class ArgumentParser(LightningArgumentParser):
    """Reports a bad option or value as one ``error:`` line instead of usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        print(f"error: {explain_parser_error(message)}", file=sys.stderr)
        self.exit(2)


class CLI(LightningCLI):
    """The project's command line: ``python -m template {fit,validate,test,predict} --config configs/x.yaml``."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        self.parser_class = ArgumentParser
        # argparse would otherwise take a misspelt prefix (--trainer.max_epoch) silently as the option it abbreviates.
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(BatchScaling, "scaling")
        parser.add_lightning_class_args(HangWatchdog, "watchdog")
        parser.add_lightning_class_args(LogCadence, "log_cadence")
        parser.add_lightning_class_args(CompileNetwork, "compile")
        add_gpu_arguments(parser)
        parser.add_class_arguments(RunOptions, "run", instantiate=False)
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
                "model": {"class_path": EXAMPLE["model"], "init_args": {"net": {"class_path": "template.nets.MLP"}}},
                "data": {"class_path": EXAMPLE["data"]},
                "checkpoint.monitor": "val_acc",
                "checkpoint.mode": "max",
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

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # jsonargparse reports broken YAML without saying which file; name it first.
        if args is None or isinstance(args, (list, tuple)):
            _check_yaml_files(sys.argv[1:] if args is None else list(args))
        with _ActionPrintConfig.skip_print_config():
            super().parse_arguments(parser, args)
        # jsonargparse hands a newly chosen class the example's values for the arguments it shares (a user's
        # DataModule would train with the digits' batch_size): parse again with that class as the default, so it
        # gets its own signature's defaults and only what the configs set.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        chosen = {
            key: {"class_path": path}
            for key, path in (("model", config.get("model.class_path")), ("data", config.get("data.class_path")))
            if path is not None and path != EXAMPLE[key]
        }
        if chosen or _asks_for_print_config(args):
            (self._subcommand_parsers[subcommand] if subcommand else parser).set_defaults(chosen)
            super().parse_arguments(parser, args)

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        # Lightning's own instantiator records every link in the hyper-parameters, also links jsonargparse did not
        # apply because a user's module has no such argument, and then fails on a missing `net`.
        self.parser.add_instantiator(_AppliedLinksOnly(cli=self, key="model"), LightningModule, subclasses=True)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        monitor = config.get("checkpoint.monitor")
        if config.get("checkpoint.filename") is None and monitor:
            # The best checkpoint's name carries the score it was chosen by, whatever metric a module monitors.
            config["checkpoint.filename"] = f"best-{{epoch}}-{{{monitor}:.4f}}"

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        run = getattr(self, "_run", None)
        logger = trainer_config.get("logger")
        trackers = self._get(self.config_init, "trackers") or []
        if logger in (None, True):
            name, resume = (run.name, run.resume) if run is not None else (None, False)
            # The CSV logger stays first: its folder is the run's (checkpoints, config.yaml), whatever trackers add.
            kwargs.setdefault(
                "logger", [*default_loggers(trainer_config.get("default_root_dir"), name, resume), *trackers]
            )
        elif trackers:
            if logger is False:
                raise ConfigError(
                    "trackers are set but trainer.logger is false; remove `trainer.logger: false` to log to them"
                )
            kwargs["logger"] = [*(logger if isinstance(logger, list) else [logger]), *trackers]
        if trainer_config.get("plugins") is None:
            # Checkpoints are written atomically beside their target and loaded weights-only.
            kwargs.setdefault("plugins", [AtomicCheckpointIO()])
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            # Lightning's default bar redraws after every step, which costs more than a small model's step here;
            # every 10th is as readable. A progress bar in trainer.callbacks replaces this one.
            kwargs.setdefault("callbacks", [*callbacks, TQDMProgressBar(refresh_rate=10)])
        if self.subcommand == "fit":
            kwargs["callbacks"] = [*kwargs.get("callbacks", callbacks), Preemption(), *periodic_checkpoint(run)]
        try:
            # `devices: free:N` becomes a list of GPU indices before anything reads it (here, dp's checks, Lightning).
            resolve_free_devices(trainer_config)
            # Before Lightning's own accelerator checks, whose messages cannot point to the CPU alternative.
            check_dp_trainer_config(trainer_config)
            trainer = super().instantiate_trainer(**kwargs)
            apply_matmul_precision(self._get(self.config_init, "float32_matmul_precision"), trainer)
            # Lightning compares devices x num_nodes with what torchrun or SLURM started only inside fit, with a
            # traceback from every process: compare them here, where the mismatch becomes one line.
            launcher = getattr(trainer.strategy, "launcher", None)
            if getattr(launcher, "cluster_environment", None) is not None:
                launcher.cluster_environment.validate_settings(launcher.num_processes, launcher.num_nodes)
        except (MisconfigurationException, ValueError) as err:
            raise ConfigError(explain_trainer_error(one_line(err))) from None
        except TypeError as err:
            if "devices" not in str(err):
                raise
            raise ConfigError(
                f"trainer.devices={trainer_config.get('devices')!r} is not valid on the CPU: CPU devices are a number "
                "of processes (>= 1), not indices; set e.g. --trainer.devices=2"
            ) from None
        for callback in trainer.callbacks:
            if isinstance(callback, HangWatchdog):
                callback.arm(trainer)
        return trainer

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            # jsonargparse wraps a ConfigError raised by a model or DataModule constructor in its own message.
            cause = config_error_in(err)
            if cause is None:
                raise
            raise cause from None

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the checkpoint here, at parse time: resolve `last` and check the file before it does.
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else None
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if ckpt_path == "last":
            root = config.get("trainer.default_root_dir") or "."
            config["ckpt_path"] = ckpt_path = find_last_checkpoint(root, config.get("checkpoint.dirpath"))
            rank_zero_info(f"Resuming from the newest checkpoint under '{root}': {ckpt_path}")
        if subcommand == "fit":
            # The run's folder, and its newest checkpoint when the same command is started again.
            self._run = continue_run(config)
            config["ckpt_path"] = ckpt_path = self._run.ckpt_path
        if ckpt_path and ckpt_path not in _SPECIAL_CKPT_PATHS:
            _check_checkpoint_file(ckpt_path)
        super()._parse_ckpt_path()

    def before_fit(self) -> None:
        # Here, before Lightning launches the other DDP processes and calls the DataModule's hooks, a batch that
        # does not divide is reported once and the DataModule sees its per-process batch from the start.
        # Also before Lightning's process group: a torchrun restart needs one apart from the failed attempt's.
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
        checkpoint = self.trainer.checkpoint_callback
        # A user's extra ModelCheckpoint without a monitor can come first: it has a path but no score.
        if checkpoint is not None and checkpoint.best_model_path and checkpoint.best_model_score is not None:
            rank_zero_info(
                f"Best checkpoint: {checkpoint.best_model_path} "
                f"({checkpoint.monitor}={float(checkpoint.best_model_score):.4f})"
            )


class _AppliedLinksOnly(_InstantiatorFn):
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


def _asks_for_print_config(args: Any) -> bool:
    argv = sys.argv[1:] if args is None else args
    return isinstance(argv, list) and any(str(arg).startswith("--print_config") for arg in argv)


def _attribute(name: str):  # noqa: ANN202 - jsonargparse calls it with the instantiated data module
    """A link function reading ``name`` from the data module, or None when it has no such attribute."""

    def read(data: LightningDataModule) -> Any:
        value = getattr(data, name, None)
        return list(value) if isinstance(value, tuple) else value

    return read


def _check_checkpoint_file(ckpt_path: str) -> None:
    """Raise a ConfigError if ``ckpt_path`` is missing, or is not a whole weights-only PyTorch checkpoint."""
    if not Path(ckpt_path).is_file():
        raise ConfigError(f"checkpoint '{ckpt_path}' does not exist; pass an existing file to --ckpt_path")
    try:
        # mmap reads the archive's index, not the tensors: a cheap check that the file is whole.
        torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # junk bytes make the unpickler fail in arbitrary ways
        reason = one_line(err).split(". ")[0][:200]
        if "mmap can only be used" in reason:
            reason = "not a PyTorch checkpoint archive"
        raise ConfigError(
            f"checkpoint '{ckpt_path}' cannot be loaded ({reason}); it is truncated, corrupt "
            "or not a weights-only PyTorch checkpoint: pass a complete .ckpt file written by this project"
        ) from None


def _check_yaml_files(argv: list[str]) -> None:
    """Raise a ConfigError naming the first ``--config`` file that is not valid YAML."""
    paths = [b for a, b in zip(argv, argv[1:], strict=False) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if not Path(path).is_file():
            continue  # jsonargparse reports a missing file itself
        try:
            yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or one_line(err)
            message = f"config file '{path}' is not valid YAML: {problem}{where}; fix the syntax there"
            raise ConfigError(message) from None


def build_cli(args: list[str] | None = None, run: bool = True, cli_class: type[CLI] = CLI) -> CLI:
    """The command line as ``python -m template`` builds it: any LightningModule and DataModule by class_path."""
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
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m template`` and of the ``template`` console script."""
    # Lightning 2.6 trips over its own deprecation in torch's pytree on every run; it is not the user's to fix.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # Evaluating a checkpoint logs into a new version folder; Lightning warns that the old folder is not reused.
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    # torchdata's StatefulDataLoader calls a torch API that torch deprecated; nothing for the user to change.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")
    argv = sys.argv[1:] if args is None else list(args)
    try:
        if argv[:1] == ["export"]:
            # A plain-PyTorch command: no Trainer, no LightningCLI.
            from template.engine.export import main as export_main

            export_main(argv[1:])
            return
        if argv[:1] == ["sweep"]:
            # Optuna drives `fit` processes; the sweep is not a LightningCLI subcommand.
            from template.engine.sweep import main as sweep_main

            sys.exit(sweep_main(argv[1:]))
        build_cli(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except DiskError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
