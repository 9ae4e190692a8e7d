"""Whose an exception is, and so how it is reported (``verdict``): a mistake in the configuration (one line), the
disk's (one line), or the user's own code (their traceback, after a line naming their function that raised).

A frame is the user's when its file is outside the Python installation and its packages, and outside this engine:
the model, data and networks at the top of the package, or any module a config names by ``class_path``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pkgutil
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException

from template.engine.errors import (
    ConfigError,
    chain,
    config_error_in,
    disk_error_in,
    explain_trainer_error,
    one_line,
    parser_error,
)

_ENGINE = str(Path(__file__).resolve().parents[1])
_INSTALLED = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)
# The exceptions a library raises when a value it was given is out of its range, of the wrong kind, or needs a
# package that is not installed. Anything else (a RuntimeError from a kernel, a KeyError...) is not blamed on a value.
REFUSALS = (ValueError, TypeError, ImportError, AssertionError, ArithmeticError, MisconfigurationException)


def verdict(
    err: BaseException, dead: Callable[[BaseException], tuple[int, str] | None] | None = None
) -> tuple[int, str] | None:
    """The exit code and the one line for ``err``; None for an exception of the user's code (or a bug), whose
    traceback is the report.

    2: the parser's refusal, a ConfigError, a value a library refused while the parser built a class of the config,
    or Lightning alone refusing a Trainer setting; 3: the disk; ``dead``: its answer for a rank of the job that died.
    """
    mistake = parser_error(err) if isinstance(err, ArgumentError) else config_error_in(err) or _refused_building(err)
    if mistake is not None:
        return 2, str(mistake)
    if (disk := disk_error_in(err)) is not None:
        return 3, str(disk)
    if dead is not None and (found := dead(err)) is not None:
        return found
    if user_function_calling(err) is None and refused_by(err, package="lightning") is not None:
        # Lightning alone refused a Trainer setting when it met the data (val_check_interval above an epoch's batches).
        return 2, explain_trainer_error(one_line(root_cause(err)))
    return None


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


def _frames(tb: TracebackType | None) -> Iterator[tuple[FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _users(frame: FrameType) -> bool:
    return is_user_file(frame.f_code.co_filename)


def raised_in_user_code(err: BaseException) -> str | None:
    """``Class.function (file:line)`` of the user's frame that raised ``err``'s root cause itself; else None."""
    frames = list(_frames(root_cause(err).__traceback__))
    return _where(*frames[-1]) if frames and _users(frames[-1][0]) else None


def user_function_calling(err: BaseException) -> str | None:
    """``Class.function (file:line)`` of the innermost frame of the user's code in ``err``'s root cause, or None."""
    user = [f for f in _frames(root_cause(err).__traceback__) if _users(f[0])]
    return _where(*user[-1]) if user else None


def _where(frame: FrameType, line: int) -> str:
    code = frame.f_code
    filename = code.co_filename
    with contextlib.suppress(ValueError):  # another drive on Windows
        relative = os.path.relpath(filename)
        filename = filename if relative.startswith("..") else relative
    return f"{getattr(code, 'co_qualname', code.co_name)} ({filename}:{line})"


def refused_by(err: BaseException, package: str | None = None, building: bool = False) -> str | None:
    """The library class (or function) that refused a value, for an exception a library (``package`` if given)
    raised; None otherwise. ``building``: ``err`` came from building the config's objects, so any exception of a
    library that no code of the user's called (a RuntimeError for a negative size too) is the values' fault."""
    cause = root_cause(err)
    frames = list(_frames(cause.__traceback__))
    own = any(_users(frame) for frame, _ in frames)
    if not isinstance(cause, REFUSALS) and not (building and not own):
        return None
    # A missing package is the environment's wherever the import is; other exceptions from the user's code are theirs.
    if not frames or (_users(frames[-1][0]) and not isinstance(cause, ImportError)):
        return None
    if package is not None and not frames[-1][0].f_globals.get("__name__", "").startswith(f"{package}."):
        return None
    # The outermost library frame below the user's and the engine's code names the class the value was given to.
    ours = [i for i, (frame, _) in enumerate(frames) if _users(frame) or frame.f_code.co_filename.startswith(_ENGINE)]
    for frame, _ in frames[ours[-1] + 1 if ours else 0 :]:
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
    reason = one_line(cause).rstrip(".") or type(cause).__name__
    if isinstance(cause, ImportError):
        missing = reason.split(". HINT")[0]
        return ConfigError(
            f"{key} ({library}) needs a package that is not installed ({missing}); {install_hint(cause)}"
        )
    if named := _named_in(reason, values):
        option = " and ".join(f"{name}={values[name]!r}" for name in named)
        return ConfigError(f"{option} refused by {library}: {reason}; set a value it accepts")
    caller = user_function_calling(err)
    where = f", called from {caller}" if caller else ""
    given = f" (given: {_given(values)})" if _given(values) and len(values) <= 12 else ""
    fix = f"fix the values under {key}{given}"
    return ConfigError(f"{key} could not be built: {library} refused its arguments ({reason}{where}); {fix}")


def _given(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v!r}" for k, v in values.items() if v is not None)[:300]


def _named_in(reason: str, values: dict[str, Any]) -> list[str]:
    """The options whose value the library's message quotes, read from it because nothing else says which argument
    a constructor refused. Among several, those whose name it mentions too; none when it gives a value to a name
    that is not among them (``save_top_k=-2`` quoting ``>= -1``: a coincidence). Else the one list option with an
    element it quotes (``hidden_sizes=[-3]`` for "negative dimension -3")."""
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
    """How to install what ``err`` misses: this project's extra that provides it, else the package itself."""
    text = str(err)
    match = re.search(r"Requirement '([A-Za-z0-9_.-]+)", text) or re.search(r"No module named '([\w.]+)'", text)
    missing = (match.group(1) if match else getattr(err, "name", None) or "").split(".")[0]
    if not missing:
        return "install the package it names"
    package = __name__.split(".")[0]
    for own in importlib.metadata.packages_distributions().get(package, [])[:1]:
        for requirement in importlib.metadata.requires(own) or []:
            extra = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", requirement)
            name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")
            if extra and (name == missing.lower() or name.startswith(f"{missing.lower()}-")):
                return f"install the project's extra: pip install -e '.[{extra.group(1)}]'"
    return f"install it: pip install {missing}"


