"""User mistakes as one line: the exception the command line reports without a traceback, and the translation of
library messages (jsonargparse, Lightning) into a line that names the bad value and the fix."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from lightning.pytorch.strategies import StrategyRegistry

# Set to 1: an `error:` line that stands for an exception (a mistake's, a dead rank's) is preceded by its traceback.
TRACEBACK_VARIABLE = "FULL_TRACEBACK"


def full_traceback() -> bool:
    """Whether the user asked for the tracebacks behind the one-line errors (``FULL_TRACEBACK=1``)."""
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


class ConfigError(Exception):
    """A mistake in the user's configuration or input; the message names the bad value and the fix."""

    # jsonargparse keeps only the text of an error raised while it builds an object inside a Union-typed option
    # (trainer.logger, trainer.callbacks): the newest ConfigError is remembered so that it can still be found.
    newest: ConfigError | None = None

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        ConfigError.newest = self


def one_line(message: str) -> str:
    """Squeeze a multi-line library message into one line, dropping the usage noise around it."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return " ".join(lines)


def explain_parser_error(message: str) -> str:
    """Turn jsonargparse's message into: what is wrong, with which value, and what to do."""
    text = one_line(message)
    help_hint = "run with --help to list the valid options"
    if m := re.search(r"No action for key \"([^\"]+)\"|does not accept option '([^']+)'", text):
        return f"unknown option '{m.group(1) or m.group(2)}'; check its spelling and nesting, or {help_hint}"
    if m := re.search(r"(?i)unrecognized arguments: (.+)", text):
        return f"unknown argument(s) {m.group(1)}; {help_hint}"
    # A bad init_args value is reported by jsonargparse as a problem with the whole class_path.
    if m := re.search(
        r'Parser key "([^"]+)":.*?class_path.*?Parser key "([^"]+)": (.*?)\. Got value: (.*?)(?: - |$)', text
    ):
        return f"invalid value {m.group(4)!r} for '{m.group(1)}.init_args.{m.group(2)}'; {_first_reason(m.group(3))}"
    # A class nested in another (model.net) fails inside its parent's class_path: report the innermost one.
    if problems := list(re.finditer(r"Problem with given class_path (\S+): ", text)):
        inner = problems[-1]
        key = ".".join(re.findall(r'Parser key "([^"]+)":', text[: inner.start()]))
        reason = text[inner.end() :].split(" - ")[0].strip()
        if m := re.search(r"the following arguments are required: (.*)", reason):
            return f"class_path {inner.group(1)} for '{key}' needs {m.group(1)}; set them under {key}.init_args"
        return (
            f"class_path {inner.group(1)} for '{key}' cannot be used ({reason}); check its spelling "
            "and that its module is importable (on PYTHONPATH)"
        )
    # An option of a class given by its registry name (`strategy: fsdp` with `--trainer.strategy.shard_layers=...`).
    if m := re.search(r'Parser key "([^"]+)":.*?NestedArg\(key=\'([^\']+)\'', text):
        option, key = m.groups()
        fsdp = f"{__package__.split('.')[0]}.engine.strategies.FSDP2Strategy"
        return (
            f"'{option}' is given by name, and a name takes no options such as {key}; give it as a class with its "
            f"options: --{option}=<class path> --{option}.{key}=... (for fsdp: {fsdp}; in YAML class_path and "
            "init_args)"
        )
    if m := re.search(r'Parser key "([^"]+)": Not of type \S+: (.*?) does not conform', text):
        return f"invalid value {m.group(2)!r} for '{m.group(1)}'; {_restriction(text)}"
    # jsonargparse words the rejected value "Given value type: T, value: V" or "... Given value: V".
    if m := re.search(r'Parser key "([^"]+)":(.*?)Given value type: \S+?(?:, value| .*? Given value): (.*)$', text):
        return f"invalid value {m.group(3).strip()!r} for '{m.group(1)}'; {_first_reason(m.group(2))}"
    if m := re.search(r'Parser key "([^"]+)":\s*(.*)$', text):
        return f"invalid value for '{m.group(1)}': {m.group(2)}"
    if "Unable to load config" in text or "does not exist" in text:
        return f"{text}; check the path given to --config"
    return text


def _first_reason(details: str) -> str:
    """jsonargparse lists why each member of a Union rejected a value; the first is usually the useful one."""
    details = details.strip(" -")
    if (restriction := _restriction(details)) is not None:
        return restriction
    if choices := re.findall(r"Expected a (?:typing\.)?Literal\[(.*?)\]", details):
        return f"expected one of {', '.join(choices)}"
    if types := re.findall(r"Expected a <class '([\w.]+)'>", details):
        return "expected " + " or ".join("null" if t == "NoneType" else t for t in types)
    return details[:300]


def _restriction(text: str) -> str | None:
    """The range of a restricted number type (jsonargparse.typing's PositiveInt, restricted_number_type) in words."""
    if m := re.search(r"does not conform to restriction (v\S+(?: (?:and|or) v\S+)*)", text):
        return "expected a value " + re.sub(r"v([<>=!]+)", r"\1 ", m.group(1))
    return None


