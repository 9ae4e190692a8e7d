"""Start-up against bare Lightning: ``fit --help`` and the seconds from the command to the first training step.

Each measurement runs the project's command and a bare Lightning script over the same model, data, packages and
work (the sanity check, the model summary, CSV and TensorBoard logs, checkpointing, the progress bar), one after
the other (alternated, each round in the other order, so that a busy machine slows all alike), ``--repeats``
rounds. The first step is measured twice: with the example's classes, and with a user's network, DataModule and
callback named by ``class_path`` on the command line (scripts/benchmark_user.py). It prints the medians, and the
ratio and difference within each round (their median and range: a shared machine's load changes between rounds,
not within one), as Markdown:

    python scripts/startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import template

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
PACKAGE = template.__name__
# Lightning's own LightningCLI over the example's classes: what `fit --help` costs without the project's command line.
BARE_HELP = f"""
from lightning.pytorch.cli import LightningCLI
from {PACKAGE}.data import DigitsDataModule
from {PACKAGE}.model import Classifier
LightningCLI(Classifier, DigitsDataModule)
"""
# A Trainer over the same objects doing the same work as the project's `fit`: Lightning's defaults (sanity check,
# model summary, checkpointing, progress bar) and the project's two loggers, CSV and TensorBoard.
BARE_FIT = """
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from benchmark_user import FirstStep
{imports}
loggers = [CSVLogger(".", name="lightning_logs"), TensorBoardLogger(".", name="lightning_logs")]
Trainer(accelerator="cpu", devices=1, max_epochs=15, log_every_n_steps=10, logger=loggers, callbacks=[FirstStep()]).fit(
    {model}, datamodule={data}
)
"""
EXAMPLE_FIT = BARE_FIT.format(
    imports=f"from {PACKAGE}.data import DigitsDataModule\nfrom {PACKAGE}.model import Classifier\n"
    f"from {PACKAGE}.nets import MLP",
    model="Classifier(MLP((1, 8, 8), 10), num_classes=10)",
    data="DigitsDataModule()",
)
# A user's ResNet-8 and synthetic images (small: the sanity check's two batches run before the first step).
USER_DATA = {"num_samples": 5000, "batch_size": 64, "num_workers": 0, "pin_memory": False}
USER_FIT = BARE_FIT.format(
    imports=f"from {PACKAGE}.model import Classifier\nfrom benchmark_user import ResNet, SyntheticImages",
    model="Classifier(ResNet((3, 32, 32), 10, widths=[16, 32, 64]), num_classes=10)",
    data=f"SyntheticImages(**{USER_DATA})",
)
# Lightning's own LightningCLI over the same command line: the share of the gap that is a command line's
# (building the parser, parsing, instantiating, writing config.yaml), which any LightningCLI pays.
USER_CLI = f"""
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from {PACKAGE}.model import Classifier
LightningCLI(Classifier, LightningDataModule, subclass_mode_data=True)
"""
LOGGERS = '[{"class_path": "CSVLogger", "init_args": {"save_dir": "."}}, '
LOGGERS += '{"class_path": "TensorBoardLogger", "init_args": {"save_dir": "."}}]'
USER_ARGS = [
    "--model.net=benchmark_user.ResNet", "--model.net.init_args.widths=[16, 32, 64]",
    "--data=benchmark_user.SyntheticImages", *(f"--data.{key}={value}" for key, value in USER_DATA.items()),
    "--trainer.callbacks+=benchmark_user.FirstStep",
]  # fmt: skip
FIT = ["-m", PACKAGE, "fit", "--config", str(REPO / "configs" / "default.yaml"), "--trainer.accelerator=cpu"]
CASES = {
    "help": "fit --help",
    "example": "first training step, the example's classes",
    "user": "first training step, a user's classes by class_path",
}
COMMANDS = {
    "help": {
        f"python -m {PACKAGE} fit --help": ["-m", PACKAGE, "fit", "--help"],
        "bare LightningCLI fit --help": ["-c", BARE_HELP, "fit", "--help"],
    },
    "example": {
        f"python -m {PACKAGE} fit": [*FIT, "--trainer.callbacks+=benchmark_user.FirstStep"],
        "bare Lightning Trainer.fit": ["-c", EXAMPLE_FIT],
    },
    "user": {
        f"python -m {PACKAGE} fit": [*FIT, *USER_ARGS],
        "bare Lightning Trainer.fit": ["-c", USER_FIT],
        "bare LightningCLI fit": [
            "-c", USER_CLI, "fit", "--trainer.accelerator=cpu", "--trainer.max_epochs=15",
            "--trainer.log_every_n_steps=10", f"--trainer.logger={LOGGERS}", *USER_ARGS,
            # What the project links from the data's attributes, given by hand.
            "--model.num_classes=10", "--model.net.init_args.num_classes=10",
            "--model.net.init_args.input_shape=[3, 32, 32]",
        ],
    },
}  # fmt: skip


def measure(args: list[str], work: Path, timeout: float) -> tuple[float, float]:
    """Seconds from launching ``python *args`` to its exit, or to the first training step it reports; and the CPU
    seconds (user + system) the process and its children used to their exit, which other work on the machine
    changes less than the wall clock."""
    path = [str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "PYTHONWARNINGS": "ignore"}
    # Python's default, as a user runs: modules compiled once and cached (the warm-up run writes the cache). With
    # PYTHONDONTWRITEBYTECODE set every start compiles the modules outside site-packages (the engine's: ~40 ms).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    done = subprocess.run(
        [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(args[:3])} exited {done.returncode}:\n{done.stderr[-2000:]}")
    # Anywhere in the output: a progress bar's carriage-return redraws share the mark's line.
    mark = re.search(r"first step at (\d+\.\d+)", done.stdout)
    if mark is None and "FirstStep" in "".join(args):
        raise SystemExit(f"error: {' '.join(args[:3])} never reached its first training step:\n{done.stderr[-2000:]}")
    return (float(mark.group(1)) if mark else end) - start, cpu


def _differences(ours: list[float], bare: list[float]) -> str:
    differences = [a - b for a, b in zip(ours, bare, strict=True)]
    middle = statistics.median(differences)
    return f"{middle:+.2f} s ({min(differences):+.2f} to {max(differences):+.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="what to measure (default: all)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        raise SystemExit(2)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, load {load}, Python {platform.python_version()}, "
        f"{args.repeats} rounds"
    )
    print(
        "| measured | against | project (median) | against (median) | ratio in a round: median (range) "
        "| difference in a round: median (range) | CPU seconds' difference | every run: project / against, s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for case in args.cases:
            commands = COMMANDS[case]
            for command in commands.values():
                measure(command, work, args.timeout)  # warm-up: file caches, the data set's first preparation
            seconds: dict[str, list[float]] = {name: [] for name in commands}
            cpu: dict[str, list[float]] = {name: [] for name in commands}
            for round_ in range(args.repeats):
                # Each round in the other order: no command always runs first, or always after the same one.
                for name, command in list(commands.items())[:: 1 if round_ % 2 == 0 else -1]:
                    wall, used = measure(command, work, args.timeout)
                    seconds[name].append(wall)
                    cpu[name].append(used)
                    print(f"{case} round {round_ + 1}: {name} {wall:.2f} s ({used:.2f} CPU s)", file=sys.stderr)
            project, *references = commands
            ours, ours_cpu = seconds[project], cpu[project]
            for reference in references:
                bare, bare_cpu = seconds[reference], cpu[reference]
                ratios = [a / b for a, b in zip(ours, bare, strict=True)]
                runs = " / ".join(", ".join(f"{x:.2f}" for x in s) for s in (ours, bare))
                print(
                    f"| {CASES[case]} | {reference} | {statistics.median(ours):.2f} s | "
                    f"{statistics.median(bare):.2f} s | {statistics.median(ratios):.2f} "
                    f"({min(ratios):.2f} to {max(ratios):.2f}) | {_differences(ours, bare)} | "
                    f"{_differences(ours_cpu, bare_cpu)} | {runs} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