def located(path: str) -> Any:
    """The object a class path (``package.module.Name``) names; None when it does not import."""
    try:
        return pkgutil.resolve_name(path)
    except Exception:  # not a name, a missing module, or a module that fails to import: the parse reports it
        return None


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """A parsed config's options as ``prefix`` + ``a.b`` -> value; the classes in a list (``trainer.callbacks``) as
    ``trainer.callbacks[0].init_args.a`` (jsonargparse's ``items()`` flattens the rest)."""
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
    """A class the parser was building when it raised: the option naming it, its class path (None for a section of
    its own such as ``checkpoint``), and the plain values it was given as ``option.init_args.name`` -> value
    (``option.name`` for a section), the ones jsonargparse linked in (``input_shape`` from the data) included."""

    option: str
    class_path: str | None
    values: dict[str, Any]


class Instantiator:
    """The parser's instantiator (``add_instantiator``) for the classes of ``config``: builds each as
    ``instantiator`` does (None: jsonargparse's default, the class called with its arguments). For an exception
    raised meanwhile, ``built`` finds the call in the traceback and the option it built.

    jsonargparse hands an instantiator the class and its arguments, not the option's key. The key is the config's
    option whose ``class_path`` imports as that very class, or the section of its own (``sections``: option ->
    class) built as it; among several (two EarlyStopping callbacks), the one whose values are those arguments.
    A class, not a closure: ``ddp_spawn`` pickles the model, whose optimizer factory holds the parser's instantiators.
    """

    def __init__(self, config: Any, sections: dict[str, type], instantiator: Callable[..., Any] | None = None) -> None:
        self.config, self.sections, self.instantiator = config, sections, instantiator

    def __call__(
        self, class_type: type, *args: Any, applied_instantiation_links: dict | None = None, **kwargs: Any
    ) -> Any:
        if self.instantiator is None:
            return class_type(*args, **kwargs)
        # The wrapped ones are Lightning's model and data instantiators, which take the links jsonargparse applied.
        return self.instantiator(
            class_type, *args, applied_instantiation_links=applied_instantiation_links or {}, **kwargs
        )

    def build(self, cls: type, kwargs: dict[str, Any]) -> Build | None:
        """The option of the config that builds ``cls`` from ``kwargs``; None for a class the config does not name."""
        options = flat(self.config)
        named = [
            (key.removesuffix(".class_path"), path, f"{key.removesuffix('class_path')}init_args.")
            for key, path in options.items()
            if key.endswith(".class_path") and isinstance(path, str) and located(path) is cls
        ]
        named += [(option, None, f"{option}.") for option, section in self.sections.items() if section is cls]
        plain = {name: value for name, value in kwargs.items() if _plain(value)}
        builds = [Build(option, path, {prefix + k: v for k, v in plain.items()}) for option, path, prefix in named]
        same = [b for b in builds if all(options.get(k) is None or options[k] == v for k, v in b.values.items())]
        return next(iter(same or builds), None)