def explain_trainer_error(text: str) -> str:
    """Lightning's complaint about the Trainer settings; GPU indices are explained against the visible GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = f" (CUDA_VISIBLE_DEVICES={visible} hides the others and renumbers these from 0)" if visible else ""
    if m := re.search(r"You requested gpu: (\[.*?\]) But your machine only has: (\[.*?\])", text):
        return (
            f"trainer.devices asks for GPU index(es) {m.group(1)} but the GPUs visible to this process are "
            f"{m.group(2)}{note}; list only those, or set `devices: N` for the first N"
        )
    if "No supported gpu backend found" in text or "GPUs requested but none are available" in text:
        return f"trainer.accelerator asks for a GPU but this process sees none{note}; use accelerator cpu or auto"
    if m := re.search(r"`num_nodes` must be a positive integer, but got (\S+?)\.?$", text):
        return f"trainer.num_nodes must be >= 1, got {m.group(1)}; set it to the number of machines (1 for one)"
    if m := re.search(r"invalid strategy name: `strategy=(.*?)`", text):
        names = ", ".join(n for n in sorted(StrategyRegistry.available_strategies()) if "find_unused" not in n)
        return f"unknown trainer.strategy {m.group(1)}; use one of: {names} (or a Strategy class_path)"
    return f"invalid trainer settings: {text}"


def chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err``, then what caused it (``__cause__``, else ``__context__``), down to the first exception."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def config_error_in(err: BaseException) -> ConfigError | None:
    """The ConfigError that caused ``err``, if any: in the exception chain, or quoted in its message."""
    found = next((e for e in chain(err) if isinstance(e, ConfigError)), None)
    if found is not None:
        return found
    newest = ConfigError.newest
    return newest if newest is not None and str(newest) and str(newest) in str(err) else None


class DiskError(Exception):
    """A file of the run could not be written (disk full, quota, read-only, permission); the message names the fix."""


# The failures a user fixes on the filesystem rather than in the code or the config.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DISK_ERRNOS = _FULL | {
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.ENAMETOOLONG,
    errno.EISDIR,
    errno.ENOENT,
    errno.ELOOP,
    errno.EEXIST,
}
ROOT_OPTION = "--trainer.default_root_dir"


def disk_error(err: OSError, path: str | os.PathLike, kept: str, option: str = ROOT_OPTION) -> DiskError | None:
    """A one-line DiskError for ``err`` while writing ``path`` (``kept``: what is still intact), or None.

    The line names the path, the errno and a fix that fits it; ``option`` is the one that chose the place.
    """
    if err.errno not in _DISK_ERRNOS:
        return None
    if err.errno == errno.EEXIST:
        if _file_on_the_way(err.filename if isinstance(err.filename, str) else path) is None:
            return None  # a folder that exists already: the caller's mistake, not the disk's
        # mkdir(exist_ok=True) on a file says "File exists": the user's problem is a file where a folder should be.
        err = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), err.filename)
    reason = err.strerror or os.strerror(err.errno)
    path = os.path.normpath(path)
    return DiskError(f"cannot write {path}: {reason} [Errno {err.errno}]; {_fix(err, path, option)} ({kept})")


def _fix(err: OSError, path: str, option: str) -> str:
    code = err.errno
    if code in _FULL:
        return f"free space there or set {option} to another disk, then run the same command again"
    if code == errno.EROFS:
        return f"the disk is mounted read-only; set {option} to a folder on a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        return f"this user may not write there; set {option} to a folder you can write to, or fix its permissions"
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocking = _file_on_the_way(err.filename if isinstance(err.filename, str) else path)
        where = f"'{blocking}' is a file, not a folder" if blocking else "a part of the path is a file, not a folder"
        return f"{where}; move it away or choose another {option}"
    if code == errno.ENAMETOOLONG:
        return f"a name in the path is longer than the filesystem allows; choose a shorter --run.name or {option}"
    if code == errno.EISDIR:
        return f"a folder has the name of the file to write; move it away or choose another {option}"
    if code == errno.ENOENT:
        return f"a folder on the way to it does not exist (removed while running?); create it or set {option}"
    return f"too many symbolic links on the way to it; fix the links or set {option} to a real folder"


def _file_on_the_way(path: str) -> str | None:
    """The first existing part of ``path`` that is not a folder (what ENOTDIR is about), or None."""
    absolute = Path(os.path.abspath(path))
    for part in reversed([absolute, *absolute.parents]):
        if os.path.lexists(part) and not part.is_dir():
            return str(part)
    return None


def disk_error_in(err: BaseException) -> DiskError | None:
    """The DiskError that ``err`` is or was caused by, or one for an OSError of the disk in its chain; else None.

    A missing file counts only where the folder that should hold it is missing too (a folder vanished): a
    missing input file is the caller's to report.
    """
    for cause in chain(err):
        if isinstance(cause, DiskError):
            return cause
        if isinstance(cause, OSError) and isinstance(cause.filename, (str, os.PathLike)):
            vanished = cause.errno != errno.ENOENT or not os.path.isdir(
                os.path.dirname(os.path.abspath(cause.filename))
            )
            found = disk_error(cause, cause.filename, kept="nothing else was changed") if vanished else None
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike, kept: str, option: str = ROOT_OPTION) -> Iterator[None]:
    """An OSError of the disk in the block becomes one DiskError line naming the file it names (else ``path``)."""
    try:
        yield
    except OSError as err:
        error = disk_error(err, err.filename if isinstance(err.filename, (str, os.PathLike)) else path, kept, option)
        if error is None:
            raise
        raise error from None
