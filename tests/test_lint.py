"""The code base stays ruff-clean and its imports follow the layers, so CI catches both without a separate step."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if not found:
        pytest.fail("ruff is not installed: install the dev extra (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    command = [_ruff(), *command, "--no-cache", "."]  # no .ruff_cache: a test run leaves the project as it was
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_imports_follow_the_layers():
    """The engine's packages import only those below them, the user's files only its public names (pyproject.toml)."""
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if not found:
        pytest.fail("import-linter is not installed: install the dev extra (pip install -e '.[dev]')")
    result = subprocess.run([found, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


MOST_COMPLEX = 15  # radon's cyclomatic complexity: the decisions a reader holds in mind to follow one function


def test_every_engine_function_reads_in_one_pass():
    """No function of ``template/engine`` above cyclomatic complexity 15 (``radon cc -n C -s template/engine``): one
    that needs more names its situations (an enum, a role, a table) instead of inferring them from flags."""
    try:
        from radon.complexity import cc_visit
    except ImportError:
        pytest.fail("radon is not installed: install the dev extra (pip install -e '.[dev]')")
    found = []
    for path in sorted((REPO / "template" / "engine").rglob("*.py")):
        for block in cc_visit(path.read_text()):  # functions and methods, and classes (their methods' sum)
            if not hasattr(block, "methods") and block.complexity > MOST_COMPLEX:
                found.append(f"{path.relative_to(REPO)}:{block.lineno} {block.fullname} {block.complexity}")
    assert not found, f"above {MOST_COMPLEX}:\n" + "\n".join(found)
