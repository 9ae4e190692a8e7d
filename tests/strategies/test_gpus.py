"""``trainer.devices: free:N``, the float32 matmul precision option and the bf16 config, without a GPU: NVML is a
fake ``pynvml`` module and ``torch.cuda.device_count`` is monkeypatched, the command line runs in process."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from template.engine.commands import cli
from template.engine.errors import ConfigError
from template.engine.strategies import devices as gpus
from template.engine.strategies.devices import (
    HANDOFF_VARIABLE,
    parse_free_request,
    pick_free_gpus,
    resolve_free_devices,
)
from tests.conftest import CONFIGS

GIB = 1024**3


class FakeNVML(types.ModuleType):
    """The part of ``pynvml`` the selection uses, over physical cards given as (UUID, free GiB, total GiB) and
    optionally the model and PCI bus id (default: one model, NVML's order is the bus order, as on most machines)."""

    class NVMLError(Exception):
        pass

    def __init__(self, cards: list[tuple[str, float, float]], init_error: str | None = None) -> None:
        super().__init__("pynvml")
        self.cards = cards
        self.init_error = init_error
        self.handles = [object() for _ in cards]
        self.memory_reads: list[int] = []
        self.open = 0

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        if self.init_error:
            raise self.NVMLError(self.init_error)
        self.open += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802
        return self.handles[index]

    def nvmlDeviceGetUUID(self, handle: object) -> bytes:  # noqa: N802 - older bindings return bytes
        return self.cards[self.handles.index(handle)][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> types.SimpleNamespace:  # noqa: N802
        index = self.handles.index(handle)
        self.memory_reads.append(index)
        _, free, total, *_ = self.cards[index]
        return types.SimpleNamespace(free=int(free * GIB), total=int(total * GIB), used=int((total - free) * GIB))

    def nvmlDeviceGetName(self, handle: object) -> str:  # noqa: N802
        card = self.cards[self.handles.index(handle)]
        return card[3] if len(card) > 3 else "NVIDIA RTX A5000"

    def nvmlDeviceGetPciInfo(self, handle: object) -> types.SimpleNamespace:  # noqa: N802
        index = self.handles.index(handle)
        card = self.cards[index]
        return types.SimpleNamespace(busId=(card[4] if len(card) > 4 else f"00000000:{0x10 + index:02X}:00.0").encode())


# Six 24 GiB cards of a shared lab machine: 0, 2 and 4 are busy, 3 and 5 nearly free.
LAB = [
    ("GPU-aaaa0000-0000-0000-0000-000000000000", 1.5, 24.0),
    ("GPU-bbbb1111-1111-1111-1111-111111111111", 12.0, 24.0),
    ("GPU-cccc2222-2222-2222-2222-222222222222", 0.3, 24.0),
    ("GPU-dddd3333-3333-3333-3333-333333333333", 23.0, 24.0),
    ("GPU-eeee4444-4444-4444-4444-444444444444", 4.0, 24.0),
    ("GPU-ffff5555-5555-5555-5555-555555555555", 20.0, 24.0),
]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeNVML]:
    """Install a fake ``pynvml``; the environment is that of a plain shell (no launcher, no rank, all GPUs visible)."""
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", HANDOFF_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    # resolve_free_devices writes the hand-off and CUDA's device order into os.environ: registered here, so that
    # they are removed afterwards.
    for name in (HANDOFF_VARIABLE, "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def install(cards: list[tuple[str, float, float]] = LAB, **kwargs: str) -> FakeNVML:
        fake = FakeNVML(cards, **kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def request(text: str) -> gpus.FreeRequest:
    parsed = parse_free_request(text)
    assert parsed is not None
    return parsed


def refused(text: str, match: str) -> str:
    """The ConfigError for ``trainer.devices=text``, checked to be one line."""
    with pytest.raises(ConfigError, match=match) as caught:
        resolve_free_devices({"accelerator": "gpu", "devices": text})
    assert "\n" not in str(caught.value)
    return str(caught.value)


# --- parsing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count", "min_gib"),
    [("free:2", 2, 0.0), ("free:1,min=8GiB", 1, 8.0), ("FREE: 3 , min = 7.5", 3, 7.5), ("free:2,min=10G", 2, 10.0)],
)
def test_requests_are_parsed(text: str, count: int, min_gib: float) -> None:
    assert (request(text).count, request(text).min_free_gib) == (count, min_gib)


@pytest.mark.parametrize("value", [2, [0, 1], "auto", "-1", "0,1", None])
def test_other_device_values_are_left_to_lightning(value: object) -> None:
    trainer = {"devices": value}
    resolve_free_devices(trainer)
    assert parse_free_request(value) is None and trainer == {"devices": value}


@pytest.mark.parametrize(
    ("value", "indices", "count"),
    [
        (2, [0, 1], 2), ("3", [0, 1, 2], 3), ([2, 0], [2, 0], 2), ("1,3", [1, 3], 2), ("1,", [1], 1),
        (-1, [0, 1, 2, 3], None), ("-1", [0, 1, 2, 3], None), ("auto", [0, 1, 2, 3], None), (0, [], 0),
    ],
)  # fmt: skip
def test_device_values_are_read_as_lightning_reads_them(value: object, indices: list[int], count: int | None) -> None:
    assert gpus.gpu_indices(value, visible=4) == indices and gpus.gpu_count(value) == count


def test_a_free_request_counts_its_gpus_and_nonsense_is_one_line() -> None:
    assert gpus.gpu_count("free:3,min=8GiB") == 3
    for value in ("two", "0,x", [0.5j]):
        with pytest.raises(ConfigError, match=r"trainer.devices=.* is not a number of devices.*devices: \[0, 1\]"):
            gpus.gpu_count(value)


@pytest.mark.parametrize(
    "text", ["free:", "free:0", "free:-1", "free:two", "free:2,min=lots", "free:2,max=3", "free:2,min=nan"]
)
def test_malformed_requests_name_the_value_and_the_syntax(text: str) -> None:
    message = refused(text, "is not a free-GPU request")
    assert repr(text) in message and "free:N or free:N,min=MGiB (e.g. free:2 or free:2,min=8GiB)" in message


# --- selection against NVML ------------------------------------------------------------------------------------------


def test_picks_the_gpus_with_the_most_free_memory_most_free_first(nvml) -> None:  # noqa: ANN001
    fake = nvml()
    chosen, message = pick_free_gpus(request("free:2"))
    assert chosen == [3, 5]  # the most free first: under dp it is the root that fills first
    assert message.startswith("trainer.devices='free:2': training on GPU(s) [3, 5], the 2 with the most free memory")
    assert "GPU 2: 0.3 of 24.0 GiB free" in message and "GPU 3: 23.0 of 24.0 GiB free" in message
    assert "\n" not in message and fake.open == 0  # NVML shut down again


def test_busy_cards_are_taken_last_and_min_excludes_them(nvml) -> None:  # noqa: ANN001
    nvml()
    assert pick_free_gpus(request("free:4"))[0] == [3, 5, 1, 4]
    assert pick_free_gpus(request("free:3,min=2GiB"))[0] == [3, 5, 1]


def test_too_few_qualifying_gpus_names_every_gpus_free_memory(nvml) -> None:  # noqa: ANN001
    nvml()
    message = refused("free:3,min=16GiB", r"needs 3 GPU\(s\) with at least 16 GiB free but 2 of the 6 visible qualify")
    for index, (_, free, total) in enumerate(LAB):
        assert f"GPU {index}: {free:.1f} of {total:.1f} GiB free" in message
    assert "ask for fewer, lower min" in message and "list the devices explicitly" in message
    refused("free:7", r"needs 7 GPU\(s\) but 6 of the 6 visible qualify")


@pytest.mark.parametrize(
    ("visible", "expected", "free_of_first"),
    [
        ("5,2,3", [2, 0], "GPU 0: 20.0"),  # visible 2 = physical 3 (23 GiB), visible 0 = physical 5 (20 GiB)
        ("GPU-bbbb,GPU-dddd3333-3333-3333-3333-333333333333", [1, 0], "GPU 0: 12.0"),  # UUIDs and unique prefixes
        ("1, 3, 9, 5", [1, 0], "GPU 0: 12.0"),  # CUDA ignores everything from the first index that does not exist
        ("GPU-eeee,GPU-1234,3", [0], "GPU 0: 4.0"),  # ... and from the first UUID that matches no card
    ],
)
def test_cuda_visible_devices_renumbers_like_cuda(nvml, monkeypatch, visible, expected, free_of_first) -> None:  # noqa: ANN001
    fake = nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    chosen, message = pick_free_gpus(request(f"free:{len(expected)}"))
    assert chosen == expected and free_of_first in message
    assert f"of {len(set(fake.memory_reads))} visible" in message  # hidden cards are not even read


@pytest.mark.parametrize(
    ("cards", "visible", "init_error", "reason"),
    [
        (LAB, "", None, "(none visible, CUDA_VISIBLE_DEVICES='')"),
        (LAB, "-1", None, "(none visible, CUDA_VISIBLE_DEVICES='-1')"),
        ([], None, None, "(NVML lists no GPU)"),
        (LAB, None, "Driver Not Loaded", "(NVML cannot start: Driver Not Loaded)"),
    ],
)
def test_no_gpu_is_one_line(nvml, monkeypatch, cards, visible, init_error, reason) -> None:  # noqa: ANN001
    nvml(cards, init_error=init_error)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    message = refused("free:1", "picks among CUDA GPUs but this process sees none")
    assert reason in message and "configs/ddp_cpu.yaml" in message


def test_an_nvml_failure_while_reading_is_one_line(nvml, monkeypatch) -> None:  # noqa: ANN001
    fake = nvml()

    def no_permission(handle: object) -> None:
        raise fake.NVMLError("Insufficient Permissions")

    monkeypatch.setattr(fake, "nvmlDeviceGetMemoryInfo", no_permission, raising=False)
    refused("free:1", r"cannot read the GPUs' free memory \(NVML: Insufficient Permissions\); list the devices")
    assert fake.open == 0


def test_without_nvml_says_which_extra_to_install(nvml, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    message = refused("free:2", "NVML, which is not installed")
    assert "pip install nvidia-ml-py (this project's gpu extra: pip install -e '.[gpu]')" in message


# A node with mixed models in PCI bus order, as nvidia-smi lists them. CUDA's default order (FASTEST_FIRST) would
# number the A100s 0 and 1: without PCI_BUS_ID, free:1 would read card 1 and train on another.
V100, A100 = "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB"
MIXED = [
    ("GPU-11111111-1111-1111-1111-111111111111", 30.0, 32.0, V100, "00000000:1A:00.0"),
    ("GPU-22222222-2222-2222-2222-222222222222", 70.0, 80.0, A100, "00000000:3B:00.0"),
    ("GPU-33333333-3333-3333-3333-333333333333", 31.0, 32.0, V100, "00000000:5C:00.0"),
    ("GPU-44444444-4444-4444-4444-444444444444", 10.0, 80.0, A100, "00000000:88:00.0"),
]


@pytest.mark.parametrize("nvml_order", [MIXED, MIXED[::-1]], ids=["nvml-in-bus-order", "nvml-in-another-order"])
@pytest.mark.parametrize(
    ("visible", "expected", "first"),
    [
        (None, [1, 2], "GPU 1: 70.0 of 80.0"),  # indices in PCI bus order: nvidia-smi's
        ("3,1", [1], "GPU 1: 70.0 of 80.0"),  # CUDA_VISIBLE_DEVICES indices are bus-order indices too
        ("GPU-4444,GPU-22222222-2222-2222-2222-222222222222", [1], "GPU 0: 10.0 of 80.0"),
    ],
)
def test_mixed_models_are_numbered_by_cuda_as_they_are_read(
    nvml, monkeypatch, nvml_order, visible, expected, first
) -> None:  # noqa: ANN001, E501
    nvml(nvml_order)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    chosen, message = pick_free_gpus(request(f"free:{len(expected)}"))
    assert chosen == expected and first in message
    assert gpus.os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # set before CUDA starts, inherited by DDP processes


@pytest.mark.parametrize(("order", "cards"), [("PCI_BUS_ID", MIXED), ("FASTEST_FIRST", LAB), ("fastest_first", LAB)])
def test_a_device_order_the_user_set_is_kept_where_it_numbers_the_same(nvml, monkeypatch, order, cards) -> None:  # noqa: ANN001
    nvml(cards)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    pick_free_gpus(request("free:1"))
    assert gpus.os.environ["CUDA_DEVICE_ORDER"] == order  # one model: every order numbers the cards alike


@pytest.mark.parametrize(("order", "said"), [("FASTEST_FIRST", "FASTEST_FIRST"), (None, "FASTEST_FIRST (CUDA started")])
def test_another_order_over_mixed_models_is_refused(nvml, monkeypatch, order, said) -> None:  # noqa: ANN001
    nvml(MIXED)
    if order is None:  # CUDA started before the pick, in CUDA's default order: too late to change it
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    message = refused("free:1", f"reads the GPUs in PCI bus order, but CUDA_DEVICE_ORDER={re.escape(said)}")
    assert f"mixed models ({A100}, {V100})" in message and "unset CUDA_DEVICE_ORDER" in message
    assert gpus.os.environ.get("CUDA_DEVICE_ORDER") == order


def test_mig_instances_are_refused(nvml, monkeypatch) -> None:  # noqa: ANN001
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0123")
    refused("free:1", r"CUDA_VISIBLE_DEVICES='MIG-0123' names a MIG instance.*list the devices explicitly")


def test_cpu_accelerator_is_refused(nvml) -> None:  # noqa: ANN001
    fake = nvml()
    with pytest.raises(ConfigError, match=r"picks CUDA GPUs but trainer.accelerator is 'cpu'; set trainer.acc"):
        resolve_free_devices({"accelerator": "cpu", "devices": "free:2"})
    assert fake.memory_reads == []


@pytest.mark.parametrize(("accelerator", "hidden"), [("cpu", ""), (" CPU", ""), ("gpu", "0,1"), ("auto", "0,1")])
def test_a_cpu_run_hides_the_gpus_from_its_processes(monkeypatch, accelerator, hidden) -> None:  # noqa: ANN001
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    gpus.hide_gpus_from_cpu_run({"accelerator": accelerator, "devices": 2})
    assert gpus.os.environ["CUDA_VISIBLE_DEVICES"] == hidden


# --- DDP: one decision for every process ------------------------------------------------------------------------


def test_rank_zero_decides_and_a_launched_child_reuses_the_choice_without_nvml(nvml, monkeypatch) -> None:  # noqa: ANN001
    nvml()
    rank0 = {"accelerator": "auto", "devices": "free:2"}
    resolve_free_devices(rank0)
    assert rank0 == {"accelerator": "gpu", "devices": [3, 5]}
    # What Lightning's launcher gives rank 1: rank 0's environment plus LOCAL_RANK. Meanwhile the free memory changed
    # (rank 0's own context), and NVML is not even importable: the child must not query it.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    child = {"accelerator": "auto", "devices": "free:2"}
    resolve_free_devices(child)
    assert child == rank0


def test_a_child_without_rank_zeros_choice_is_refused(nvml, monkeypatch) -> None:  # noqa: ANN001
    fake = nvml()
    monkeypatch.setenv("LOCAL_RANK", "1")
    refused("free:2", r"this process is local rank 1 but has no choice handed down from rank 0 \(FREE_GPUS_CHOSEN=''\)")
    # A choice made for another request (an earlier run in the same shell) is not taken either.
    monkeypatch.setenv(HANDOFF_VARIABLE, "free:1->3")
    refused("free:2", r"FREE_GPUS_CHOSEN='free:1->3'\); start one process and let Lightning launch the others")
    assert fake.memory_reads == []


def test_rank_zero_overwrites_a_stale_choice(nvml, monkeypatch) -> None:  # noqa: ANN001
    nvml()
    monkeypatch.setenv(HANDOFF_VARIABLE, "free:2->0,1")
    trainer = {"devices": "free:2"}
    resolve_free_devices(trainer)
    assert trainer["devices"] == [3, 5] and gpus.os.environ[HANDOFF_VARIABLE] == "free:2->3,5"


@pytest.mark.parametrize(
    ("variables", "launcher"),
    [
        ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}, "TorchElastic"),
        ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train", "SLURM_LOCALID": "0"}, "SLURM"),
    ],
)
def test_several_processes_started_by_torchrun_or_slurm_are_refused(nvml, monkeypatch, variables, launcher) -> None:  # noqa: ANN001
    fake = nvml()
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    message = refused("free:2", rf"but {launcher} started this process as one of several on this node")
    assert "list the GPUs explicitly (devices: [0, 1]" in message and fake.memory_reads == []


def test_one_process_per_node_under_torchrun_picks_on_its_own_node(nvml, monkeypatch) -> None:  # noqa: ANN001
    nvml()
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    trainer = {"devices": "free:1"}
    resolve_free_devices(trainer)
    assert trainer["devices"] == [3]


# --- the command line, in process ----------------------------------------------------------------------------------


BUILT_TRAINERS: list = []


def _report_instead_of_training(self: cli.CLI) -> None:
    BUILT_TRAINERS.append(self.trainer)
    strategy = self.trainer.strategy
    devices = getattr(strategy, "parallel_devices", None) or [strategy.root_device]
    built = {
        "strategy": type(strategy).__name__,
        "devices": [str(d) for d in devices],
        "matmul": torch.get_float32_matmul_precision(),
        "precision": self.trainer.precision,
        # What Lightning's launcher hands to ranks 1..N while the command runs (put back when it ends).
        "environment": {name: os.environ.get(name) for name in (HANDOFF_VARIABLE, "CUDA_DEVICE_ORDER")},
    }
    print("BUILT " + json.dumps(built))
    sys.exit(0)


@pytest.fixture
def run_with_fake_gpus(run_main, nvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):  # noqa: ANN001, ANN201
    """The real command line with fake GPUs and NVML; it reports the Trainer it built instead of training."""
    # Lightning's logger does not propagate to the root logger that caplog listens to.
    logging.getLogger("lightning.pytorch").addHandler(caplog.handler)
    monkeypatch.setattr(cli.CLI, "before_fit", _report_instead_of_training)
    # A Trainer built as DDP rank 1 sets Lightning's process-wide rank: put it back, or later loggers here stay silent.
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))

    def run(gpu_count: int, *args: str) -> tuple[dict, str]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpu_count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_count > 0)
        result = run_main(*args)
        assert result.returncode == 0, result.stderr[-2000:]
        line = next(line for line in result.stdout.splitlines() if line.startswith("BUILT "))
        return json.loads(line[len("BUILT ") :]), caplog.text

    yield run
    logging.getLogger("lightning.pytorch").removeHandler(caplog.handler)


