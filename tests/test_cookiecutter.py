"""`cookiecutter <this repo>`: the baked project is renamed throughout, runs, and passes its own tests."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cookiecutter.exceptions import FailedHookException, OutputDirExistsException
from cookiecutter.main import cookiecutter

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

import template
from tests.conftest import REPO, cli_env

OLD = template.__name__
sys.path.insert(0, str(REPO))  # the cookiecutter-only package, for the rename unit test
from cookiecutter_bake.answers import MAX_PACKAGE_LENGTH  # noqa: E402
from cookiecutter_bake.bake import ruff_version  # noqa: E402
from cookiecutter_bake.rename import Renamer  # noqa: E402
from cookiecutter_bake.wrap import rewrap  # noqa: E402

# What a module reference to the old package looks like; prose such as "a template." is not one.
LEFTOVER = re.compile(
    rf"(?<![\w.-]){OLD}\.[A-Za-z_]|(?:-m|import|from)[ \t]+{OLD}\b|[\"']{OLD}\*?[\"']|(?<![\w.-]){OLD}/"
    rf"|`{OLD}`|--cov[= ]{OLD}\b|\"-m\",\s*\"{OLD}\"|={OLD}(?![\w.-])"
)
BAKE_ONLY = ["cookiecutter.json", "hooks", "cookiecutter_bake", "{{cookiecutter.project_slug}}"]
CUSTOM = {
    "project_name": "Digit Lab",
    "package_name": "digit_lab",
    "description": 'Digits, """quoted""" and \'\'\' then ); import os # \\',
    "author_name": "Ann O'Neil",
    "author_email": "ann@example.org",
    "license": "none",
    "python_version": "3.12",
}
# The longest package name the answers accept: its bake passes its own lint as well.
LONG = ("time_series_forecaster_" * 2)[:MAX_PACKAGE_LENGTH]
TIMEOUT = 120


def _config(tmp: Path) -> Path:
    """A cookiecutter user config that keeps clones and replay files inside the test's folder."""
    path = tmp / "cookiecutterrc.yaml"
    if not path.exists():
        tmp.mkdir(parents=True, exist_ok=True)
        path.write_text(f"cookiecutters_dir: {tmp / 'clones'}\nreplay_dir: {tmp / 'replay'}\n")
    return path


def bake(out: Path, template_path: str | Path = REPO, **answers: str) -> Path:
    """Bake in this process through cookiecutter's API (the hooks still run as subprocesses)."""
    return Path(
        cookiecutter(
            str(template_path), no_input=True, extra_context=answers, output_dir=str(out), config_file=str(_config(out))
        )
    )


