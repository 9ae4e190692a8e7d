"""The machinery that runs any LightningModule. Not yours to edit: your code imports only the names listed here.

Packages, each using only those listed after it (``lint-imports`` checks it, pyproject.toml): ``sweep`` (sweeps and
cross-validation), ``commands``, ``jobs`` (signals, dead ranks), ``resume`` (exact resume, checkpoint files), ``runs``
(run folders and their record), ``strategies`` (dp, fsdp, devices, batch), ``logs``, ``store`` (crash-safe writes),
``errors``, ``internals`` (other packages' private names).
"""

from importlib import import_module
from typing import Any

# Each public name and the module defining it, imported on first use (`runs` lists run folders without torch).
PUBLIC = {
    "ConfigError": "errors",
    "DiskError": "errors",
    "disk_error": "errors",
    "atomic_torch_save": "store",
    "fold_indices": "sweep.folds",
    "load_weights": "commands.export",
    "built_by_lightning_cli": "internals",
}
__all__ = list(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{PUBLIC[name]}"), name)