@pytest.mark.parametrize(("config", "strategy"), [("dp.yaml", "DataParallelStrategy"), ("ddp.yaml", "DDPStrategy")])
def test_command_line_trains_on_the_free_gpus(run_with_fake_gpus, nvml, config, strategy) -> None:  # noqa: ANN001
    nvml()
    built, log = run_with_fake_gpus(6, "fit", "--config", CONFIGS / config, "--trainer.devices=free:2")
    assert built["strategy"] == strategy and built["devices"] == ["cuda:3", "cuda:5"]
    assert "trainer.devices='free:2': training on GPU(s) [3, 5]" in log
    assert built["environment"][HANDOFF_VARIABLE] == "free:2->3,5"
    assert HANDOFF_VARIABLE not in os.environ  # the command's choice ends with it


def test_ddp_child_builds_the_same_trainer_from_the_handed_down_choice(run_with_fake_gpus, nvml, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(HANDOFF_VARIABLE, "free:2,min=8GiB->3,5")
    config = CONFIGS / "ddp.yaml"
    built, log = run_with_fake_gpus(6, "fit", "--config", config, "--trainer.devices=free:2,min=8GiB")
    assert built["devices"] == ["cuda:3", "cuda:5"] and "training on GPU" not in log


def test_lightnings_ddp_launcher_hands_the_choice_to_its_children(
    run_with_fake_gpus, nvml, monkeypatch, caplog
) -> None:  # noqa: ANN001
    from lightning.pytorch.strategies.launchers import subprocess_script

    nvml()
    args = ("fit", "--config", CONFIGS / "ddp.yaml", "--trainer.devices=free:2")
    built, _ = run_with_fake_gpus(6, *args)
    assert built["devices"] == ["cuda:3", "cuda:5"]
    for name, value in built["environment"].items():  # as the launcher finds them inside the command
        monkeypatch.setenv(name, value)
    # Lightning's own launcher starts rank 1 (recorded, not run): it sets these variables in rank 0's environment.
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    started: list[dict[str, str]] = []
    monkeypatch.setattr(subprocess_script.subprocess, "Popen", lambda command, env, cwd: started.append(env))
    BUILT_TRAINERS[-1].strategy.launcher._call_children_scripts()
    (child_env,) = started
    assert child_env["LOCAL_RANK"] == "1" and child_env[HANDOFF_VARIABLE] == "free:2->3,5"
    assert child_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # the children number the GPUs as rank 0 picked them
    # Rank 1 runs the same command line in that environment, with NVML not importable: it cannot have asked NVML.
    for name, value in child_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    caplog.clear()
    built, log = run_with_fake_gpus(6, *args)
    assert built["devices"] == ["cuda:3", "cuda:5"] and "[rank: 1]" in log and "training on GPU" not in log


def test_yaml_form_and_one_line_error_through_the_command_line(run_main, nvml, tmp_path: Path) -> None:  # noqa: ANN001
    nvml()
    (tmp_path / "free.yaml").write_text("trainer:\n  accelerator: gpu\n  devices: free:2,min=30GiB\n")
    result = run_main("fit", "--config", CONFIGS / "default.yaml", "--config", tmp_path / "free.yaml")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'free:2,min=30GiB' needs 2 GPU(s) with at least 30 GiB free but 0 of" in errors[0]


# --- float32 matmul precision and bf16 ---------------------------------------------------------------------------


def test_matmul_precision_is_high_on_cuda_by_default_and_untouched_on_cpu(run_with_fake_gpus, nvml) -> None:  # noqa: ANN001
    torch.set_float32_matmul_precision("highest")
    built, _ = run_with_fake_gpus(0, "fit", "--config", CONFIGS / "default.yaml")
    assert built["matmul"] == "highest" and built["devices"] == ["cpu"]
    built, _ = run_with_fake_gpus(1, "fit", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=gpu")
    assert built["matmul"] == "high" and built["devices"] == ["cuda:0"]
    built, _ = run_with_fake_gpus(1, "fit", "--config", CONFIGS / "default.yaml", "--float32_matmul_precision=medium")
    assert built["matmul"] == "medium"


def test_bad_matmul_precision_is_one_line(run_main) -> None:  # noqa: ANN001
    result = run_main("fit", "--config", CONFIGS / "default.yaml", "--float32_matmul_precision=fast")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "invalid value 'fast' for 'float32_matmul_precision'" in line
    assert "expected one of 'auto', 'highest', 'high', 'medium'" in line


def test_bf16_config_builds_bf16_mixed(run_with_fake_gpus, nvml) -> None:  # noqa: ANN001
    built, _ = run_with_fake_gpus(1, "fit", "--config", CONFIGS / "bf16.yaml")
    assert (built["precision"], built["devices"], built["matmul"]) == ("bf16-mixed", ["cuda:0"], "high")


def test_bf16_config_trains_on_the_cpu(run_main, tmp_path: Path) -> None:  # noqa: ANN001
    torch.set_float32_matmul_precision("highest")
    result = run_main(
        "fit", "--config", CONFIGS / "bf16.yaml", "--trainer.accelerator=cpu", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file(), sorted(map(str, tmp_path.rglob("*")))
    assert torch.get_float32_matmul_precision() == "highest"  # auto leaves the CPU alone