def run(args: list[str], cwd: Path, timeout: float = TIMEOUT, **env: str) -> subprocess.CompletedProcess:
    git_identity = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    return subprocess.run(
        args,
        cwd=cwd,
        env=cli_env(**git_identity, GIT_COMMITTER_EMAIL="t@t", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def text_files(project: Path) -> dict[Path, str]:
    found = {}
    for path in project.rglob("*"):
        # .cruft.json is cruft's own record, where "template" is a key naming the template's URL.
        if path.is_file() and ".git" not in path.relative_to(project).parts and path.name != ".cruft.json":
            try:
                found[path] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
    return found


def leftovers(project: Path) -> list[str]:
    return [
        f"{path.relative_to(project)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path, text in text_files(project).items()
        for m in LEFTOVER.finditer(text)
    ]


# A Markdown link or image: [text](target) or ![alt](target); the target up to a space or the closing parenthesis.
MARKDOWN_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)[^)]*\)")


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks, where brackets are code, not links."""
    return re.sub(r"(?ms)^ *(```|~~~).*?^ *\1[^\n]*$", "", text)


def broken_links(project: Path) -> list[str]:
    """Relative links in the README and docs/ whose file, or heading anchor, does not exist in ``project``."""
    pages = [project / "README.md", *sorted((project / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in MARKDOWN_LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(project)}: {target}"
            if not linked.exists():
                broken.append(where)
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"(?m)^#{1,6} +(.+?) *$", _prose(linked.read_text(encoding="utf-8")))
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{where} (no such heading)")
    return broken


@pytest.fixture(scope="module")
def default_bake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def custom_bake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bake(tmp_path_factory.mktemp("custom"), **CUSTOM)


def test_renamer_changes_module_references_and_leaves_prose() -> None:
    rename = Renamer(OLD, "lab", ["cli.py", "nets.py", "assets"], slug="my-lab")
    before = (
        f"from {OLD}.cli import main\nimport {OLD}\n>>> import {OLD}.nets\nclass_path: {OLD}.nets.MLP\n"
        f'python -m {OLD} fit\n["-m", "{OLD}"]\nsee {OLD}/cli.py and {OLD}/assets/x\nthe `{OLD}` package\n'
        f'{OLD}.__version__\n{OLD} fit --config x.yaml\nresources.files("{OLD}")\n'
        f"A {OLD}. The {OLD} fit for purpose; {OLD}.format(x); my_{OLD}.cli; my-{OLD}/cli.py\n"
    )
    after = rename.text(before, ".py")
    assert after.splitlines()[:-1] == [
        "from lab.cli import main",
        "import lab",
        ">>> import lab.nets",
        "class_path: lab.nets.MLP",
        "python -m lab fit",
        '["-m", "lab"]',
        "see lab/cli.py and lab/assets/x",
        "the `lab` package",
        "lab.__version__",
        "lab fit --config x.yaml",
        'resources.files("lab")',
    ]
    assert after.splitlines()[-1] == before.splitlines()[-1]  # prose and other names untouched
    assert rename.text(after, ".py") == after  # renaming twice changes nothing
    shell = rename.text(f'PACKAGE={OLD}\n#SBATCH --job-name={OLD}\npython -m "{OLD}"\n', ".sh")
    assert shell == 'PACKAGE=lab\n#SBATCH --job-name=lab\npython -m "lab"\n'
    toml = rename.text(f'[project]\nname = "{OLD}"\n[project.scripts]\n{OLD} = "{OLD}.cli:main"\n', ".toml")
    assert tomllib.loads(toml) == {"project": {"name": "my-lab", "scripts": {"lab": "lab.cli:main"}}}


def test_longer_name_rewraps_prose_past_the_line_length() -> None:
    docstring = f'    """Run ``python -m {OLD} fit --config configs/x.yaml``'.ljust(115, "w") + '"""'
    comment = f"    # see ``python -m {OLD} fit``".ljust(118, "w")
    code = f"    x = '{OLD}'  # the author's own long line".ljust(130, "!")
    before = "\n".join(["def f():", docstring, comment, code]) + "\n"
    after = before.replace(OLD, "a_much_longer_package_name")
    wrapped = rewrap(before, after, 120)
    compile(wrapped, "wrapped.py", "exec")
    lines = wrapped.splitlines()
    assert len(lines) == 6 and all(len(line) <= 120 for line in lines[:-1])
    assert lines[3].startswith("    # ") and lines[4].startswith("    # ")
    assert lines[-1] == after.splitlines()[-1]  # code is left to ruff format


def test_default_bake_is_a_renamed_copy_of_the_live_project(default_bake: Path) -> None:
    project = default_bake
    package = "lightning_project"
    assert project.name == "lightning-project"
    assert (project / package / "__init__.py").is_file() and not (project / OLD).exists()
    assert leftovers(project) == []
    for name in BAKE_ONLY:
        assert not (project / name).exists(), name
    assert not list(project.rglob("*cookiecutter*.py")) and not list(project.rglob("__pycache__"))
    assert not list(project.rglob("*.egg-info"))
    # Every live package file is there, binary files byte for byte, executable bits kept.
    live = {p.relative_to(REPO / OLD) for p in (REPO / OLD).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert live <= {p.relative_to(project / package) for p in (project / package).rglob("*") if p.is_file()}
    digits = Path("assets", "digits.csv.gz")
    assert (project / package / digits).read_bytes() == (REPO / OLD / digits).read_bytes()
    assert (project / ".ci" / "run").stat().st_mode & stat.S_IXUSR
    workflow = yaml.safe_load((project / ".github" / "workflows" / "tests.yml").read_text())
    assert "python -m pytest -n auto" in [step.get("run") for step in workflow["jobs"]["tests"]["steps"]]
    ruff_hooks = yaml.safe_load((project / ".pre-commit-config.yaml").read_text())["repos"][0]
    assert [hook["id"] for hook in ruff_hooks["hooks"]] == ["ruff-check", "ruff-format"]
    assert ruff_hooks["rev"] == f"v{ruff_version(REPO)}"  # the ruff the lint test and the bake format with
    # A git repository from the start, everything in its first commit: the first run's provenance.json names it.
    assert run(["git", "log", "--format=%s"], project).stdout == "Lightning Project: first commit\n"
    assert run(["git", "status", "--porcelain", "--ignored"], project).stdout == ""
    assert (project / ".gitignore").read_text() == (REPO / ".gitignore").read_text()

    meta = tomllib.loads((project / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "lightning-project"
    assert meta["project"]["authors"] == [{"name": "Your Name", "email": "you@example.com"}]
    assert meta["project"]["license"] == "MIT" and "Your Name" in (project / "LICENSE").read_text()
    assert meta["project"]["scripts"] == {package: f"{package}.engine.commands:main"}
    assert not [d for d in meta["project"]["optional-dependencies"]["dev"] if re.match(r"cookiecutter|cruft", d)]

    readme = (project / "README.md").read_text()
    assert readme.startswith("# Lightning Project\n")
    assert f"python -m {package} fit --config configs/default.yaml" in readme
    assert 'pip install "torch==2.13.0" -e ".[dev]" && python -m pytest -n auto' in readme
    assert "strategy:" in readme and "cookiecutter" not in readme.lower()
    headings = [line for line in readme.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Quickstart", "## Where to put your model and data"]
    assert "It starts as a git repository whose first commit" in readme
    # Nothing says how the project was made: it reads as written by hand.
    told = [f"{path.relative_to(project)}: {m.group(0)!r}" for path, text in text_files(project).items()
            for m in re.finditer(r"(?i)cookiecutter|cruft|\bbak(?:e|ed|ing)\b|\brenamed by\b", text)]  # fmt: skip
    assert told == []
    # The docs/ pages come along, without this repository's own results and the page on baking.
    assert (project / "docs" / "strategies.md").is_file() and not (project / "docs" / "results").exists()
    assert not list(project.rglob("*cookiecutter*"))
    assert broken_links(project) == []


def test_links_in_the_readme_and_docs_resolve() -> None:
    assert broken_links(REPO) == []


def test_custom_bake_carries_the_answers(custom_bake: Path) -> None:
    project, package = custom_bake, CUSTOM["package_name"]
    assert project.name == "digit-lab" and leftovers(project) == []
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == CUSTOM["description"]  # quotes and backslashes arrive as data
    assert meta["authors"] == [{"name": "Ann O'Neil", "email": "ann@example.org"}]
    assert "license" not in meta and not (project / "LICENSE").exists()
    assert 'python-version: "3.12"' in (project / ".github" / "workflows" / "tests.yml").read_text()
    assert f"python -m {package} fit" in (project / "README.md").read_text()
    assert f'"python", "-m", "{package}"' in (project / "Containerfile").read_text()


def readme_commands(readme: str) -> list[str]:
    """The Quickstart's "install the development tools and run the tests" line, split at ``&&``, word for word."""
    quickstart = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    (line,) = [line for line in quickstart.splitlines() if "pip install" in line and "pytest" in line]
    return [command.strip() for command in line.split("&&")]


