import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from template.data import DigitsDataModule
from template.engine.errors import ConfigError, DiskError
from tests.conftest import CONFIGS, PACKAGE, cli_env

TESTS = Path(__file__).parent


@pytest.fixture
def digits(tmp_path):
    dm = DigitsDataModule(data_dir=str(tmp_path / "data"), batch_size=32)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _indices(dataset):
    # Rows are unique enough to identify a sample: compare splits by content.
    return {tuple(x.flatten().tolist()) + (int(y),) for x, y in dataset}


def test_splits_cover_the_data_and_are_disjoint(digits):
    sizes = {name: len(ds) for name, ds in digits.splits.items()}
    assert sizes == {"val": 179, "test": 179, "train": 1439}
    train, val, test = (_indices(digits.splits[k]) for k in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)


def test_split_is_deterministic_and_seeded(tmp_path, digits):
    again = DigitsDataModule(data_dir=digits.data_dir)
    again.setup("fit")
    assert torch.equal(again.splits["val"].tensors[1], digits.splits["val"].tensors[1])
    other = DigitsDataModule(data_dir=digits.data_dir, split_seed=7)
    other.setup("fit")
    assert not torch.equal(other.splits["val"].tensors[1], digits.splits["val"].tensors[1])


def test_batches_have_the_declared_shapes(digits):
    x, y = next(iter(digits.train_dataloader()))
    assert x.shape == (32, *DigitsDataModule.input_shape) and x.dtype == torch.float32
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert y.dtype == torch.long and set(y.tolist()) <= set(range(DigitsDataModule.num_classes))
    assert len(digits.val_dataloader().dataset) == 179


def test_all_ten_classes_in_every_split(digits):
    for dataset in digits.splits.values():
        assert set(dataset.tensors[1].tolist()) == set(range(10))


def test_prepare_data_writes_once_and_leaves_no_temp_file(tmp_path):
    dm = DigitsDataModule(data_dir=str(tmp_path))
    dm.prepare_data()
    stamp = dm.cache_path.stat().st_mtime_ns
    dm.prepare_data()
    assert dm.cache_path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [dm.cache_path.name]


def test_concurrent_writers_leave_a_valid_file(tmp_path):
    modules = [DigitsDataModule(data_dir=str(tmp_path)) for _ in range(4)]
    threads = [threading.Thread(target=m.prepare_data) for m in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    data = torch.load(modules[0].cache_path, weights_only=True)
    assert data["images"].shape == (1797, 1, 8, 8)
    assert [p.name for p in tmp_path.iterdir()] == [modules[0].cache_path.name]


def test_data_dir_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    with pytest.raises(DiskError, match=r"\[Errno 20\].*is a file, not a folder.*--data.data_dir"):
        DigitsDataModule(data_dir=str(target)).prepare_data()
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("batch_size", [0, -3])
def test_non_positive_batch_size_is_refused(batch_size):
    with pytest.raises(ConfigError, match=f"batch_size must be a positive integer, got {batch_size}"):
        DigitsDataModule(batch_size=batch_size)


@pytest.mark.parametrize(
    ("pin_memory", "accelerator", "expected"),
    [(None, None, False), (None, "cpu", False), (None, "cuda", True), (False, "cuda", False), (True, "cpu", True)],
)
def test_pin_memory_is_on_for_cuda_trainers_unless_set(tmp_path, pin_memory, accelerator, expected):
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    dm = DigitsDataModule(data_dir=str(tmp_path), pin_memory=pin_memory)
    dm.prepare_data()
    dm.setup("fit")
    if accelerator is not None:
        # Only the accelerator's type is read; a real CUDA Trainer cannot be built without a GPU.
        dm.trainer = SimpleNamespace(accelerator={"cpu": CPUAccelerator, "cuda": CUDAAccelerator}[accelerator]())
    assert [dm.train_dataloader().pin_memory, dm.val_dataloader().pin_memory] == [expected, expected]


def _read_by_both_ranks(workdir, train_images):
    """Assert that 2 DDP processes read disjoint halves of the training set in epoch 0, through a DistributedSampler."""
    ranks = [torch.load(workdir / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert [record["sampler"] for record in ranks] == ["DistributedSampler"] * 2
    seen = Counter(map(tuple, torch.cat([record["images"] for record in ranks]).flatten(1).tolist()))
    expected = Counter(map(tuple, train_images.flatten(1).tolist()))
    assert not expected - seen, "some training samples were read by no process"
    # DistributedSampler pads 1439 samples to 2 x 720 with one repeated sample; overlapping ranks repeat hundreds.
    assert sum((seen - expected).values()) <= 1


def _train_images(data_dir):
    dm = DigitsDataModule(data_dir=str(data_dir))
    dm.setup("fit")
    return dm.splits["train"].tensors[0]


@pytest.mark.slow
def test_ddp_splits_the_example_data_under_a_plain_trainer(tmp_path):
    """The DataModule in a notebook or script, no command line: Lightning gives each process its own half."""
    env = cli_env(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(TESTS / "plain_trainer_ddp.py"), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    _read_by_both_ranks(tmp_path, _train_images(tmp_path))


@pytest.mark.slow
def test_ddp_splits_the_example_data_under_the_command_line(tmp_path):
    (tmp_path / "record.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: sample_recorder.SampleRecorder\n"
        f"      init_args: {{dirpath: {str(tmp_path)!r}}}\n"
    )
    env = cli_env(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), "--config", "record.yaml",
        "--trainer.max_epochs=1", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    _read_by_both_ranks(tmp_path, _train_images(tmp_path / "data"))
