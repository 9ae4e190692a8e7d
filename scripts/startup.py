"""Start-up against bare Lightning: ``fit --help`` and the seconds from the command to the first training step.

Each measurement runs the project's command and a bare Lightning script over the same model, data and packages,
one after the other (alternated, so that a busy machine slows both alike), ``--repeats`` times; it prints the
medians and their ratio as a Markdown table:

    python scripts/startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import template

REPO = Path(__file__).resolve().parents[1]
PACKAGE = template.__name__
FIRST_STEP = """
import sys, time
from lightning.pytorch import Callback

class FirstStep(Callback):
    def on_train_batch_start(self, *args):
        print(f"first step at {time.time()}", flush=True)
        sys.exit(0)
"""
# Lightning's own LightningCLI over the example's classes: what `fit --help` costs without the project's command line.
BARE_HELP = f"""
from lightning.pytorch.cli import LightningCLI
from {PACKAGE}.data import DigitsDataModule
from {PACKAGE}.model import Classifier
LightningCLI(Classifier, DigitsDataModule)
"""
# A Trainer with Lightning's defaults over the example: what the first step costs without the project's machinery.
BARE_FIT = f"""
from lightning.pytorch import Trainer
from {PACKAGE}.data import DigitsDataModule
from {PACKAGE}.model import Classifier
from {PACKAGE}.nets import MLP
from first_step import FirstStep
Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[FirstStep()]).fit(
    Classifier(MLP((1, 8, 8), 10), num_classes=10), datamodule=DigitsDataModule()
)
"""
CASES = {
    "fit --help": {
        f"python -m {PACKAGE} fit --help": ["-m", PACKAGE, "fit", "--help"],
        "bare LightningCLI fit --help": ["-c", BARE_HELP, "fit", "--help"],
    },
    "command to first training step": {
        f"python -m {PACKAGE} fit": [
            "-m", PACKAGE, "fit", "--config", str(REPO / "configs" / "default.yaml"),
            "--trainer.accelerator=cpu", "--trainer.callbacks+=first_step.FirstStep",
        ],
        "bare Lightning Trainer.fit": ["-c", BARE_FIT],
    },
}  # fmt: skip


def measure(args: list[str], work: Path, timeout: float) -> float:
    """Seconds from launching ``python *args`` to its exit, or to the first training step it reports."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(REPO)]), "PYTHONWARNINGS": "ignore"}
    start = time.time()
    done = subprocess.run(
        [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    end = time.time()
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(args[:3])} exited {done.returncode}:\n{done.stderr[-2000:]}")
    # Anywhere in the output: a progress bar's carriage-return redraws share the mark's line.
    mark = re.search(r"first step at (\d+\.\d+)", done.stdout)
    if mark is None and "FirstStep" in " ".join(args):
        raise SystemExit(f"error: {' '.join(args[:3])} never reached its first training step:\n{done.stderr[-2000:]}")
    return (float(mark.group(1)) if mark else end) - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take (default 300)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "first_step.py").write_text(FIRST_STEP)
        rows = []
        for case, commands in CASES.items():
            for command in commands.values():
                measure(command, work, args.timeout)  # warm-up: file caches, the data set's first preparation
            seconds: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(args.repeats):
                for name, command in commands.items():
                    seconds[name].append(measure(command, work, args.timeout))
            (ours, bare) = (statistics.median(s) for s in seconds.values())
            runs = " / ".join(", ".join(f"{x:.1f}" for x in s) for s in seconds.values())
            rows.append(f"| {case} | {ours:.2f} s | {bare:.2f} s | {ours / bare:.2f} | {runs} |")
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, {args.repeats} repeats")
    print("| measured | project (median) | bare Lightning (median) | ratio | every run: project / bare, s |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
