#!/usr/bin/env python
"""What each process holds under ddp and under fsdp: parameter, gradient and optimizer-state bytes, and step time.

    python scripts/memory.py                                   # an MLP of ~23 MB of parameters, 2 processes
    python scripts/memory.py --hidden 4096 4096 --repeats 5    # a bigger model, more pairs
    python scripts/memory.py --steps 3 --warmup 2 --repeats 1 --hidden 256 --out /tmp/mem   # a quick smoke run

Every measurement is a fresh process running the real command, ``python -m template fit ...``, with the strategy
switched by one option (``--trainer.strategy=ddp`` or ``fsdp``) and two callbacks added: after ``--warmup`` steps
every rank sums the bytes of the tensors it holds (the local shard of a sharded parameter, its gradient, the
optimizer's state), and rank 0 times the next ``--steps`` steps. ddp and fsdp run in pairs, alternating which goes
first, ``--repeats`` times; step times are compared pair by pair. On GPUs (as many as processes) each rank also
reports ``torch.cuda.max_memory_allocated``. Writes ``memory.md`` and ``memory.csv`` to ``--out``, and each run's
JSON (``{strategy}-{repeat}-rank{N}.json`` per rank, ``-time.json`` for rank 0's clock) to ``--out/runs``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from benchmark import PACKAGE, REPO, OneLineErrors, StepTimer, SyntheticDataModule, _run, machine
from lightning.pytorch import Callback, LightningModule, Trainer

MODULE = Path(__file__).stem  # how child processes import this file: it is on their PYTHONPATH
STRATEGIES = ("ddp", "fsdp")
MB = 1e6
INPUT_SHAPE, CLASSES = [1, 28, 28], 10

# An MLP on synthetic in-memory data (benchmark.py's data module): big enough that its states dwarf the rest.
WORKLOAD = """\
# An MLP on synthetic in-memory data (written by scripts/memory.py).
model:
  net:
    class_path: {package}.nets.MLP
    init_args:
      hidden_sizes: {hidden}
      dropout: 0.0
data:
  class_path: {data_module}
  init_args:
    num_samples: {samples}
    input_shape: {input_shape}
    num_classes: {classes}
    batch_size: {batch}
"""


class MemoryProbe(Callback):
    """After ``at_step`` training steps, writes the bytes this rank holds to ``{prefix}-rank{N}.json``.

    Counted: parameters as this process stores them (a sharded parameter's local shard), their gradients and every
    tensor in the optimizers' state. The step is after an optimizer step, so gradients and state both exist. Also
    the most parameter bytes held whole at once in a forward pass up to then: fsdp gathers a sharding unit's
    parameters just before the unit runs, so that figure is the largest unit, which the held shards do not show.
    """

    def __init__(self, prefix: str, at_step: int) -> None:
        self.prefix = prefix
        self.at_step = at_step
        self.batches = 0
        self.gathered = 0
        self.hooks: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        def count(module: torch.nn.Module, args: Any) -> None:
            # Runs after fsdp's own pre-forward hook, which has swapped the unit's shards for gathered parameters.
            whole = (p for p in pl_module.parameters() if not _is_dtensor(p))
            self.gathered = max(self.gathered, local_bytes(whole))

        owners = [m for m in pl_module.modules() if any(True for _ in m.parameters(recurse=False))]
        self.hooks = [m.register_forward_pre_hook(count) for m in owners]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches += 1
        if self.batches != self.at_step:
            return
        for hook in self.hooks:  # out of the timed steps that follow
            hook.remove()
        parameters = list(pl_module.parameters())
        state = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()]
        device = pl_module.device
        result = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "sharded_parameters": sum(_is_dtensor(p) for p in parameters),
            "parameters": len(parameters),
            "param_bytes": local_bytes(parameters),
            "grad_bytes": local_bytes(p.grad for p in parameters),
            "optimizer_bytes": local_bytes(state),
            "gathered_param_bytes": self.gathered,
            "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
        Path(f"{self.prefix}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_bytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors among ``values`` as this process stores them: a DTensor's local shard, not its whole."""
    total = 0
    for value in values:
        if _is_dtensor(value):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


# ---------------------------------------------------------------------------------------------------------------
# The orchestrator: pairs of runs, then the tables.
# ---------------------------------------------------------------------------------------------------------------


def run_pairs(args: argparse.Namespace, config: Path, work: Path) -> dict[str, list[dict[str, Any]]]:
    """Run ddp and fsdp ``repeats`` times each, alternating which goes first; one record per run."""
    accelerator = "gpu" if torch.cuda.device_count() >= args.processes else "cpu"
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        # Alternating the order: a machine that gets busier (or quieter) through a pair slows both alike on average.
        for strategy in STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]:
            record = run_one(args, config, work, strategy, accelerator, repeat)
            runs[strategy].append(record)
            total = sum(r["total_bytes"] for r in record["ranks"]) / len(record["ranks"]) / MB
            print(
                f"{time.perf_counter() - started:6.0f} s  {strategy:<4} x {args.processes}  repeat {repeat + 1}/"
                f"{args.repeats}  {record['ms_per_step']:8.1f} ms/step  {total:8.1f} MB/rank",
                file=sys.stderr,
            )
    return runs


