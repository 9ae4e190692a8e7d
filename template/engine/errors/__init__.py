"""User mistakes as one line: ConfigError (exit code 2), DiskError (3), and library messages made into a line naming
the bad value and the fix. ``blame.verdict`` is the one way from an exception to an ``error:`` line."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Set to 1: an `error:` line that stands for an exception (a mistake's, a dead rank's) is preceded by its traceback.
TRACEBACK_VARIABLE = "FULL_TRACEBACK"
SWEEP_EXTRA = "install the extra: pip install -e '.[sweep]'"  # Optuna, matplotlib


def full_traceback() -> bool:
    """Whether the user asked for the tracebacks behind the one-line errors (``FULL_TRACEBACK=1``)."""
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


def signal_exit(signum: int) -> int:
    """The exit code of a process a signal ended, as a shell reports it: 128 + the signal (143 for SIGTERM)."""
    return 128 + signum


def exit_signal(code: object) -> str | None:
    """The name of the signal ``signal_exit`` made ``code`` from (SIGTERM for 143); None for another code."""
    return signal.Signals(code - 128).name if isinstance(code, int) and code - 128 in signal.valid_signals() else None


class ConfigError(Exception):
    """A mistake in the user's configuration or input; the message names the bad value and the fix."""


class DiskError(Exception):
    """A file of the run could not be written (disk full, quota, read-only, permission); the message names the fix.
    Exit code 3, or its ``exit_code`` (75: a run's lease lost)."""


def one_line(message: object) -> str:
    """A multi-line library message squeezed into one line."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err``, then what caused it (``__cause__``, else ``__context__``), down to the first exception."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def config_error_in(err: BaseException) -> ConfigError | None:
    """The ConfigError in ``err``'s chain, if any."""
    return next((e for e in chain(err) if isinstance(e, ConfigError)), None)


def parser_error(err: BaseException, prefix: str = "", files: dict[str, Any] | None = None) -> ConfigError:
    """The one-line ConfigError for a parser's refusal, or for a ConfigError of the code it ran."""
    return ConfigError(f"{prefix}{config_error_in(err) or explain_parser_error(str(err), files)}")


def explain_parser_error(message: str, files: dict[str, Any] | None = None) -> str:
    """jsonargparse's message as: what is wrong, with which value, and what to do (``PARSER_MESSAGES``); an option a
    class does not take named by the first of the config files (``files``: path -> content) that sets it."""
    text = one_line(message)
    for pattern, says in PARSER_MESSAGES.values():
        if m := re.search(pattern, text):
            return says(m, files or {})
    return text


def _class_path_problem(m: re.Match[str], files: dict[str, Any]) -> str:
    """A class nested in another (model.net) fails inside its parent's class_path: the innermost (last) is meant."""
    keys = re.findall(r'Parser key "([^"]+)":', m[1])
    class_path, key, reason = m[2], ".".join(keys), m[3].split(" - ")[0].strip()
    if required := re.search(r"the following arguments are required: (.*)", reason):
        return f"class_path {class_path} for '{key}' needs {required[1]}; set them under {key}.init_args"
    if refused := re.match(r"Option '([^']+)' is not accepted", reason):
        option = ".init_args.".join([*keys, refused[1]])
        file = next((path for path, content in files.items() if _sets(content, option)), None)
        where, there = (f" (set in config file '{file}')", " from that file") if file else ("", "")
        return (
            f"{option}{where} is not an argument of {class_path}; check its spelling, drop it{there}, or add the "
            "argument to the class"
        )
    return (
        f"class_path {class_path} for '{key}' cannot be used ({reason}); check its spelling and that its module is "
        "importable (on PYTHONPATH)"
    )


def _given_by_name(m: re.Match[str], files: dict[str, Any]) -> str:
    option, key = m.groups()
    fsdp = f"{__package__.split('.')[0]}.engine.strategies.FSDP2Strategy"
    return (
        f"'{option}' is given by name, and a name takes no options such as {key}; give it as a class with its "
        f"options: --{option}=<class path> --{option}.{key}=... (for fsdp: {fsdp}; in YAML class_path and init_args)"
    )


