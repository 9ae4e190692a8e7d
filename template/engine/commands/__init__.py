"""The commands: ``python -m <package> fit|validate|test|predict`` (LightningCLI), ``export``, ``tune``, and what the
command line adds to a Trainer. Uses every package below it; the user's code only through the configuration.

This module imports neither torch nor Lightning: what needs no training (the program's help, a subcommand it does not
have, ``runs``, the help of ``sweep`` and ``cv``) answers at once; every other command is ``cli.main``'s."""

from __future__ import annotations

import argparse
import difflib
import pkgutil
import sys
from dataclasses import dataclass

import template
from template.engine.errors import ConfigError, DiskError

PROGRAM = f"python -m {template.__name__}"


@dataclass(frozen=True)
class Command:
    """A subcommand: its line in ``--help``, and for one that is not LightningCLI's, ``module:function`` running it."""

    description: str
    runs: str | None = None


# Every subcommand, in the order --help lists them.
COMMANDS: dict[str, Command] = {
    "fit": Command("Train (a named run continues from its newest checkpoint)"),
    "validate": Command("Evaluate a checkpoint on the validation data"),
    "test": Command("Evaluate a checkpoint on the test data"),
    "predict": Command("Write a checkpoint's predictions to a CSV file"),
    "export": Command("Write a checkpoint's network weights for plain PyTorch, or ONNX", f"{__name__}.export:main"),
    "tune": Command(
        "Find a learning rate or the largest batch (Lightning's Tuner): a config file", f"{__name__}.tune:main"
    ),
    "sweep": Command(
        "Search hyper-parameters with Optuna: each trial a fit in its own process (sweep: section)",
        f"{template.__name__}.engine.sweep:main",
    ),
    "cv": Command(
        "K-fold cross-validation, each fold a fit in its own process (--cv.folds)",
        f"{template.__name__}.engine.sweep:cv_main",
    ),
    "runs": Command(
        "List the runs under a folder in one table (status, best score, speed, config differences)",
        f"{template.__name__}.engine.runs.table:main",
    ),
}


def main(args: list[str] | None = None) -> None:
    """``python -m <package>``: the commands that need no training run here, without torch; ``cli.main`` the others."""
    argv = sys.argv[1:] if args is None else list(args)
    name = argv[0] if argv else ""
    if name in ("-h", "--help"):
        epilog = f"Each subcommand has its own --help: {PROGRAM} fit --help"
        parser = argparse.ArgumentParser(prog=PROGRAM, description=template.__doc__, epilog=epilog)
        listed = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
        for each, command in COMMANDS.items():
            listed.add_parser(each, help=command.description)
        return parser.print_help()
    if name not in COMMANDS and not name.startswith("-"):  # options before the subcommand are LightningCLI's
        close = "".join(f" (did you mean {n!r}?)" for n in difflib.get_close_matches(name, COMMANDS, n=1))
        said = f"no subcommand {name!r}{close}" if name else "no subcommand given"
        print(f"error: {said}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    if name == "runs" or name in ("sweep", "cv") and not {"-h", "--help"}.isdisjoint(argv):
        try:  # each prints what it was asked for, with no exit code of its own
            return pkgutil.resolve_name(COMMANDS[name].runs)(argv[1:])
        except (ConfigError, DiskError) as err:  # these commands' only failures, said as cli.main says them
            print(f"error: {err}", file=sys.stderr)
            sys.exit(3 if isinstance(err, DiskError) else 2)
    from template.engine.commands.cli import main as run

    return run(args)