def _instantiator_call(err: BaseException) -> tuple[FrameType, bool] | None:
    """The innermost ``Instantiator`` call in the traceback nearest ``err``'s root cause, and whether the user's code
    made it (an optimizer factory called in ``configure_optimizers``) rather than the parser."""
    for cause in reversed(list(chain(err))):
        frames = [frame for frame, _ in _frames(cause.__traceback__)]
        calls = [i for i, frame in enumerate(frames) if frame.f_code is Instantiator.__call__.__code__]
        if calls:
            return frames[calls[-1]], any(_users(frame) for frame in frames[: calls[-1]])
    return None


def built(err: BaseException) -> Build | None:
    """What the parser was building when ``err``, or an exception it wraps, was raised; None when it was not
    building a class of the config."""
    call = _instantiator_call(err)
    if call is None:
        return None
    local = call[0].f_locals
    return local["self"].build(local["class_type"], local["kwargs"])


def _refused_building(err: BaseException) -> ConfigError | None:
    """A value a library refused while the parser built a class of the config (dropout=1.5, mode=maximum), or a
    package it needs that is missing (a tracker's extra): one line naming the option."""
    call = _instantiator_call(err)
    build = built(err) if call is not None and not call[1] else None
    return refusal(err, build.option, build.values) if build is not None else None


def users_exception(err: BaseException) -> BaseException:
    """For an exception the parser wrapped while it built a class of the user's, the user's own (their traceback,
    without jsonargparse's "Does not validate against any of the Union subtypes" around it); else ``err``."""
    if built(err) is not None:
        for cause in chain(err):
            if any(_users(frame) for frame, _ in _frames(cause.__traceback__)):
                return cause
    return err


def user_code_line(err: BaseException) -> str | None:
    """The line printed before the traceback of an exception that passed through the user's code; None otherwise."""
    caller = user_function_calling(err)
    if caller is None:
        return None
    how = "raised in your code" if raised_in_user_code(err) else "raised by a library called from your code"
    return f"error: {_built_from(err)}{type(root_cause(err)).__name__} {how}, {caller}; its traceback follows"


def _built_from(err: BaseException) -> str:
    """``option=value ... refused while building option (class): `` for the values of the class being built that the
    exception quotes, else the class and all its values; "" when the parser was not building a class of the config."""
    build = built(err)
    if build is None:
        return ""
    what = f"{build.option} ({build.class_path})" if build.class_path else build.option
    if named := _named_in(one_line(root_cause(err)), build.values):
        values = " and ".join(f"{name}={build.values[name]!r:.200}" for name in named)
        return f"{values} refused while building {what}: "
    return f"{what} could not be built from {_given(build.values) or 'its defaults'}: "


def print_user_code_line(err: BaseException) -> None:
    """Say, before Python prints the traceback, which of the user's functions raised ``err``."""
    if (line := user_code_line(err)) is not None:
        print(line, file=sys.stderr, flush=True)
