"""``python -m template tune lr|batch_size --config ...``: Lightning's Tuner on the configured model and data.

The finder runs on one device, without a logger, in a temporary folder that takes the checkpoints it writes and the
config Lightning saves: no run folder is touched. What it finds is written as a config file to stack on ``fit``.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_info

from template.engine import preflight
from template.engine.atomic import atomic_write, prove_writable
from template.engine.cli import CLI, PROGRAM, build_cli
from template.engine.errors import ConfigError, disk_errors
from template.engine.export import ArgumentParser, FitConfig

# Each finder's options (--tune.<name>), with Lightning's defaults.
FINDERS: dict[str, dict[str, Any]] = {
    "lr": {"min_lr": 1e-8, "max_lr": 1.0, "num_training": 100},
    "batch_size": {"mode": "power", "init_val": 2, "max_trials": 25, "steps_per_trial": 3},
}


class _OneDevice(FitConfig):
    """The fit config's Trainer on one device: Lightning's batch-size finder refuses distributed strategies."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        devices, nodes = self.config.get("trainer.devices"), self.config.get("trainer.num_nodes")
        one = devices[:1] if isinstance(devices, list) else 1
        if nodes != 1 or self.config.get("trainer.strategy") != "auto" or devices not in (1, "1", "auto", one):
            rank_zero_info(
                "tune: the config trains on several devices; the finder runs on one, with the batch of one process"
            )
        return CLI.instantiate_trainer(self, devices=one, num_nodes=1, strategy="auto", **kwargs)


def main(argv: list[str]) -> None:
    """Run the finder ``argv[0]`` on the fit configuration of the other arguments; write its config file."""
    finder = argv[0] if argv else ""
    if finder not in FINDERS:
        raise ConfigError(f"tune: unknown finder {finder!r}; choose one: {PROGRAM} tune lr|batch_size --config ...")
    parser = ArgumentParser(prog=f"{PROGRAM} tune {finder}", allow_abbrev=False, epilog="Every other option is fit's.")
    parser.add_argument("--tune.output", dest="output", default=f"tune-{finder}.yaml", help="the config file written")
    for name, default in FINDERS[finder].items():
        choices = ("power", "binsearch") if name == "mode" else None
        parser.add_argument(f"--tune.{name}", dest=name, type=type(default), default=default, choices=choices)
    options, fit_args = parser.parse_known_args(argv[1:])
    output = Path(options.output)
    if output.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--tune.output={output} is not a .yaml file; name the config file to write, e.g. tune.yaml")
    if finder == "lr" and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("tune lr draws its plot with matplotlib; install the extra: pip install -e '.[sweep]'")
    prove_writable(output.parent, "--tune.output")
    with tempfile.TemporaryDirectory(prefix="tune-") as scratch:
        off = ["--trainer.logger=false", "--trackers=null", f"--trainer.default_root_dir={scratch}"]
        cli = build_cli([*fit_args, *off], False, _OneDevice)
        preflight.check_trainer_counts(cli.config)
        preflight.build_optimizers(cli.config, cli.model)
        key, value, line = (_find_lr if finder == "lr" else _find_batch_size)(cli, options, output.with_suffix(".png"))
    for part in reversed(key.split(".")):
        value = {part: value}
    text = f"# {PROGRAM} tune {finder}: {line}\n{yaml.safe_dump(value)}"
    with disk_errors(output, kept="nothing was written at --tune.output", option="--tune.output"):
        atomic_write(output, lambda f: f.write(text.encode()))
    print(f"{line}\nWrote {output}: {PROGRAM} fit --config <yours> --config {output}")


def _find_lr(cli: CLI, options: Any, plot: Path) -> tuple[str, float, str]:
    key = _lr_option(cli.config)
    kwargs = {name: getattr(options, name) for name in FINDERS["lr"]}
    found = Tuner(cli.trainer).lr_find(cli.model, datamodule=cli.datamodule, update_attr=False, **kwargs)
    lr = found.suggestion() if found is not None else None
    if lr is None:
        raise ConfigError(
            f"the learning-rate finder made no suggestion; raise --tune.num_training={options.num_training}"
        )
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    figure = found.plot(suggest=True)
    figure.axes[0].set_title(f"suggested learning rate {lr:.3g} (red)")
    with disk_errors(plot, kept="nothing was written there", option="--tune.output"):
        atomic_write(plot, lambda f: figure.savefig(f, format="png"))
    return key, lr, f"Suggested learning rate: {lr:.3g} ({key}); the loss against the learning rate: {plot}"


def _lr_option(config: Any) -> str:
    """The option holding the learning rate that configure_optimizers uses."""
    optimizers, _ = preflight.optimizer_options(config)
    if "optimizer" in optimizers:
        return "optimizer.init_args.lr"  # LightningCLI's --optimizer replaces the module's configure_optimizers
    for name in ("lr", "learning_rate"):
        if f"model.init_args.{name}" in config:
            return f"model.init_args.{name}"
    if len(optimizers) == 1:
        return f"{optimizers[0]}.init_args.lr"
    raise ConfigError(
        f"tune lr: no one option sets the learning rate (optimizers: {optimizers or 'none'}); give the model an `lr` "
        "argument or an optimizer argument, or name one: --optimizer=Adam"
    )


def _find_batch_size(cli: CLI, options: Any, plot: Path) -> tuple[str, int, str]:
    # Where Lightning's finder looks for `batch_size`, in its order: the module, then the DataModule.
    holders = {"model": cli.model, "data": cli.datamodule}
    key = next((k for k, h in holders.items() if hasattr(h, "batch_size") or "batch_size" in h.hparams), None)
    if key is None:
        raise ConfigError(
            "tune batch_size: neither the DataModule nor the module has a `batch_size` for the finder to change; "
            "give the DataModule a batch_size argument kept as self.batch_size"
        )
    kwargs = {name: getattr(options, name) for name in FINDERS["batch_size"]}
    size = Tuner(cli.trainer).scale_batch_size(cli.model, datamodule=cli.datamodule, **kwargs)
    where = f"{key}.init_args.batch_size"
    return where, size, f"Batch size {size} per process ({where}): the largest that ran in {options.max_trials} trials"
