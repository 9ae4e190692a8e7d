"""The ``--config`` files of a command line: found among its arguments, read, and refused in one line when they hold
no options. ``fit`` (and the other Trainer commands) and ``sweep`` read them here, so both refuse a file alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from template.engine.errors import ConfigError, one_line

OPTIONS = ("--config", "-c")


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The values given to ``--config`` (``--config x``, ``-c x``, ``--config=x``), in order, and the other
    arguments."""
    configs, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in OPTIONS and i + 1 < len(argv):
            configs.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return configs, rest


def read(value: str) -> dict[str, Any]:
    """The options a ``--config`` value holds: a file's, or YAML text (a sweep hands each trial's config to the fit
    parser as text; jsonargparse reads either). A ConfigError names the file that is missing, is not valid YAML, is
    empty or holds no mapping of options."""
    path = Path(value)
    if not path.is_file():
        # jsonargparse takes a value that is no file as YAML text; a path that is not there reads as a plain string.
        try:
            content = yaml.safe_load(value)
        except yaml.YAMLError:
            content = None
        if isinstance(content, dict):
            return content
        raise ConfigError(f"config file {value} does not exist; check the path given to --config")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or one_line(str(err))
        raise ConfigError(f"config file '{value}' is not valid YAML: {problem}{where}; fix the syntax there") from None
    if content is None:
        # jsonargparse refuses it with "Unexpected config:", naming no file.
        raise ConfigError(
            f"config file '{value}' is empty (or only comments); write its options in it as `key: value` lines "
            "(e.g. `trainer:` then `  max_epochs: 10`), or leave it out of the command"
        )
    if not isinstance(content, dict):
        raise ConfigError(
            f"config file '{value}' holds a {_kind(content)}, not options; write `key: value` lines such as "
            "`trainer:` followed by its options"
        )
    return content


def check_sections(files: dict[str, dict[str, Any]], sections: Any, config: Any) -> None:
    """A ConfigError for a config file whose section (``trainer:``, ``checkpoint:``...) is not a mapping.

    jsonargparse takes ``trainer:`` written as a list as "no trainer options" and silently resets every setting an
    earlier file made; a section is a mapping of options, or a class path where the option takes a class.
    ``sections``: the parser's groups; ``config``: the parsed configuration.
    """
    for path, content in files.items():
        for key, value in content.items():
            if key not in sections or value is None or isinstance(value, dict):
                continue
            if isinstance(value, str) and config.get(f"{key}.class_path") is not None:
                continue  # `model: my_project.MyModel` names the class
            raise ConfigError(
                f"config file '{path}': `{key}:` holds a {_kind(value)} but is a section of options; write its "
                f"options indented below it (`{key}:` then `  name: value` lines), not as a list"
            )


def _kind(value: Any) -> str:
    return "list" if isinstance(value, list) else f"single value ({value!r})"
