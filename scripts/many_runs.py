"""Many runs, fast: a sweep's cost per trial, the commands that need no training, and ``fit``'s start-up, each beside
its baseline and, with ``--before REF``, beside the same commands of another commit of this repository.

- **sweep**: ``python -m template sweep --config configs/sweep.yaml`` of ``--trials`` one-epoch trials of the example
  on the CPU (no pruner, so every trial runs its epoch): the whole command, and a trial's overhead over its training
  (the driver's seconds for it in ``trials.csv`` less its fit's in its ``provenance.json``). Baseline: Optuna running
  the same fit in-process (a plain ``Trainer.fit`` per trial, the same space and sampler), the floor of a sweep: no
  process, no isolation.
- **commands that need no training**: ``runs``, ``--help``, ``sweep --help``, ``cv --help`` and a misspelt
  subcommand, to their exit. Baseline: bare Lightning's start, ``python -c "import lightning.pytorch"``.
- **fit**: to its first training step, as ``scripts/startup.py`` measures it. Baseline: bare Lightning's
  ``Trainer.fit`` of the same model and data.

The commands of a case run one after the other in each round (each round in the other order, so that a busy machine
slows all alike); the table gives the medians and the ratios within each round (their median and range), as
Markdown. ``--before`` takes any git revision: its tree is exported to a temporary folder and run from there.

    python scripts/many_runs.py --before 6a96772 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import EXAMPLE_FIT, PACKAGE, REPO, SCRIPTS, _differences

# Optuna running the example's fit in-process, trial after trial: the floor of a sweep's cost per trial.
FLOOR = """
import functools, sys, time
import optuna, torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from {package}.data import DigitsDataModule
from {package}.model import Classifier
from {package}.nets import MLP

fits = []
def objective(trial):
    lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    dropout = trial.suggest_float("dropout", 0.0, 0.5)
    batch_size = trial.suggest_categorical("batch_size", [32, 64, 128])
    seed_everything(1234, verbose=False)
    model = Classifier(MLP((1, 8, 8), 10, dropout=dropout), 10, functools.partial(torch.optim.Adam, lr=lr))
    loggers = [CSVLogger(".", f"t{{trial.number}}"), TensorBoardLogger(".", f"t{{trial.number}}")]
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, log_every_n_steps=10, logger=loggers)
    start = time.monotonic()
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=batch_size))
    fits.append(time.monotonic() - start)
    return trainer.callback_metrics["val_acc"].item()

optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
study.optimize(objective, n_trials=int(sys.argv[1]))
seconds = [(t.datetime_complete - t.datetime_start).total_seconds() for t in study.trials]
print("overhead", sum(s - f for s, f in zip(seconds, fits)) / len(fits))
""".replace("{package}", PACKAGE)
LIGHTNING = ["-c", "import lightning.pytorch"]


def commands(tree: Path, trials: int) -> dict[str, list[str]]:
    """The project's commands of each case, run from ``tree``."""
    sweep = [
        "-m", PACKAGE, "sweep", "--config", str(tree / "configs" / "sweep.yaml"), f"--sweep.n_trials={trials}",
        "--sweep.pruner=none", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
    ]  # fmt: skip
    first_step = [
        "--config", str(tree / "configs" / "default.yaml"), "--trainer.accelerator=cpu",
        "--trainer.callbacks+=benchmark_user.FirstStep",
    ]  # fmt: skip
    return {
        "runs": ["-m", PACKAGE, "runs", "."],
        "--help": ["-m", PACKAGE, "--help"],
        "sweep --help": ["-m", PACKAGE, "sweep", "--help"],
        "cv --help": ["-m", PACKAGE, "cv", "--help"],
        "a misspelt subcommand": ["-m", PACKAGE, "fitt"],
        "fit to its first training step": ["-m", PACKAGE, "fit", *first_step],
        "sweep": sweep,
    }


