"""Whose an exception is, and so how ``main`` reports it (``verdict``): a mistake of the configuration or the disk
(one line), or the user's code (their traceback): a frame outside Python, its packages and this engine."""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import re
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException

from template.engine import errors
from template.engine.errors import ConfigError, chain, one_line

_ENGINE = str(Path(__file__).resolve().parents[1])
_INSTALLED = {
    str(Path(p).resolve()) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_path(key))
}
# What a library raises for a value out of range, of the wrong kind, or needing a package that is not installed.
REFUSALS = (ValueError, TypeError, ImportError, AssertionError, ArithmeticError, MisconfigurationException)


def verdict(
    err: BaseException, dead: Callable[[BaseException], tuple[int, str] | None] | None = None
) -> tuple[int, str] | None:
    """The exit code and the one line for ``err``; None for an exception of the user's code (or a bug), whose
    traceback is the report. 2: the parser's refusal, a ConfigError, a value a library refused while the parser built
    a class of the config, or one Lightning refused alone; 3: the disk; ``dead``: its answer for a rank that died."""
    if isinstance(err, ArgumentError):
        mistake = errors.parser_error(err)
    elif (mistake := errors.config_error_in(err)) is None and (build := built(err, by_parser=True)) is not None:
        mistake = refusal(err, build.option, build.values)
    if mistake is not None:
        return 2, str(mistake)
    if (disk := errors.disk_error_in(err)) is not None:
        return getattr(disk, "exit_code", 3), str(disk)
    if dead is not None and (found := dead(err)) is not None:
        return found
    if _user_frame(err) is None and refused_by(err, package="lightning") is not None:
        # Lightning alone refused a Trainer setting when it met the data (val_check_interval above an epoch's batches).
        return 2, errors.explain_trainer_error(one_line(root_cause(err)))
    return None


def root_cause(err: BaseException) -> BaseException:
    """The first exception of ``err``'s chain, before libraries wrapped it in their own messages."""
    *_, first = chain(err)
    return first


def _frames(err: BaseException) -> list[FrameType]:
    return [frame for frame, _ in traceback.walk_tb(err.__traceback__)]


def _users(frame: FrameType) -> bool:
    """Whether ``frame`` runs the user's code: not Python's, not an installed package's, not the engine's."""
    filename = frame.f_code.co_filename
    path = "" if filename.startswith("<") else str(Path(filename).resolve())
    return bool(path) and not path.startswith((_ENGINE, *_INSTALLED)) and "site-packages" not in path


def _user_frame(err: BaseException) -> str | None:
    """``Class.function (file:line)`` of the innermost frame of the user's code in ``err``'s root cause, or None."""
    found = [(frame.f_code, line) for frame, line in traceback.walk_tb(root_cause(err).__traceback__) if _users(frame)]
    if not found:
        return None
    code, line = found[-1]
    relative = os.path.relpath(code.co_filename)
    filename = code.co_filename if relative.startswith("..") else relative
    return f"{getattr(code, 'co_qualname', code.co_name)} ({filename}:{line})"


def refused_by(err: BaseException, package: str | None = None, building: bool = False) -> str | None:
    """The library class (or function) that refused a value, for an exception a library (``package`` if given)
    raised, else None. ``building``: raised while the config's objects were built, where any library's exception that
    no code of the user's called (a RuntimeError for a negative size too) is the values' fault."""
    cause = root_cause(err)
    frames = _frames(cause)
    if not isinstance(cause, REFUSALS) and not (building and not any(map(_users, frames))):
        return None
    # A missing package is the environment's wherever the import is; other exceptions from the user's code are theirs.
    if not frames or (_users(frames[-1]) and not isinstance(cause, ImportError)):
        return None
    if package is not None and not frames[-1].f_globals.get("__name__", "").startswith(f"{package}."):
        return None
    return _refuser(frames)


