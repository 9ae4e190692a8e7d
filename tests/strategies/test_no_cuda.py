"""A run on the CPU of a machine with GPUs never initialises CUDA: each run here sees two GPUs that raise on first use
(``tests/cuda_refused/sitecustomize.py``, first on the children's PYTHONPATH) and must pass without touching them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env

REFUSER = REPO / "tests" / "cuda_refused"
SHORT = (
    "--trainer.accelerator=cpu", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--run.name=r",
)  # fmt: skip
WAIT = 300


def _env(tmp_path: Path) -> dict[str, str]:
    """The children's environment: the refuser first on PYTHONPATH, then tests/ (fault.py), then the caller's."""
    env = cli_env(CUDA_REFUSED_LOG=str(tmp_path / "cuda-refused.log"))
    paths = [str(REFUSER), str(REPO / "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _run(tmp_path: Path, *args: object, timeout: float = WAIT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", PACKAGE, *map(str, args)], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
        text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _untouched(tmp_path: Path, result: subprocess.CompletedProcess, code: int = 0) -> None:
    """The run ended with ``code`` and initialised CUDA nowhere (not even where the error was caught)."""
    log = tmp_path / "cuda-refused.log"
    assert not log.exists(), log.read_text()[-4000:]
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]


def _starts(run: Path) -> list[dict]:
    return json.loads((run / "provenance.json").read_text())["starts"]


def _rng_states(run: Path) -> list[dict]:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return checkpoint["callbacks"]["ExactResume"]["ranks"]


def test_the_refuser_stops_every_way_into_cuda(tmp_path: Path) -> None:
    calls = {
        "current_device": "torch.cuda.current_device()",
        "get_device_name": "torch.cuda.get_device_name(0)",
        "get_rng_state_all": "torch.cuda.get_rng_state_all()",
        "mem_get_info": "torch.cuda.mem_get_info()",
        "synchronize": "torch.cuda.synchronize()",
        "set_device": "torch.cuda.set_device(0)",
        "tensor": "torch.zeros(1, device='cuda')",
    }
    script = "import os, torch\nprint(torch.cuda.is_available(), torch.cuda.device_count())\n"
    for name, call in calls.items():
        script += f"try:\n    {call}\n    print('{name} passed')\nexcept Exception:\n    print('{name} refused')\n"
    script += "os.environ['CUDA_VISIBLE_DEVICES'] = ''\nprint(torch.cuda.is_available(), torch.cuda.device_count())\n"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n") == ["True 2", *(f"{name} refused" for name in calls), "False 0", ""]
    assert (tmp_path / "cuda-refused.log").read_text().count("CUDA initialised") >= 5


@pytest.mark.slow  # two runs; the refuser's own test above is the fast suite's
def test_a_cpu_fit_and_its_continuation_never_initialise_cuda(tmp_path: Path) -> None:
    for epochs in (1, 2):
        result = _run(tmp_path, "fit", "--config", CONFIGS / "default.yaml", *SHORT, f"--trainer.max_epochs={epochs}")
        _untouched(tmp_path, result)
    run = tmp_path / "lightning_logs" / "r"
    expected = [("finished", 4, ["cpu"]), ("finished", 8, ["cpu"])]
    assert [(s["status"], s["steps"], s["devices"]) for s in _starts(run)] == expected
    (state,) = _rng_states(run)
    assert state["cuda"] == {}  # a CPU process saves no GPU's random state


@pytest.mark.slow  # two processes, twice
@pytest.mark.timeout(2 * WAIT)
def test_a_ddp_cpu_fit_and_its_continuation_never_initialise_cuda(tmp_path: Path) -> None:
    for epochs in (1, 2):
        result = _run(tmp_path, "fit", "--config", CONFIGS / "ddp_cpu.yaml", *SHORT, f"--trainer.max_epochs={epochs}")
        _untouched(tmp_path, result)
    run = tmp_path / "lightning_logs" / "r"
    assert [(s["status"], s["devices"]) for s in _starts(run)] == [("finished", ["cpu", "cpu"])] * 2
    assert [state["cuda"] for state in _rng_states(run)] == [{}, {}]


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_stop_and_its_continuation_never_initialise_cuda(tmp_path: Path) -> None:
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: {moment: train_batch, batch: 1}\n"
    )
    command = ("fit", "--config", CONFIGS / "default.yaml", *SHORT, "--trainer.max_epochs=2", "--config", "fault.yaml")
    stopped = _run(tmp_path, *command)
    _untouched(tmp_path, stopped, code=143)
    assert "Stopping on SIGTERM" in stopped.stdout + stopped.stderr
    _untouched(tmp_path, _run(tmp_path, *command))
    starts = _starts(tmp_path / "lightning_logs" / "r")
    assert [(s["status"], s.get("signal")) for s in starts] == [("interrupted", "SIGTERM"), ("finished", None)]


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_sweep_trial_never_initialises_cuda(tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    (tmp_path / "s.yaml").write_text(
        "sweep:\n  name: s\n  n_trials: 1\n  space:\n"
        "    model.optimizer.init_args.lr: {type: categorical, choices: [0.01]}\n"
    )
    args = [a for a in SHORT if not a.startswith("--run.name")]
    result = _run(tmp_path, "sweep", "--config", CONFIGS / "default.yaml", "--config", "s.yaml", *args,
                  "--trainer.max_epochs=1")  # fmt: skip
    log = tmp_path / "cuda-refused.log"
    assert not log.exists(), log.read_text()[-4000:]
    assert result.returncode == 0 and "1/1 finished" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# --- the random states of the GPUs a process trains on ---------------------------------------------------------------


class FakeCudaRng:
    """The CUDA generators of ``count`` visible GPUs, each state a distinct tensor; what was set is recorded."""

    def __init__(self, count: int) -> None:
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}
        self.set: list[tuple[int, torch.Tensor]] = []

    def get(self, device: torch.device) -> torch.Tensor:
        assert device.type == "cuda" and device.index in self.states, f"{device} is not visible"
        return self.states[device.index].clone()

    def put(self, state: torch.Tensor, device: torch.device) -> None:
        assert device.type == "cuda" and device.index in self.states, f"{device} is not visible"
        self.set.append((device.index, state))


def _rng_callback(monkeypatch: pytest.MonkeyPatch, visible: int, devices: list[str]) -> tuple[object, FakeCudaRng]:
    """An ExactResume set up for a process that trains on ``devices`` where ``visible`` GPUs are seen."""
    from types import SimpleNamespace

    from template.engine.resume.states import ExactResume

    fake = FakeCudaRng(visible)
    for name in ("get_rng_state", "set_rng_state"):
        monkeypatch.setattr(torch.cuda, name, {"get_rng_state": fake.get, "set_rng_state": fake.put}[name])
    for name in ("get_rng_state_all", "set_rng_state_all", "current_device", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("a CUDA function outside the run's devices"))
    parallel = [torch.device(d) for d in devices]
    strategy = SimpleNamespace(world_size=1, root_device=parallel[0], parallel_devices=parallel)
    callback = ExactResume()
    # What a checkpoint's state reads of a trainer outside a fit: no batch trained in an epoch, a module.
    progress = SimpleNamespace(current=SimpleNamespace(processed=0), is_last_batch=False)
    trainer = SimpleNamespace(
        strategy=strategy, train_dataloader=None, callback_metrics={}, lr_scheduler_configs=[],
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        lightning_module=torch.nn.Linear(1, 1), state=SimpleNamespace(fn="validate"),
    )  # fmt: skip
    callback.setup(trainer, None, "validate")
    return callback, fake


def _saved(callback: object) -> dict:
    """The callback's state as a checkpoint holds it, through torch.save and a weights-only load."""
    import io

    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("written", "continued"),
    [
        ((8, ["cuda:5"]), (1, ["cuda:0"])),  # free:1 picked GPU 5 of 8; the restart's scheduler shows only that one
        ((1, ["cuda:0"]), (8, ["cuda:3"])),  # and the other way
        ((4, ["cuda:2", "cuda:3"]), (2, ["cuda:0", "cuda:1"])),  # strategy dp: every device, in its order
    ],
)
def test_a_process_saves_its_own_gpus_states_and_restores_them_on_its_gpus_now(monkeypatch, written, continued) -> None:  # noqa: ANN001
    writer, at_write = _rng_callback(monkeypatch, *written)
    saved = _saved(writer)
    (state,) = saved["ranks"]
    assert list(state["cuda"]) == written[1]  # only the devices it trained on, not every visible GPU
    reader, at_read = _rng_callback(monkeypatch, *continued)
    reader.load_state_dict(saved)
    expected = [at_write.states[torch.device(d).index] for d in written[1]]
    assert [index for index, _ in at_read.set] == [torch.device(d).index for d in continued[1]]
    assert all(torch.equal(got, want) for (_, got), want in zip(at_read.set, expected, strict=True))


