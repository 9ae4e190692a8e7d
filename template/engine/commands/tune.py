"""``python -m template tune lr|batch_size --config ...``: Lightning's Tuner on one device, in a temporary folder (no
logger, no run folder), writing what it finds as a config file to stack on ``fit``."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_info

from template.engine import internals
from template.engine.commands import preflight
from template.engine.commands.cli import CLI, PROGRAM, build_cli, quiet_libraries
from template.engine.commands.export import ArgumentParser, FitConfig
from template.engine.errors import SWEEP_EXTRA, ConfigError, disk_errors
from template.engine.store import atomic_write, prove_writable

# Each finder's options (--tune.<name>), with Lightning's defaults.
FINDERS: dict[str, dict[str, Any]] = {
    "lr": {"min_lr": 1e-8, "max_lr": 1.0, "num_training": 100},
    "batch_size": {"mode": "power", "init_val": 2, "max_trials": 25, "steps_per_trial": 3},
}
# Lightning's lines about the finders' own fits and checkpoints, which are no fit of the user's (nor "will continue").
FINDER_LINES = ("`Trainer.fit` stopped", "`weights_only` was not", "Restoring states", "Restored all", "Finished batch")


class _OneDevice(FitConfig):
    """The fit config's Trainer on one device: Lightning's batch-size finder refuses distributed strategies."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        devices, nodes = self.config.get("trainer.devices"), self.config.get("trainer.num_nodes")
        one = devices[:1] if isinstance(devices, list) else 1
        if nodes != 1 or self.config.get("trainer.strategy") != "auto" or devices not in (1, "1", "auto", one):
            rank_zero_info("tune: the config trains on several devices; the finder runs on one (one process' batch)")
        return CLI.instantiate_trainer(self, devices=one, num_nodes=1, strategy="auto", **kwargs)


def main(argv: list[str]) -> None:
    """Run the finder ``argv[0]`` on the fit configuration of the other arguments; write its config file."""
    finder = argv[0] if argv else ""
    if finder in ("-h", "--help"):
        print(f"usage: {PROGRAM} tune lr|batch_size [--tune.* options] [fit's options]; tune lr --help lists them")
        return
    if finder not in FINDERS:
        raise ConfigError(f"tune: unknown finder {finder!r}; name one first: {PROGRAM} tune lr|batch_size --config ...")
    parser = ArgumentParser(
        prog=f"{PROGRAM} tune {finder}", allow_abbrev=False, epilog=f"Every other option is fit's: {PROGRAM} fit --help"
    )
    parser.add_argument("--tune.output", dest="output", type=Path, default=Path(f"tune-{finder}.yaml"))
    for name, default in FINDERS[finder].items():
        choices = ("power", "binsearch") if name == "mode" else None
        parser.add_argument(f"--tune.{name}", dest=name, type=type(default), default=default, choices=choices)
    options, fit_args = parser.parse_known_args(argv[1:])
    if finder == "lr" and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"tune lr draws its plot with matplotlib; {SWEEP_EXTRA}")
    settings = {name: getattr(options, name) for name in FINDERS[finder]}
    with tempfile.TemporaryDirectory(prefix="tune-") as scratch, quiet_libraries(*FINDER_LINES):
        off = ["--trainer.logger=false", "--trackers=null", f"--trainer.default_root_dir={scratch}"]
        cli = build_cli([*fit_args, *off], False, _OneDevice)
        preflight.check_trainer_counts(cli.config)
        preflight.build_optimizers(cli.config, cli.model)
        key = _lr_option(cli.config) if finder == "lr" else _batch_size_option(cli)
        prove_writable(options.output.parent, "--tune.output")  # after every refusal, before the finder
        if finder == "lr":
            bar = getattr(cli.trainer.progress_bar_callback, "is_enabled", False)  # off, or not a terminal
            with contextlib.nullcontext() if bar else internals.lr_finder_without_bar():
                found = Tuner(cli.trainer).lr_find(cli.model, datamodule=cli.datamodule, update_attr=False, **settings)
            value = _plot(found, options.output.with_suffix(".png"))
            line = f"Suggested learning rate: {value:.3g} ({key}), marked on {options.output.with_suffix('.png')}"
        else:
            value = Tuner(cli.trainer).scale_batch_size(cli.model, datamodule=cli.datamodule, **settings)
            with contextlib.suppress(TypeError):  # an iterable dataset has no length
                if value >= (samples := len((cli.datamodule or cli.model).train_dataloader().dataset)):
                    raise ConfigError(
                        f"tune batch_size: every batch size tried ran, up to {value}, which takes all {samples} "
                        f"training samples: memory does not bound the batch here; choose {key} by speed or accuracy "
                        "(a sweep), or cap the search with --tune.max_trials"
                    )
            line = f"Batch size {value} per process ({key}): the largest that ran"
    for part in reversed(key.split(".")):
        value = {part: value}
    text = f"# {PROGRAM} tune {finder}: {line}\n{yaml.safe_dump(value)}"
    with disk_errors(options.output, kept="nothing was written at --tune.output", option="--tune.output"):
        atomic_write(options.output, lambda f: f.write(text.encode()))
    print(f"{line}\nWrote {options.output}: {PROGRAM} fit --config <yours> --config {options.output}")


