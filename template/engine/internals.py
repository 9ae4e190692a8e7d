"""The private names of other packages that the engine relies on, each behind one small function, in one place.

A release that renames one fails its test in tests/test_internals_cli.py instead of silently switching a feature off.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any


class InternalsChanged(RuntimeError):
    """A private name of another package that the engine relies on is gone or behaves differently."""


def _changed(package: str, name: str, needed_for: str) -> InternalsChanged:
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = "(version unknown)"
    return InternalsChanged(
        f"{package} {installed} no longer has `{name}`, which {needed_for} relies on; install a {package} version "
        "from the tested range in README.md (Tested versions), or adapt engine/internals.py"
    )


def _require(obj: Any, attribute: str, package: str, needed_for: str) -> Any:
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _changed(package, f"{type(obj).__name__}.{attribute}", needed_for) from None


# --- used by the command line ---


def print_config_action() -> Any:
    """jsonargparse's ``--print_config`` action: ``skip_print_config()`` defers the print, which
    ``print_config_if_requested(parser, config)`` then does with the configuration the run will use."""
    try:
        from jsonargparse._actions import _ActionPrintConfig
    except ImportError:
        raise _changed("jsonargparse", "_actions._ActionPrintConfig", "--print_config") from None
    for name in ("skip_print_config", "print_config_if_requested"):
        _require(_ActionPrintConfig, name, "jsonargparse", "--print_config")
    return _ActionPrintConfig


def instantiator_class() -> type:
    """LightningCLI's model instantiator (``_InstantiatorFn``), which records the config as hyper-parameters."""
    try:
        from lightning.pytorch.cli import _InstantiatorFn
    except ImportError:
        raise _changed("lightning", "cli._InstantiatorFn", "the model's hyper-parameters") from None
    return _InstantiatorFn
