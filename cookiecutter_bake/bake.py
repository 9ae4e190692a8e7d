"""Copy the live project into a new project folder under the user's names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from cookiecutter_bake.answers import AnswerError, package_folder
from cookiecutter_bake.files import live_files, templated_files
from cookiecutter_bake.rename import Renamer
from cookiecutter_bake.wrap import rewrap

# Needed to bake, not to use a baked project: dropped from its pyproject.toml.
BAKE_ONLY_DEPENDENCIES = ("cookiecutter", "cruft", "pytest-cookies")
_TEXT_SUFFIXES_WITH_RULES = (".py", ".pyi", ".toml", ".cfg")
_SHELL_SUFFIXES = (".sh", ".bash", ".zsh", ".sbatch", ".slurm", ".pbs", ".lsf")


def renamer(root: Path, answers: Mapping[str, object]) -> Renamer:
    """The rename from the live package to ``answers['package_name']``."""
    old = package_folder(root)
    children = [entry.name for entry in (root / old).iterdir() if entry.name != "__pycache__"]
    return Renamer(old, str(answers["package_name"]), children, slug=str(answers["project_slug"]))


def plan(root: Path, answers: Mapping[str, object]) -> dict[PurePosixPath, PurePosixPath]:
    """Live file -> its path in the new project; a file cookiecutter renders from the template wins."""
    rename = renamer(root, answers)
    rendered = set(templated_files(root))
    targets = {rel: rename.path(rel) for rel in live_files(root)}
    return {src: dst for src, dst in targets.items() if dst not in rendered}


def conflicts(root: Path, answers: Mapping[str, object], project_dir: Path) -> list[PurePosixPath]:
    """Files the bake would write that already exist in ``project_dir`` (it exists with ``-f``)."""
    planned = [*templated_files(root), *plan(root, answers).values()]
    return [rel for rel in planned if os.path.lexists(project_dir / rel)]


def refuse_overwrites(root: Path, answers: Mapping[str, object], project_dir: Path) -> None:
    """Raise ``AnswerError`` if the bake would replace a file that is already there."""
    found = conflicts(root, answers, project_dir)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise AnswerError(
            f"{project_dir} already holds {', '.join(map(str, found[:3]))}{more}, which this bake would overwrite; "
            "move them away or bake into a new folder (even with -f/-s this template never overwrites files)"
        )


def copy_live_files(root: Path, project_dir: Path, answers: Mapping[str, object]) -> None:
    """Copy every live file into ``project_dir``, renamed; binary files byte for byte, modes kept."""
    rename = renamer(root, answers)
    limit = line_length(root)
    for src_rel, dst_rel in plan(root, answers).items():
        src, dst = root / src_rel, project_dir / dst_rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
            continue
        data = src.read_bytes()
        text = _as_text(data)
        if text is not None:
            suffix = _kind(src_rel, text)
            renamed = rename.text(text, suffix)
            text = rewrap(text, renamed, limit) if suffix == ".py" else renamed
            if src_rel == PurePosixPath("pyproject.toml"):
                text = rewrite_pyproject(text, answers)
            data = text.encode("utf-8")
        with open(dst, "xb") as f:  # never replaces a file: refuse_overwrites ran in pre_gen
            f.write(data)
        shutil.copymode(src, dst)


def _kind(rel: PurePosixPath, text: str) -> str:
    """The suffix whose extra rename rules apply: ".py", ".toml", ".cfg", ".sh" (also for a shebang), or none."""
    if rel.suffix in _SHELL_SUFFIXES or re.match(r"#![^\n]*\b(?:ba|z|da)?sh\b", text):
        return ".sh"
    return rel.suffix if rel.suffix in _TEXT_SUFFIXES_WITH_RULES else ""


def line_length(root: Path) -> int:
    """The project's lint line length (``[tool.ruff] line-length``), ruff's default when unset."""
    match = re.search(r"(?m)^line-length\s*=\s*(\d+)", (root / "pyproject.toml").read_text(encoding="utf-8"))
    return int(match.group(1)) if match else 88


def _as_text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def rewrite_pyproject(text: str, answers: Mapping[str, object]) -> str:
    """The new project's own name, description, author and licence; no cookiecutter-only dependencies."""
    start = re.search(r"(?m)^\[project\][ \t]*$", text)
    if not start:
        raise AnswerError("the live pyproject.toml has no [project] table; cannot name the new project")
    end = re.search(r"(?m)^\[", text[start.end() :])
    stop = start.end() + end.start() if end else len(text)
    head, table, tail = text[: start.end()], text[start.end() : stop], text[stop:]

    def toml(value: object) -> str:
        return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a valid TOML basic string

    table = re.sub(r"(?m)^authors[ \t]*=[ \t]*\[(?:[^\]\n]*\]|.*?\n\])[ \t]*\n", "", table, flags=re.S)
    table = re.sub(r"(?m)^license(?:-files)?[ \t]*=.*\n", "", table)
    table = re.sub(r"(?m)^[ \t]*[\"']License :: [^\n]*\n", "", table)  # classifiers would contradict the choice
    table = re.sub(r"(?m)^name[ \t]*=.*$", f"name = {toml(answers['project_slug'])}", table, count=1)
    author = f"name = {toml(answers['author_name'])}"
    if answers.get("author_email"):
        author += f", email = {toml(answers['author_email'])}"
    extra = f"authors = [{{ {author} }}]\n"
    if answers["license"] != "none":
        extra += f"license = {toml(answers['license'])}\n"
    description = f"description = {toml(answers['description'])}\n"
    table, found = re.subn(r"(?m)^description[ \t]*=.*\n", lambda _: description + extra, table, count=1)
    if not found:
        table = re.sub(r"(?m)^(name[ \t]*=.*\n)", lambda m: m.group(1) + description + extra, table, count=1)
    text = head + table + tail
    dropped = "|".join(map(re.escape, BAKE_ONLY_DEPENDENCIES))
    return re.sub(rf"(?m)^[ \t]*[\"'](?:{dropped})(?![\w-])[^\"'\n]*[\"'][ \t]*,?[ \t]*\n", "", text)


