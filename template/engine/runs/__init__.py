"""Run folders and their record: the one owner of a run folder's layout and names, its lock, how each start ended,
and the ``runs`` table; a folder on object storage (``remote``, through fsspec); other packages ask here for any path
into a run folder. Uses the store, strategies and errors. This module imports neither torch nor Lightning: the runs
table reads run folders with these names alone."""

from __future__ import annotations

import json
import os
import socket
from enum import Enum
from pathlib import Path
from typing import Any

LOGS = "lightning_logs"  # under trainer.default_root_dir: one folder per run
CONFIG = "config.yaml"  # the config of the run's first start; a differing restart's is config.restart-<n>.yaml
PROVENANCE = "provenance.json"  # one entry per start: how the run was made and how that start ended
CHECKPOINTS = "checkpoints"  # the run's checkpoints, unless checkpoint.dirpath puts them elsewhere
LAST = "last.ckpt"  # written at every validation (the checkpoint section's ModelCheckpoint)
INTERRUPTED = "interrupted.ckpt"  # written when a signal stops the run (jobs/preemption.py)
LAST_STEP = "last-step.ckpt"  # written every run.save_every_n_steps steps


class Status(str, Enum):
    """How a start of a run ended, as ``provenance.json`` records it and the ``runs`` table shows it."""

    RUNNING = "running"  # no end written yet: running, unless ``settled`` finds it killed
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # a signal stopped it (its ``signal``), with a checkpoint
    FAILED = "failed"  # an exception ended it (its ``error``), before training too
    KILLED = "killed"  # it wrote no end and its process is gone: SIGKILL, the OOM killer, a lost node
    PRUNED = "pruned"  # a sweep's pruner stopped it
    __str__ = str.__str__  # the value, as written


def run_dir(root: str | os.PathLike | None, name: str) -> Path:
    """The folder of the run ``name`` under ``trainer.default_root_dir``."""
    return Path(root or ".") / LOGS / name


def configs(folder: str | os.PathLike) -> list[Path]:
    """The configs a run saved, oldest first: ``config.yaml``, then each ``config.restart-<n>.yaml``."""
    restarts = _restarts(Path(folder))
    return [p for p in [Path(folder) / CONFIG, *(restarts[n] for n in sorted(restarts))] if p.is_file()]


def restart_config(folder: str | os.PathLike) -> Path:
    """Where a restart whose config differs from the first saves it: the next ``config.restart-<n>.yaml``."""
    return Path(folder) / f"config.restart-{max(_restarts(Path(folder)), default=0) + 1}.yaml"


def _restarts(folder: Path) -> dict[int, Path]:
    return {int(n): p for p in folder.glob("config.restart-*.yaml") if (n := p.name[15:-5]).isdigit()}


def is_remote(path: Any) -> bool:
    """Whether a path is an fsspec URL other than a local file (``s3://bucket/prefix``, ``gs://...``)."""
    if not isinstance(path, str) or "://" not in path:  # a path: fsspec, 0.1 s to import, need not read it
        return False
    from fsspec.utils import get_protocol

    return get_protocol(path) not in ("file", "local")


def config_of(checkpoint: str | os.PathLike) -> Path | str:
    """The ``config.yaml`` of the run a checkpoint in its ``checkpoints/`` folder belongs to (a URL's, a URL)."""
    if is_remote(str(checkpoint)):
        return f"{str(checkpoint).rsplit('/', 2)[0]}/{CONFIG}"
    return Path(checkpoint).resolve().parent.parent / CONFIG


def evaluations(root: str | os.PathLike | None, checkpoint: str | None) -> Path:
    """Where validate, test and predict of ``checkpoint`` log: in the folder of its run (where it is writable), else
    in ``<root>/lightning_logs``."""
    config = config_of(checkpoint) if checkpoint and Path(checkpoint).exists() else None
    ours = isinstance(config, Path) and config.is_file() and os.access(config.parent, os.W_OK)
    return config.parent if ours else Path(root or ".") / LOGS


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint: a folder of torch distributed checkpoint shards (strategy fsdp)."""
    from template.engine.internals import SHARDED_METADATA  # torch, which reading the runs table does not need

    return (Path(path) / SHARDED_METADATA).is_file()


def read_starts(folder: str | os.PathLike, writing: bool = False) -> list[dict[str, Any]]:
    """The starts in the run folder's ``provenance.json``, oldest first and ``settled``; none for a missing file, one
    written by hand or by another tool, or, unless ``writing`` (a new record would replace it), an unreadable one."""
    try:
        starts = json.loads((Path(folder) / PROVENANCE).read_text())["starts"]
    except OSError as err:
        if writing and not isinstance(err, FileNotFoundError):
            raise
        return []
    except (ValueError, KeyError, TypeError):
        return []
    return settled([start for start in starts if isinstance(start, dict)])


def settled(starts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``starts`` (provenance.json's, oldest first) with each start that wrote no end and is not running ``killed``
    (SIGKILL, the OOM killer, a lost node). The folder's lock lets one process at a time run a run, so only the
    newest may still be running: it is unless it ran on this host and its process is gone."""
    for i, start in enumerate(starts):
        newest = i == len(starts) - 1
        alive = newest and may_be_running(start.get("hosts"), start.get("pid"))
        if start.get("status") == Status.RUNNING and not alive:
            start["status"] = Status.KILLED
    return starts


def may_be_running(hosts: Any, pid: Any) -> bool:
    """Whether process ``pid`` of ``hosts`` may still run: only this host's processes can be checked."""
    if hosts != [socket.gethostname()] or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
