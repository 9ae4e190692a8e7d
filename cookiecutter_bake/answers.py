"""Check the answers before anything is written: each mistake is one line naming the value and the fix."""

from __future__ import annotations

import keyword
import re
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from cookiecutter.exceptions import FailedHookException

from cookiecutter_bake.files import live_files, templated_files

LICENSES = ("MIT", "Apache-2.0", "BSD-3-Clause", "none")
_PACKAGE = re.compile(r"[a-z][a-z0-9_]*")
# Longer names push lines that name their modules (imports, class paths in strings) past the lint's line length.
MAX_PACKAGE_LENGTH = 30
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
# Import names that a Lightning project pulls in under other distribution names, known even when the
# environment running cookiecutter has none of them installed.
_COMMON_IMPORTS = {
    "numpy", "yaml", "typing_extensions", "packaging", "fsspec", "lightning_fabric", "lightning_utilities",
    "pytorch_lightning", "torchvision", "torchaudio", "tqdm", "setuptools", "pkg_resources", "pip", "google",
    "grpc", "absl", "aiohttp", "sympy", "networkx", "jinja2", "filelock", "triton",
}  # fmt: skip


class AnswerError(FailedHookException):
    """An answer that cannot make a working project; cookiecutter's command line prints it as one line."""


def check_answers(answers: Mapping[str, object], root: Path) -> None:
    """Raise ``AnswerError`` for the first answer that would not bake into a working project."""
    for key in ("project_name", "project_slug", "package_name", "description", "author_name", "author_email"):
        value = answers.get(key)
        if not isinstance(value, str) or not value.isprintable() or (key != "author_email" and not value.strip()):
            raise AnswerError(f"{key} {value!r} must be one line of printable text; give {key} a plain value")
    _check_slug(str(answers["project_slug"]))
    _check_package(str(answers["package_name"]), root)
    email = str(answers["author_email"])
    if email and not _EMAIL.fullmatch(email):
        raise AnswerError(f"author_email {email!r} is not an e-mail address; give name@domain or leave it empty")
    if answers.get("license") not in LICENSES:
        raise AnswerError(f"license {answers.get('license')!r} is not offered; choose one of {', '.join(LICENSES)}")
    _check_python(str(answers.get("python_version")), root)


def _check_slug(slug: str) -> None:
    if Path(slug).is_absolute() or "/" in slug or "\\" in slug or ".." in slug:
        raise AnswerError(
            f"project_slug {slug!r} must be a folder name, not a path; give a name such as 'my-project' "
            "and choose where it goes with -o/--output-dir"
        )
    if not _SLUG.fullmatch(slug) or len(slug) > 100:
        raise AnswerError(
            f"project_slug {slug!r} is not a safe folder name; use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )


def _check_package(name: str, root: Path) -> None:
    fix = "choose another package_name"
    if not _PACKAGE.fullmatch(name):
        raise AnswerError(
            f"package_name {name!r} is not a valid lowercase Python identifier; use lowercase letters, digits "
            "and '_', starting with a letter (e.g. 'my_project')"
        )
    if len(name) > MAX_PACKAGE_LENGTH:
        raise AnswerError(
            f"package_name {name!r} is longer than {MAX_PACKAGE_LENGTH} characters, too long for lines that name its "
            "modules to fit the lint's line length; choose a shorter package_name"
        )
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise AnswerError(f"package_name {name!r} is a Python keyword; {fix}")
    if name in sys.stdlib_module_names:
        raise AnswerError(f"package_name {name!r} would shadow the standard-library module {name!r}; {fix}")
    if name in dependency_imports(root):
        raise AnswerError(f"package_name {name!r} would shadow the dependency {name!r}; {fix}")
    if name in top_level_names(root):
        raise AnswerError(f"package_name {name!r} is already a top-level file or folder of the project; {fix}")


def _check_python(version: str, root: Path) -> None:
    match = re.fullmatch(r"3\.(\d+)", version)
    lowest = _lowest_python(root)
    if not match or int(match.group(1)) < lowest:
        raise AnswerError(
            f"python_version {version!r} is not a Python the project runs on; give 3.N with N >= {lowest} (e.g. 3.11)"
        )


def _lowest_python(root: Path) -> int:
    """The minor version from ``requires-python = ">=3.N"`` in the live pyproject.toml."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"(?m)^requires-python\s*=\s*[\"']>=\s*3\.(\d+)", text)
    return int(match.group(1)) if match else 8


def top_level_names(root: Path) -> set[str]:
    """Names a package folder would collide with: the project's other top-level folders and modules."""
    package = package_folder(root)
    names = {rel.parts[0] for rel in [*live_files(root), *templated_files(root)] if len(rel.parts) > 1}
    names |= {Path(rel.parts[0]).stem for rel in live_files(root) if rel.suffix == ".py" and len(rel.parts) == 1}
    return {name for name in names if name != package}


def package_folder(root: Path) -> str:
    """The live package: the one ``[tool.setuptools.packages.find] include`` names, checked to exist."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"(?ms)^\[tool\.setuptools\.packages\.find\].*?^include\s*=\s*\[\s*[\"']([\w]+)", text)
    if not match or not (root / match.group(1) / "__init__.py").is_file():
        raise AnswerError(f"cannot find the live package in {root}/pyproject.toml ([tool.setuptools.packages.find])")
    return match.group(1)


def dependency_imports(root: Path) -> set[str]:
    """Import names of the project's dependencies, and of theirs where they are installed here."""
    project = _project_table(root)
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    wanted = {_normalise(m.group(1)) for m in map(_REQUIREMENT.match, requirements) if m}
    seen: set[str] = set()
    while wanted:
        dist = wanted.pop()
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            match = _REQUIREMENT.match(requirement)
            if match and "extra ==" not in requirement and _normalise(match.group(1)) not in seen:
                wanted.add(_normalise(match.group(1)))
    # Distribution names mostly are import names; the usual exceptions are in _COMMON_IMPORTS.
    return {name.replace("-", "_") for name in seen} | _COMMON_IMPORTS


def _project_table(root: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the direct dependencies are enough
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
        block = re.search(r"(?ms)^dependencies\s*=\s*\[(.*?)\]", text)
        return {"dependencies": re.findall(r"[\"']([^\"']+)[\"']", block.group(1)) if block else []}
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("project", {})


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
