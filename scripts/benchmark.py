#!/usr/bin/env python
"""Training throughput of the project under single, dp and ddp against a hand-written PyTorch loop.

    python scripts/benchmark.py                                 # a small MLP on synthetic data, and the example
    python scripts/benchmark.py --config configs/my.yaml        # your own model and data (configs stack)
    python scripts/benchmark.py --steps 20 --warmup 5 --repeats 1 --out /tmp/bench   # a quick smoke run
    python scripts/benchmark.py --workload conv --strategies single --steps 200 --warmup 30 --repeats 3

Every measurement is a fresh process running the real command, ``python -m template fit ...``, for a fixed number
of steps with validation off: the first ``--warmup`` steps are not timed, the next ``--steps`` are, and each cell
of the matrix is repeated ``--repeats`` times (medians are reported). Writes ``benchmark.md``, ``benchmark.csv``
and ``benchmark.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader

import template
from template.data import BatchedTensorDataset, collate_batch

REPO = Path(__file__).resolve().parents[1]
PACKAGE = template.__name__
SCRIPTS = Path(__file__).resolve().parent
MODULE = Path(__file__).stem  # how child processes import this file: it is on their PYTHONPATH

# A small MLP on synthetic in-memory data: a workload where the per-step overhead of the machinery shows.
MLP_WORKLOAD = """\
# A 784-256-10 MLP, batch 64, on synthetic in-memory data (written by scripts/benchmark.py).
model:
  net:
    class_path: {package}.nets.MLP
    init_args:
      hidden_sizes: [256]
      dropout: 0.0
data:
  class_path: {module}.SyntheticDataModule
  init_args:
    num_samples: 60000
    input_shape: [1, 28, 28]
    batch_size: 64
"""

# A small ResNet on synthetic 3x32x32 images, batch 256, as a GPU user runs it: bf16-mixed, DataLoader workers,
# pinned memory. The network and the DataModule are a user's code (scripts/benchmark_user.py), named by class_path.
CONV_WORKLOAD = """\
# A CIFAR-style ResNet, batch 256, synthetic 3x32x32 images (written by scripts/benchmark.py).
model:
  net:
    class_path: benchmark_user.ResNet
    init_args:
      widths: {widths}
      blocks_per_stage: {blocks}
data:
  class_path: benchmark_user.SyntheticImages
  init_args:
    batch_size: 256
    num_workers: {workers}
    pin_memory: {pin_memory}
trainer:
  precision: {precision}
"""


CONV_GPU = {"widths": [64, 128, 256, 512], "blocks": 2, "workers": 4, "pin_memory": "true", "precision": "bf16-mixed"}
# A step of the GPU's ResNet-18 takes ~20 s on two CPU cores: the CPU runs the same code at the classic ResNet-8 size,
# in fp32 (bf16 autocast is slower than fp32 on most CPUs) with nothing to pin memory for.
CONV_CPU = {"widths": [16, 32, 64], "blocks": 1, "workers": 2, "pin_memory": "false", "precision": "32-true"}


def conv_workload(gpus: int) -> tuple[str, str]:
    """The conv workload's name and config on this machine: ResNet-18 in bf16-mixed on a GPU, ResNet-8 in fp32 on
    the CPU."""
    name = "conv: ResNet-18 bf16-mixed" if gpus else "conv: ResNet-8 fp32"
    return f"{name}, batch 256, synthetic 3x32x32", CONV_WORKLOAD.format(**(CONV_GPU if gpus else CONV_CPU))


# The reference row of Lightning's loop without the project's loggers, progress bar and callbacks.
BARE = "bare Lightning"

WORKLOADS = {
    "mlp": "MLP 784-256-10, batch 64, synthetic data",
    "example": "example (configs/default.yaml)",
    "conv": "ResNet, batch 256, synthetic 3x32x32",  # named with its size and precision by conv_workload
}
DEFAULT_WORKLOADS = ("mlp", "example")  # conv takes seconds a step on a CPU: asked for by name


class SyntheticDataModule(LightningDataModule):
    """Random images and labels held in memory: a data set that costs nothing to read, for benchmarks."""

    def __init__(
        self,
        num_samples: int = 60000,
        input_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.dataset: BatchedTensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.dataset is None:
            generator = torch.Generator().manual_seed(self.seed)
            images = torch.rand(self.num_samples, *self.input_shape, generator=generator)
            labels = torch.randint(0, self.num_classes, (self.num_samples,), generator=generator)
            self.dataset = BatchedTensorDataset(images, labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=collate_batch,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )


class StepTimer(Callback):
    """Times a window of training steps after a warm-up and writes it, with the first step's clock time, as JSON."""

    def __init__(self, out_path: str, warmup: int, steps: int) -> None:
        self.out_path = out_path
        self.warmup = warmup
        self.steps = steps
        self.first_step: float | None = None
        self.window_start: float | None = None
        self.window_end: float | None = None
        self.samples = 0
        self.batches = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.first_step is None:
            self.first_step = time.time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches += 1
        if self.batches == self.warmup:
            self.window_start = _clock(pl_module.device)
        elif self.warmup < self.batches <= self.warmup + self.steps:
            self.samples += _batch_len(batch)
            if self.batches == self.warmup + self.steps:
                self.window_end = _clock(pl_module.device)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        if self.window_end is None:
            raise RuntimeError(
                f"only {self.batches} training steps ran; the benchmark needs {self.warmup + self.steps}"
            )
        result = {
            "first_step": self.first_step,
            "seconds": self.window_end - self.window_start,
            # Under DDP every process reads its own batch of the same size; DP splits one batch over its devices.
            "samples": self.samples * trainer.world_size,
            "steps": self.steps,
            "world_size": trainer.world_size,
        }
        Path(self.out_path).write_text(json.dumps(result))