def fresh_environment(venv: Path) -> dict[str, str]:
    """A new virtual environment (never this repository's: a dependency missing there shows here) and the variables
    that activate it, with no ruff on PATH."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS")}
    env = {k: v for k, v in env.items() if not k.startswith("PL_")}
    others = [folder for folder in env["PATH"].split(os.pathsep) if folder and not shutil.which("ruff", path=folder)]
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), *others]), PYTHONUNBUFFERED="1")
    return env


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_bake_by_cookiecutter_alone_passes_its_own_readme_commands(tmp_path: Path) -> None:
    """What README.md tells its user: `pip install cookiecutter` (no ruff, no dev extra), the bake; then, in a new
    environment, the baked README's install and test commands, its lint test among them. The longest package name
    the answers accept bakes lint-clean too."""
    baking = fresh_environment(tmp_path / "baking")
    shell("pip install cookiecutter", tmp_path, baking, 600)
    assert shutil.which("ruff", path=baking["PATH"]) is None
    assert subprocess.run(["python", "-c", "import ruff"], env=baking, capture_output=True).returncode != 0
    projects = {}
    for name in (CUSTOM["package_name"], LONG):
        out = tmp_path / name
        answers = [f"{key}={value}" for key, value in {**CUSTOM, "package_name": name}.items()]
        baked = shell(shlex.join(["cookiecutter", "--no-input", str(REPO), "-o", str(out), "--config-file",
                                  str(_config(out)), *answers]), tmp_path, baking, 900)  # fmt: skip
        assert f"ruff=={ruff_version(REPO)} is not installed here" in baked.stderr  # so the bake fetched it
        projects[name] = out / "digit-lab"

    project = projects[CUSTOM["package_name"]]
    install, test = readme_commands((project / "README.md").read_text())
    assert install.startswith("pip install") and '".[dev]"' in install and test.startswith("python -m pytest")
    env = fresh_environment(tmp_path / "venv")
    shell(install, project, env, 1200)
    summary = shell(test, project, env, 1800).stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert (tmp_path / "venv" / "bin" / CUSTOM["package_name"]).is_file()  # the console script landed there
    # The longest name's own lint test (ruff and import-linter), with the tools the README's install brought.
    shell("python -m pytest -q tests/test_lint.py", projects[LONG], {**env, "PYTHONPATH": str(projects[LONG])}, 600)


@pytest.mark.parametrize(
    ("answer", "value", "message"),
    [
        ("package_name", "os", "would shadow the standard-library module 'os'"),
        ("package_name", "class", "is a Python keyword"),
        ("package_name", "match", "is a Python keyword"),
        ("package_name", "torch", "would shadow the dependency 'torch'"),
        ("package_name", "numpy", "would shadow the dependency 'numpy'"),
        ("package_name", "configs", "already a top-level file or folder"),
        ("package_name", "My-Pkg", "is not a valid lowercase Python identifier"),
        ("package_name", "1st", "is not a valid lowercase Python identifier"),
        ("package_name", LONG + "x", f"is longer than {MAX_PACKAGE_LENGTH} characters"),
        ("project_slug", "../escape", "must be a folder name, not a path"),
        ("project_slug", "/tmp/abs", "must be a folder name, not a path"),
        ("project_slug", ".hidden", "is not a safe folder name"),
        ("author_email", "not-an-email", "is not an e-mail address"),
        ("python_version", "2.7", "is not a Python the project runs on"),
        ("description", "two\nlines", "must be one line of printable text"),
    ],
)
def test_invalid_answer_is_refused_before_anything_is_written(
    tmp_path: Path, answer: str, value: str, message: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FailedHookException, match=re.escape(f"{answer} {value!r}")) as err:
        bake(out, **{answer: value})
    assert message in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == ["cookiecutterrc.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # ../escape did not land beside it either


def test_longest_package_name_bakes_lint_clean(tmp_path: Path) -> None:
    """Its imports and class paths grow by the most: the bake's ruff and re-wrapping keep its own lint test passing."""
    project = bake(tmp_path, package_name=LONG)
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    for command in (["check"], ["format", "--check"]):  # what the baked tests/test_lint.py runs
        lint = run([ruff, *command, "--no-cache", "--output-format", "concise", "."], project)
        assert lint.returncode == 0, lint.stdout[-3000:]


