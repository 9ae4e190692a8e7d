"""Training speed with checkpoints on object storage against the same run on a local disk, side by side.

Each round runs the example's ``fit`` twice, in alternating order, with a checkpoint every ``--every`` steps: once with
``trainer.default_root_dir`` on a local disk, once on an S3 server (moto's, started here on loopback; ``--endpoint``
for another). It prints each run's samples/s over the epochs after the first, the seconds a checkpoint save holds the
training thread (Lightning's simple profiler), the time from the command to its end, their medians, and the ratio S3 /
local within each round, as Markdown:

    python scripts/storage_benchmark.py --rounds 3 --every 20
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import template

REPO = Path(__file__).resolve().parents[1]
PACKAGE = template.__name__


def run(root: str, name: str, args: argparse.Namespace, env: dict[str, str], work: Path) -> tuple[float, float, float]:
    """samples/s (the mean over the epochs after the first), seconds per checkpoint save on the training thread and
    seconds from the command to its end."""
    command = [
        sys.executable, "-m", PACKAGE, "fit", "--config", str(REPO / "configs" / "default.yaml"),
        "--trainer.accelerator=cpu", f"--trainer.max_epochs={args.epochs}", "--trainer.enable_progress_bar=false",
        f"--run.save_every_n_steps={args.every}", f"--run.name={name}", f"--trainer.default_root_dir={root}",
        f"--model.net.init_args.hidden_sizes=[{args.width}, {args.width}]", "--trainer.profiler=simple",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{root}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rates = [float(v) for v in re.findall(r"throughput/samples_per_sec=([\d.]+)", done.stdout + done.stderr)]
    found = re.search(r"Throughput: ([\d,]+) samples/s in the last epoch \(([\d,]+) mean", done.stdout + done.stderr)
    rate = float(found.group(2).replace(",", "")) if found else (statistics.mean(rates) if rates else float("nan"))
    save = re.search(r"\|\s+save_checkpoint\s+\|\s+([\d.e-]+)", done.stdout + done.stderr)
    return rate, float(save.group(1)) if save else float("nan"), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="a checkpoint every N training steps")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024, help="hidden sizes of the MLP: the checkpoint's size")
    parser.add_argument("--endpoint", help="an S3 endpoint URL (default: moto's server, started here)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    server = None
    if args.endpoint is None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        args.endpoint = f"http://{host}:{port}"
    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**os.environ, **credentials, "FSSPEC_S3_ENDPOINT_URL": args.endpoint, "PYTHONWARNINGS": "ignore"}
    import s3fs

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=args.endpoint, key="bench", secret="bench").mkdir(bucket)
    results: dict[str, list[tuple[float, float, float]]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for n in range(args.rounds):
            order = ["local", "s3"] if n % 2 == 0 else ["s3", "local"]
            for where in order:
                root = str(work / "runs") if where == "local" else f"s3://{bucket}/runs"
                results[where].append(run(root, f"{where}-{n}", args, env, work))
                print(f"round {n + 1}/{args.rounds} {where}: {results[where][-1][0]:.0f} samples/s", file=sys.stderr)
    if server is not None:
        server.stop()
    print(f"| where | samples/s (median of {args.rounds}) | ms per checkpoint save | seconds per run (median) |")
    print("| --- | --- | --- | --- |")
    for where, values in results.items():
        rate, save, seconds = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"| {where} | {rate:.0f} | {save * 1000:.1f} | {seconds:.1f} |")
    ratios = [s[0] / local[0] for s, local in zip(results["s3"], results["local"], strict=True)]
    spread = f"median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}"
    print(f"\nS3 / local samples/s within each round: {spread} (a checkpoint every {args.every} steps)")
    saves = [s[1] / local[1] for s, local in zip(results["s3"], results["local"], strict=True)]
    print(f"S3 / local time per checkpoint save within each round: median {statistics.median(saves):.3f}, "
          f"range {min(saves):.3f}-{max(saves):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