def _refuser(frames: list[FrameType]) -> str:
    """The class (else the function) of the outermost library frame below the user's and the engine's code: the
    one given the value."""
    ours = [i for i, frame in enumerate(frames) if _users(frame) or frame.f_code.co_filename.startswith(_ENGINE)]
    for frame in frames[ours[-1] + 1 if ours else 0 :]:
        if frame.f_code.co_name == "__init__" and (owner := frame.f_locals.get("self")) is not None:
            return f"{type(owner).__module__}.{type(owner).__qualname__}"
    code = frames[-1].f_code
    return f"{frames[-1].f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"


def refusal(err: BaseException, key: str, values: dict[str, Any]) -> ConfigError | None:
    """A one-line ConfigError for a value a library refused while ``key`` was built from the options ``values``
    (dotted name -> value); None when ``err`` is not a library's refusal."""
    library = refused_by(err, building=True)
    if library is None:
        return None
    cause = root_cause(err)
    reason = one_line(cause).rstrip(".") or type(cause).__name__
    if isinstance(cause, ImportError):
        missing = reason.split(". HINT")[0]
        return ConfigError(
            f"{key} ({library}) needs a package that is not installed ({missing}); {install_hint(cause)}"
        )
    if named := _named_in(reason, values):
        option = " and ".join(f"{name}={values[name]!r}" for name in named)
        return ConfigError(f"{option} refused by {library}: {reason}; set a value it accepts")
    where = f", called from {caller}" if (caller := _user_frame(err)) else ""
    given = f" (given: {_given(values)})" if _given(values) and len(values) <= 12 else ""
    fix = f"fix the values under {key}{given}"
    return ConfigError(f"{key} could not be built: {library} refused its arguments ({reason}{where}); {fix}")


def _given(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v!r}" for k, v in values.items() if v is not None)[:300]


def _named_in(reason: str, values: dict[str, Any]) -> list[str]:
    """The options whose value the library's message quotes (nothing else says which argument it refused). Among
    several, those it names too; none when it names another (``save_top_k=-2`` quoting ``>= -1``). Else the one list
    option with an element it quotes (``hidden_sizes=[-3]`` for "negative dimension -3")."""
    words = {word.rstrip(".") for word in re.findall(r"[\w.+-]+", reason)}  # "-2." at a sentence's end is -2

    def quoted(value: Any) -> bool:
        return value is not None and not isinstance(value, bool) and str(value) in words

    scalars = [k for k, v in values.items() if quoted(v)]
    mentioned = [k for k in scalars if k.rsplit(".", 1)[-1].lower() in reason.lower()]
    if mentioned or len(scalars) > 1:
        return mentioned
    if scalars and not re.search(r"[A-Za-z_]\w*\s*=", reason):
        return scalars
    lists = [k for k, v in values.items() if isinstance(v, (list, tuple)) and any(map(quoted, v))]
    return lists if len(lists) == 1 else []


def install_hint(err: ImportError) -> str:
    """How to install what ``err`` misses: the project's extra that provides it, else the package itself."""
    text = str(err)
    match = re.search(r"Requirement '([A-Za-z0-9_.-]+)", text) or re.search(r"No module named '([\w.]+)'", text)
    missing = (match.group(1) if match else getattr(err, "name", None) or "").split(".")[0].lower()
    if not missing:
        return "install the package it names"
    for own in importlib.metadata.packages_distributions().get(__name__.split(".")[0], [])[:1]:
        for requirement in importlib.metadata.requires(own) or []:
            extra = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", requirement)
            name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            if extra and (name == missing or name.startswith(f"{missing}-")):
                return f"install the project's extra: pip install -e '.[{extra.group(1)}]'"
    return f"install it: pip install {missing}"