def run(args: list[str], tree: Path, work: Path, timeout: float) -> tuple[float, str]:
    """Seconds from launching ``python *args`` (``tree`` first on its path) to its exit or its first training step;
    its output."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS), str(tree), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user runs: modules compiled once (the warm-up writes the cache)
    start = time.time()
    done = subprocess.run(
        [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    end = time.time()
    if done.returncode not in (0, 2) or done.returncode == 2 and "fitt" not in args:
        raise SystemExit(f"error: {' '.join(args[:4])} exited {done.returncode}:\n{done.stderr[-2000:]}")
    mark = [float(line.split()[-1]) for line in done.stdout.replace("\r", "\n").splitlines() if "first step at" in line]
    return (mark[0] if mark else end) - start, done.stdout


def overhead(work: Path) -> float:
    """A sweep trial's mean seconds over its training: the driver's seconds for it less its fit's."""
    folder = work / "lightning_logs" / "digits-lr"
    with (folder / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    fits = [json.loads((folder / row["folder"].split("/")[-1] / "provenance.json").read_text()) for row in rows]
    return statistics.fmean(float(r["seconds"]) - p["starts"][-1]["seconds"] for r, p in zip(rows, fits, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", metavar="REF", help="also run the commands of this git revision (e.g. main)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--trials", type=int, default=20, help="one-epoch trials of the sweep (default 20)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one command may take (default 1800)")
    parser.add_argument(
        "--cases", nargs="+", choices=["sweep", "commands", "fit"], default=["sweep", "commands", "fit"],
        help="what to measure (default: all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.trials < 1:
        print(
            f"error: --repeats and --trials must be at least 1, got {args.repeats} and {args.trials}", file=sys.stderr
        )
        raise SystemExit(2)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    python = platform.python_version()
    print(f"{platform.node()}: {os.cpu_count()} CPUs, load {load}, Python {python}, {args.repeats} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": REPO}
        if args.before:
            trees["before"] = Path(tmp) / "before"
            trees["before"].mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(trees["before"])], input=archive.stdout, check=True)
        mine = commands(REPO, args.trials)
        baselines = {"sweep": ["-c", FLOOR, str(args.trials)], "fit to its first training step": ["-c", EXAMPLE_FIT]}
        print(
            f"| measured | {' | '.join(f'{name} (median)' for name in trees)} | baseline (median) | "
            + " | ".join(f"{name} / baseline in a round: median (range)" for name in trees)
            + (" | this tree / before | difference this tree - before" if args.before else "")
            + " |"
        )
        print("|" + " --- |" * (3 + 2 * len(trees) + (2 if args.before else 0) - 1), flush=True)
        kinds = {"sweep": "sweep", "fit to its first training step": "fit"}
        for case in (case for case in mine if kinds.get(case, "commands") in args.cases):
            sides = {name: commands(tree, args.trials)[case] for name, tree in trees.items()}
            sides["baseline"] = baselines.get(case, LIGHTNING)
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            extra: dict[str, list[float]] = {name: [] for name in sides}  # a sweep trial's overhead
            # Round 0 warms the caches up and is not counted; a sweep's own first trial does.
            for round_ in range(int(case == "sweep"), args.repeats + 1):
                for name, command in list(sides.items())[:: 1 if round_ % 2 == 0 else -1]:
                    with tempfile.TemporaryDirectory(dir=tmp) as work:
                        wall, out = run(command, trees.get(name, REPO), Path(work), args.timeout)
                        if round_:
                            seconds[name].append(wall)
                            if case == "sweep":
                                extra[name].append(
                                    float(out.split()[-1]) if name == "baseline" else overhead(Path(work))
                                )
                    print(f"{case} round {round_}: {name} {wall:.2f} s", file=sys.stderr)
            rows = [(case, seconds)] + (
                [("a sweep trial's overhead over its training", extra)] if case == "sweep" else []
            )
            for what, values in rows:
                cells = [f"{statistics.median(values[name]):.2f} s" for name in sides]
                for name in trees:
                    ratios = [a / b for a, b in zip(values[name], values["baseline"], strict=True)]
                    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})")
                if args.before:
                    ratios = [a / b for a, b in zip(values["this tree"], values["before"], strict=True)]
                    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})")
                    cells.append(_differences(values["this tree"], values["before"]))
                print(f"| {what} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
