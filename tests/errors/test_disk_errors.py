"""Real disk failures (no mocks of the OS) under the run folder, the data folder and ``export --output``: each ends
in one ``error:`` line naming the path and the errno, exit 3 (2 for a data folder the user chose wrongly), no
traceback, and no 0-byte or temporary file left anywhere.

Read-only disks and full disks are made in a user and mount namespace (``unshare -rm``): a read-only bind mount, a
tiny tmpfs. As root, permission bits stop nothing, so they are not used.
"""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from template.engine.commands.cli import main
from template.engine.errors import DiskError, disk_error
from template.engine.store import prove_writable
from tests.conftest import CONFIGS, PACKAGE, cli_env
from tests.errors.test_disk_full import _can_mount_tmpfs

NAMESPACE = pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user+mount namespace (needs unshare -rm)")
LONG = "n" * 300  # longer than any filesystem's 255-byte name limit: ENAMETOOLONG
FIT = [
    "fit", "--config", str(CONFIGS / "default.yaml"), "--trainer.accelerator=cpu", "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=3",
    "--trainer.enable_model_summary=false", "--run.name=disk",
]  # fmt: skip
# Fills a tmpfs to the last block (head fails at the end: the disk is full, which is the point).
FILL = '{ head -c 1M /dev/zero 2>&- >"$ROOT/ro/f"; true; }'
# Printed from inside the namespace after the command: what a failed write left (a tmpfs is gone once it exits).
_LEFT = "find \"$ROOT\" -type f \\( -size 0 -o -name '*.tmp' \\) -printf 'left: %p\\n'"


def _one_line(code: int, stderr: str, expected_code: int, path: str | Path, errno_: int) -> str:
    assert code == expected_code, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert str(path) in errors[0] and f"[Errno {errno_}]" in errors[0], errors[0]
    return errors[0]


def _nothing_half_written(root: Path) -> None:
    left = [p for p in root.rglob("*") if p.is_file() and (p.stat().st_size == 0 or p.name.endswith(".tmp"))]
    assert left == [], left


