"""The bad-input catalogue: each mistake ends with one ``error:`` line naming the value and the fix, exit code 2 (3
for a folder the disk refuses), no traceback, and nothing already on disk touched."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from template.data import DigitsDataModule
from template.engine.commands.cli import main
from tests.conftest import CONFIGS, PACKAGE, TESTS, cli_env, pythonpath

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
ROOT = os.geteuid() == 0
# Root writes through permission bits; sysfs refuses new directories even to root.
UNWRITABLE = "/sys/unwritable-test-data/data" if ROOT else "readonly/data"

ES = "lightning.pytorch.callbacks.EarlyStopping"
# On the CPU wherever the machine has a GPU too (default.yaml's accelerator is auto); the GPU cases name theirs.
BASE = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
]  # fmt: skip

# id: (extra arguments, fragments the one error line must contain: the bad value and the way out)
CASES = {
    "unknown-strategy": (["--trainer.strategy=dpp"], ["'dpp'", "ddp", "use one of"]),
    "gpu-without-gpu": (["--trainer.accelerator=gpu"], ["GPU", "accelerator", "cpu"]),
    "cpu-device-index": (["--trainer.accelerator=cpu", "--trainer.devices=[5]"], ["[5]", "--trainer.devices=2"]),
    "gpu-device-index": (["--trainer.accelerator=gpu", "--trainer.devices=[63]"], ["[63]", "visible"]),
    "misspelt-option": (["--trainer.max_epocs=3"], ["max_epocs", "--help"]),
    "abbreviated-option": (["--trainer.max_epoch=3"], ["max_epoch=3", "--help"]),
    "misspelt-yaml-key": (["--config", "typo.yaml"], ["max_epocs", "spelling"]),
    "missing-config-file": (["--config", "nope.yaml"], ["nope.yaml", "--config"]),
    "malformed-yaml": (["--config", "broken.yaml"], ["broken.yaml", "line 3", "fix the syntax"]),
    "empty-config-file": (["--config", "blank.yaml"], ["'blank.yaml' is empty", "key: value"]),
    "comments-only-config-file": (["--config", "comments.yaml"], ["'comments.yaml' is empty (or only comments)"]),
    "missing-checkpoint": (["--ckpt_path", "nope.ckpt"], ["nope.ckpt", "--ckpt_path"]),
    "corrupt-checkpoint": (["--ckpt_path", "corrupt.ckpt"], ["corrupt.ckpt", "complete"]),
    "truncated-checkpoint": (["--ckpt_path", "truncated.ckpt"], ["truncated.ckpt", "complete"]),
    "foreign-checkpoint": (["--ckpt_path", "foreign.ckpt"], ["foreign.ckpt", "not a Lightning checkpoint"]),
    "exported-weights-as-checkpoint": (
        ["--ckpt_path", "net.pt"],
        ["net.pt", "weights only", "load_state_dict", "Lightning .ckpt it was exported from"],
    ),
    "ckpt-last-without-runs": (["--ckpt_path", "last", "--trainer.default_root_dir=empty"], ["empty", "train first"]),
    "zero-batch-size": (["--data.init_args.batch_size=0"], ["batch_size", "got 0", "--data.batch_size=64"]),
    "negative-batch-size": (["--data.init_args.batch_size=-5"], ["batch_size", "got -5", "--data.batch_size=64"]),
    "unknown-net-class-path": (["--model.net=mypkg.nets.Nope"], ["mypkg.nets.Nope", "PYTHONPATH"]),
    "net-missing-argument": (
        ["--model.net=torch.nn.Linear"],
        ["torch.nn.Linear", "in_features", "model.net.init_args"],
    ),
    "unknown-data-class-path": (["--data=mypkg.data.Nope"], ["mypkg.data.Nope", "PYTHONPATH"]),
    # An option the chosen class does not take: from a stacked file (the file named), or from the command line.
    "preset-key-the-class-does-not-take": (
        ["--data=tests.user_code.my_code.Waves", "--config", str(CONFIGS / "presets" / "debug.yaml")],
        [
            "data.init_args.num_workers (set in config file",
            "presets/debug.yaml') is not an argument of",
            "Waves",
            "drop it from that file, or add the argument to the class",
        ],
    ),  # fmt: skip
    "misspelt-init-arg": (
        ["--model.net.init_args.dropuot=0.2"],
        ["model.init_args.net.init_args.dropuot is not an argument of 'template.nets.MLP'", "check its spelling"],
    ),
    "wrong-value-type": (["--trainer.max_epochs=abc"], ["'abc'", "trainer.max_epochs", "expected int"]),
    "wrong-init-arg-type": (["--data.init_args.batch_size=x"], ["'x'", "data.init_args.batch_size", "expected int"]),
    "invalid-precision": (["--trainer.precision=17"], ["'17'", "precision", "32-true"]),
    "zero-nodes": (["--trainer.num_nodes=0"], ["num_nodes", "got 0", "number of machines"]),
    # A folder the disk refuses: exit code 3, as for every failure of the disk.
    "data-dir-is-a-file": (["--data.init_args.data_dir=afile"], ["afile", "is a file, not a folder", "data_dir"]),
    "data-dir-not-writable": ([f"--data.init_args.data_dir={UNWRITABLE}"], [UNWRITABLE, "--data.data_dir"]),
    # Found before training, not at the first checkpoint an epoch later.
    "checkpoint-dirpath-is-a-file": (
        ["--checkpoint.dirpath=afile/ckpts"],
        ["afile' is a file, not a folder", "choose another --checkpoint.dirpath"],
    ),
    "checkpoint-dirpath-not-writable": ([f"--checkpoint.dirpath={UNWRITABLE}"], [UNWRITABLE, "--checkpoint.dirpath"]),
    # A folder the command created for the checkpoints goes again when a mistake stops it before training.
    "misspelt-monitor-with-new-checkpoint-dirpath": (
        ["--checkpoint.dirpath=new/ckpts", "--checkpoint.monitor=val_accuracy"],
        ["val_accuracy", "--checkpoint.monitor="],
    ),
    "negative-devices": (["--trainer.accelerator=cpu", "--trainer.devices=-2"], ["-2", "--trainer.devices=2"]),
    "dp-on-cpu": (["--trainer.strategy=dp", "--trainer.accelerator=cpu"], ["dp", "accelerator", "ddp_cpu.yaml"]),
    "watchdog-timeout": (["--watchdog.timeout=0"], ["'0'", "watchdog.timeout", "expected a value > 0"]),
    # Values a library refuses when the classes are built, or when the optimizer is built from the parameters.
    "optimizer-lr": (
        ["--model.optimizer.init_args.lr=-0.001"],
        ["model.init_args.optimizer.init_args.lr=-0.001", "torch.optim", "Invalid learning rate", "set a value"],
    ),
    "net-dropout": (["--model.net.init_args.dropout=1.5"], ["dropout=1.5", "Dropout", "between 0 and 1"]),
    "net-without-parameters": (["--model.net=torch.nn.Flatten"], ["no trainable parameters", "torch.nn.Flatten"]),
    "net-negative-size": (
        ["--model.net=torch.nn.Linear", "--model.net.init_args.in_features=-3", "--model.net.out_features=10"],
        ["model.init_args.net", "Linear", "negative dimension -3", "in_features=-3"],
    ),
    "checkpoint-mode": (["--checkpoint.mode=maximum"], ["checkpoint.mode='maximum'", "ModelCheckpoint", "min, max"]),
    # The reason quotes "-1" too (Must be >= -1), as trainer.max_steps is: the option named is the one it assigns.
    "callback-in-a-list": (
        [f"--trainer.callbacks={ES}", "--trainer.callbacks.monitor=val_acc", "--trainer.callbacks.mode=maximum"],
        ["error: trainer.callbacks[0].init_args.mode='maximum' refused by", "EarlyStopping"],
    ),
    "checkpoint-save-top-k": (["--checkpoint.save_top_k=-2"], ["error: checkpoint.save_top_k=-2 refused by", ">= -1"]),
    # Trainer counts Lightning leaves unchecked; one checked against the data (the epoch has 1 batch here).
    "accumulate-zero": (["--trainer.accumulate_grad_batches=0"], ["accumulate_grad_batches=0", ">= 1"]),
    "val-check-interval-above-epoch": (
        ["--trainer.val_check_interval=100"],
        ["val_check_interval", "(100)", "training batches (1)"],
    ),
    "scheduler-step-size": (
        ["--model.scheduler=torch.optim.lr_scheduler.StepLR", "--model.scheduler.init_args.step_size=0"],
        ["model.init_args.scheduler", "StepLR", "step_size=0"],
    ),
    "early-stopping-monitor": (
        [f"--trainer.callbacks={ES}", "--trainer.callbacks.monitor=val_accuracy"],
        ["EarlyStopping", "val_accuracy", "val_acc"],
    ),
    "misspelt-monitor": (["--checkpoint.monitor=val_accuracy"], ["val_accuracy", "val_acc", "--checkpoint.monitor="]),
    "trainer-section-as-list": (["--config", "listed.yaml"], ["listed.yaml", "`trainer:`", "list"]),
    "logger-save-interval": (
        [
            f"--trainer.logger={PACKAGE}.engine.logs.loggers.ResumableCSVLogger",
            *("--trainer.logger.init_args.save_dir=logs", "--trainer.logger.init_args.save_interval=-3"),
        ],
        ["'-3'", "trainer.logger.init_args.save_interval", "expected a value >= 0"],
    ),
}
MARKS = {"gpu-without-gpu": NO_GPU, "gpu-device-index": pytest.mark.gpu(1)}
# A folder the disk refuses: 3, as for every failure of the disk; else 2.
DISK_CASES = ["data-dir-is-a-file", "data-dir-not-writable", "checkpoint-dirpath-is-a-file"]
EXIT_CODES = dict.fromkeys([*DISK_CASES, "checkpoint-dirpath-not-writable"], 3)


def _workspace(root: Path) -> None:
    """A folder as a user has it after a run: logs, a checkpoint, data; plus the bad inputs the cases point to."""
    checkpoints = root / "lightning_logs" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.zeros(3)}}, checkpoints / "last.ckpt")
    (root / "lightning_logs" / "version_0" / "config.yaml").write_text("trainer: {max_epochs: 1}\n")
    DigitsDataModule(data_dir=str(root / "data")).prepare_data()
    (root / "typo.yaml").write_text("trainer:\n  max_epocs: 3\n")
    (root / "listed.yaml").write_text("trainer:\n  - max_epochs: 300\n")
    (root / "broken.yaml").write_text("trainer:\n  max_epochs: [1\n  devices: 1\n")
    (root / "blank.yaml").write_text("")
    (root / "comments.yaml").write_text("# trainer:\n#   max_epochs: 3\n")
    (root / "corrupt.ckpt").write_bytes(b"this is not a checkpoint")
    whole = (checkpoints / "last.ckpt").read_bytes()
    (root / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    torch.save({"epoch": 3, "note": "another program's file"}, root / "foreign.ckpt")
    torch.save({"0.weight": torch.zeros(2, 2)}, root / "net.pt")  # what `export` writes
    (root / "afile").write_text("a file, not a directory")
    (root / "empty").mkdir()
    if not ROOT:
        (root / "readonly").mkdir(mode=0o500)


def _snapshot(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


@pytest.mark.parametrize(
    ("extra", "fragments", "code"),
    [pytest.param(*case, EXIT_CODES.get(name, 2), id=name, marks=MARKS.get(name, ())) for name, case in CASES.items()],
)
def test_bad_input_is_one_clear_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    extra: list,
    fragments: list,
    code: int,
) -> None:
    _assert_one_clear_line(tmp_path, monkeypatch, capsys, [*BASE, *extra], fragments, code)


# Mistakes met by a run on the GPU as they are on the CPU: the data, the net and the optimizer on the device.
GPU_CASES = ["val-check-interval-above-epoch", "net-negative-size", "optimizer-lr", "misspelt-monitor"]


@pytest.mark.gpu(1)
@pytest.mark.parametrize("name", GPU_CASES)
def test_bad_input_is_one_clear_line_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, name: str
) -> None:
    extra, fragments = CASES[name]
    _assert_one_clear_line(tmp_path, monkeypatch, capsys, [*BASE, "--trainer.accelerator=gpu", *extra], fragments, 2)


def _assert_one_clear_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    args: list,
    fragments: list,
    code: int,
) -> None:
    _workspace(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == code, stderr[-3000:]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert _snapshot(tmp_path) == before, "the failed command changed files on disk"


@pytest.mark.parametrize(
    "extra",
    [
        ["--trainer.max_epocs=3"],
        pytest.param(["--model.optimizer.init_args.lr=-0.001"], marks=pytest.mark.slow),
        pytest.param(["--ckpt_path", "corrupt.ckpt"], marks=pytest.mark.slow),
    ],
    ids=["at-parse-time", "inside-fit", "checkpoint"],
)
def test_real_command_exits_2_without_traceback(tmp_path: Path, run_cli, extra: list) -> None:  # noqa: ANN001
    _workspace(tmp_path)
    before = _snapshot(tmp_path)
    done = run_cli(*BASE, *extra)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert sum(line.startswith("error:") for line in done.stderr.splitlines()) == 1
    assert _snapshot(tmp_path) == before


# Every subcommand, with and without a run name (given, or from SLURM or torchrun): a bad checkpoint is one line.
CKPT_CASES = {
    "fit-slurm-missing": (["fit"], {"SLURM_JOB_ID": "123"}, "missing.ckpt"),
    "fit-run-name-missing": (["fit", "--run.name", "x"], {}, "missing.ckpt"),
    "fit-torchrun-truncated": (["fit"], {"TORCHELASTIC_RUN_ID": "job7"}, "truncated.ckpt"),
    "validate-slurm-corrupt": (["validate"], {"SLURM_JOB_ID": "123"}, "corrupt.ckpt"),
    "test-missing": (["test"], {}, "missing.ckpt"),
    "predict-foreign": (["predict"], {}, "foreign.ckpt"),
}


@pytest.mark.parametrize(("command", "environ", "ckpt"), CKPT_CASES.values(), ids=CKPT_CASES.keys())
def test_a_bad_checkpoint_is_one_line_for_every_subcommand(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    command: list,
    environ: dict,
    ckpt: str,
) -> None:
    _workspace(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--config", str(CONFIGS / "default.yaml"), f"--ckpt_path={ckpt}"])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ckpt in errors[0] and "--ckpt_path" in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr
    assert _snapshot(tmp_path) == before, "the failed command changed files on disk"


def test_predictions_named_after_a_folder_is_one_line_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _workspace(tmp_path)
    checkpoint = "model.ckpt"  # passes the checkpoint's own check: the refusal is the predictions file's
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {}}, tmp_path / checkpoint)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", str(CONFIGS / "default.yaml"), f"--ckpt_path={checkpoint}", "--predictions=data"])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert errors == ["error: --predictions=data is a folder; name a file, e.g. --predictions=data/new.csv"]
    assert _snapshot(tmp_path) == before, "the failed command changed files on disk"


@pytest.mark.parametrize("ckpt", ["missing.ckpt", "truncated.ckpt", "corrupt.ckpt"])
def test_export_of_a_bad_checkpoint_is_one_line(tmp_path: Path, run_main, ckpt: str) -> None:  # noqa: ANN001
    _workspace(tmp_path)
    before = _snapshot(tmp_path)
    done = run_main("export", ckpt)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and ckpt in errors[0], done.stderr
    assert _snapshot(tmp_path) == before


def test_a_running_named_run_is_not_started_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # The folder is locked as a running fit holds it: flock on the folder, released by the kernel with the process.
    _workspace(tmp_path)
    folder = tmp_path / "lightning_logs" / "busy"
    folder.mkdir()
    holder = os.open(folder, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        before = _snapshot(tmp_path)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [PACKAGE])
        with pytest.raises(SystemExit) as exit_info:
            main([*BASE, "--run.name=busy"])
    finally:
        os.close(holder)
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, stderr[-3000:]
    assert "run 'busy' is already running" in errors[0] and "--run.name" in errors[0], errors[0]
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_second_start_refuses_and_a_killed_run_leaves_no_lock(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    # The first run waits a minute after its first step: still running, whatever the machine's load, when the second
    # starts; the third start (after the kill) is not paced.
    paced = "trainer:\n  callbacks:\n    - class_path: step_marker.StepMarker\n"
    paced += "      init_args: {{path: steps.txt, delay: {}}}\n"
    (tmp_path / "paced.yaml").write_text(paced.format(60))
    command = [*BASE[:4], "--config", "paced.yaml", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"]
    command += ["--trainer.limit_train_batches=6", "--trainer.limit_val_batches=1", "--run.name=once"]
    env = cli_env(PYTHONPATH=pythonpath(TESTS))
    first = subprocess.Popen(
        [sys.executable, "-m", PACKAGE, *command], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "steps.txt").is_file():
            assert time.monotonic() < deadline and first.poll() is None, "the first run never trained"
            time.sleep(0.2)
        second = run_cli(*command, env=env)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1 and "already running" in errors[0], second.stderr[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        (tmp_path / "paced.yaml").write_text(paced.format(0))
        third = run_cli(*command, env=env)
        assert third.returncode == 0, third.stderr[-3000:]
        assert "Run once" in third.stdout + third.stderr
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluating_without_a_checkpoint_says_the_weights_are_untrained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, subcommand: str
) -> None:
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    main([subcommand, *BASE[1:4], "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
          "--trainer.limit_predict_batches=1", "--trainer.enable_progress_bar=false"])  # fmt: skip
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "untrained weights" in warnings[0] and "--ckpt_path" in warnings[0], warnings


@pytest.mark.slow
def test_a_missing_extra_is_one_line_naming_the_extra(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    _workspace(tmp_path)
    # mlflow made unimportable for this process, as on a machine where the extra was never installed.
    (tmp_path / "hidden" / "mlflow").mkdir(parents=True)
    (tmp_path / "hidden" / "mlflow" / "__init__.py").write_text("raise ImportError('No module named mlflow')\n")
    before = _snapshot(tmp_path)
    done = run_cli(
        *BASE, "--config", str(CONFIGS / "mlflow.yaml"), env=cli_env(PYTHONPATH=pythonpath(tmp_path / "hidden"))
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "trackers" in errors[0] and "MLFlowLogger" in errors[0] and "pip install -e '.[mlflow]'" in errors[0]
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_every_strategy_the_unknown_strategy_line_offers_runs(run_cli) -> None:  # noqa: ANN001
    # ddp_spawn pickles the model and its links: they are plain classes, not closures.
    done = run_cli(*BASE, "--trainer.strategy=ddp_spawn", "--trainer.accelerator=cpu", "--trainer.devices=2")
    assert done.returncode == 0, done.stderr[-3000:]


# A config file that holds no options: fit and sweep read it in one place, and refuse it with the same line.
BAD_FILES = {
    "broken.yaml": ("trainer:\n  max_epochs: [1\n  devices: 1\n", "is not valid YAML"),
    "blank.yaml": ("", "is empty"),
    "toplist.yaml": ("- trainer\n- model\n", "holds a list, not options"),
    "nope.yaml": (None, "does not exist"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_fit_and_sweep_refuse_a_config_file_with_the_same_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, name: str
) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from template.engine.errors import ConfigError
    from template.engine.sweep import SWEEP
    from template.engine.sweep.options import Configs

    text, fragment = BAD_FILES[name]
    if text is not None:
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    with pytest.raises(ConfigError) as sweep:
        Configs(["--config", str(CONFIGS / "sweep.yaml"), "--config", name], SWEEP)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", name])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and errors == [f"error: {sweep.value}"], errors
    assert name in errors[0] and fragment in errors[0], errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if text is not None else [])
