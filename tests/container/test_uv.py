"""uv, the README's other installer: its two set-up commands, word for word, in a fresh copy of the project with uv
from PyPI (slow).

What belongs to this machine is here, not in ``pyproject.toml``: uv trusts the system's certificates (the network
here inspects TLS), and where pip finds torch's CPU build in a local folder (``pip config list``) rather than on
PyTorch's index, ``UV_INDEX`` names a local index holding it, the override docs/install.md shows for CUDA builds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PACKAGE, REPO

TORCH = "2.13.0"  # [tool.uv] constraint-dependencies
# Of the README's test command, only these files run here: uv's environment and the suite's runner in it (the
# README's pip commands run the whole fast suite in a fresh environment elsewhere in the slow suite).
SELECTED = "tests/test_data.py tests/test_nets.py"


def _shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    return done


def _copy_of_project(to: Path) -> Path:
    """What a clone of this working tree holds: git's tracked and untracked-not-ignored files (else all but runs,
    environments and caches)."""
    if (REPO / ".git").exists():
        listed = (
            subprocess.run(
                ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                capture_output=True,
                check=True,
                timeout=60,
            )
            .stdout.decode()
            .split("\0")
        )
        for name in filter(None, listed):
            if (REPO / name).is_file():
                (to / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, to / name, follow_symlinks=False)
    else:
        ignored = shutil.ignore_patterns(".venv*", "__pycache__", "*.egg-info", "lightning_logs", "data", ".*_cache")
        shutil.copytree(REPO, to, ignore=ignored, symlinks=True, dirs_exist_ok=True)
    return to


def _local_torch_index(folder: Path) -> str | None:
    """A PEP 503 index in ``folder`` holding the torch wheel of pip's local find-links folder, if there is one.

    Its name lists every CPython of the lock (``cp310.cp311...``): uv locks for all the Pythons the project allows,
    and this machine has the wheel of one; only that one is installed.
    """
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    folders = [p.removeprefix("file://") for v in re.findall(r"find-links='([^']*)'", listed) for p in v.split()]
    wheels = [w for f in folders for w in sorted(Path(f).glob(f"torch-{TORCH}+cpu-*-linux_x86_64.whl"))]
    wheels += [w for f in folders for w in sorted(Path(f).glob(f"torch-{TORCH}+cpu-*-manylinux*_x86_64.whl"))]
    if not wheels:
        return None
    wheel = wheels[0]
    platform = wheel.name.rsplit("-", 1)[1]
    tags = ".".join(f"cp3{minor}" for minor in range(10, 15))
    name = f"torch-{TORCH}+cpu-{tags}-{tags}-{platform}"
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / name).symlink_to(wheel)
    (folder / "torch" / "index.html").write_text(f'<a href="{name}">{name}</a>\n')
    return folder.as_uri()


def _readme_uv_commands() -> list[str]:
    """The Quickstart's uv lines (a command and its comment), in order."""
    quickstart = (REPO / "README.md").read_text().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in quickstart.splitlines() if line.startswith("uv sync")]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_uv_sync_and_run_the_readme_commands_in_a_fresh_copy(tmp_path: Path) -> None:
    """`uv sync && uv run python -m template fit ...` trains the example with torch 2.13.0 in the project's `.venv`,
    locked in a new `uv.lock`; `uv sync --extra dev && uv run python -m pytest -n auto` runs the suite there (two of
    its files, chosen by ``PYTEST_ADDOPTS``)."""
    train, test = _readme_uv_commands()
    assert train.startswith("uv sync && uv run python -m") and f" -m {PACKAGE} fit " in train, train
    assert test.startswith("uv sync --extra dev && uv run python -m pytest"), test
    tools = tmp_path / "tools"
    subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True, timeout=300, capture_output=True)
    subprocess.run([tools / "bin" / "python", "-m", "pip", "install", "--quiet", "uv"], check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "PL_", "UV_"))}
    env.update(
        PATH=os.pathsep.join([str(tools / "bin"), env["PATH"]]),
        UV_CACHE_DIR=str(tmp_path / "cache"),
        UV_SYSTEM_CERTS="1",
        UV_PYTHON_DOWNLOADS="never",
        UV_PYTHON=f"{sys.version_info[0]}.{sys.version_info[1]}",
    )
    if index := _local_torch_index(tmp_path / "index"):
        env["UV_INDEX"] = f"pytorch={index}"
    project = _copy_of_project(tmp_path / "project")

    done = _shell(train, project, env, 1200)
    output = done.stdout + done.stderr
    assert "Best checkpoint: " in output and "Traceback" not in output, output[-3000:]
    assert (project / "lightning_logs/version_0/checkpoints/last.ckpt").is_file(), output[-3000:]
    version = _shell(".venv/bin/python -c 'import torch; print(torch.__version__)'", project, env, 120).stdout.strip()
    assert version.split("+")[0] == TORCH and (project / "uv.lock").is_file(), version

    env["PYTEST_ADDOPTS"] = SELECTED  # paths here are the run's files: the command stays the README's
    summary = _shell(test, project, env, 1200).stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
