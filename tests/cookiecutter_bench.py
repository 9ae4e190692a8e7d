"""Bake time: `python tests/cookiecutter_bench.py [runs]` prints the wall time of whole bakes from this repository.

Two numbers: the command line (interpreter start, cookiecutter import, both hooks, copy, ruff) and the Python API
in an already running interpreter. Timings depend on machine load; the target is <= 2 s for the command line.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cookiecutter.main import cookiecutter

REPO = Path(__file__).resolve().parents[1]


def main(runs: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "rc.yaml")
        config.write_text(f"replay_dir: {tmp}/replay\ncookiecutters_dir: {tmp}/clones\n")
        cli, api = [], []
        for i in range(runs):
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "cookiecutter", "--no-input", str(REPO), "-o", f"{tmp}/cli{i}",
                 "--config-file", str(config)],
                check=True,
                timeout=120,
            )  # fmt: skip
            cli.append(time.perf_counter() - start)
            start = time.perf_counter()
            cookiecutter(str(REPO), no_input=True, output_dir=f"{tmp}/api{i}", config_file=str(config))
            api.append(time.perf_counter() - start)
    load = os.getloadavg()[0]
    for name, times in (("command line", cli), ("python API", api)):
        print(f"bake via {name}: median {statistics.median(times):.2f} s, min {min(times):.2f} s over {runs} runs")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs (other work on the machine inflates these numbers)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
