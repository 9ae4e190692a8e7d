"""Whose an exception is: a value a library refused (the configuration's, one line), or the user's own code (theirs
to debug, with its traceback and a line naming their function that raised).

A frame is the user's when its file is outside the Python installation and its packages, and outside this engine:
the model, data and networks at the top of the package, or any module a config names by ``class_path``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

from template.engine.errors import ConfigError, chain, one_line

_ENGINE = str(Path(__file__).resolve().parents[1])
_INSTALLED = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)
# The exceptions a library raises when a value it was given is out of its range, of the wrong kind, or needs a
# package that is not installed. Anything else (a RuntimeError from a kernel, a KeyError...) is not blamed on a value.
REFUSALS = (ValueError, TypeError, ImportError, AssertionError, ArithmeticError, MisconfigurationException)


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's: not Python's, not an installed package's, not the engine's."""
    if not filename or filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    if path.startswith(_ENGINE):
        return False
    return not any(path.startswith(root + os.sep) for root in _INSTALLED) and "site-packages" not in path


def root_cause(err: BaseException) -> BaseException:
    """The first exception of ``err``'s chain: what went wrong before libraries wrapped it in their own messages."""
    *_, first = chain(err)
    return first


def _frames(tb: TracebackType | None) -> Iterator[tuple[Any, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def raised_in_user_code(err: BaseException) -> str | None:
    """``Class.function (file:line)`` of the innermost frame of the user's code that ``err``'s root cause passed
    through, when the exception was raised there (and not by a library the user's code called); else None."""
    frames = list(_frames(root_cause(err).__traceback__))
    if not frames or not is_user_file(frames[-1][0].f_code.co_filename):
        return None
    return _where(*frames[-1])


def user_function_calling(err: BaseException) -> str | None:
    """``Class.function (file:line)`` of the innermost frame of the user's code in ``err``'s root cause, or None."""
    user = [f for f in _frames(root_cause(err).__traceback__) if is_user_file(f[0].f_code.co_filename)]
    return _where(*user[-1]) if user else None


def _where(frame: Any, line: int) -> str:
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    filename = code.co_filename
    with contextlib.suppress(ValueError):  # another drive on Windows
        relative = os.path.relpath(filename)
        filename = filename if relative.startswith("..") else relative
    return f"{name} ({filename}:{line})"


def refused_by(err: BaseException, package: str | None = None, building: bool = False) -> str | None:
    """The library class (or function) that refused a value, for an exception a library (``package`` if given)
    raised; None otherwise.

    ``building``: ``err`` came from building the config's objects, so any exception of a library that no code of
    the user's called (a RuntimeError for a negative size too) is the values' fault.
    """
    cause = root_cause(err)
    frames = list(_frames(cause.__traceback__))
    own = any(is_user_file(frame.f_code.co_filename) for frame, _ in frames)
    if not isinstance(cause, REFUSALS) and not (building and not own):
        return None
    # A missing package is the environment's wherever the import is; other exceptions from the user's code are theirs.
    if not frames or (is_user_file(frames[-1][0].f_code.co_filename) and not isinstance(cause, ImportError)):
        return None
    if package is not None and not frames[-1][0].f_globals.get("__name__", "").startswith(f"{package}."):
        return None
    # The outermost library frame below the user's or the engine's code names the class the value was given to.
    for frame, _ in frames:
        if is_user_file(frame.f_code.co_filename) or frame.f_code.co_filename.startswith(_ENGINE):
            continue
        owner = frame.f_locals.get("self")
        if owner is not None and frame.f_code.co_name == "__init__":
            return f"{type(owner).__module__}.{type(owner).__qualname__}"
    frame = frames[-1][0]
    return f"{frame.f_globals.get('__name__', '?')}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


def refusal(err: BaseException, key: str, values: dict[str, Any]) -> ConfigError | None:
    """A one-line ConfigError for a value a library refused while ``key`` (``model``, ``trainer``...) was built from
    the options ``values`` (dotted name -> value); None when ``err`` is not a library's refusal."""
    library = refused_by(err, building=True)
    if library is None:
        return None
    cause = root_cause(err)
    reason = one_line(str(cause)).rstrip(".") or type(cause).__name__
    if isinstance(cause, ImportError):
        return ConfigError(
            f"{key} ({library}) needs a package that is not installed ({reason.split('. HINT')[0]}); "
            f"{install_hint(cause)}"
        )
    named = _options_named_in(reason, values)
    if named:
        option = " and ".join(f"{name}={values[name]!r}" for name in named)
        return ConfigError(f"{option} refused by {library}: {reason}; set a value it accepts")
    caller = user_function_calling(err)
    where = f", called from {caller}" if caller else ""
    given = ", ".join(f"{k.rsplit('.', 1)[-1]}={v!r}" for k, v in values.items() if v is not None)[:300]
    given = f" (given: {given})" if given and len(values) <= 12 else ""
    return ConfigError(
        f"{key} could not be built: {library} refused its arguments ({reason}{where}); fix the values under "
        f"{key}{given}"
    )


def _options_named_in(reason: str, values: dict[str, Any]) -> list[str]:
    """The options whose value the reason quotes; among several, those whose name it mentions too. None when the
    reason gives a value to a name (``save_top_k=-2``) that is not among them: a value quoted elsewhere in it (``>=
    -1``) is then a coincidence.

    Read from the library's message because nothing else says it: the parser knows which object it was building
    and with which arguments (``Builds``), not which of them the constructor refused.
    """
    words = {word.rstrip(".") for word in re.findall(r"[\w.+-]+", reason)}  # "-2." at a sentence's end is -2
    quoted = [k for k, v in values.items() if v is not None and not isinstance(v, bool) and str(v) in words]
    mentioned = [k for k in quoted if k.rsplit(".", 1)[-1].lower() in reason.lower()]
    if mentioned or len(quoted) > 1:
        return mentioned
    assigned = set(re.findall(r"([A-Za-z_]\w*)\s*=", reason))
    return [] if assigned else quoted


def install_hint(err: ImportError) -> str:
    """How to install what ``err`` misses: this project's extra that provides it, else the package itself."""
    text = str(err)
    match = re.search(r"Requirement '([A-Za-z0-9_.-]+)", text) or re.search(r"No module named '([\w.]+)'", text)
    missing = (match.group(1) if match else getattr(err, "name", None) or "").split(".")[0]
    if not missing:
        return "install the package it names"
    own = _own_distribution()
    if own is not None:
        for requirement in importlib.metadata.requires(own) or []:
            extra = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", requirement)
            name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            if extra and (name == missing.lower() or name.startswith(f"{missing.lower()}-")):
                return f"install the project's extra: pip install -e '.[{extra.group(1)}]'"
    return f"install it: pip install {missing}"


def _own_distribution() -> str | None:
    package = __name__.split(".")[0]
    names = importlib.metadata.packages_distributions().get(package, [])
    return names[0] if names else None


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def leaves(config: Any, prefix: str) -> dict[str, Any]:
    """Every option under a parsed config's ``prefix`` section as ``prefix.a.b`` -> value (the classes in a list
    such as ``trainer.callbacks`` as ``trainer.callbacks[0].init_args.a``)."""
    flat = dict(_flattened(config))
    if not prefix:
        return flat
    return {key: value for key, value in flat.items() if key == prefix or key.startswith(f"{prefix}.")}


def _flattened(section: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if not hasattr(section, "items"):
        return
    for key, value in section.items():
        if isinstance(value, list) and value and all(hasattr(item, "items") for item in value):
            for i, item in enumerate(value):
                yield from _flattened(item, f"{prefix}{key}[{i}].")
        else:
            yield f"{prefix}{key}", value


def users_exception(err: BaseException) -> BaseException | None:
    """The outermost exception of ``err``'s chain whose traceback passes through the user's code: theirs, below the
    libraries' wrappers (jsonargparse's "Does not validate against any of the Union subtypes"); None for none."""
    for cause in chain(err):
        if any(is_user_file(frame.f_code.co_filename) for frame, _ in _frames(cause.__traceback__)):
            return cause
    return None


@dataclass(frozen=True)
class Build:
    """A class the parser was building when it raised: the option naming it, its class path (None for a section of
    its own such as ``checkpoint``), and the plain values the parser gave it as ``option.init_args.name`` -> value
    (``option.name`` for a section), the ones jsonargparse linked in (``input_shape`` from the data) included."""

    option: str
    class_path: str | None
    values: dict[str, Any]


class Builds:
    """The objects the parser builds from a parsed config, as its instantiator hook reports them: for an exception
    raised while one was built, the option that built it and the arguments it was given.

    jsonargparse hands an instantiator the class and its arguments, not the option's key. The key is the config's
    option whose ``class_path`` imports as that very class, or the section of its own (``sections``: option ->
    class) built as it; among several (two EarlyStopping callbacks), the one whose values are those arguments.
    """

    # The latest command line's: its user-code line is printed after the command line is gone.
    latest: Builds | None = None

    def __init__(self, config: Any, sections: dict[str, type]) -> None:
        self.config, self.sections = config, sections
        self._failed: list[tuple[type, dict[str, Any], BaseException]] = []
        Builds.latest = self

    def recording(self, instantiator: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """``instantiator`` (None: jsonargparse's default, the class called with the arguments) for the parser's
        ``add_instantiator``, reporting here each build that raises."""
        return _Recording(self, instantiator)

    def failure(self, err: BaseException) -> Build | None:
        """What the parser was building when ``err``, or an exception it wraps, was raised; None when it was not
        building a class of the config."""
        causes = [id(cause) for cause in chain(err)]
        failed = [(causes.index(id(e)), cls, kwargs) for cls, kwargs, e in self._failed if id(e) in causes]
        if not failed:
            return None
        _, cls, kwargs = max(failed, key=lambda f: f[0])  # the innermost: nearest the root cause
        return self._built(cls, kwargs)

    def _built(self, cls: type, kwargs: dict[str, Any]) -> Build | None:
        flat = dict(_flattened(self.config))
        options = [
            (key.removesuffix(".class_path"), path, f"{key.removesuffix('class_path')}init_args.")
            for key, path in flat.items()
            if key.endswith(".class_path") and isinstance(path, str) and _imported(path) is cls
        ]
        options += [(option, None, f"{option}.") for option, section in self.sections.items() if section is cls]
        builds = [
            Build(option, path, {f"{prefix}{name}": v for name, v in kwargs.items() if _plain(v)})
            for option, path, prefix in options
        ]
        same = [b for b in builds if all(flat.get(k) is None or flat[k] == v for k, v in b.values.items())]
        return next(iter(same or builds), None)


class _Recording:
    """An instantiator reporting to ``builds`` each build that raises, with its class and arguments. A class, not a
    closure: ``ddp_spawn`` pickles the model, whose optimizer factory holds the parser's instantiators."""

    def __init__(self, builds: Builds, instantiator: Callable[..., Any] | None) -> None:
        self.builds, self.instantiator = builds, instantiator

    def __call__(
        self, class_type: type, *args: Any, applied_instantiation_links: dict | None = None, **kwargs: Any
    ) -> Any:
        links = applied_instantiation_links or {}
        try:
            if self.instantiator is None:
                return class_type(*args, **kwargs)
            # The wrapped ones are Lightning's model and data instantiators, which take the links jsonargparse applied.
            return self.instantiator(class_type, *args, applied_instantiation_links=links, **kwargs)
        except Exception as err:
            self.builds._failed.append((class_type, kwargs, err))
            raise


def _imported(path: str) -> Any:
    """The object ``package.module.Name`` names; None when it does not import (the parse has imported it already)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:
        return None


def _built_from(err: BaseException) -> str:
    """``option=value: `` for the value of the class being built that the exception quotes, else the class and all
    its values; "" when ``err`` was not raised while the parser built a class of the config."""
    built = Builds.latest.failure(err) if Builds.latest is not None else None
    if built is None:
        return ""
    reason = one_line(str(root_cause(err)))
    named = _options_named_in(reason, built.values) or _elements_named_in(reason, built.values)
    what = f"{built.option} ({built.class_path})" if built.class_path else built.option
    if named:
        values = " and ".join(f"{name}={built.values[name]!r:.200}" for name in named)
        return f"{values} refused while building {what}: "
    given = ", ".join(f"{k.rsplit('.', 1)[-1]}={v!r}" for k, v in built.values.items() if v is not None)[:300]
    return f"{what} could not be built from {given or 'its defaults'}: "


def _elements_named_in(reason: str, values: dict[str, Any]) -> list[str]:
    """The one list option with an element the reason quotes (``hidden_sizes=[-3]`` for "negative dimension -3");
    from the message, as ``_options_named_in``."""
    words = {word.rstrip(".") for word in re.findall(r"[\w.+-]+", reason)}
    quoted = [
        key
        for key, value in values.items()
        if isinstance(value, (list, tuple))
        and any(not isinstance(x, bool) and isinstance(x, (int, float, str)) and str(x) in words for x in value)
    ]
    return quoted if len(quoted) == 1 else []


def user_code_line(err: BaseException) -> str | None:
    """The line printed before the traceback of an exception that passed through the user's code; None otherwise."""
    caller = user_function_calling(err)
    if caller is None:
        return None
    name = type(root_cause(err)).__name__
    built = _built_from(err)
    if raised_in_user_code(err) is not None:
        return f"error: {built}{name} raised in your code, {caller}; its traceback follows"
    return f"error: {built}{name} raised by a library called from your code, {caller}; its traceback follows"


def print_user_code_line(err: BaseException) -> None:
    """Say, before Python prints the traceback, which of the user's functions raised ``err``."""
    line = user_code_line(err)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
