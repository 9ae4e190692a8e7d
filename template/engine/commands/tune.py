"""``python -m template tune lr|batch_size --config ...``: Lightning's Tuner on one device, in a temporary folder (no
logger, no run folder), writing what it finds as a config file to stack on ``fit``."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_info

from template.engine import internals
from template.engine.commands import preflight
from template.engine.commands.cli import CLI, PROGRAM, build_cli, quiet_libraries
from template.engine.commands.export import ArgumentParser, FitConfig
from template.engine.errors import SWEEP_EXTRA, ConfigError, disk_errors
from template.engine.store import atomic_write, prove_writable
from template.engine.strategies.devices import gpu_count, gpu_indices

# Each finder's options (--tune.<name>), with Lightning's defaults.
FINDERS: dict[str, dict[str, Any]] = {
    "lr": {"min_lr": 1e-8, "max_lr": 1.0, "num_training": 100},
    "batch_size": {"mode": "power", "init_val": 2, "max_trials": 25, "steps_per_trial": 3},
}
# The factor of the running mean Lightning's learning-rate finder keeps of the loss (its _LRCallback's beta).
LIGHTNING_BETA = 0.98
# Lightning's lines about the finders' own fits and checkpoints, which are no fit of the user's (nor "will continue").
FINDER_LINES = ("`Trainer.fit` stopped", "`weights_only` was not", "Restoring states", "Restored all", "Finished batch")


class _OneDevice(FitConfig):
    """The fit config's Trainer on one device (Lightning's batch-size finder refuses distributed strategies), for as
    many epochs as the finder's steps take."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        devices, nodes = self.config.get("trainer.devices"), self.config.get("trainer.num_nodes")
        one = gpu_indices(devices, 1)[:1] if isinstance(devices, list) else 1  # the first GPU listed, else one device
        if nodes != 1 or self.config.get("trainer.strategy") != "auto" or gpu_count(devices) not in (1, None):
            rank_zero_info("tune: the config trains on several devices; the finder runs on one (one process' batch)")
        # The finders stop by steps; the config's epochs would cut a small data set's learning-rate curve short.
        return CLI.instantiate_trainer(self, devices=one, num_nodes=1, strategy="auto", max_epochs=-1, **kwargs)


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
        value, line = (find_lr if finder == "lr" else find_batch_size)(cli, settings, key, options.output)
    for part in reversed(key.split(".")):
        value = {part: value}
    text = f"# {PROGRAM} tune {finder}: {line}\n{yaml.safe_dump(value)}"
    with disk_errors(options.output, kept="nothing was written at --tune.output", option="--tune.output"):
        atomic_write(options.output, lambda f: f.write(text.encode()))
    print(f"{line}\nWrote {options.output}: {PROGRAM} fit --config <yours> --config {options.output}")


def find_lr(cli: CLI, settings: dict[str, Any], key: str, output: Path) -> tuple[float, str]:
    """Lightning's learning-rate finder's curve, plotted beside ``output`` and judged: the rate where the loss falls
    fastest, and the line saying so; a ConfigError where the loss does not fall."""
    bar = getattr(cli.trainer.progress_bar_callback, "is_enabled", False)  # off, or not a terminal
    with contextlib.nullcontext() if bar else internals.lr_finder_without_bar():
        found = Tuner(cli.trainer).lr_find(cli.model, datamodule=cli.datamodule, update_attr=False, **settings)
    curve, plot = (
        judge(*measured_losses(found.results if found else {"lr": [], "loss": []})),
        output.with_suffix(".png"),
    )
    draw(curve, plot)
    value = curve.lrs[curve.steepest] if curve.lrs else math.nan
    if not curve.falls:
        raise ConfigError(
            f"tune lr: the loss does not fall at the learning rate the finder suggests ({value:.3g}, where the "
            f"smoothed loss falls fastest), nor elsewhere from {settings['min_lr']:.3g} to {settings['max_lr']:.3g}: "
            f"{curve.why}; see {plot}; widen --tune.min_lr/--tune.max_lr or raise --tune.num_training"
        )
    return value, f"Suggested learning rate: {value:.3g} ({key}), marked on {plot}"


def find_batch_size(cli: CLI, settings: dict[str, Any], key: str, output: Path) -> tuple[int, str]:
    """Lightning's batch-size finder's largest batch that ran, and the line saying so; a ConfigError where that takes
    the whole training set (memory does not bound it)."""
    value = Tuner(cli.trainer).scale_batch_size(cli.model, datamodule=cli.datamodule, **settings)
    with contextlib.suppress(TypeError):  # an iterable dataset has no length
        if value >= (samples := len((cli.datamodule or cli.model).train_dataloader().dataset)):
            raise ConfigError(
                f"tune batch_size: every batch size tried ran, up to {value}, which takes all {samples} training "
                f"samples: memory does not bound the batch here; choose {key} by speed or accuracy (a sweep), or cap "
                "the search with --tune.max_trials"
            )
    return value, f"Batch size {value} per process ({key}): the largest that ran"


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


