"""scripts/memory.py: real ddp and fsdp runs count what each rank holds, and fsdp holds half on 2 processes."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from tests.test_benchmark import _load, _script

# The smoke run's MLP 784-256-10 in float32: weights and biases of both layers.
FIRST_LAYER_BYTES = 4 * (784 * 256 + 256)
PARAM_BYTES = FIRST_LAYER_BYTES + 4 * (256 * 10 + 10)
# Adam: exp_avg and exp_avg_sq per parameter, plus one float32 `step` per parameter tensor (4 tensors).
ADAM_BYTES = 2 * PARAM_BYTES + 4 * 4


def _memory():  # noqa: ANN202 - a module object
    _load("benchmark")  # memory.py imports it as its neighbour, as it does when run as a script
    return _load("memory")


@pytest.mark.slow
def test_fsdp_holds_half_of_what_ddp_holds_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _script(
        "memory.py",
        *("--hidden", "256", "--steps", "3", "--warmup", "2", "--repeats", "1", "--out", out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = {row["strategy"]: row for row in csv.DictReader((out / "memory.csv").open())}
    assert set(rows) == {"ddp", "fsdp"}
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    assert int(ddp["processes"]) == int(fsdp["processes"]) == 2
    # ddp replicates every parameter; fsdp holds every one as a shard.
    assert int(ddp["sharded_parameters"]) == 0 and int(fsdp["sharded_parameters"]) == int(fsdp["parameters"]) == 4

    # ddp's rank holds the whole model, its gradients and Adam's two moments: counted to the byte (rounded to 100 B).
    assert float(ddp["param_mb"]) == pytest.approx(PARAM_BYTES / 1e6, abs=1e-4)
    assert float(ddp["grad_mb"]) == pytest.approx(PARAM_BYTES / 1e6, abs=1e-4)
    assert float(ddp["optimizer_mb"]) == pytest.approx(ADAM_BYTES / 1e6, abs=1e-4)
    ratio = float(fsdp["total_mb"]) / float(ddp["total_mb"])
    assert 0.4 < ratio < 0.6 and float(fsdp["total_vs_ddp"]) == pytest.approx(ratio, abs=1e-3)
    for key in ("param_mb", "grad_mb", "optimizer_mb"):
        assert 0.4 < float(fsdp[key]) / float(ddp[key]) < 0.6, key
    # Whole at once in a forward pass: ddp's whole model; fsdp's largest gathered unit, at least the 784x256 layer.
    assert float(ddp["gathered_param_mb"]) == pytest.approx(PARAM_BYTES / 1e6, abs=1e-4)
    assert FIRST_LAYER_BYTES / 1e6 - 1e-4 <= float(fsdp["gathered_param_mb"]) <= PARAM_BYTES / 1e6 + 1e-4
    assert float(ddp["ms_per_step"]) > 0 and float(fsdp["ms_per_step"]) > 0 and float(fsdp["step_time_vs_ddp"]) > 0

    # Every rank of every run wrote what it holds; the table is the larger rank's, and both ranks of fsdp hold a half.
    totals = {}
    for strategy in ("ddp", "fsdp"):
        ranks = [json.loads((out / "runs" / f"{strategy}-0-rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
        totals[strategy] = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks]
        assert max(totals[strategy]) / 1e6 == pytest.approx(float(rows[strategy]["total_mb"]), abs=1e-4)
        on_gpus = torch.cuda.device_count() >= 2  # the runs use GPUs only where there is one per process
        assert all((r["cuda_peak_bytes"] is not None) == on_gpus for r in ranks)
    assert ranks[0]["strategy"] == ranks[1]["strategy"] == "FSDP2Strategy"
    assert all(0.4 < fsdp_rank / totals["ddp"][0] < 0.6 for fsdp_rank in totals["fsdp"])

    markdown = (out / "memory.md").read_text()
    assert markdown.startswith("Machine: ") and "MLP 784-256-10" in markdown
    assert "| strategy | processes | sharded parameters | params MB/rank |" in markdown
    assert "| fsdp | 2 | 4/4 | 0.41 | 0.41 | 0.81 | 1.63 | 0.500 |" in markdown
    (pair,) = re.findall(r"Step time fsdp / ddp, pair by pair: (\d+\.\d+)\.", markdown)
    assert float(pair) == pytest.approx(float(fsdp["step_time_vs_ddp"]), abs=0.006)
    progress = [line for line in result.stderr.splitlines() if "ms/step" in line]
    assert len(progress) == 2


def test_step_time_ratios_are_taken_pair_by_pair() -> None:
    memory = _memory()

    def run(ms: float, total: int) -> dict:
        bytes_ = {
            "param_bytes": total,
            "grad_bytes": 0,
            "optimizer_bytes": 0,
            "total_bytes": total,
            "gathered_param_bytes": 0,
        }
        rank = {"world_size": 2, "sharded_parameters": 0, "parameters": 2, "cuda_peak_bytes": None, **bytes_}
        return {"ms_per_step": ms, "ranks": [rank]}

    # The load changed between pairs: the pairs say 2x, 2.67x, 2x (median 2); the medians, 30 and 80 ms, say 2.67x.
    runs = {"ddp": [run(10, 100), run(30, 100), run(50, 100)], "fsdp": [run(20, 50), run(80, 50), run(100, 50)]}
    assert memory.pair_ratios(runs) == [2.0, 80 / 30, 2.0]
    ddp, fsdp = memory.table_rows(runs)
    assert fsdp["step_time_vs_ddp"] == 2.0 and fsdp["ms_per_step"] == 80 and ddp["ms_per_step"] == 30
    assert fsdp["total_vs_ddp"] == 0.5 and ddp["step_time_vs_ddp"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--processes", "1"], "--processes must be at least 2 to shard anything, got 1"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--hidden", "256", "0"], "--hidden sizes must be at least 1, got [256, 0]"),
    ],
)
def test_memory_refuses_bad_options_in_one_line(args: list[str], message: str, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        _memory().parse_args(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}; see --help"]
