"""The benchmark and the learning-curve plot in smoke form: real runs with tiny step counts, real output files."""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env

SCRIPTS = REPO / "scripts"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _script(name: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *map(str, args)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _load(name: str):  # noqa: ANN202 - a module object
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, f"{path} is not a real plot"


@pytest.mark.slow
def test_benchmark_smoke_single_and_ddp_against_the_hand_written_loop(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _script(
        "benchmark.py",
        *("--workload", "mlp", "--strategies", "single", "ddp", "--devices", "2"),
        *("--steps", "6", "--warmup", "2", "--repeats", "1", "--out", out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # Progress while it runs: one line per finished run, numbered out of the total.
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 5 and progress[-1].startswith("[  5/5]")

    rows = {(r["strategy"], int(r["devices"])): r for r in csv.DictReader((out / "benchmark.csv").open())}
    assert set(rows) == {("hand-written", 1), ("bare Lightning", 1), ("data pipeline", 1), ("single", 1), ("ddp", 2)}
    for (_, devices), row in rows.items():
        samples_per_s, ms_per_step = float(row["samples_per_s"]), float(row["ms_per_step"])
        # Every run sees the per-device batch of the config; the two numbers describe the same steps.
        assert float(row["batch_per_device"]) == 64, row
        assert 0 < ms_per_step < 10_000 and samples_per_s > 0, row
        assert samples_per_s == pytest.approx(64 * devices * 1000 / ms_per_step, rel=0.01), row
    single, ddp, hand = rows[("single", 1)], rows[("ddp", 2)], rows[("hand-written", 1)]
    assert float(single["speedup"]) == 1.0 and float(single["efficiency"]) == 1.0
    assert float(ddp["efficiency"]) == pytest.approx(float(ddp["speedup"]) / 2, abs=0.002)
    assert float(hand["step_time_vs_hand"]) == 1.0
    assert float(single["step_time_vs_hand"]) == pytest.approx(
        float(single["ms_per_step"]) / float(hand["ms_per_step"]), rel=0.01
    )
    # Start-up: from launching `python -m <package> fit` to its first training step, DDP's second process included.
    assert 0 < float(single["startup_s"]) < 240 and 0 < float(ddp["startup_s"]) < 240

    markdown = (out / "benchmark.md").read_text()
    assert markdown.startswith("Machine: ") and "CPU cores" in markdown
    assert "| strategy | devices | batch/device | samples/s |" in markdown and "| ddp | 2 | 64 |" in markdown
    assert "the time per step of the hand-written loop" in markdown and "what training consumes" in markdown
    # Lightning's own floor next to the project, so the cost of the project's defaults is their difference.
    bare = rows[("bare Lightning", 1)]
    floor = re.search(r"Lightning's loop alone .* takes (\d+\.\d+)x \((\d+\.\d+) ms\)", markdown)
    assert floor, markdown[-1500:]
    assert float(floor.group(1)) == pytest.approx(float(bare["step_time_vs_hand"]), abs=0.006)
    assert float(floor.group(2)) == pytest.approx(float(bare["ms_per_step"]), abs=0.006)
    # Start-up: how long the imports take, and how much of that is the package's own modules (well under a second).
    own = re.search(rf"Import time by what pulled it in .*\b{PACKAGE} (\d+\.\d+) s", markdown)
    assert own and float(own.group(1)) < 1.0, markdown[-800:]
    _assert_png(out / "benchmark.png")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_benchmark_conv_workload_against_bare_lightning_and_the_hand_written_loop(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _script(
        "benchmark.py",
        *("--workload", "conv", "--strategies", "single", "--steps", "1", "--warmup", "1", "--repeats", "1"),
        *("--out", out),
        cwd=tmp_path,
        timeout=1100,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = {r["strategy"]: r for r in csv.DictReader((out / "benchmark.csv").open())}
    assert set(rows) == {"hand-written", "bare Lightning", "data pipeline", "single"}
    # The user's ResNet-8 in fp32 on the CPU, batch 256 in every row, the project next to bare Lightning per step.
    assert {r["workload"] for r in rows.values()} == {"conv: ResNet-8 fp32, batch 256, synthetic 3x32x32"}
    assert all(float(r["batch_per_device"]) == 256 for r in rows.values())
    single, bare = rows["single"], rows["bare Lightning"]
    assert float(single["step_time_vs_bare"]) == pytest.approx(
        float(single["ms_per_step"]) / float(bare["ms_per_step"]), rel=0.01
    )
    # Start-up to the first step of all three in the same run.
    assert all(0 < float(rows[name]["startup_s"]) < 600 for name in ("hand-written", "bare Lightning", "single"))
    markdown = (out / "benchmark.md").read_text()
    assert re.search(r"paired by round, the project's step takes \d+\.\d+x bare Lightning's", markdown), markdown


def test_conv_workload_is_a_users_resnet_in_bf16_with_workers_on_a_gpu(tmp_path: Path) -> None:
    import yaml

    benchmark = _load("benchmark")
    sys.path.insert(0, str(SCRIPTS))  # the child processes have scripts/ on PYTHONPATH: benchmark_user imports
    try:
        from benchmark_user import ResNet, SyntheticImages
    finally:
        sys.path.remove(str(SCRIPTS))
    gpu_name, gpu = benchmark.conv_workload(gpus=1)
    cpu_name, cpu = benchmark.conv_workload(gpus=0)
    assert "ResNet-18 bf16-mixed" in gpu_name and "ResNet-8 fp32" in cpu_name
    gpu, cpu = yaml.safe_load(gpu), yaml.safe_load(cpu)
    # As a GPU user sets it: bf16-mixed, batch 256, DataLoader workers and pinned memory; on the CPU, fp32.
    assert gpu["trainer"]["precision"] == "bf16-mixed" and cpu["trainer"]["precision"] == "32-true"
    assert gpu["data"]["init_args"] == {"batch_size": 256, "num_workers": 4, "pin_memory": True}
    assert cpu["data"]["init_args"]["batch_size"] == 256 and cpu["data"]["init_args"]["pin_memory"] is False
    assert gpu["model"]["net"]["class_path"] == "benchmark_user.ResNet"
    assert gpu["data"]["class_path"] == "benchmark_user.SyntheticImages"
    # The user's classes build from those arguments: ResNet-18 (11.2M parameters) and images of CIFAR's shape.
    resnet18 = ResNet(SyntheticImages.input_shape, SyntheticImages.num_classes, **gpu["model"]["net"]["init_args"])
    assert sum(p.numel() for p in resnet18.parameters()) == pytest.approx(11.2e6, rel=0.01)
    data = SyntheticImages(num_samples=64, batch_size=16, num_workers=0, pin_memory=False)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (16, 3, 32, 32) and x.dtype.is_floating_point and y.shape == (16,)
    resnet8 = ResNet(SyntheticImages.input_shape, SyntheticImages.num_classes, **cpu["model"]["net"]["init_args"])
    assert resnet8(x).shape == (16, 10)


def test_benchmark_takes_the_gpu_check_options_for_conv() -> None:
    args = _load("benchmark").parse_args(
        ["--workload", "conv", "--strategies", "single", "--steps", "50", "--warmup", "10", "--repeats", "2"]
        + ["--out", "results"]
    )
    assert (args.workload, args.strategies, args.steps, args.warmup, args.repeats) == (["conv"], ["single"], 50, 10, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "nowhere.yaml"], "config file 'nowhere.yaml' does not exist; pass an existing YAML file"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--devices", "2", "0"], "device and thread counts must be at least 1, got 0"),
        (["--workload", "mlp", "--config", __file__], "cannot be combined with --config"),
    ],
)
def test_benchmark_refuses_bad_options_in_one_line(args: list[str], message: str, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        _load("benchmark").parse_args(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.slow
def test_learning_curves_from_a_real_run(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "fit",
        *("--config", CONFIGS / "default.yaml", "--trainer.max_epochs=3", "--trainer.limit_train_batches=6"),
        *("--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false"),
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    run_dir = tmp_path / "lightning_logs" / "version_0"

    plot = _script("plot_metrics.py", run_dir, cwd=tmp_path, timeout=120)
    assert plot.returncode == 0, plot.stderr
    _assert_png(run_dir / "learning_curves.png")

    # The curves are the per-epoch values of metrics.csv: one point per epoch for train and val, loss and accuracy.
    plot_metrics = _load("plot_metrics")
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    curves = plot_metrics.curves(rows)
    for panel, column in (("loss", "val_loss"), ("accuracy", "train_acc")):
        assert set(curves[panel]) == {"train", "val"}
        assert all(list(points) == [0, 1, 2] for points in curves[panel].values())
        logged = [float(r[column]) for r in rows if r[column]]
        split = "val" if column.startswith("val") else "train"
        assert list(curves[panel][split].values()) == logged
    assert all(0 <= acc <= 1 for split in curves["accuracy"].values() for acc in split.values())


def test_plot_metrics_explains_a_wrong_path(tmp_path: Path) -> None:
    result = _script("plot_metrics.py", tmp_path / "version_9", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: no metrics file at '{tmp_path / 'version_9'}'; pass a run folder such as lightning_logs/version_0"
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_startup_compares_the_command_with_bare_lightning(tmp_path: Path) -> None:
    result = _script("startup.py", "--repeats", "1", cwd=tmp_path, timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| fit --help", "| first training"))]
    # --help, then the first step with the example's classes and with a user's classes named by class_path, the
    # latter against a bare Trainer and against Lightning's own LightningCLI.
    assert len(rows) == 4 and all("a user's classes by class_path" in row for row in rows[2:]), result.stdout
    assert [row.split("|")[2].strip() for row in rows[2:]] == ["bare Lightning Trainer.fit", "bare LightningCLI fit"]
    for row in rows:
        ours, bare, ratio, difference = (float(cell.split()[0]) for cell in row.split("|")[3:7])
        # One round: the round's ratio and difference are those of the two runs. Every cell is rounded to 0.01 on
        # its own, so each may be off by half of that, and the recomputed ratio by what its inputs' rounding moves.
        half = 0.005 + 1e-9
        assert 0 < ours < 600 and 0 < bare < 600
        assert ratio == pytest.approx(ours / bare, abs=half + half * (1 / bare + ours / bare**2) * 1.01)
        assert difference == pytest.approx(ours - bare, abs=3 * half)


def test_startup_refuses_no_repeats_in_one_line(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        _load("startup").main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --repeats must be at least 1, got 0"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_many_runs_puts_a_sweep_and_the_commands_without_training_beside_their_baselines(tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    args = ("--repeats", "1", "--trials", "2", "--cases", "commands", "sweep")
    result = _script("many_runs.py", *args, cwd=tmp_path, timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row.split("|")[1].strip(): row.split("|")[2:-1] for row in result.stdout.splitlines()[3:]}
    light = ["runs", "--help", "sweep --help", "cv --help", "a misspelt subcommand"]
    assert list(rows) == [*light, "sweep", "a sweep trial's overhead over its training"], result.stdout
    for name in light:  # each answers before bare Lightning is even imported (one round: the ratio of its two runs)
        assert float(rows[name][2].split()[0]) < 1, (name, rows[name])
    # The sweep's trials cost more than Optuna's in-process trials, the floor; its overhead is under its whole time.
    sweep, overhead = ([float(cell.split()[0]) for cell in rows[name][:2]] for name in list(rows)[-2:])
    assert sweep[0] > sweep[1] > 0 and 0 < overhead[0] < sweep[0] and overhead[1] < overhead[0]


def test_many_runs_refuses_no_repeats_in_one_line(capsys) -> None:  # noqa: ANN001
    sys.path.insert(0, str(SCRIPTS))  # it reads startup.py's commands
    try:
        with pytest.raises(SystemExit) as exit_info:
            _load("many_runs").main(["--repeats", "0"])
    finally:
        sys.path.remove(str(SCRIPTS))
    assert exit_info.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["error: --repeats and --trials must be at least 1, got 0 and 20"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_storage_benchmark_runs_the_example_on_a_disk_and_on_s3_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("moto", reason="the dev extra is not installed: pip install -e '.[dev]'")
    result = _script("storage_benchmark.py", "--rounds", "1", "--epochs", "2", "--every", "5", "--width", "32",
                     cwd=tmp_path, timeout=540)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ")}
    assert {"local", "s3"} <= rows.keys(), result.stdout
    for where in ("local", "s3"):
        rate, save, seconds = (float(cell) for cell in rows[where].split("|")[2:5])
        assert rate > 0 and save > 0 and seconds > 0, rows[where]  # save: the profiler's time per checkpoint save
    ratio = re.search(r"S3 / local samples/s within each round: median ([\d.]+)", result.stdout)
    assert ratio and float(ratio.group(1)) > 0, result.stdout
