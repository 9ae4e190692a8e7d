"""A DDP rank that raises, is SIGKILLed or hangs ends the whole job, non-zero, with no process of the job left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONFIGS, PACKAGE, TESTS, cli_env, session_processes

pytestmark = pytest.mark.slow  # DDP jobs whose ranks fail, die or hang

TIMEOUT = 15  # --watchdog.timeout here; it also bounds the rendezvous, so rank 1 must start within it


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks processes through /proc")
@pytest.mark.parametrize(
    ("mode", "rank", "kill_launcher"),
    [("raise", 1, False), ("kill", 1, False), ("hang", 1, False), ("hang", 0, False), ("hang", 1, True)],
    ids=["raise", "sigkill", "hang", "hang-rank0", "hang-then-launcher-sigkilled"],
)
def test_failing_rank_ends_the_job(tmp_path: Path, mode: str, rank: int, kill_launcher: bool) -> None:
    record = tmp_path / "record"
    plant = {
        "trainer": {
            "callbacks": [
                {
                    "class_path": "failure_plant.PlantedFailure",
                    "init_args": {"mode": mode, "rank": rank, "record_dir": str(record)},
                }
            ]
        }
    }
    (tmp_path / "plant.yaml").write_text(yaml.safe_dump(plant))
    command = [
        sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), "--config", "plant.yaml",
        f"--watchdog.timeout={TIMEOUT}", "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = cli_env(PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    # A session of its own: every process the job starts can be found (and, if the test fails, cleaned up) by it.
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    job = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True, **pipes)
    try:
        if kill_launcher:
            # The launcher dies without any cleanup (OOM killer, scheduler): its hung child must not live on.
            deadline = time.monotonic() + 120
            while not (record / "failed-at").is_file():
                assert time.monotonic() < deadline and job.poll() is None, "the planted hang never happened"
                time.sleep(0.1)
            time.sleep(0.5)
            job.send_signal(signal.SIGKILL)
        try:
            _, stderr = job.communicate(timeout=120 + TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {120 + TIMEOUT} s after a planted {mode} on rank {rank}")
        ended = time.time()
        assert (record / "failed-at").is_file(), f"the planted failure never ran:\n{stderr[-3000:]}"
        seconds = ended - float((record / "failed-at").read_text())
        label = f"{mode} on rank {rank}" + (", then rank 0 SIGKILLed" if kill_launcher else "")
        print(f"\n{label}: exit code {job.returncode}, {seconds:.1f} s from failure to job exit")
        assert job.returncode != 0
        # The timeout, then Lightning's launcher sees a child's exit within 5 s (it polls) and gives rank 0 the
        # watchdog's grace (3 s) to fail on its own before it reports the dead rank; a few seconds' margin.
        assert seconds <= TIMEOUT + 15, f"job took {seconds:.1f} s to end after the failure"
        pids = [int(p.read_text()) for p in sorted(record.glob("pid-rank*"))]
        assert len(pids) == 2
        deadline = time.monotonic() + 5  # the kernel may need a moment to reap a SIGKILLed process
        while any(map(_alive, pids)) or session_processes(job.pid):
            assert time.monotonic() < deadline, (
                f"processes of the job still running: ranks {[p for p in pids if _alive(p)]}, "
                f"session {session_processes(job.pid)}"
            )
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