def located(path: str) -> Any:
    """The object a class path (``package.module.Name``) names; None when it does not import."""
    try:
        return pkgutil.resolve_name(path)
    except Exception:  # not a name, or a module that fails to import: the parse reports it
        return None


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """A parsed config's options as ``prefix`` + ``a.b`` -> value, a list's classes as ``trainer.callbacks[0].a``."""
    found: dict[str, Any] = {}
    for key, value in config.items() if config is not None else ():
        if isinstance(value, list) and value and all(hasattr(item, "items") for item in value):
            for i, item in enumerate(value):
                found.update(flat(item, f"{prefix}{key}[{i}]."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass(frozen=True)
class Build:
    """A class the parser was building: the option naming it, its class path (None for a section such as
    ``checkpoint``), and the plain values it was given (linked ones included) as ``option.init_args.name`` -> value."""

    option: str
    class_path: str | None
    values: dict[str, Any]


class Instantiator:
    """The parser's instantiator for the classes of ``config``, built by ``instantiator`` (None: the class itself);
    ``built`` finds its call in a traceback. A class, not a closure: ``ddp_spawn`` pickles it with the model."""

    def __init__(self, config: Any, sections: dict[str, type], instantiator: Callable[..., Any] | None = None) -> None:
        self.config, self.sections, self.instantiator = config, sections, instantiator

    def __call__(
        self, class_type: type, *args: Any, applied_instantiation_links: dict | None = None, **kwargs: Any
    ) -> Any:
        if self.instantiator is None:
            return class_type(*args, **kwargs)
        links = applied_instantiation_links or {}  # Lightning's model and data instantiators take them
        return self.instantiator(class_type, *args, applied_instantiation_links=links, **kwargs)

    def build(self, cls: type, kwargs: dict[str, Any]) -> Build | None:
        """The option building ``cls`` from ``kwargs`` (jsonargparse names the class, not the option): the one whose
        class_path imports as ``cls``, or its section; among several, the one with those values."""
        options = flat(self.config)
        plain = {name: value for name, value in kwargs.items() if _plain(value)}
        named = self._options_of(cls, options)
        builds = [Build(option, path, {prefix + k: v for k, v in plain.items()}) for option, path, prefix in named]
        same = [b for b in builds if all(options.get(k) is None or options[k] == v for k, v in b.values.items())]
        return next(iter(same or builds), None)

    def _options_of(self, cls: type, options: dict[str, Any]) -> list[tuple[str, str | None, str]]:
        """The options that may build ``cls``, each with its class path and its arguments' prefix: those naming it by
        class_path, and its section."""
        named = [
            (key.removesuffix(".class_path"), path, f"{key.removesuffix('class_path')}init_args.")
            for key, path in options.items()
            if key.endswith(".class_path") and isinstance(path, str) and located(path) is cls
        ]
        return named + [(option, None, f"{option}.") for option, section in self.sections.items() if section is cls]


def built(err: BaseException, by_parser: bool = False) -> Build | None:
    """What was being built when ``err`` (or one it wraps) was raised: the innermost ``Instantiator`` call nearest the
    root cause, else None. ``by_parser``: not a call the user's code made (an optimizer factory)."""
    for cause in reversed(list(chain(err))):
        frames = _frames(cause)
        calls = [i for i, frame in enumerate(frames) if frame.f_code is Instantiator.__call__.__code__]
        if calls:
            if by_parser and any(map(_users, frames[: calls[-1]])):
                return None
            local = frames[calls[-1]].f_locals
            return local["self"].build(local["class_type"], local["kwargs"])
    return None


def users_exception(err: BaseException) -> BaseException:
    """For an exception the parser wrapped while it built a class of the user's, the user's own; else ``err``."""
    if built(err) is not None:
        return next((cause for cause in chain(err) if any(map(_users, _frames(cause)))), err)
    return err


def user_code_line(err: BaseException) -> str | None:
    """The line before the traceback of an exception that passed through the user's code, naming their function
    and the values of the class being built; None otherwise."""
    if (caller := _user_frame(err)) is None:
        return None
    cause, build, built_from = root_cause(err), built(err), ""
    if build is not None:
        what = f"{build.option} ({build.class_path})" if build.class_path else build.option
        values = " and ".join(f"{k}={build.values[k]!r:.200}" for k in _named_in(one_line(cause), build.values))
        given = _given(build.values) or "its defaults"
        built_from = (
            f"{values} refused while building {what}: " if values else f"{what} could not be built from {given}: "
        )
    how = "raised in your code" if _users(_frames(cause)[-1]) else "raised by a library called from your code"
    return f"error: {built_from}{type(cause).__name__} {how}, {caller}; its traceback follows"