# A new project's README opens with what its owner does first: install and train, then where their code goes.
FIRST_HEADINGS = ("## Quickstart", "## Where to put your model and data")


def readme_body(root: Path, answers: Mapping[str, object]) -> str:
    """The live README after its introduction, renamed, user's section first, no cookiecutter or licence sections."""
    text = (root / "README.md").read_text(encoding="utf-8")
    sections: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            sections.append([])
        sections[-1].append(line)
    kept = [
        "".join(section)
        for section in sections[1:]
        if not re.search(r"cookiecutter|^## licen[cs]e", section[0], flags=re.I)
    ]
    kept.sort(key=_reading_order)
    return renamer(root, answers).text("".join(kept), ".md").strip() + "\n"


def _reading_order(section: str) -> int:
    heading = section.split("\n", 1)[0].strip()
    return FIRST_HEADINGS.index(heading) if heading in FIRST_HEADINGS else len(FIRST_HEADINGS)


def finish(root: Path, project_dir: Path, answers: Mapping[str, object], commit: bool = True) -> None:
    """Drop what renders empty on purpose (LICENSE for 'none'); format the renamed code with the pinned ruff; with
    ``commit``, make the project a git repository with a first commit."""
    for rel in ("LICENSE",):
        path = project_dir / rel
        if path.is_file() and not path.read_text(encoding="utf-8").strip():
            path.unlink()
    _ruff(root, project_dir)
    if commit:
        _first_commit(project_dir, answers)


def ruff_version(root: Path) -> str | None:
    """The ruff that the dev extra pins (``"ruff==X"`` in pyproject.toml): the one whose format the lint test checks."""
    match = re.search(r"[\"']ruff==([\w.]+)[\"']", (root / "pyproject.toml").read_text(encoding="utf-8"))
    return match.group(1) if match else None


def _ruff(root: Path, project_dir: Path) -> None:
    """A name of another length moves line breaks and import order; the pinned ruff puts them where the lint wants.

    Where cookiecutter runs without that ruff (installed alone), pip fetches it into a temporary folder, installing
    nothing. Formatting comes first and last: a fix (a re-sorted import) can move what the formatter decides.
    """
    version = ruff_version(root)
    requirement = f"ruff=={version}" if version else "ruff"
    fix = f"`pip install {requirement} && ruff format . && ruff check --fix . && ruff format .`"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ruff = _installed_ruff(version) or _fetched_ruff(requirement, Path(tmp))
        except (OSError, subprocess.SubprocessError) as err:
            print(f"note: cannot get {requirement} to format the renamed code ({err}); run {fix} in {project_dir}",
                  file=sys.stderr)  # fmt: skip
            return
        quiet = ["--no-cache", "--quiet", "."]
        _run([ruff, "format", *quiet], project_dir)
        left = _run([ruff, "check", "--fix", "--output-format", "concise", *quiet], project_dir)  # what it cannot fix
        _run([ruff, "format", *quiet], project_dir)
    if left:  # nothing for the names that the answers accept; a fork's own longer lines, perhaps
        first = left.splitlines()[0]
        print(f"note: {len(left.splitlines())} lint error(s) left (first: {first}); fix them by hand", file=sys.stderr)


def _installed_ruff(version: str | None) -> str | None:
    """The ruff beside this Python or on PATH, if it is the pinned version."""
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found and (version is None or _run([found, "--version"], Path.cwd()).split()[-1:] == [version]):
        return found
    return None


def _fetched_ruff(requirement: str, folder: Path) -> str:
    """``requirement`` installed by pip into ``folder``, nothing else; OSError says why it could not be."""
    print(f"note: {requirement} is not installed here; pip fetches it into a temporary folder", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input"]
    done = subprocess.run([*command, "--target", str(folder), requirement], capture_output=True, text=True, timeout=600)
    ruff = folder / "bin" / "ruff"
    if done.returncode != 0 or not ruff.is_file():
        raise OSError((done.stderr.strip().splitlines() or [f"pip exited with {done.returncode}"])[-1])
    return str(ruff)


def _first_commit(project_dir: Path, answers: Mapping[str, object]) -> None:
    """The project starts as a git repository with one commit, so that its first run's provenance.json names a commit.

    Git's own identity signs it; where git has none, the author's answers do. Without git, one line says so.
    """
    if shutil.which("git") is None:
        print("note: git is not installed: the project is no git repository, and its runs record no commit until it is",
              file=sys.stderr)  # fmt: skip
        return

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=project_dir, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)  # fmt: skip

    if git("rev-parse", "--show-toplevel").returncode == 0:  # inside the user's own repository: theirs to commit
        print(f"note: {project_dir} lies in a git repository already: nothing committed", file=sys.stderr)
        return
    identity = []
    for key, answer in (("user.name", "author_name"), ("user.email", "author_email")):
        if git("config", key).returncode != 0:  # not configured: the answer signs (GIT_AUTHOR_* variables still win)
            identity += ["-c", f"{key}={answers[answer]}"]
    message = f"{answers['project_name']}: first commit"
    for step in (["init", "-q"], ["add", "-A"], [*identity, "commit", "-q", "-m", message]):
        done = git(*step)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            print(f"note: the project's first commit failed ({reason}); commit it yourself", file=sys.stderr)
            return


def _run(command: list[str], cwd: Path) -> str:
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
