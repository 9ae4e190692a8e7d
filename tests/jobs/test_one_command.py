"""A fit's signal handling lasts only while its command runs: the process's next command, and the user's own
children, find the signals as they were before it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

from tests.conftest import CONFIGS

SHORT = ("--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false")


def _a_forked_child_dies_of_sigterm() -> bool:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    time.sleep(0.5)  # past the hooks multiprocessing runs in the child
    os.kill(child.pid, signal.SIGTERM)
    child.join(10)
    if child.exitcode is None:
        child.kill()
        child.join(10)
    return child.exitcode == -signal.SIGTERM


def test_after_a_fit_a_forked_child_takes_signals_as_before(run_main) -> None:  # noqa: ANN001
    # As before: an earlier fit in this process without a command around it (build_cli, a Trainer of its own) may
    # have left its handlers, which only a command's end puts back.
    handler, dies = signal.getsignal(signal.SIGTERM), _a_forked_child_dies_of_sigterm()
    for _ in range(2):  # the fork hook is the process's one: two fits leave nothing behind
        result = run_main("fit", "--config", CONFIGS / "default.yaml", *SHORT, "--trainer.accelerator=cpu")
        assert result.returncode == 0, result.stderr[-3000:]
    assert signal.getsignal(signal.SIGTERM) is handler
    assert _a_forked_child_dies_of_sigterm() == dies  # not blocked and left to the (ended) run