_HELP = "run with --help to list the valid options"
# jsonargparse's messages (made one line) in the order tried: their pattern, and the line from the match and the config
# files. tests/errors/test_messages.py holds a message of jsonargparse's for each.
PARSER_MESSAGES: dict[str, tuple[str, Callable[[re.Match[str], dict[str, Any]], str]]] = {
    "unknown option": (
        r"(?:No action for key \"|does not accept option ')([^\"']+)",
        lambda m, _: f"unknown option '{m[1]}'; check its spelling and nesting, or {_HELP}",
    ),
    "unknown argument": (r"(?i)unrecognized arguments: (.+)", lambda m, _: f"unknown argument(s) {m[1]}; {_HELP}"),
    # A value outside an option's restricted type (PositiveFloat...), also an init_args one.
    "restricted value": (
        r'Parser key "([^"]+)":(?:.*?class_path.*?Parser key "([^"]+)":)? Not of type \S+: (.*?) does not conform',
        lambda m, _: (
            f"invalid value {m[3]!r} for '{m[1]}{'.init_args.' + m[2] if m[2] else ''}'; {_restriction(m.string)}"
        ),
    ),
    # jsonargparse reports a bad init_args value as a problem with the whole class_path.
    "init_args value": (
        r'Parser key "([^"]+)":.*?class_path.*?Parser key "([^"]+)": (.*?)\. Got value: (.*?)(?: - |$)',
        lambda m, _: f"invalid value {m[4]!r} for '{m[1]}.init_args.{m[2]}'; {_first_reason(m[3])}",
    ),
    "class_path": (r"^(.*)Problem with given class_path (\S+): (.*)$", _class_path_problem),
    # An option of a class given by its registry name (`strategy: fsdp` and `--trainer.strategy.shard_layers=...`).
    "option of a name": (r'Parser key "([^"]+)":.*?NestedArg\(key=\'([^\']+)\'', _given_by_name),
    # The rejected value, worded "Given value type: T, value: V" or "... Given value: V".
    "rejected value": (
        r'Parser key "([^"]+)":(.*?)Given value type: \S+?(?:, value| .*? Given value): (.*)$',
        lambda m, _: f"invalid value {m[3].strip()!r} for '{m[1]}'; {_first_reason(m[2])}",
    ),
    "value of one type": (
        r'Parser key "([^"]+)": (Expected .*?)\. Got value: (.*)$',
        lambda m, _: f"invalid value {m[3]!r} for '{m[1]}'; {_first_reason(m[2])}",
    ),
    "other": (r'Parser key "([^"]+)":\s*(.*)$', lambda m, _: f"invalid value for '{m[1]}': {m[2]}"),
    "config file": (
        r"Unable to load config|does not exist",
        lambda m, _: f"{m.string}; check the path given to --config",
    ),
}


def _sets(content: Any, option: str) -> bool:
    """Whether a config file's ``content`` sets the dotted ``option`` (where the file may leave out ``init_args``)."""
    key, _, rest = option.partition(".")
    if not isinstance(content, dict) or key not in content and key != "init_args":
        return False
    return not rest or _sets(content.get(key, content), rest)  # a left out init_args: the same mapping


def _first_reason(details: str) -> str:
    """jsonargparse lists why each member of a Union rejected a value; the first is usually the useful one."""
    details = details.strip(" -")
    if (restriction := _restriction(details)) is not None:
        return restriction
    if choices := re.findall(r"Expected a (?:typing\.)?Literal\[(.*?)\]", details):
        return f"expected one of {', '.join(choices)}"
    if names := re.findall(r"Expected a <class '([\w.]+)'>", details):
        return "expected " + " or ".join("null" if name == "NoneType" else name for name in names)
    return details[:300]


def _restriction(details: str) -> str | None:
    """A restricted number type's rule (PositiveInt's ``v>0``) in words, "or null" where the option takes null too."""
    if m := re.search(r"does not conform to restriction (v\S+(?: (?:and|or) v\S+)*)", details):
        rule = re.sub(r"v([<>=!]+)", r"\1 ", m.group(1))
        return f"expected a value {rule}" + (" or null" if "NoneType" in details else "")
    return None


