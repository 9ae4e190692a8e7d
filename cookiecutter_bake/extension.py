"""Jinja extension named in cookiecutter.json: it runs inside cookiecutter and cruft, beside the template."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from jinja2 import Environment
from jinja2.ext import Extension

from cookiecutter_bake.answers import AnswerError, check_answers
from cookiecutter_bake.bake import readme_body

_MODULE_ROOT = Path(__file__).resolve().parents[1]


def template_root() -> str:
    """The template being baked, as an absolute path.

    Cookiecutter renders hooks with the template folder as working directory and files from inside the
    ``{{cookiecutter.project_slug}}`` folder; both are true for ``cruft``, which sets no ``_repo_dir``.
    """
    cwd = Path(os.getcwd())
    for candidate in (cwd, cwd.parent):
        if (candidate / "cookiecutter.json").is_file() and (candidate / "cookiecutter_bake").is_dir():
            return str(candidate)
    return str(_MODULE_ROOT)


def _check(answers: Mapping[str, object]) -> str:
    # Runs while cookiecutter collects the answers: a bad one stops it before anything is written.
    try:
        check_answers(answers, _MODULE_ROOT)
    except AnswerError as err:
        # cookiecutter's command line prints this exception as one line; cruft's prints a whole traceback.
        if "cruft._cli" in sys.modules:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        raise
    return "yes"


def _under_cruft() -> bool:
    # cruft bakes here too, for `cruft update` and `cruft diff` into folders it compares as plain trees: a .git in
    # them would enter the comparison. Its own `create` leaves the repository to the user, as cruft's docs say.
    return "cruft" in sys.modules


def _readme_body(answers: Mapping[str, object]) -> str:
    return readme_body(Path(template_root()), answers)


class BakeExtension(Extension):
    """Adds ``template_root()``, ``check_answers(cookiecutter)``, ``readme_body(cookiecutter)`` and ``under_cruft()``
    to Jinja."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.globals.update(
            template_root=template_root, check_answers=_check, readme_body=_readme_body, under_cruft=_under_cruft
        )