def _without_git_identity(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    for name in [k for k in os.environ if k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_", "GIT_CONFIG"))]:
        monkeypatch.delenv(name)
    for name in ("HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def test_first_commit_is_signed_by_the_author_where_git_has_no_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_git_identity(monkeypatch, tmp_path)
    project = bake(tmp_path / "out", **CUSTOM)
    log = run(["git", "log", "--format=%an <%ae>: %s"], project, HOME=str(tmp_path)).stdout
    assert log == "Ann O'Neil <ann@example.org>: Digit Lab: first commit\n"


def test_without_git_the_bake_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:  # noqa: ANN001
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # this Python and ruff, no git
    project = bake(tmp_path, package_name="no_git")
    assert not (project / ".git").exists() and (project / "no_git" / "__init__.py").is_file()
    said = [line for line in capfd.readouterr().err.splitlines() if "git" in line]
    assert said == [
        "note: git is not installed: the project is no git repository, and its runs record no commit until it is"
    ]


def test_command_line_reports_a_bad_answer_in_one_line(tmp_path: Path) -> None:
    result = run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(REPO), "-o", str(tmp_path), "package_name=torch"],
        cwd=tmp_path,
        HOME=str(tmp_path),
    )
    assert result.returncode != 0
    assert result.stdout.strip().splitlines() == [
        "package_name 'torch' would shadow the dependency 'torch'; choose another package_name"
    ]
    assert "Traceback" not in result.stderr and not (tmp_path / "lightning-project").exists()


def test_existing_folder_is_never_overwritten(tmp_path: Path) -> None:
    project = bake(tmp_path)
    edited = project / "configs" / "default.yaml"
    edited.write_text("# my edits\n")
    with pytest.raises(OutputDirExistsException):
        bake(tmp_path)
    for skip in (False, True):  # -f, and -f -s
        with pytest.raises(FailedHookException):
            cookiecutter(
                str(REPO),
                no_input=True,
                output_dir=str(tmp_path),
                config_file=str(_config(tmp_path)),
                overwrite_if_exists=True,
                skip_if_file_exists=skip,
            )
        assert edited.read_text() == "# my edits\n"


@pytest.mark.slow
def test_relative_path_dot_and_replay(tmp_path: Path) -> None:
    config = _config(tmp_path)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    first = run(
        [sys.executable, "-m", "cookiecutter", "--no-input", ".", "-o", str(tmp_path / "a"), "--config-file",
         str(config), "project_name=Dot Bake"],
        cwd=REPO,
        TMPDIR=str(tmpdir),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "a" / "dot-bake" / "dot_bake" / "engine" / "commands" / "cli.py").is_file()
    assert list(tmpdir.iterdir()) == []  # the rendered hooks, answers inside, removed themselves
    relative = os.path.relpath(REPO, tmp_path)
    again = run(
        [sys.executable, "-m", "cookiecutter", "--replay", relative, "-o", "b", "--config-file", str(config)],
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "b" / "dot-bake" / "dot_bake" / "engine" / "commands" / "cli.py").is_file()
    assert leftovers(tmp_path / "b" / "dot-bake") == []


def _copy_live_tree(dest: Path) -> Path:
    """The live tree as it is now (committed or not), without .git: what a zip or a plain copy holds."""
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / "lightning_logs" / "version_0").mkdir(parents=True)  # clutter a plain copy may carry
    (dest / "lightning_logs" / "version_0" / "metrics.csv").write_text("epoch\n0\n")
    return dest