def _lr_option(config: Any) -> str:
    """The option holding the learning rate that configure_optimizers uses."""
    optimizers, _ = preflight.optimizer_options(config)
    if "optimizer" in optimizers:
        return "optimizer.init_args.lr"  # LightningCLI's --optimizer replaces the module's configure_optimizers
    names = [f"model.init_args.{name}" for name in ("lr", "learning_rate") if f"model.init_args.{name}" in config]
    names = names or [f"{option}.init_args.lr" for option in optimizers]
    if len(names) != 1:
        raise ConfigError(f"tune lr: not one option sets the learning rate ({names}); give the model an `lr` argument")
    return names[0]


def _batch_size_option(cli: CLI) -> str:
    """Where Lightning's finder changes ``batch_size``, in its order: the module, then the DataModule."""
    for key, holder in (("model", cli.model), ("data", cli.datamodule)):
        if hasattr(holder, "batch_size") or "batch_size" in getattr(holder, "hparams", {}):
            return f"{key}.init_args.batch_size"
    raise ConfigError("tune batch_size: no `batch_size` in the DataModule or the module; keep it as self.batch_size")


def _plot(found: Any, path: Path) -> float:
    """The suggested learning rate, after writing the loss against the learning rate with it marked to ``path``; a
    ConfigError where the curve does not support it: its lowest loss after the rate is not 1% below its highest up to
    it (a flat or rising curve has no steepest descent to suggest)."""
    lr = found.suggestion() if found is not None else None
    if lr is None:
        raise ConfigError("the learning-rate finder made no suggestion from so few steps; raise --tune.num_training")
    figure = found.plot(suggest=True)
    figure.axes[0].set_title(f"suggested learning rate {lr:.3g} (red)")
    with disk_errors(path, kept="nothing was written there", option="--tune.output"):
        atomic_write(path, lambda f: figure.savefig(f, format="png"))
    at = found.results["lr"].index(lr)
    finite = [(i, loss) for i, loss in enumerate(found.results["loss"]) if math.isfinite(loss)]
    highest, lowest = max(x for i, x in finite if i <= at), min(x for i, x in finite if i >= at)
    if highest - lowest < abs(highest) / 100:
        raise ConfigError(
            f"tune lr: the loss does not fall at the learning rate the finder suggests ({lr:.3g}: at most "
            f"{highest:.4g} up to it, at best {lowest:.4g} after; see {path}); widen --tune.min_lr/--tune.max_lr or "
            "raise --tune.num_training"
        )
    return lr
