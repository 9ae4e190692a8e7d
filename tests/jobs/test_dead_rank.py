"""A rank of a ddp or fsdp job that dies (SIGKILL as the OOM killer sends it, a segfault) ends the job with one line:
the rank, its signal, the checkpoint the same command continues from; exit code 128 + the signal; no traceback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from template.engine.commands.cli import main
from template.engine.errors import TRACEBACK_VARIABLE
from template.engine.jobs import processes
from template.engine.jobs.processes import DeadRank
from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env, finish, session_processes

WAIT = 240  # seconds for one start; a healthy 2-process start takes 15-25 s here
BASE = [
    "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.val_check_interval=0.5",
    "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--run.name=r", "--config=fault.yaml",
]  # fmt: skip


def test_the_line_names_the_rank_its_signal_and_the_checkpoint() -> None:
    killed = DeadRank(1, 4242, -signal.SIGKILL, "lightning_logs/r/checkpoints/last.ckpt")
    assert killed.exit_code == 137
    assert killed.line() == (
        "rank 1 (PID 4242) was killed by SIGKILL (out of memory, or kill -9 by a user or the scheduler); the job "
        "stops with exit code 137; run the same command to continue from lightning_logs/r/checkpoints/last.ckpt"
    )
    crashed = DeadRank(3, 7, -signal.SIGSEGV, None)
    assert crashed.exit_code == 139
    assert "rank 3 (PID 7) was killed by SIGSEGV (a crash in native code" in crashed.line()
    assert crashed.line().endswith("no checkpoint was written yet: the same command starts from the beginning")
    exited = DeadRank(2, 7, 3, None)
    assert exited.exit_code == 3 and "rank 2 (PID 7) exited with code 3 (its own output says why)" in exited.line()
    # The launcher, seen from a rank it started: its end is its parent's to see, the job's exit status says how.
    parent = DeadRank(0, 7, None, "x.ckpt")
    assert parent.line().startswith("rank 0 (PID 7), which started this process, ended without stopping it")
    assert "\n" not in parent.line() and parent.exit_code == 1
    assert DeadRank(1, 7, -99, None).line().startswith("rank 1 (PID 7) was killed by signal 99;")
    # A rank that torchrun or SLURM started apart from the others cannot name the one that died; their launcher does.
    apart = DeadRank(None, None, None, "x.ckpt")
    assert apart.line() == (
        "another rank of the job ended while this one waited for it (the collective's connection closed): the "
        "launcher's report names which and how; run the same command to continue from x.ckpt"
    )


def test_a_collectives_lost_peer_is_told_from_other_errors() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:59054. This is ...")
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("while syncing the metric") from err
    except ValueError as wrapped:
        assert processes.lost_peer(wrapped)
    assert not processes.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # A process that knows of no dead rank (no trainer yet, or nothing recorded) keeps the exception's own report.
    shapes = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert processes.dead_rank(shapes, None) is None and processes.RankWatchdog().dead_rank(shapes) is None


def test_full_traceback_shows_the_exception_behind_an_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for value, shown in (("", False), ("1", True)):
        monkeypatch.setenv(TRACEBACK_VARIABLE, value)
        with pytest.raises(SystemExit) as exited:
            main(["fit", "--ckpt_path=missing.ckpt", "--trainer.accelerator=cpu"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert ("Traceback (most recent call last)" in err) is shown, err
        assert err.splitlines()[-1].startswith("error: checkpoint 'missing.ckpt' does not exist"), err


def _start(command: list[str], work: Path, env: dict[str, str]) -> tuple[int, str]:
    with (work / "run.log").open("w") as log:
        proc = subprocess.Popen(
            command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        code = finish(proc, WAIT)
    # The job's other ranks end with it; none is left behind in its session (rank 0's watching thread polls 5x/s).
    deadline = time.monotonic() + 5
    while session_processes(proc.pid):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {session_processes(proc.pid)}"
        time.sleep(0.1)
    return code, (work / "run.log").read_text()


# Too long for any process group, under each strategy (single, ddp, fsdp); nan and negative the parser refuses.
STRATEGIES = ("default", "ddp_cpu", "fsdp_cpu")
WATCHDOG_VALUES = {
    **{f"inf-{c}": ("inf", c, "watchdog.timeout=inf is longer than a process group can wait: give at most 1e+09 s")
       for c in STRATEGIES},
    **{f"huge-{c}": ("1e300", c, "watchdog.timeout=1e+300 is longer than a process group can wait")
       for c in STRATEGIES},
    "nan": ("nan", "ddp_cpu", "invalid value 'nan' for 'watchdog.timeout'"),
    "negative": ("-5", "ddp_cpu", "invalid value '-5' for 'watchdog.timeout'"),
}  # fmt: skip


@pytest.mark.parametrize("case", WATCHDOG_VALUES)
def test_a_watchdog_timeout_no_process_group_can_wait_is_one_line(run_main, tmp_path: Path, case: str) -> None:  # noqa: ANN001
    value, config, expected = WATCHDOG_VALUES[case]
    done = run_main("fit", "--config", CONFIGS / f"{config}.yaml", f"--watchdog.timeout={value}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert expected in errors[0], errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks processes through /proc")
@pytest.mark.parametrize(
    ("config", "signal_name", "rank"),
    [
        ("ddp_cpu.yaml", "SIGKILL", 1),
        ("ddp_cpu.yaml", "SIGSEGV", 1),
        ("fsdp_cpu.yaml", "SIGKILL", 1),
        ("ddp_cpu.yaml", "SIGKILL", 0),
    ],
    ids=["ddp-SIGKILL-rank1", "ddp-SIGSEGV-rank1", "fsdp-SIGKILL-rank1", "ddp-SIGKILL-rank0"],
)
def test_a_dead_rank_ends_the_job_with_one_line(tmp_path: Path, config: str, signal_name: str, rank: int) -> None:
    # Mid-epoch, after the first validation wrote last.ckpt: rank `rank` sends itself the signal from a callback.
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: "
        f"{{moment: train_batch, signal: {signal_name}, epoch: 0, batch: 5, ranks: [{rank}]}}\n"
    )
    command = [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / config), *BASE]
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop(TRACEBACK_VARIABLE, None)

    code, output = _start(command, tmp_path, env)
    assert (tmp_path / "fault.fired").is_file(), output[-3000:]
    signum = int(getattr(signal, signal_name))
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    checkpoint = os.path.join("lightning_logs", "r", "checkpoints", "last.ckpt")
    if rank == 0:
        # Rank 0 started the others: the job is rank 0, ended by the signal as a shell shows it (128 + the signal);
        # the rank it started says so, and where to continue from.
        assert code == -signum, output[-3000:]
        assert re.fullmatch(
            rf"error: rank 0 \(PID \d+\), which started this process, ended without stopping it: .*; run the same "
            rf"command to continue from {re.escape(checkpoint)}",
            errors[0],
        ), errors[0]
    else:
        assert code == 128 + signum, output[-3000:]
        assert re.fullmatch(
            rf"error: rank {rank} \(PID \d+\) was killed by {signal_name} \(.*\); the job stops with exit code "
            rf"{128 + signum}; run the same command to continue from {re.escape(checkpoint)} \({TRACEBACK_VARIABLE}=1 "
            r"shows this rank's traceback\)",
            errors[0],
        ), errors[0]

    # The same command continues from that checkpoint and finishes.
    code, output = _start(command, tmp_path, env)
    assert code == 0, output[-4000:]
    assert f"resuming from {checkpoint} (epoch 0, step 4)" in output, output[-3000:]


@pytest.mark.slow
def test_a_collective_on_one_rank_before_training_is_named_within_the_setup_bound(tmp_path: Path) -> None:
    """A user's ``trainer.log_dir`` under ``is_global_zero`` in ``on_fit_start``: the other rank never joins its
    broadcast. Named after ``watchdog.setup_timeout``, not the 600 s of ``watchdog.timeout``, pointing at that code."""
    command = [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), *BASE[:-1]]
    command += ["--trainer.callbacks+=one_rank.LogDirOnRankZero", "--watchdog.setup_timeout=10"]
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "jobs"), os.environ.get("PYTHONPATH", "")]))
    code, output = _start(command, tmp_path, env)  # within its bound (less than watchdog.timeout's 600 s)
    assert code == 1, output[-3000:]
    assert "a collective waited more than watchdog.setup_timeout=10 s: before the first training step" in output
    assert "raise --watchdog.setup_timeout" in output
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert re.search(r"LogDirOnRankZero.on_fit_start \(\S*one_rank.py:9\)", line), line


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks processes through /proc")
def test_under_torchrun_the_surviving_rank_says_one_line(tmp_path: Path) -> None:
    """Each rank started apart by torchrun's agent: the agent reports which died; the rank left says one line."""
    (tmp_path / "fault.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: fault.Fault\n      init_args: "
        "{moment: train_batch, signal: SIGKILL, epoch: 0, batch: 5, ranks: [1]}\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        "bash", str(REPO / "scripts" / "torchrun.sh"), "--nproc_per_node=2", f"--master_port={port}", "--run_id=t1",
        "fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), *BASE[:-2], "--config=fault.yaml",
    ]  # fmt: skip
    env = cli_env(
        PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    env.pop(TRACEBACK_VARIABLE, None)

    code, output = _start(command, tmp_path, env)
    assert code != 0 and (tmp_path / "fault.fired").is_file(), output[-3000:]
    checkpoint = os.path.join("lightning_logs", "torchrun-t1", "checkpoints", "last.ckpt")
    ours = (
        "error: another rank of the job ended while this one waited for it (the collective's connection closed): the "
        f"launcher's report names which and how; run the same command to continue from {checkpoint}"
    )
    # The agent's SIGTERM to rank 0 can come while Lightning hands rank 0's failure to the callbacks: recorded, it
    # does not replace the failure's line.
    lines = [line for line in output.splitlines() if line == ours or line.startswith("Stopping on")]
    assert lines == [ours], output[-4000:]
    assert "[rank0]" not in output and "error:" not in output.replace(ours, ""), output[-4000:]  # no traceback
    assert "Signal 9 (SIGKILL) received by PID" in output  # torchrun's report names the dead rank

    code, output = _start(command, tmp_path, env)
    assert code == 0, output[-4000:]
    assert f"resuming from {checkpoint} (epoch 0, step 4)" in output, output[-3000:]
