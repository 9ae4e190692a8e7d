"""A callback for sweep tests: it records what a trial's process holds when its fit starts, and leaves state behind
when the fit ends (an environment variable, a warnings filter, a logging handler, a signal handler, an open file, the
random generators drawn from), which no later trial may see; and an exit handler, which its process must run."""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import signal
import sys
import warnings
from pathlib import Path

import numpy
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

LEFT = "STATE_PROBE_LEFT"


class StateProbe(Callback):
    """At setup writes ``<record_dir>/<run>.json``; the trial whose run folder is named ``kill_run`` then kills its own
    process with SIGKILL (as the out-of-memory killer would). At its exit the process writes ``<run>.exited``."""

    def __init__(self, record_dir: str, kill_run: str | None = None) -> None:
        self.record_dir = Path(record_dir)
        self.kill_run = kill_run

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run = Path(trainer.log_dir).name
        fds = {fd: _target(fd) for fd in sorted(os.listdir("/proc/self/fd"), key=int)}
        seen = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "parent": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(),
            "orig_argv": sys.orig_argv,
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            "left": os.environ.get(LEFT),
            "files": sorted(target for target in fds.values() if target.startswith("/")),
            "stdout": [fds["1"], fds["2"]],
            "warnings": len(warnings.filters),
            "handlers": len(logging.getLogger().handlers),
            "sigusr2": str(signal.getsignal(signal.SIGUSR2)),
            "random": random.random(),
            "numpy": float(numpy.random.random()),
            "torch_seed": torch.initial_seed(),
        }
        self.record_dir.mkdir(parents=True, exist_ok=True)
        (self.record_dir / f"{run}.json").write_text(json.dumps(seen))
        if run == self.kill_run:
            os.kill(os.getpid(), signal.SIGKILL)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        os.environ[LEFT] = "1"
        warnings.filterwarnings("ignore", message="left by the state probe")
        logging.getLogger().addHandler(logging.NullHandler())
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        self.left_open = (self.record_dir / "left-open.txt").open("a")
        atexit.register((self.record_dir / f"{Path(trainer.log_dir).name}.exited").touch)


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor listdir itself held
        return ""
