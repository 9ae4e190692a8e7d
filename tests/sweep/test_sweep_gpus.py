"""Several trials on one GPU: worker slots mapped onto GPUs (``sweep.trials_per_gpu``), a per-trial memory cap
(``sweep.gpu_memory_fraction``), an out-of-memory trial failing alone. GPUs are faked by ``torch.cuda.device_count``
on the CPU; the last test runs three trials at once on a real GPU."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import CONFIGS, REPO, cli_env

optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")

from template.engine.errors import ConfigError  # noqa: E402
from template.engine.sweep.driver import slot_gpus  # noqa: E402
from template.engine.sweep.reporter import MEMORY_FRACTION, ObjectiveReporter  # noqa: E402

WAIT = 600
SLOTS = [f"h.{n}" for n in range(6)]
FAKED = "GPU-faked-by-this-test"


def test_worker_slots_share_gpus_as_trials_per_gpu_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # The case: 3 workers on one GPU; each trial sees the GPU as device 0.
    assert slot_gpus({"devices": 1}, SLOTS[:3], 3, environ={}) == {"h.0": "0", "h.1": "0", "h.2": "0"}
    with pytest.raises(ConfigError, match=r"worker slot 1 needs GPUs 1\.\.1 .* raise sweep.trials_per_gpu"):
        slot_gpus({"devices": 1}, SLOTS[:3], environ={})  # the default, 1: today's refusal
    with pytest.raises(ConfigError, match="worker slot 3 needs GPUs 1..1"):
        slot_gpus({"devices": 1}, SLOTS[:4], 3, environ={})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    two_each = {"h.0": "0", "h.1": "0", "h.2": "1", "h.3": "1", "h.4": "2", "h.5": "2"}
    assert slot_gpus({"devices": "free:1"}, SLOTS, 2, environ={}) == two_each
    # Trials of 2 GPUs, 2 trials on each pair.
    assert slot_gpus({"devices": 2}, SLOTS[:4], 2, environ={}) == {
        "h.0": "0,1",
        "h.1": "0,1",
        "h.2": "2,3",
        "h.3": "2,3",
    }
    # A second sweep command's slots continue the numbering, over the GPUs CUDA_VISIBLE_DEVICES leaves.
    assert slot_gpus({"devices": 1}, ["h.4", "h.5"], 3, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {
        "h.4": "5",
        "h.5": "5",
    }
    assert slot_gpus({"accelerator": "cpu", "devices": 1}, SLOTS, 3, environ={}) == {}


FRACTION, IN_0_1 = "sweep.gpu_memory_fraction", "expected a value > 0 and <= 1"
REFUSED = {
    "trials_per_gpu 0": (
        ["--sweep.trials_per_gpu=0"],
        "invalid value '0' for 'sweep.trials_per_gpu'; expected a value > 0",
    ),
    "fraction 0": (["--sweep.gpu_memory_fraction=0"], f"invalid value '0' for '{FRACTION}'; {IN_0_1}"),
    "fraction above 1": (["--sweep.gpu_memory_fraction=1.5"], f"invalid value '1.5' for '{FRACTION}'; {IN_0_1}"),
    "fraction nan": (["--sweep.gpu_memory_fraction=nan"], f"invalid value 'nan' for '{FRACTION}'; {IN_0_1}"),
    "more memory than a GPU has": (
        ["--sweep.workers=3", "--sweep.trials_per_gpu=3", "--sweep.gpu_memory_fraction=0.5"],
        "would need 150% of a GPU's memory; lower one of them (e.g. gpu_memory_fraction: 0.33)",
    ),
    "3 workers, 1 GPU, 1 trial per GPU": (["--sweep.workers=3"], "raise sweep.trials_per_gpu"),
    "4 workers, 1 GPU, 3 trials per GPU": (["--sweep.workers=4", "--sweep.trials_per_gpu=3"], "worker slot 3 needs"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_mistake_is_one_line_before_anything_is_written(
    case: str, run_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU
    args, expected = REFUSED[case]
    done = run_main("sweep", "--config", CONFIGS / "sweep.yaml", *args)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and expected in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_memory_cap_reaches_the_cuda_devices_of_the_process_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch import Trainer

    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, str(d))))
    reporter = ObjectiveReporter("val_acc")
    cpu = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    cuda = [torch.device("cuda", i) for i in range(2)]
    one = SimpleNamespace(strategy=SimpleNamespace(world_size=1, root_device=cuda[0]))
    ddp_rank_1 = SimpleNamespace(strategy=SimpleNamespace(world_size=2, root_device=cuda[1], parallel_devices=cuda))
    dp = SimpleNamespace(strategy=SimpleNamespace(world_size=1, root_device=cuda[0], parallel_devices=cuda))
    reporter.setup(one, None, "fit")  # no fraction given: nothing
    monkeypatch.setenv(MEMORY_FRACTION, "0.3")
    reporter.setup(cpu, None, "fit")  # a CPU run never touches CUDA
    assert capped == []
    for trainer in (one, ddp_rank_1, dp):
        reporter.setup(trainer, None, "fit")
    assert capped == [(0.3, "cuda:0"), (0.3, "cuda:1"), (0.3, "cuda:0"), (0.3, "cuda:1")]


# -- three trials at once on one GPU: faked on the CPU, real on a GPU ------------------------------------------------
TINY = [
    "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--trainer.log_every_n_steps=1",
]  # fmt: skip


def _three_trials_on_one_gpu(tmp_path: Path) -> list:
    """A sweep of 3 workers sharing one GPU, capped at 0.3 of its memory each; its first trial asks for 0.5."""
    (tmp_path / "s.yaml").write_text(
        "sweep:\n  name: s\n  n_trials: 3\n  workers: 3\n  trials_per_gpu: 3\n  gpu_memory_fraction: 0.3\n"
        "  pruner: none\n  space:\n    data.batch_size: {type: categorical, choices: [32, 64, 128]}\n"
        "  enqueue: [{data.batch_size: 128}, {data.batch_size: 32}, {data.batch_size: 64}]\n"
        "trainer:\n  callbacks:\n  - class_path: gpu_share.SharedGpuProbe\n"
        f"    init_args: {{record_dir: {tmp_path / 'probes'}, hog_run: trial-0000, hog_fraction: 0.5}}\n"
    )
    return ["sweep", "--config", CONFIGS / "default.yaml", "--config", tmp_path / "s.yaml", *TINY]


def _check_three_trials_on_one_gpu(tmp_path: Path, stdout: str, device: str, visible: str) -> None:
    backend = optuna.storages.journal.JournalFileBackend(str(tmp_path / "lightning_logs" / "s" / "study.journal"))
    trials = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(backend)).trials
    # The trial out of memory failed alone and was replaced; the other two went on.
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"], stdout[-3000:]
    reason = trials[0].user_attrs["reason"]
    assert "OutOfMemoryError" in reason and "\n" not in reason, reason
    assert reason.endswith("its traceback is in trial-0000.log"), reason
    # The first three ran at once: each started before any ended.
    assert max(t.user_attrs["started"] for t in trials[:3]) < min(t.user_attrs["ended"] for t in trials[:3])
    # The failure is one line of the sweep's progress; the trial's traceback stays in its own log.
    said = [line for line in stdout.splitlines() if line.startswith("Sweep s:") and "OutOfMemoryError" in line]
    assert len(said) == 1 and "trial 0 fail" in said[0] and "Traceback" not in stdout, stdout[-3000:]
    assert "Traceback" in (tmp_path / "lightning_logs" / "s" / "trial-0000.log").read_text()
    seen = [json.loads(p.read_text()) for p in (tmp_path / "probes").iterdir()]
    assert sorted(s["run"] for s in seen) == [f"trial-000{n}" for n in range(4)]
    capped = 0.3 if device != "cpu" and hasattr(torch.cuda, "get_per_process_memory_fraction") else None
    for s in seen:
        assert (s["CUDA_VISIBLE_DEVICES"], s["SWEEP_GPU_MEMORY_FRACTION"], s["device"]) == (visible, "0.3", device)
        assert s["allocator_fraction"] == capped


@pytest.mark.slow  # three fit processes at once
@pytest.mark.timeout(WAIT)
def test_three_trials_share_a_faked_gpu_and_an_out_of_memory_trial_fails_alone(
    run_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver runs here with one GPU faked; its trials are real processes, on the CPU of this machine.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.syspath_prepend(str(REPO / "tests"))  # the driver here reads the trials' callback gpu_share.py too
    for key, value in cli_env(
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    ).items():
        monkeypatch.setenv(key, value)
    # The one GPU the driver is told of: a name no GPU has, so that the trials find none and run on the CPU here
    # and on a GPU machine alike.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", FAKED)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        done = run_main(*_three_trials_on_one_gpu(tmp_path))
    finally:
        for signum, handler in handlers.items():  # the driver's own handlers end with it
            signal.signal(signum, handler)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _check_three_trials_on_one_gpu(tmp_path, done.stdout, "cpu", FAKED)


@pytest.mark.gpu(1)
@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_three_trials_at_once_on_one_gpu(run_cli, tmp_path: Path) -> None:
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env["CUDA_VISIBLE_DEVICES"] = gpu  # one GPU, whatever the machine has
    done = run_cli(*_three_trials_on_one_gpu(tmp_path), "--trainer.accelerator=gpu", timeout=WAIT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The trial asking for 0.5 of the GPU fails under the cap of 0.3 (uncapped, it would have had it).
    _check_three_trials_on_one_gpu(tmp_path, done.stdout, "cuda:0", gpu)
