"""A full disk during a checkpoint write ends the run with one line naming the file and the fix, exit code 3, the
previous checkpoint intact and no temporary file left."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import template.engine.store as atomic
from tests.conftest import CONFIGS, PACKAGE, cli_env

FAST = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=3",
    "--trainer.enable_model_summary=false", "--run.name=disk",
]  # fmt: skip


def _check(code: int, stderr: str, run: Path) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 3, stderr[-3000:]
    # In process, Lightning's log handler may still point at an earlier test's captured stream ("Logging error"):
    # what matters is that no traceback of the failed write reaches the user.
    assert len(errors) == 1 and "OSError" not in stderr and "DiskError" not in stderr, stderr[-3000:]
    assert f"cannot write {Path('lightning_logs/disk/checkpoints')}" in errors[0]
    assert "No space left on device [Errno 28]; free space there or set --trainer.default_root_dir" in errors[0]
    assert "(any previous checkpoint there is intact)" in errors[0]
    checkpoints = run / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4  # the end of epoch 0
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".")] == []
    assert (run / "metrics.csv").read_text().count("\n") >= 2, "the logs up to the failure are on disk"


def test_disk_full_at_a_checkpoint_write_is_one_line(run_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = torch.save
    calls = []

    def fill_up(obj: object, f: object, *args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) <= 3:  # the prepared data, then epoch 0: best-*.ckpt and last.ckpt fit on the disk
            real_save(obj, f, *args, **kwargs)
            return
        f.write(b"half a checkpoint")  # type: ignore[attr-defined]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.torch, "save", fill_up)
    result = run_main(*FAST)
    _check(result.returncode, result.stderr, tmp_path / "lightning_logs" / "disk")


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespace to mount a small tmpfs in (needs unshare -rm)")
def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    # 200 KiB holds the logs but not one 240 KiB checkpoint: the kernel's own ENOSPC at the first checkpoint write.
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [sys.executable, "-m", PACKAGE, *FAST, f"--data.data_dir={tmp_path / 'data'}"]
    # The tmpfs lives only in the mount namespace: list the checkpoint folder from inside it, after the run.
    script = (
        f'mount -t tmpfs -o size=200k tmpfs "{disk}" && cd "{disk}" || exit 99; "$@"; code=$?; '
        'echo "left: $(ls -A lightning_logs/disk/checkpoints)"; exit $code'
    )
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *command],
        env=cli_env(), capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device [Errno 28]" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[-1] == "left: ", "no temporary or partial checkpoint is left"
    print(f"\nreal ENOSPC: {errors[0]}")