def _clock(device: torch.device) -> float:
    # CUDA runs asynchronously: wait for the queued work so the window holds the steps, not just their launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return len(first)


# ---------------------------------------------------------------------------------------------------------------
# The hand-written baseline: the same net, data, batch and optimizer as the project run, in plain PyTorch.
# ---------------------------------------------------------------------------------------------------------------


def _endless(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def _build(cli_args: list[str]) -> Any:
    """The LightningCLI object of `fit` with these arguments, stopped before training (same seed, links, batch)."""
    from template.engine.commands.cli import CLI, build_cli

    class Built(Exception):
        pass

    class BuildOnly(CLI):
        def before_fit(self) -> None:
            parent = getattr(super(), "before_fit", None)  # LightningCLI itself has no such hook
            if parent is not None:
                parent()
            raise Built(self)

    try:
        build_cli(
            ["fit", *cli_args, "--trainer.logger=false", "--trainer.devices=1", "--trainer.strategy=auto"],
            cli_class=BuildOnly,
        )
    except Built as built:
        return built.args[0]
    raise RuntimeError("the command line finished without reaching fit")


def baseline_worker(out_path: str, warmup: int, steps: int, cli_args: list[str]) -> None:
    """Run the hand-written loop and the data pipeline alone on the config's model and data; write JSON."""
    from torch.nn import functional as F

    cli = _build(cli_args)
    model, data = cli.model, cli.datamodule
    device = cli.trainer.strategy.root_device
    data.prepare_data()
    data.setup("fit")
    loader = data.train_dataloader()

    # Data pipeline alone: batches per second out of the same DataLoader, nothing else. The first batch's arrival
    # is this process's "first step", as Lightning calls on_train_batch_start once it holds the first batch.
    batches = _endless(loader)
    next(batches)
    first_step = time.time()
    for _ in range(warmup - 1):
        next(batches)
    start, samples = time.perf_counter(), 0
    for _ in range(steps):
        samples += _batch_len(next(batches))
    data_seconds = time.perf_counter() - start

    net = model.net.to(device).train()
    # What precision="bf16-mixed" does around a step: the forward pass and the loss under bf16 autocast.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cli.trainer.precision == "bf16-mixed")
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    batches = _endless(loader)
    window_start, timed_samples = None, 0
    for step in range(warmup + steps):
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step + 1 == warmup:
            window_start = _clock(device)
        elif step + 1 > warmup:
            timed_samples += len(y)
    hand_seconds = _clock(device) - window_start

    result = {
        "hand": {"seconds": hand_seconds, "samples": timed_samples, "steps": steps, "first_step": first_step},
        "data": {"seconds": data_seconds, "samples": samples, "steps": steps},
        "batch_size": getattr(data, "batch_size", None),
        "device": str(device),
    }
    Path(out_path).write_text(json.dumps(result))


def bare_worker(out_path: str, warmup: int, steps: int, cli_args: list[str]) -> None:
    """Lightning's own floor: the config's LightningModule and data in a Trainer without what the project adds.

    No loggers, progress bar, checkpointing or callbacks besides the timer: the project's row minus this one is
    what its defaults cost per step, and this row minus the hand-written loop is Lightning's loop.
    """
    cli = _build(cli_args)
    device = cli.trainer.strategy.root_device
    bare = Trainer(
        accelerator=device.type, devices=1, precision=cli.trainer.precision, max_epochs=-1, max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0, log_every_n_steps=cli.trainer.log_every_n_steps, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[StepTimer(out_path, warmup, steps)], default_root_dir=Path(out_path).parent,
    )  # fmt: skip
    bare.fit(cli.model, datamodule=cli.datamodule)


# ---------------------------------------------------------------------------------------------------------------
# The orchestrator: the matrix of runs, medians, tables and the plot.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One entry of the matrix: a strategy on a number of devices, measured ``repeats`` times."""

    workload: str
    strategy: str  # "hand-written", "single", "dp", "ddp"
    devices: int
    samples_per_s: list[float] = field(default_factory=list)
    ms_per_step: list[float] = field(default_factory=list)
    startup_s: list[float] = field(default_factory=list)
    per_device_batch: float | None = None
    import_seconds: dict[str, float] = field(default_factory=dict)  # for the imports cell: seconds per package

    @property
    def throughput(self) -> float:
        return statistics.median(self.samples_per_s)

    @property
    def step_ms(self) -> float:
        return statistics.median(self.ms_per_step)

    @property
    def startup(self) -> float | None:
        return statistics.median(self.startup_s) if self.startup_s else None


def _child_env(threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), str(REPO), env.get("PYTHONPATH")]))
    env.update({"PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _run(command: list[str], cwd: Path, args: argparse.Namespace) -> None:
    result = subprocess.run(
        command,
        cwd=cwd,
        env=_child_env(args.threads),
        capture_output=True,
        text=True,
        timeout=args.timeout,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"benchmark run failed (exit {result.returncode}): {' '.join(command)}\n{tail}")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


# The packages start-up time is attributed to: a module's own import time counts for the innermost of these that
# imported it (torch._dynamo's sympy counts for torch._dynamo, torchmetrics' matplotlib for matplotlib).
IMPORT_GROUPS = ("torch", "torch._dynamo", "lightning", "torchmetrics", "matplotlib", "jsonargparse")


def import_breakdown(work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of importing the command line per group of IMPORT_GROUPS and the package (``-X importtime``)."""
    command = [sys.executable, "-X", "importtime", "-c", f"import {PACKAGE}.engine.commands.cli"]
    result = subprocess.run(
        command, cwd=work, env=_child_env(args.threads), capture_output=True, text=True, timeout=args.timeout
    )
    groups = (*IMPORT_GROUPS, PACKAGE)
    # importtime prints a module after the modules it imported, each level indented by two more spaces.
    finished: list[tuple[int, str, float, list]] = []  # (depth, name, self seconds, children)
    for line in result.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue  # the header line, or anything else on stderr
        name = fields[2].strip()
        depth = (len(fields[2]) - len(fields[2].lstrip()) - 1) // 2
        children = []
        while finished and finished[-1][0] > depth:
            children.insert(0, finished.pop())
        finished.append((depth, name, int(fields[0]) / 1e6, children))

    seconds: dict[str, float] = {}

    def attribute(node: tuple[int, str, float, list], group: str) -> None:
        _, name, own, children = node
        group = max((g for g in groups if name == g or name.startswith(g + ".")), key=len, default=group)
        seconds[group] = seconds.get(group, 0.0) + own
        for child in children:
            attribute(child, group)

    for root in finished:
        attribute(root, "other")
    return seconds


def _device_counts(maximum: int) -> list[int]:
    counts = [1]
    while counts[-1] * 2 <= maximum:
        counts.append(counts[-1] * 2)
    return sorted({*counts, maximum})


def plan(devices: Sequence[int], strategies: Sequence[str], gpus: int) -> list[tuple[str, int]]:
    """The (strategy, devices) pairs to run: single on one device, dp over GPUs only, ddp over every count."""
    cells: list[tuple[str, int]] = []
    for strategy in strategies:
        if strategy == "single":
            cells.append(("single", 1))
        elif strategy == "dp" and gpus:
            cells += [("dp", n) for n in devices if n <= gpus]
        elif strategy == "ddp":
            cells += [("ddp", n) for n in devices]
    return cells


def _strategy_args(strategy: str, devices: int, gpus: int, batch: int | None) -> list[str]:
    accelerator = "gpu" if gpus else "cpu"
    if strategy == "single":
        return ["--trainer.strategy=auto", "--trainer.devices=1"]
    args = [f"--trainer.accelerator={accelerator}", f"--trainer.strategy={strategy}", f"--trainer.devices={devices}"]
    if strategy == "dp" and batch:
        # DP splits one batch over its devices: grow it so every device keeps the per-device batch of one device,
        # as each DDP process does. That is what makes the rows comparable.
        args.append(f"--data.init_args.batch_size={batch * devices}")
    return args


def run_matrix(args: argparse.Namespace, workloads: dict[str, list[str]], work: Path) -> list[Cell]:
    """Run every workload under every (strategy, devices) pair, ``repeats`` times; report progress on stderr."""
    gpus = torch.cuda.device_count()
    counts = args.devices or _device_counts(args.max_devices or gpus or 2)
    pairs = plan(counts, args.strategies, gpus)
    total = (len(workloads) * (len(pairs) + 2) + 1) * args.repeats
    done, cells = 0, []
    started = time.perf_counter()

    def progress(cell: Cell, repeat: int, note: str) -> None:
        elapsed = time.perf_counter() - started
        label = f"{cell.workload}: {cell.strategy} x {cell.devices}"
        print(
            f"[{done:>3}/{total}] {elapsed:6.0f} s  {label:<28} repeat {repeat + 1}/{args.repeats}  {note}",
            file=sys.stderr,
        )

    if "dp" in args.strategies and not gpus:
        print("note: dp runs only on GPUs (DataParallel on the CPU does nothing); skipped here", file=sys.stderr)
    cells_text = ", ".join(f"{strategy} x {devices}" for strategy, devices in pairs)
    print(
        f"{total} runs: {args.repeats} x (import, then per workload: hand-written, {BARE}, {cells_text})",
        file=sys.stderr,
    )

    # The floor of every start-up: importing torch, Lightning, torchmetrics and the package's command line.
    imports = Cell("all", "imports", 1)
    cells.append(imports)
    # Repeats are the outer loop: a burst of load from elsewhere then slows one run of every cell, not every run
    # of one cell, and the medians stay comparable.
    matrix = {
        name: [Cell(name, "hand-written", 1), Cell(name, BARE, 1), Cell(name, "data pipeline", 1)] for name in workloads
    }
    for name in workloads:
        matrix[name] += [Cell(name, strategy, devices) for strategy, devices in pairs]
        cells += matrix[name]
    for repeat in range(args.repeats):
        launched = time.time()
        _run([sys.executable, "-c", f"import {PACKAGE}.engine.commands.cli"], work, args)
        imports.startup_s.append(time.time() - launched)
        done += 1
        progress(imports, repeat, f"`import {PACKAGE}.engine.commands.cli` took {imports.startup_s[-1]:.1f} s")
        if repeat == 0:
            imports.import_seconds = import_breakdown(work, args)
        for name, config_args in workloads.items():
            hand, bare, data, *runs = matrix[name]
            results, launches = {}, {}
            for worker in ("baseline", "bare"):
                out = work / f"{_slug(name)}-{worker}-{repeat}.json"
                command = [sys.executable, str(Path(__file__).resolve()), f"--{worker}-worker", str(out)]
                command += [f"--warmup={args.warmup}", f"--steps={args.steps}", "--", *config_args]
                launches[worker] = time.time()
                _run(command, work, args)
                results[worker] = json.loads(out.read_text())
            batch = results["baseline"]["batch_size"]
            measured = (
                (hand, results["baseline"]["hand"], launches["baseline"]),
                (data, results["baseline"]["data"], None),
                (bare, results["bare"], launches["bare"]),
            )
            for cell, numbers, launched in measured:
                cell.samples_per_s.append(numbers["samples"] / numbers["seconds"])
                cell.ms_per_step.append(1000 * numbers["seconds"] / numbers["steps"])
                cell.per_device_batch = numbers["samples"] / numbers["steps"]
                if launched is not None:
                    cell.startup_s.append(numbers["first_step"] - launched)
            done += 1
            progress(
                hand, repeat, f"{hand.samples_per_s[-1]:>10,.0f} samples/s (data alone {data.samples_per_s[-1]:,.0f})"
            )
            done += 1
            progress(bare, repeat, f"{bare.samples_per_s[-1]:>10,.0f} samples/s")

            for cell in runs:
                out = work / f"{_slug(name)}-{cell.strategy}-{cell.devices}-{repeat}.json"
                timer = {
                    "class_path": f"{MODULE}.StepTimer",
                    "init_args": {"out_path": str(out), "warmup": args.warmup, "steps": args.steps},
                }
                command = [sys.executable, "-m", PACKAGE, "fit", *config_args]
                command += [
                    "--trainer.max_epochs=-1",
                    f"--trainer.max_steps={args.warmup + args.steps}",
                    # Training throughput: validation (and its sanity check) would run between the timed steps.
                    "--trainer.limit_val_batches=0",
                    "--trainer.num_sanity_val_steps=0",
                    f"--trainer.default_root_dir={work / 'runs'}",
                    *_strategy_args(cell.strategy, cell.devices, gpus, batch),
                    f"--trainer.callbacks+={json.dumps(timer)}",
                ]
                launched = time.time()
                _run(command, work, args)
                result = json.loads(out.read_text())
                cell.samples_per_s.append(result["samples"] / result["seconds"])
                cell.ms_per_step.append(1000 * result["seconds"] / result["steps"])
                cell.startup_s.append(result["first_step"] - launched)
                cell.per_device_batch = result["samples"] / result["steps"] / cell.devices
                done += 1
                note = f"{cell.samples_per_s[-1]:>10,.0f} samples/s, first step after {cell.startup_s[-1]:.1f} s"
                progress(cell, repeat, note)
    return cells


# ---------------------------------------------------------------------------------------------------------------
# Reports.
# ---------------------------------------------------------------------------------------------------------------

COLUMNS = [
    "workload",
    "strategy",
    "devices",
    "batch_per_device",
    "samples_per_s",
    "ms_per_step",
    "speedup",
    "efficiency",
    "step_time_vs_hand",
    "step_time_vs_bare",
    "startup_s",
    "repeats",
]


def table_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per cell with speed-up and efficiency against the project on one device, and the hand-loop ratio."""
    rows = []
    for cell in cells:
        if cell.strategy == "imports":
            continue
        same = [c for c in cells if c.workload == cell.workload]
        single = next((c for c in same if c.strategy == "single"), None)
        hand = next(c for c in same if c.strategy == "hand-written")
        bare = next(c for c in same if c.strategy == BARE)
        training = cell.strategy != "data pipeline"
        project_run = cell.strategy in ("single", "dp", "ddp")
        speedup = cell.throughput / single.throughput if single and project_run else None
        rows.append(
            {
                "workload": cell.workload,
                "strategy": cell.strategy,
                "devices": cell.devices,
                "batch_per_device": round(cell.per_device_batch, 1) if cell.per_device_batch else None,
                "samples_per_s": round(cell.throughput, 1),
                "ms_per_step": round(cell.step_ms, 3),
                "speedup": round(speedup, 3) if speedup else None,
                "efficiency": round(speedup / cell.devices, 3) if speedup else None,
                "step_time_vs_hand": round(cell.step_ms / hand.step_ms, 3) if training else None,
                "step_time_vs_bare": round(cell.step_ms / bare.step_ms, 3) if training else None,
                "startup_s": round(cell.startup, 2) if cell.startup is not None else None,
                "repeats": len(cell.samples_per_s),
            }
        )
    return rows


def _paired(ours: list[float], theirs: list[float], how: str) -> str:
    """The median of per-round ratios (or differences) and their range: rounds ran under the same load."""
    pairs = [a / b if how == "/" else a - b for a, b in zip(ours, theirs, strict=True)]
    spec = ".3f" if how == "/" else "+.2f"
    middle = f"{statistics.median(pairs):{spec}}{'x' if how == '/' else ''}"
    return middle if len(pairs) == 1 else f"{middle} (rounds {min(pairs):{spec}} to {max(pairs):{spec}})"


def summary_lines(cells: list[Cell]) -> list[str]:
    """The acceptance ratios in words: project vs hand-written per step, data pipeline vs training."""
    lines = []
    imports = next((c for c in cells if c.strategy == "imports"), None)
    for workload in dict.fromkeys(c.workload for c in cells if c.strategy != "imports"):
        same = {(c.strategy, c.devices): c for c in cells if c.workload == workload}
        hand, data, single = same[("hand-written", 1)], same[("data pipeline", 1)], same.get(("single", 1))
        bare = same[(BARE, 1)]
        if single is None:
            continue
        lines.append(
            f"- **{workload}**: the project takes {single.step_ms / hand.step_ms:.2f}x the time per step of the "
            f"hand-written loop ({single.step_ms:.2f} ms vs {hand.step_ms:.2f} ms, "
            f"{single.step_ms - hand.step_ms:+.2f} ms per step); the data pipeline alone delivers "
            f"{data.throughput:,.0f} samples/s, {data.throughput / single.throughput:.1f}x what training consumes; "
            f"first training step {single.startup:.1f} s after `python -m {PACKAGE} fit` starts. "
            f"Lightning's loop alone (same LightningModule; no loggers, progress bar, checkpointing or callbacks) "
            f"takes {bare.step_ms / hand.step_ms:.2f}x ({bare.step_ms:.2f} ms): the project's defaults add "
            f"{single.step_ms - bare.step_ms:+.2f} ms per step to it; paired by round, the project's step takes "
            f"{_paired(single.ms_per_step, bare.ms_per_step, '/')} bare Lightning's and its first step comes "
            f"{_paired(single.startup_s, bare.startup_s, '-')} s later (bare Lightning and the hand-written loop are "
            f"built by the project's command line, so its imports and parsing are in their start-up too)."
        )
    if imports is not None:
        parts = imports.import_seconds
        shares = ", ".join(f"{name} {parts.get(name, 0.0):.2f} s" for name in (*IMPORT_GROUPS, PACKAGE, "other"))
        lines.append(
            f"- **start-up**: `python -c 'import {PACKAGE}.engine.commands.cli'` alone takes {imports.startup:.1f} s "
            f"(median of its own runs). Import time by what pulled it in (`python -X importtime`): {shares}."
        )
    return lines


def machine() -> str:
    """One line describing the hardware and the library versions the numbers belong to."""
    import lightning

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    accelerators = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} CPU cores, {accelerators}; {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}"
    )


def write_markdown(path: Path, rows: list[dict[str, Any]], cells: list[Cell], settings: str) -> None:
    def fmt(value: Any, spec: str = "") -> str:
        return "" if value is None else format(value, spec)

    lines = [f"Machine: {machine()}.", "", f"Settings: {settings}.", ""]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [
            f"### {workload}",
            "",
            "| strategy | devices | batch/device | samples/s | ms/step | speed-up | efficiency "
            "| step time vs hand-written | step time vs bare | start-up s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in (r for r in rows if r["workload"] == workload):
            lines.append(
                f"| {r['strategy']} | {r['devices']} | {fmt(r['batch_per_device'], 'g')} | "
                f"{r['samples_per_s']:,.0f} | {r['ms_per_step']:.3f} | {fmt(r['speedup'], '.2f')} | "
                f"{fmt(r['efficiency'], '.2f')} | {fmt(r['step_time_vs_hand'], '.2f')} | "
                f"{fmt(r['step_time_vs_bare'], '.3f')} | {fmt(r['startup_s'], '.2f')} |"
            )
        lines.append("")
    lines += summary_lines(cells)
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Throughput against devices, one line per strategy and one panel per workload."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    figure, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    styles = {
        "hand-written": ("*", "black"),
        BARE: ("x", "grey"),
        "single": ("o", "tab:blue"),
        "dp": ("s", "tab:orange"),
        "ddp": ("^", "tab:green"),
    }
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload and r["strategy"] in styles]
        for strategy, (marker, color) in styles.items():
            points = sorted((r["devices"], r["samples_per_s"]) for r in mine if r["strategy"] == strategy)
            if points:
                xs, ys = zip(*points, strict=True)
                line = "-" if len(xs) > 1 else "none"
                size = 11 if marker == "*" else 7
                labels = {"hand-written": "hand-written loop", BARE: "Lightning, no loggers/bar/callbacks"}
                label = labels.get(strategy, f"project, {strategy}")
                ax.plot(xs, ys, marker=marker, linestyle=line, color=color, label=label, markersize=size)
        single = next((r for r in mine if r["strategy"] == "single"), None)
        top = max(r["devices"] for r in mine)
        if single and top > 1:
            ax.plot(
                [1, top],
                [single["samples_per_s"], single["samples_per_s"] * top],
                "--",
                color="grey",
                label="linear scaling",
            )
        ax.set(title=workload, xlabel="devices", ylabel="training samples / s")
        ax.set_xticks(sorted({r["devices"] for r in mine}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(
            'error: the plots need matplotlib; install it with `pip install matplotlib` (or `pip install -e ".[dev]"`)'
        )
    return plt


# ---------------------------------------------------------------------------------------------------------------


class OneLineErrors(argparse.ArgumentParser):
    """Reports a bad option as one ``error:`` line and exit status 2, without the usage text."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineErrors(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        action="append",
        type=Path,
        help="a config of the project (repeat to stack); default: the MLP and configs/default.yaml",
    )
    parser.add_argument("--steps", type=int, default=500, help="timed training steps per run (default 500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps before them (default 50)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh processes per cell; medians are reported (default 3)"
    )
    parser.add_argument(
        "--max-devices", type=int, default=None, help="largest device count (default: all GPUs, or 2 CPU processes)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        nargs="+",
        help="device counts for dp and ddp (default: 1, 2, 4, ... up to --max-devices)",
    )
    parser.add_argument("--strategies", nargs="+", default=["single", "dp", "ddp"], choices=["single", "dp", "ddp"])
    parser.add_argument(
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help="built-in workloads to run when no --config is given (default: mlp and example)",
    )
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run (default: the libraries' choice)")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmark"), help="folder for benchmark.md/.csv/.png (default ./benchmark)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take before it counts as hung")
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for count in [args.max_devices or 1, args.threads or 1, *(args.devices or [])]:
        if count < 1:
            parser.error(f"device and thread counts must be at least 1, got {count}")
    if args.config and args.workload:
        parser.error("--workload picks a built-in workload; it cannot be combined with --config")
    for config in args.config or []:
        if not config.is_file():
            parser.error(f"config file '{config}' does not exist; pass an existing YAML file to --config")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark matrix and write the Markdown table, the CSV table and the plot."""
    argv = list(sys.argv[1:] if argv is None else argv)
    workers = {"--baseline-worker": baseline_worker, "--bare-worker": bare_worker}
    if argv[:1] and argv[0] in workers:
        split = argv.index("--")
        options = dict(a.lstrip("-").split("=", 1) for a in argv[2:split])
        workers[argv[0]](argv[1], int(options["warmup"]), int(options["steps"]), argv[split + 1 :])
        return
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="benchmark-") as scratch:
        work = Path(scratch)
        if args.config:
            name = "+".join(c.stem for c in args.config)
            workloads = {name: [a for c in args.config for a in ("--config", str(c.resolve()))]}
        else:
            mlp, conv = work / "mlp.yaml", work / "conv.yaml"
            mlp.write_text(MLP_WORKLOAD.format(package=PACKAGE, module=MODULE))
            names = {**WORKLOADS}
            names["conv"], text = conv_workload(torch.cuda.device_count())
            conv.write_text(text)
            default = str(REPO / "configs" / "default.yaml")
            configs = {
                "mlp": ["--config", default, "--config", str(mlp)],
                "example": ["--config", default],
                "conv": ["--config", default, "--config", str(conv)],
            }
            workloads = {names[key]: configs[key] for key in args.workload or DEFAULT_WORKLOADS}
        cells = run_matrix(args, workloads, work)
    rows = table_rows(cells)
    settings = f"{args.steps} timed steps after {args.warmup} warm-up steps, median of {args.repeats} fresh process(es)"
    write_markdown(args.out / "benchmark.md", rows, cells, settings)
    write_csv(args.out / "benchmark.csv", rows)
    write_plot(args.out / "benchmark.png", rows)
    print((args.out / "benchmark.md").read_text())
    print(
        f"wrote {args.out / 'benchmark.md'}, {args.out / 'benchmark.csv'} and {args.out / 'benchmark.png'}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