def run_one(
    args: argparse.Namespace, config: Path, work: Path, strategy: str, accelerator: str, repeat: int
) -> dict[str, Any]:
    """One fresh ``fit`` process tree; its rank-0 step time and every rank's bytes (their JSON kept in --out)."""
    (args.out / "runs").mkdir(exist_ok=True)
    prefix = args.out / "runs" / f"{strategy}-{repeat}"
    timer = args.out / "runs" / f"{strategy}-{repeat}-time.json"
    rank_files = [Path(f"{prefix}-rank{r}.json") for r in range(args.processes)]
    for stale in (timer, *rank_files):  # from an earlier call with the same --out: never read as this run's
        stale.unlink(missing_ok=True)
    probe = {"class_path": f"{MODULE}.MemoryProbe", "init_args": {"prefix": str(prefix), "at_step": args.warmup}}
    clock = {
        "class_path": _importable(StepTimer),
        "init_args": {"out_path": str(timer), "warmup": args.warmup, "steps": args.steps},
    }
    command = [sys.executable, "-m", PACKAGE, "fit", "--config", str(REPO / "configs" / "default.yaml")]
    command += [
        "--config", str(config), f"--trainer.accelerator={accelerator}", f"--trainer.devices={args.processes}",
        *strategy_args(strategy, args.shard_layers),
        "--trainer.max_epochs=-1", f"--trainer.max_steps={args.warmup + args.steps}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={work / 'runs'}",  # checkpoints and logs: scratch
        # The probe before the timer: its counting at the last warm-up step stays out of the timed window.
        f"--trainer.callbacks+={json.dumps(probe)}", f"--trainer.callbacks+={json.dumps(clock)}",
    ]  # fmt: skip
    _run(command, work, args)
    timed = json.loads(timer.read_text())
    ranks = [json.loads(path.read_text()) for path in rank_files]
    for rank in ranks:
        rank["total_bytes"] = rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_bytes"]
    return {"ms_per_step": 1000 * timed["seconds"] / timed["steps"], "ranks": ranks}


def strategy_args(strategy: str, shard_layers: list[str] | None) -> list[str]:
    """The strategy option: the registry name, or fsdp by class_path where it takes a sharding unit."""
    if strategy == "fsdp" and shard_layers:
        chosen = {
            "class_path": f"{PACKAGE}.engine.strategies.FSDP2Strategy",
            "init_args": {"shard_layers": shard_layers},
        }
        return [f"--trainer.strategy={json.dumps(chosen)}"]
    return [f"--trainer.strategy={strategy}"]


