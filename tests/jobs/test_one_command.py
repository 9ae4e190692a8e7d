"""A fit's signal handling lasts only while it runs: the process's next command, and the user's own children, find
the signals as they were."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from tests.conftest import CONFIGS

SHORT = ("--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false")


def test_after_a_fit_a_forked_child_takes_signals_as_it_would(run_main) -> None:  # noqa: ANN001
    before = signal.getsignal(signal.SIGTERM)
    for _ in range(2):  # the fork hook is the process's one: two fits leave nothing behind
        result = run_main("fit", "--config", CONFIGS / "default.yaml", *SHORT, "--trainer.accelerator=cpu")
        assert result.returncode == 0, result.stderr[-3000:]
    assert signal.getsignal(signal.SIGTERM) is before
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    time.sleep(0.5)  # past the hooks multiprocessing runs in the child
    os.kill(child.pid, signal.SIGTERM)
    child.join(10)
    assert child.exitcode == -signal.SIGTERM  # not blocked and left to the (ended) run
