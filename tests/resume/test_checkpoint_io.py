"""Checkpoint writes survive SIGKILL at any moment, keep the file's mode, leak no temporary, and load weights-only."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import random
import signal
import stat
import struct
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from template.engine import store as atomic
from template.engine.commands.cli import build_cli
from template.engine.resume.checkpoints import AtomicCheckpointIO
from tests.conftest import CONFIGS, PACKAGE

KILLS = 20
NUMEL = 6_000_000  # 24 MB of float32: big enough that a kill usually lands inside a write


def _writer(path: str, tmpdir: str, unnamed: bool, saving, saved) -> None:  # noqa: ANN001 - shared mp.Values
    """Child process: save checkpoints to ``path`` in a loop until killed."""
    os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = None  # forget the cached $TMPDIR: a writer that used it would now write there
    if not unnamed:
        del os.O_TMPFILE  # force the named-temporary path (filesystems without O_TMPFILE)
    io = AtomicCheckpointIO()
    step = saved.value
    while True:
        step += 1
        # No torch kernels here: OpenMP's thread pool does not survive fork() and would deadlock.
        weights = torch.frombuffer(bytearray(struct.pack("f", step) * NUMEL), dtype=torch.float32)
        checkpoint = {"step": step, "state_dict": {"w": weights}}
        saving.value = 1
        io.save_checkpoint(checkpoint, path)
        saving.value = 0
        saved.value = step


def _check(path: Path) -> int:
    """The step of a complete checkpoint at ``path``; raises if it is missing, truncated or mixed."""
    checkpoint = torch.load(path, weights_only=True)
    w = checkpoint["state_dict"]["w"]
    assert w.numel() == NUMEL and bool((w == checkpoint["step"]).all())
    return checkpoint["step"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills forked writers")
@pytest.mark.slow
@pytest.mark.parametrize("unnamed", [True, False], ids=["O_TMPFILE", "named-temporary"])
@pytest.mark.parametrize("tmpdir_on", ["same-filesystem", "other-filesystem"])
def test_sigkill_during_saves_never_corrupts_or_leaks(tmp_path: Path, tmpdir_on: str, unnamed: bool) -> None:
    if tmpdir_on == "other-filesystem":
        shm = Path("/dev/shm")
        if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
            pytest.skip("needs /dev/shm on a filesystem other than the test directory's")
        tmpdir = Path(tempfile.mkdtemp(dir=shm))
    else:
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir()
    assert (tmpdir.stat().st_dev != tmp_path.stat().st_dev) == (tmpdir_on == "other-filesystem")
    target = tmp_path / "checkpoints" / "last.ckpt"
    ctx = multiprocessing.get_context("fork")
    # No lock: a writer SIGKILLed while holding a Value's lock would leave this process waiting on it forever.
    saving, saved = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False)
    corrupt, leaked, during_write, last_step = 0, 0, 0, 0
    rng = random.Random(0)
    try:
        for _ in range(KILLS):
            before = saved.value
            writer = ctx.Process(target=_writer, args=(str(target), str(tmpdir), unnamed, saving, saved))
            writer.start()
            deadline = time.monotonic() + 60
            while saved.value == before:  # let it complete one save, then kill it at a random point of the next
                assert time.monotonic() < deadline and writer.is_alive(), "the writer made no progress"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.25))
            during_write += saving.value
            os.kill(writer.pid, signal.SIGKILL)
            writer.join(timeout=30)
            try:
                step = _check(target)
                assert step >= last_step
                last_step = step
            except Exception:
                corrupt += 1
            # What a kill leaves behind, before any later save gets the chance to clean up.
            leftovers = list(target.parent.glob(f".{target.name}.*.tmp")) + list(tmpdir.iterdir())
            leaked += len(leftovers)
            atomic.remove_stale_temporaries(target)
            saving.value = 0
    finally:
        if tmpdir_on == "other-filesystem":
            for f in tmpdir.iterdir():
                f.unlink()
            tmpdir.rmdir()
    print(
        f"\n{KILLS} SIGKILLs ({during_write} inside a write), $TMPDIR on {tmpdir_on}, "
        f"{'O_TMPFILE' if unnamed else 'named temporary'}: {corrupt} corrupt, {leaked} temporaries left by the kills"
    )
    assert corrupt == 0
    assert during_write >= KILLS // 4, "too few kills hit a write for this test to mean anything"
    assert list(tmpdir.iterdir()) == [] if tmpdir.exists() else True
    if unnamed:
        # Unnamed until the two system calls that link and rename it: a kill between them (seen once in 20 on a
        # loaded machine) is the only way to leave one.
        assert leaked <= 1, f"{leaked} of {KILLS} kills left an O_TMPFILE temporary behind"
    # Whatever a kill left, the next save removes it.
    AtomicCheckpointIO().save_checkpoint({"step": 0, "state_dict": {"w": torch.zeros(NUMEL)}}, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_save_keeps_mode_and_new_files_follow_umask(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "nested" / "a.ckpt"
    old = os.umask(0o027)
    try:
        io.save_checkpoint({"x": torch.ones(2)}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # like open(): not mkstemp's 0600
    path.chmod(0o604)
    io.save_checkpoint({"x": torch.zeros(2)}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o604
    assert torch.equal(io.load_checkpoint(path)["x"], torch.zeros(2))
    assert [p.name for p in path.parent.iterdir()] == ["a.ckpt"]


def test_load_is_weights_only_even_when_asked_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "unsafe.ckpt"
    torch.save({"where": pathlib.PosixPath("/tmp")}, path)  # needs unpickling a class: refused weights-only
    with pytest.raises(Exception, match="weights_only"):
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)


def test_the_cli_trainer_uses_the_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    cli = build_cli(
        ["--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.logger=false"], run=False
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert list(tmp_path.iterdir()) == []


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "shard").write_text(content)
    return path


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_folder_replaces_a_folder_or_a_file_whole(tmp_path: Path, monkeypatch, exchange: bool) -> None:  # noqa: ANN001
    """How strategy fsdp puts a sharded checkpoint in place: the new folder under the name, nothing else left."""
    if not exchange:  # a filesystem without renameat2's exchange (some network filesystems)
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = tmp_path / "last.ckpt"
    atomic.replace_directory(_folder(tmp_path / ".new1", "first"), target)  # nothing there yet
    atomic.replace_directory(_folder(tmp_path / ".new2", "second"), target)  # a previous checkpoint folder
    assert (target / "shard").read_text() == "second"
    (tmp_path / "file.ckpt").write_text("a single-file checkpoint")
    atomic.replace_directory(_folder(tmp_path / ".new3", "third"), tmp_path / "file.ckpt")
    assert (tmp_path / "file.ckpt" / "shard").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.ckpt", "last.ckpt"]


def test_renameat2_swaps_two_folders_here(tmp_path: Path) -> None:
    # The exchange this machine's filesystem offers is the one used; where it is missing the fallback runs.
    a, b = _folder(tmp_path / "a", "a"), _folder(tmp_path / "b", "b")
    if not atomic._exchange(a, b):
        pytest.skip("this filesystem has no atomic exchange (renameat2 RENAME_EXCHANGE)")
    assert (a / "shard").read_text() == "b" and (b / "shard").read_text() == "a"