def _in_namespace(setup: str, command: list[str], root: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``setup`` (mounts) then ``command`` in a new user+mount namespace; stdout lists files left half-written."""
    script = f'ROOT={shlex.quote(str(root))}; {setup} || exit 99; "$@"; code=$?; {_LEFT}; exit $code'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *command],
        env=cli_env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=root,
    )  # fmt: skip


def _left(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("left: ")]


# --- the line itself -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.ENOSPC, "free space there or set --opt to another disk"),
        (errno.EDQUOT, "free space there"),
        (errno.EROFS, "read-only; set --opt to a folder on a writable disk"),
        (errno.EACCES, "set --opt to a folder you can write to"),
        (errno.ENAMETOOLONG, "shorter --run.name or --opt"),
        (errno.ELOOP, "symbolic links"),
    ],
)
def test_each_errno_gets_its_own_fix(code: int, fix: str) -> None:
    error = disk_error(OSError(code, os.strerror(code)), "some/dir/file.ckpt", kept="kept", option="--opt")
    assert error is not None
    assert str(error).startswith(f"cannot write {Path('some/dir/file.ckpt')}: {os.strerror(code)} [Errno {code}]; ")
    assert fix in str(error) and str(error).endswith("(kept)")


def test_a_bug_is_not_a_disk_error() -> None:
    assert disk_error(OSError(errno.EBADF, "Bad file descriptor"), "x", kept="") is None
    assert disk_error(OSError(errno.EEXIST, "File exists", "."), ".", kept="") is None  # a folder that exists


# --- prove_writable --------------------------------------------------------------------------------------------------


def test_prove_writable_creates_the_folder_and_leaves_nothing(tmp_path: Path) -> None:
    prove_writable(tmp_path / "a" / "b", "--trainer.default_root_dir")
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == []


def test_prove_writable_through_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for target in (tmp_path / "afile", tmp_path / "afile" / "runs"):
        with pytest.raises(DiskError) as raised:
            prove_writable(target, "--trainer.default_root_dir")
        message = str(raised.value)
        assert f"[Errno {errno.ENOTDIR}]" in message and f"'{tmp_path / 'afile'}' is a file" in message, message
        assert "--trainer.default_root_dir" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_prove_writable_with_a_name_too_long(tmp_path: Path) -> None:
    with pytest.raises(DiskError, match=rf"\[Errno {errno.ENAMETOOLONG}\].*shorter --run.name or --root"):
        prove_writable(tmp_path / LONG, "--root")
    assert list(tmp_path.iterdir()) == []


@NAMESPACE
@pytest.mark.parametrize(
    ("setup", "code"),
    [
        ('mkdir -p "$ROOT/ro" && mount --bind -o ro "$ROOT/ro" "$ROOT/ro"', errno.EROFS),
        (f'mkdir -p "$ROOT/ro" && mount -t tmpfs -o size=16k tmpfs "$ROOT/ro" && {FILL}',
         errno.ENOSPC),
    ],
    ids=["read-only", "full"],
)  # fmt: skip
def test_prove_writable_on_a_read_only_or_full_disk(tmp_path: Path, setup: str, code: int) -> None:
    probe = (
        f"import sys; from {PACKAGE}.engine.store import prove_writable\n"
        f"from {PACKAGE}.engine.errors import DiskError\n"
        "try:\n    prove_writable(sys.argv[1], '--trainer.default_root_dir')\n"
        "except DiskError as err:\n    print(f'error: {err}', file=sys.stderr); sys.exit(3)\n"
    )
    target = tmp_path / "ro" / "runs"
    done = _in_namespace(setup, [sys.executable, "-c", probe, str(target)], tmp_path, timeout=60)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "ro", code)
    assert "--trainer.default_root_dir" in line
    assert [p for p in _left(done) if not p.endswith("/ro/f")] == [], done.stdout


# --- export --output -------------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "in.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"net.w": torch.ones(64, 64)}}, path)
    return path


def _export(checkpoint: Path, output: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(checkpoint), "--output", str(output)])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("output", "code"),
    [("afile/net.pt", errno.ENOTDIR), (f"{LONG}.pt", errno.ENAMETOOLONG), (f"{LONG}/net.pt", errno.ENAMETOOLONG)],
    ids=["through-a-file", "name-too-long", "folder-name-too-long"],
)
def test_export_output_that_cannot_be_written_is_one_line(
    tmp_path: Path,
    checkpoint: Path,
    capsys,
    monkeypatch,
    output: str,
    code: int,  # noqa: ANN001
) -> None:
    (tmp_path / "afile").write_text("x")
    exit_code, err = _export(checkpoint, tmp_path / output, capsys, monkeypatch)
    line = _one_line(exit_code, err, 3, tmp_path, code)
    assert "--output" in line and "nothing was written at --output" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.ckpt"]


@NAMESPACE
@pytest.mark.parametrize(
    ("setup", "code"),
    [
        # The same refusal as the full disk's, by another errno: in the slow suite.
        pytest.param(
            'mkdir -p "$ROOT/out" && mount --bind -o ro "$ROOT/out" "$ROOT/out"', errno.EROFS, marks=pytest.mark.slow
        ),
        ('mkdir -p "$ROOT/out" && mount -t tmpfs -o size=8k tmpfs "$ROOT/out"', errno.ENOSPC),
    ],
    ids=["read-only", "full"],
)
def test_export_to_a_read_only_or_full_disk_is_one_line(
    tmp_path: Path, checkpoint: Path, setup: str, code: int
) -> None:
    command = [sys.executable, "-m", PACKAGE, "export", str(checkpoint), "--output", str(tmp_path / "out/net.pt")]
    done = _in_namespace(setup, command, tmp_path, timeout=60)
    _one_line(done.returncode, done.stderr, 3, tmp_path / "out" / "net.pt", code)
    assert _left(done) == [], done.stdout
    assert not (tmp_path / "out" / "net.pt").exists()


# --- the data folder -------------------------------------------------------------------------------------------------


def test_data_dir_with_a_name_too_long_is_one_line(tmp_path: Path) -> None:
    from template.data import DigitsDataModule

    with pytest.raises(DiskError, match=rf"\[Errno {errno.ENAMETOOLONG}\].*--data.data_dir"):
        DigitsDataModule(data_dir=str(tmp_path / LONG)).prepare_data()
    assert list(tmp_path.iterdir()) == []


@NAMESPACE
@pytest.mark.slow  # a training subprocess
def test_a_full_data_folder_is_one_line(tmp_path: Path) -> None:
    setup = 'mkdir -p "$ROOT/data" && mount -t tmpfs -o size=16k tmpfs "$ROOT/data"'
    command = [sys.executable, "-m", PACKAGE, *FIT, f"--data.data_dir={tmp_path / 'data'}"]
    done = _in_namespace(setup, command, tmp_path)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "data" / "digits.pt", errno.ENOSPC)
    assert "--data.data_dir" in line
    assert _left(done) == [], done.stdout
    _nothing_half_written(tmp_path)


@NAMESPACE
@pytest.mark.slow  # a training subprocess
def test_a_read_only_data_folder_is_one_line(tmp_path: Path) -> None:
    setup = 'mkdir -p "$ROOT/data" && mount --bind -o ro "$ROOT/data" "$ROOT/data"'
    command = [sys.executable, "-m", PACKAGE, *FIT, f"--data.data_dir={tmp_path / 'data'}"]
    done = _in_namespace(setup, command, tmp_path)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "data" / "digits.pt", errno.EROFS)
    assert "read-only" in line and "--data.data_dir" in line
    assert _left(done) == [], done.stdout


# --- the run folder --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits prepared once: the runs below fail on their run folder, not on the data."""
    from template.data import DigitsDataModule

    folder = tmp_path_factory.mktemp("data")
    DigitsDataModule(data_dir=str(folder)).prepare_data()
    return folder


def _fit(tmp_path: Path, data_dir: Path, *extra: str, setup: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", PACKAGE, *FIT, f"--data.data_dir={data_dir}", *extra]
    if setup is not None:
        return _in_namespace(setup, command, tmp_path)
    return subprocess.run(
        command, env=cli_env(), capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, cwd=tmp_path
    )


@pytest.mark.slow  # a training subprocess
def test_run_folder_through_a_file(tmp_path: Path, data_dir: Path) -> None:
    (tmp_path / "afile").write_text("x")
    done = _fit(tmp_path, data_dir, f"--trainer.default_root_dir={tmp_path / 'afile' / 'runs'}")
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "afile", errno.ENOTDIR)
    assert f"'{tmp_path / 'afile'}' is a file" in line and "--trainer.default_root_dir" in line
    _nothing_half_written(tmp_path)


@pytest.mark.slow  # a training subprocess
def test_run_name_too_long(tmp_path: Path, data_dir: Path) -> None:
    done = _fit(tmp_path, data_dir, f"--trainer.default_root_dir={tmp_path}", f"--run.name={LONG}")
    line = _one_line(done.returncode, done.stderr, 3, tmp_path, errno.ENAMETOOLONG)
    assert "--run.name" in line
    _nothing_half_written(tmp_path)


@NAMESPACE
@pytest.mark.slow  # a training subprocess
def test_run_folder_on_a_read_only_disk(tmp_path: Path, data_dir: Path) -> None:
    setup = 'mkdir -p "$ROOT/runs" && mount --bind -o ro "$ROOT/runs" "$ROOT/runs"'
    done = _fit(tmp_path, data_dir, f"--trainer.default_root_dir={tmp_path / 'runs'}", setup=setup)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "runs", errno.EROFS)
    assert "read-only" in line and "--trainer.default_root_dir" in line
    assert _left(done) == [], done.stdout