def test_plain_folder_without_git(tmp_path: Path) -> None:
    def files(project: Path) -> list[Path]:  # the project's own, not its new repository's objects
        return sorted(p.relative_to(project) for p in project.rglob("*") if p.is_file() and ".git" not in p.parts)

    project = bake(tmp_path / "out", _copy_live_tree(tmp_path / "plain"), package_name="walked")
    assert files(project) == files(bake(tmp_path / "baseline", package_name="walked"))
    assert not (project / "lightning_logs").exists() and leftovers(project) == []


@pytest.mark.slow
def test_git_url_and_cruft_create_then_update(tmp_path: Path) -> None:
    remote = _copy_live_tree(tmp_path / "remote")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        assert run(["git", *args], remote).returncode == 0
    config = _config(tmp_path)
    url = f"git+file://{remote}"
    cloned = run(
        [sys.executable, "-m", "cookiecutter", "--no-input", url, "--checkout", "main", "-o", str(tmp_path / "cc"),
         "--config-file", str(config), "package_name=from_git"],
        cwd=tmp_path,
    )  # fmt: skip
    assert cloned.returncode == 0, cloned.stderr[-2000:]
    assert (tmp_path / "cc" / "lightning-project" / "from_git" / "engine" / "commands" / "cli.py").is_file()

    created = run(
        [sys.executable, "-m", "cruft", "create", f"file://{remote}", "--no-input", "--config-file", str(config),
         "--output-dir", str(tmp_path / "cruft"), "--extra-context", json.dumps({"package_name": "via_cruft"})],
        cwd=tmp_path,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr[-2000:]
    project = tmp_path / "cruft" / "lightning-project"
    refused = run(
        [sys.executable, "-m", "cruft", "create", f"file://{remote}", "--no-input", "--config-file", str(config),
         "--output-dir", str(tmp_path / "refused"), "--extra-context", json.dumps({"package_name": "lightning"})],
        cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert refused.stderr.splitlines() == [
        "error: package_name 'lightning' would shadow the dependency 'lightning'; choose another package_name"
    ]
    assert (project / "via_cruft" / "engine" / "commands" / "cli.py").is_file() and leftovers(project) == []
    assert "python -m via_cruft fit" in (project / "README.md").read_text()
    assert json.loads((project / ".cruft.json").read_text())["context"]["cookiecutter"]["package_name"] == "via_cruft"

    # cruft compares bakes as plain trees, so under cruft the bake makes no repository: the user does, as cruft says.
    assert not (project / ".git").exists() and "git repository" not in (project / "README.md").read_text()
    # The template moves on while the user edits their project; `cruft update` merges both.
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "baked"]):
        assert run(["git", *args], project).returncode == 0
    (project / "configs" / "default.yaml").write_text((project / "configs" / "default.yaml").read_text() + "# mine\n")
    assert run(["git", "commit", "-qam", "my edit"], project).returncode == 0
    nets = remote / OLD / "nets.py"
    nets.write_text(nets.read_text() + "\n\n# template update\n")
    assert run(["git", "commit", "-qam", "update"], remote).returncode == 0
    updated = run([sys.executable, "-m", "cruft", "update", "-y"], project)
    assert updated.returncode == 0, updated.stdout[-2000:] + updated.stderr[-2000:]
    assert (project / "via_cruft" / "nets.py").read_text().endswith("# template update\n")
    assert (project / "configs" / "default.yaml").read_text().endswith("# mine\n")
