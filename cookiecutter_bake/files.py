"""Which live files a bake copies: what git tracks or would track, minus cookiecutter-only files and run clutter."""

from __future__ import annotations

import fnmatch
import os
import subprocess
from pathlib import Path, PurePosixPath

# The folder cookiecutter renders: only the files that need Jinja (README, LICENSE, CI, pre-commit).
TEMPLATED_DIR = "{{cookiecutter.project_slug}}"
# Build, run and tool output; never part of a project even if someone committed it.
CLUTTER_DIRS = {
    ".git", ".venv", "venv", "__pycache__", "lightning_logs", "build", "dist", ".pytest_cache", ".ruff_cache",
    ".mypy_cache", ".ipynb_checkpoints", ".tox", ".nox", ".eggs",
}  # fmt: skip
CLUTTER_TOP = {"data", "runs"}  # data caches and run output at the project root
CLUTTER_SUFFIXES = (".egg-info", ".pyc", ".pyo", ".ckpt")
# Cookiecutter-only files at the root (besides anything named cookiecutter*).
BAKE_ONLY_TOP = {"hooks", TEMPLATED_DIR, ".cruft.json"}
# Measured on and for this repository: a baked project measures its own.
REPO_RESULTS = PurePosixPath("docs/results")


def is_bake_only(rel: PurePosixPath) -> bool:
    """cookiecutter.json, hooks/, this package, the templated folder, the cookiecutter tests, this repo's results."""
    top = rel.parts[0]
    if rel.is_relative_to(REPO_RESULTS):
        return True
    if top in BAKE_ONLY_TOP or top.startswith("cookiecutter") or "{{" in top:
        return True
    return any(part.startswith(("cookiecutter", "test_cookiecutter")) for part in rel.parts[1:])


def is_clutter(rel: PurePosixPath) -> bool:
    """Caches, virtual environments, logs, checkpoints and build output."""
    if rel.parts[0] in CLUTTER_TOP and len(rel.parts) > 1:
        return True
    return any(part in CLUTTER_DIRS or part.endswith(CLUTTER_SUFFIXES) for part in rel.parts)


def live_files(root: Path) -> list[PurePosixPath]:
    """The files a bake copies from ``root``, sorted, as paths relative to it."""
    listed = _git_files(root)
    candidates = listed if listed is not None else _walk(root)
    keep = []
    for rel in candidates:
        path = root / rel
        # A tracked file deleted in the working tree is not part of the project any more.
        if not (path.is_file() or path.is_symlink()) or is_bake_only(rel) or is_clutter(rel):
            continue
        keep.append(rel)
    return sorted(set(keep))


def templated_files(root: Path) -> list[PurePosixPath]:
    """The files cookiecutter renders from the templated folder, as paths inside the new project."""
    base = root / TEMPLATED_DIR
    return sorted(PurePosixPath(p.relative_to(base).as_posix()) for p in base.rglob("*") if p.is_file())


def _git_files(root: Path) -> list[PurePosixPath] | None:
    """Tracked plus untracked-but-not-ignored files, or None when ``root`` is not the top of a git work tree."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [PurePosixPath(name) for name in out.decode("utf-8", "surrogateescape").split("\0") if name]


def _walk(root: Path) -> list[PurePosixPath]:
    """Every file under ``root`` (a zip or a plain copy without .git), minus what its .gitignore names."""
    ignored = _gitignore_patterns(root)
    found = []
    for folder, dirs, files in os.walk(root):
        rel_folder = PurePosixPath(Path(folder).relative_to(root).as_posix())
        dirs[:] = [d for d in dirs if not _ignored(rel_folder / d, True, ignored) and d not in CLUTTER_DIRS]
        found += [rel_folder / f for f in files if not _ignored(rel_folder / f, False, ignored)]
    return found


def _gitignore_patterns(root: Path) -> list[str]:
    path = root / ".gitignore"
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines())
    # Negations are rare in a project's .gitignore; skipping them only copies less, never more.
    return [line for line in lines if line and not line.startswith(("#", "!"))]


def _ignored(rel: PurePosixPath, is_dir: bool, patterns: list[str]) -> bool:
    """The common subset of .gitignore: `name`, `*.ext`, `dir/`, `/anchored`."""
    for pattern in patterns:
        if pattern.endswith("/"):
            if not is_dir:
                continue
            pattern = pattern.rstrip("/")
        if pattern.startswith("/") or "/" in pattern:
            if fnmatch.fnmatchcase(rel.as_posix(), pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(rel.name, pattern):
            return True
    return False