def test_a_cpu_process_saves_and_restores_no_gpu_state(monkeypatch) -> None:  # noqa: ANN001
    writer, _ = _rng_callback(monkeypatch, 2, ["cuda:1"])
    from_gpu = _saved(writer)
    cpu, fake = _rng_callback(monkeypatch, 2, ["cpu"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: pytest.fail("a CPU process read a GPU's state"))
    assert _saved(cpu)["ranks"][0]["cuda"] == {}
    cpu.load_state_dict(from_gpu)  # a GPU run continued on the CPU: its GPU states are left alone
    assert fake.set == []


@pytest.mark.parametrize(("visible", "device", "restored"), [(8, "cuda:0", 0), (8, "cuda:2", 2), (1, "cuda:2", None)])
def test_older_checkpoints_with_every_visible_gpus_state_still_load(monkeypatch, visible, device, restored) -> None:  # noqa: ANN001
    writer, _ = _rng_callback(monkeypatch, 1, ["cpu"])
    saved = _saved(writer)
    # What earlier versions wrote: torch.cuda.get_rng_state_all(), one state per visible GPU in CUDA's numbering.
    every = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(visible)]
    saved["ranks"][0]["cuda"] = every
    reader, fake = _rng_callback(monkeypatch, 8, [device])
    reader.load_state_dict(saved)
    if restored is None:  # that GPU's state was never saved
        assert fake.set == []
    else:
        ((index, state),) = fake.set
        assert index == restored and torch.equal(state, every[restored])