def explain_trainer_error(text: str, devices: Any = None) -> str:
    """Lightning's complaint about the Trainer settings (``devices``: trainer.devices, where known)."""
    from lightning.pytorch.strategies import StrategyRegistry

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = f" (CUDA_VISIBLE_DEVICES={visible} hides the others and renumbers these from 0)" if visible else ""
    if m := re.search(r"You requested gpu: (\[.*?\]) But your machine only has: (\[.*?\])", text):
        return (
            f"trainer.devices asks for GPU index(es) {m.group(1)} but the GPUs visible to this process are "
            f"{m.group(2)}{note}; list only those, or set `devices: N` for the first N"
        )
    if "`devices` selected with `CPUAccelerator`" in text:
        return (
            f"trainer.devices={devices!r} is not valid on the CPU: CPU devices are a number of processes (>= 1), not "
            "indices; set e.g. --trainer.devices=2"
        )
    if "No supported gpu backend found" in text or "GPUs requested but none are available" in text:
        return f"trainer.accelerator asks for a GPU but this process sees none{note}; use accelerator cpu or auto"
    if m := re.search(r"`num_nodes` must be a positive integer, but got (\S+?)\.?$", text):
        return f"trainer.num_nodes must be >= 1, got {m.group(1)}; set it to the number of machines (1 for one)"
    if m := re.search(r"DataLoader.__init__\(\) got multiple values for argument '(\w+)'", text):
        return (
            f"a DataLoader of the data is given {m[1]} by position, and Lightning cannot rebuild it with its own "
            f"sampler (Lightning issue 17991); pass it by name: DataLoader(dataset, {m[1]}=...)"
        )
    if m := re.search(r"invalid strategy name: `strategy=(.*?)`", text):
        names = ", ".join(n for n in sorted(StrategyRegistry.available_strategies()) if "find_unused" not in n)
        return f"unknown trainer.strategy {m.group(1)}; use one of: {names} (or a Strategy class_path)"
    return f"invalid trainer settings: {text}"


ROOT_OPTION = "--trainer.default_root_dir"
# The failures a user fixes on the filesystem, and how; ENOTDIR and EEXIST (a file where a folder should be) name it.
_FULL = "free space there or set {option} to another disk, then run the same command again"
_NOT_YOURS = "this user may not write there; set {option} to a folder you can write to, or fix its permissions"
_FIXES = {
    errno.ENOSPC: _FULL,
    errno.EDQUOT: _FULL,
    errno.EFBIG: _FULL,
    errno.EROFS: "the disk is mounted read-only; set {option} to a folder on a writable disk",
    errno.EACCES: _NOT_YOURS,
    errno.EPERM: _NOT_YOURS,
    errno.ENAMETOOLONG: "a name in the path is longer than the filesystem allows; choose a shorter --run.name or "
    "{option}",
    errno.EISDIR: "a folder has the name of the file to write; move it away or choose another {option}",
    errno.ENOENT: "a folder on the way to it does not exist (removed while running?); create it or set {option}",
    errno.ELOOP: "too many symbolic links on the way to it; fix the links or set {option} to a real folder",
}


def disk_error(err: OSError, path: str | os.PathLike, kept: str, option: str = ROOT_OPTION) -> DiskError | None:
    """A one-line DiskError for ``err`` while writing ``path``, naming the fix and the ``option`` that chose the place
    (``kept``: what is still intact); None for an error that is not the disk's."""
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        absolute = Path(os.path.abspath(err.filename if isinstance(err.filename, str) else path))
        parts = reversed([absolute, *absolute.parents])
        blocking = next((str(part) for part in parts if os.path.lexists(part) and not part.is_dir()), None)
        if err.errno == errno.EEXIST and blocking is None:
            return None  # a folder that exists already: the caller's mistake, not the disk's
        # mkdir(exist_ok=True) on a file says "File exists": a file where a folder should be.
        err = NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), err.filename)
        where = f"'{blocking}' is a file, not a folder" if blocking else "a part of the path is a file, not a folder"
        fix = f"{where}; move it away or choose another {option}"
    elif err.errno in _FIXES:
        fix = _FIXES[err.errno].format(option=option)
    else:
        return None
    reason = err.strerror or os.strerror(err.errno)
    return DiskError(f"cannot write {os.path.normpath(path)}: {reason} [Errno {err.errno}]; {fix} ({kept})")


def disk_error_in(err: BaseException) -> DiskError | None:
    """The DiskError in ``err``'s chain, or one for an OSError of the disk there; a missing file only where its folder
    is missing too (a missing input file is the caller's to report)."""
    for cause in chain(err):
        if isinstance(cause, DiskError):
            return cause
        if isinstance(cause, OSError) and isinstance(cause.filename, (str, os.PathLike)):
            folder = os.path.dirname(os.path.abspath(cause.filename))
            if cause.errno != errno.ENOENT or not os.path.isdir(folder):
                found = disk_error(cause, cause.filename, kept="nothing else was changed")
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