class Curve(NamedTuple):
    """The finder's curve judged: the loss as measured at each rate, smoothed over a window of rates around each
    (``smoothed``, by index), where it falls (from ``start`` to its lowest, ``low``), the rate where it falls fastest
    there, moved down to the region's highest rate at most a tenth of the lowest's where it has one (``steepest``),
    whether that fall is real (``falls``) and why not."""

    lrs: list[float]
    measured: list[float]
    smoothed: dict[int, float]
    start: int
    low: int
    steepest: int
    falls: bool
    why: str


def measured_losses(results: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    """The finder's rates and the losses measured at them, up to the first that is not finite. Lightning keeps only
    their running mean, debiased as if a step later (its first value is half the first loss): this undoes that."""
    lrs, losses, previous = [], [], 0.0
    for step, (lr, mean) in enumerate(zip(results["lr"], results["loss"], strict=True), start=2):
        if not math.isfinite(mean):
            break
        average = mean * (1 - LIGHTNING_BETA**step)
        lrs.append(lr)
        losses.append((average - LIGHTNING_BETA * previous) / (1 - LIGHTNING_BETA))
        previous = average
    return lrs, losses


def judge(lrs: list[float], measured: list[float]) -> Curve:
    """Where the smoothed loss falls fastest against log(lr), within the region where it falls: from the last rate
    above 60% of the way down from its highest to its lowest, to its lowest. The fall is real where it is at least
    2% of the loss and eight times the noise of the smoothed loss (a flat curve's noise spans up to 7), over three
    rates or more."""
    half = max(2, len(measured) // 12)  # 2/3 of a decade either side over Lightning's range (1e-8 to 1, 100 steps)
    inner = range(half, len(measured) - half)
    smoothed = {i: sum(measured[i - half : i + half + 1]) / (2 * half + 1) for i in inner}
    if len(inner) < 3:
        return Curve(lrs, measured, smoothed, 0, 0, 0, False, f"{len(measured)} steps are too few to tell")
    low = min(inner, key=smoothed.__getitem__)
    highest = max(smoothed[i] for i in range(half, low + 1))
    start = max(i for i in range(half, low + 1) if smoothed[i] >= smoothed[low] + 0.6 * (highest - smoothed[low]))
    x = [math.log(lr) for lr in lrs]
    slopes = {i: (smoothed[i + 1] - smoothed[i - 1]) / (x[i + 1] - x[i - 1]) for i in range(start + 1, low)}
    # The noise of one loss from its steps' differences (their median: the fall and the divergence barely move it).
    step_noise = statistics.median(abs(b - a) for a, b in itertools.pairwise(measured)) * 1.4826 / math.sqrt(2)
    noise = step_noise / math.sqrt(2 * half + 1)
    falls = bool(slopes) and highest - smoothed[low] >= max(abs(highest) / 50, 8 * noise)
    why = f"its smoothed loss falls by {highest - smoothed[low]:.3g} at most, from {highest:.4g} (noise {noise:.2g})"
    steepest = min(slopes, key=slopes.__getitem__) if slopes else low
    # No higher than a tenth of the rate at the lowest loss (fastai's rule) where the region reaches below it: the
    # fall's steepest point can be a rate at which training, over more steps than the finder's, diverges (a BatchNorm
    # CNN with augmentation: chance accuracy).
    tenth = max((i for i in slopes if lrs[i] <= lrs[low] / 10), default=steepest)
    return Curve(lrs, measured, smoothed, start, low, min(steepest, tenth), falls, why)


def draw(curve: Curve, path: Path) -> None:
    """Write the plot: the loss as measured and smoothed against the learning rate, the region where it falls
    (shaded) and the suggested rate (red)."""
    from matplotlib.figure import Figure  # without pyplot, which keeps every figure and picks a backend

    axes = Figure().subplots()
    axes.plot(curve.lrs, curve.measured, alpha=0.35, label="loss as measured")
    axes.plot([curve.lrs[i] for i in curve.smoothed], list(curve.smoothed.values()), label="smoothed")
    if curve.falls:
        axes.axvspan(curve.lrs[curve.start], curve.lrs[curve.low], alpha=0.1, label="where it falls")
        axes.plot(curve.lrs[curve.steepest], curve.smoothed[curve.steepest], "o", color="red", label="suggested")
    title = f"suggested learning rate {curve.lrs[curve.steepest]:.3g}" if curve.falls else "no suggestion"
    axes.set(xscale="log", xlabel="learning rate", ylabel="loss", title=title)
    if curve.measured and max(curve.measured[: curve.low + 1]) > min(curve.measured):  # the divergence out of view
        axes.set_ylim(min(curve.measured), max(curve.measured[: curve.low + 1]))
    axes.legend()
    with disk_errors(path, kept="nothing was written there", option="--tune.output"):
        atomic_write(path, lambda f: axes.figure.savefig(f, format="png"))