@NAMESPACE
@pytest.mark.slow  # training subprocesses
@pytest.mark.parametrize("size", ["8k", "16k", "40k", "100k"])
def test_run_folder_full_at_the_start(tmp_path: Path, data_dir: Path, size: str) -> None:
    # From no room for the first file to room for the logs but not the first checkpoint: whichever write fails.
    setup = f'mkdir -p "$ROOT/runs" && mount -t tmpfs -o size={size} tmpfs "$ROOT/runs"'
    done = _fit(tmp_path, data_dir, f"--trainer.default_root_dir={tmp_path / 'runs'}", setup=setup)
    _one_line(done.returncode, done.stderr, 3, tmp_path / "runs", errno.ENOSPC)
    assert _left(done) == [], done.stdout


@NAMESPACE
@pytest.mark.slow  # a training subprocess
def test_run_folder_full_after_the_first_checkpoints(tmp_path: Path, data_dir: Path) -> None:
    # Room for epoch 0's best and last checkpoints (about 240 KiB each) and the logs, not for epoch 1's.
    setup = 'mkdir -p "$ROOT/runs" && mount -t tmpfs -o size=700k tmpfs "$ROOT/runs"'
    done = _fit(tmp_path, data_dir, f"--trainer.default_root_dir={tmp_path / 'runs'}", setup=setup)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "runs/lightning_logs/disk/checkpoints", errno.ENOSPC)
    assert "(any previous checkpoint there is intact)" in line
    assert _left(done) == [], done.stdout


@NAMESPACE
def test_a_checkpoint_dirpath_on_a_read_only_disk_is_refused_before_training(tmp_path: Path, data_dir: Path) -> None:
    setup = 'mkdir -p "$ROOT/ro" && mount --bind -o ro "$ROOT/ro" "$ROOT/ro"'
    done = _fit(tmp_path, data_dir, f"--checkpoint.dirpath={tmp_path / 'ro' / 'ckpts'}", setup=setup)
    line = _one_line(done.returncode, done.stderr, 3, tmp_path / "ro" / "ckpts", errno.EROFS)
    assert "read-only; set --checkpoint.dirpath to a folder on a writable disk" in line, line
    # Stopped before the run's folder, its logs or the data were written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]
    assert _left(done) == [], done.stdout