def _importable(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pair_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[float]:
    """fsdp's step time over ddp's within each pair, in run order: the machine's load at that moment cancels out."""
    return [f["ms_per_step"] / d["ms_per_step"] for d, f in zip(runs["ddp"], runs["fsdp"], strict=True)]


def table_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per strategy: the largest rank's bytes (what must fit on each device), step time and the ratios."""
    worst = {s: max(runs[s][-1]["ranks"], key=lambda r: r["total_bytes"]) for s in STRATEGIES}
    paired = pair_ratios(runs)
    rows = []
    for strategy in STRATEGIES:
        rank = worst[strategy]
        peaks = [r["cuda_peak_bytes"] for r in runs[strategy][-1]["ranks"] if r["cuda_peak_bytes"] is not None]
        rows.append(
            {
                "strategy": strategy,
                "processes": rank["world_size"],
                "sharded_parameters": rank["sharded_parameters"],
                "parameters": rank["parameters"],
                "param_mb": round(rank["param_bytes"] / MB, 4),
                "grad_mb": round(rank["grad_bytes"] / MB, 4),
                "optimizer_mb": round(rank["optimizer_bytes"] / MB, 4),
                "total_mb": round(rank["total_bytes"] / MB, 4),
                "total_vs_ddp": round(rank["total_bytes"] / worst["ddp"]["total_bytes"], 4),
                "gathered_param_mb": round(rank["gathered_param_bytes"] / MB, 4),
                "cuda_peak_mb": round(max(peaks) / MB, 1) if peaks else None,
                "ms_per_step": round(statistics.median(r["ms_per_step"] for r in runs[strategy]), 2),
                "step_time_vs_ddp": round(statistics.median(paired), 3) if strategy == "fsdp" else 1.0,
                "repeats": len(runs[strategy]),
            }
        )
    return rows


def write_markdown(path: Path, rows: list[dict[str, Any]], ratios: list[float], settings: str) -> None:
    peak = any(r["cuda_peak_mb"] is not None for r in rows)
    columns = [
        "strategy", "processes", "sharded parameters", "params MB/rank", "grads MB/rank", "optimizer MB/rank",
        "total MB/rank", "total vs ddp", "params whole at once MB/rank", *(["peak GPU MB/rank"] if peak else []),
        "ms/step", "step time vs ddp",
    ]  # fmt: skip
    lines = [f"Machine: {machine()}.", "", f"Settings: {settings}.", ""]
    lines += ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for r in rows:
        sizes = " | ".join(f"{r[key]:.2f}" for key in ("param_mb", "grad_mb", "optimizer_mb", "total_mb"))
        cuda = f" {r['cuda_peak_mb']:.1f} |" if peak else ""
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {r['sharded_parameters']}/{r['parameters']} | {sizes} | "
            f"{r['total_vs_ddp']:.3f} | {r['gathered_param_mb']:.2f} |{cuda} {r['ms_per_step']:.1f} | "
            f"{r['step_time_vs_ddp']:.2f} |"
        )
    lines += [
        "",
        "MB/rank: 10^6 bytes held by the rank holding the most; total vs ddp: that total over ddp's; params whole at "
        "once: the most parameter bytes unsharded at one moment of a forward pass (fsdp's largest gathered unit); "
        "step time vs ddp: the median of the ratios of the runs of each pair.",
        "",
        f"Step time fsdp / ddp, pair by pair: {', '.join(f'{r:.2f}' for r in ratios)}.",
    ]
    path.write_text("\n".join(lines) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineErrors(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=[2048, 2048], help="the MLP's hidden sizes (default 2048 2048)"
    )
    parser.add_argument("--batch", type=int, default=64, help="samples per process and step (default 64)")
    parser.add_argument("--processes", type=int, default=2, help="processes (GPUs, if there are so many) (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them; bytes counted after (5)")
    parser.add_argument("--repeats", type=int, default=3, help="ddp/fsdp pairs; medians are reported (default 3)")
    parser.add_argument(
        "--shard-layers", nargs="+", help="fsdp's sharding units by class name (default: the strategy's own)"
    )
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run (default: the libraries' choice)")
    parser.add_argument("--out", type=Path, default=Path("memory"), help="folder for memory.md/.csv (./memory)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take before it counts as hung")
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "warmup", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.processes < 2:
        parser.error(f"--processes must be at least 2 to shard anything, got {args.processes}")
    if min(args.hidden) < 1:
        parser.error(f"--hidden sizes must be at least 1, got {args.hidden}")
    return args


def write_workload(path: Path, args: argparse.Namespace) -> None:
    """The MLP config for these options; one epoch holds all the steps, so none ends inside the timed window."""
    samples = args.batch * args.processes * (args.warmup + args.steps)
    data_module = _importable(SyntheticDataModule)
    path.write_text(
        WORKLOAD.format(
            package=PACKAGE,
            hidden=args.hidden,
            data_module=data_module,
            samples=samples,
            input_shape=INPUT_SHAPE,
            classes=CLASSES,
            batch=args.batch,
        )
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run the pairs and write the Markdown and CSV tables."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memory-") as scratch:
        work = Path(scratch)
        config = work / "mlp.yaml"
        write_workload(config, args)
        runs = run_pairs(args, config, work)
    rows = table_rows(runs)
    sizes = "-".join(map(str, [math.prod(INPUT_SHAPE), *args.hidden, CLASSES]))
    shard = f"fsdp sharding units {args.shard_layers}" if args.shard_layers else "fsdp's default sharding units"
    settings = (
        f"MLP {sizes}, float32, Adam, batch {args.batch} per process, {args.processes} processes, {shard}; bytes "
        f"counted after {args.warmup} steps; {args.steps} timed steps, median of {args.repeats} ddp/fsdp pair(s) "
        f"run alternately in fresh processes"
    )
    write_markdown(args.out / "memory.md", rows, pair_ratios(runs), settings)
    write_csv(args.out / "memory.csv", rows)
    print((args.out / "memory.md").read_text())
    print(f"wrote {args.out / 'memory.md'} and {args.out / 'memory.csv'}", file=sys.stderr)


if __name__ == "__main__":
    main()
