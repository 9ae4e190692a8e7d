"""Long runs on clusters: a SLURM time-limit signal requeues the job and the same command continues it exactly; SIGTERM
ends with a checkpoint; torchrun restarts a killed worker and the run continues from its newest checkpoint."""

from __future__ import annotations

import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, PACKAGE, REPO, TESTS, cli_env, finish, session_processes

pytestmark = pytest.mark.slow  # signals and restarts of running jobs, DDP and torchrun included

WAIT = 120  # seconds for any one wait on a child; a healthy run here takes 5-25 s
COMMON = [
    "--trainer.accelerator=cpu", "--trainer.deterministic=true", "--trainer.limit_train_batches=8",
    "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
    "--trainer.max_epochs=2", "--trainer.enable_model_summary=false",
]  # fmt: skip
SINGLE = ["fit", "--config", str(CONFIGS / "default.yaml"), *COMMON]
DDP = ["fit", "--config", str(CONFIGS / "ddp_cpu.yaml"), *COMMON]
# Paces the steps (so that a signal lands mid-epoch) and reports each one in steps.txt.
MARKER = """trainer:
  callbacks:
    - class_path: step_marker.StepMarker
      init_args: {path: steps.txt, delay: 0.25}
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(path: Path) -> list[tuple[int, float]]:
    if not path.is_file():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(int(line[0]), float(line[1])) for line in lines if len(line) == 2]


def _wait_for_step(path: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT
    while not any(s >= step for s, _ in _steps(path)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"step {step} not reached (exit code {proc.poll()})")
        time.sleep(0.05)


def _start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    log = (cwd / "run.log").open("a")
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=_ctrl_c_as_in_a_terminal,
    )  # fmt: skip


def _ctrl_c_as_in_a_terminal() -> None:
    # A suite started in the background (`cmd &` in a script) passes SIGINT on ignored, which the run then keeps
    # ignored (as under nohup): the runs here get Ctrl-C as a terminal gives it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finish(proc: subprocess.Popen, timeout: float = WAIT) -> int:
    return finish(proc, timeout)


def _weights(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def _max_difference(a: dict, b: dict) -> float:
    assert a["global_step"] == b["global_step"]
    tensors = [(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]]
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        tensors += [(opt_a["state"][i][k], opt_b["state"][i][k]) for i in opt_a["state"] for k in opt_a["state"][i]]
    return max((torch.as_tensor(x).double() - torch.as_tensor(y).double()).abs().max().item() for x, y in tensors)


def _check_logged_once(run: Path, steps: int) -> None:
    """Every training step in metrics.csv and in TensorBoard exactly once, epoch values once per epoch."""
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for column in ("train_loss_step", "train_loss"):
        if column in rows[0]:
            logged = [int(r["step"]) for r in rows if r[column]]
            break
    assert logged == list(range(steps)), logged
    for column in ("val_acc", "train_loss_epoch"):
        assert len([r for r in rows if r.get(column)]) == 2, column  # one value per epoch, 2 epochs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()
    tag = column if (column := "train_loss_step") in events.Tags()["scalars"] else "train_loss"
    assert [e.step for e in events.Scalars(tag)] == list(range(steps))
    assert len(events.Scalars("val_acc")) == 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted single-process run: its final checkpoint."""
    work = tmp_path_factory.mktemp("straight")
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--run.name=straight"]
    done = subprocess.run(command, cwd=work, env=_env(work), capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "lightning_logs" / "straight" / "checkpoints" / "last.ckpt"


def test_slurm_signal_requeues_and_the_same_command_continues_exactly(straight: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol as SLURM's controller sees it: the requeue request is recorded.
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "marker.yaml").write_text(MARKER)
    # What srun gives the one task of a batch job (sbatch --ntasks=1).
    env = _env(
        tmp_path, PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]), SLURM_JOB_ID="777", SLURM_JOBID="777",
        SLURM_JOB_NAME="simulated", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1",
        SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1",
        SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(_free_port()),
    )  # fmt: skip
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", "marker.yaml"]
    run = tmp_path / "lightning_logs" / "slurm-777"

    first = _start(command, tmp_path, env)
    _wait_for_step(tmp_path / "steps.txt", 5, first)
    signalled = time.time()
    first.send_signal(signal.SIGUSR1)
    assert _finish(first, 60) == 128 + signal.SIGUSR1
    checkpoint = run / "checkpoints" / "interrupted.ckpt"
    seconds = checkpoint.stat().st_mtime - signalled
    assert (tmp_path / "scontrol.log").read_text() == "requeue 777\n"
    stopped_at = _weights(checkpoint)["global_step"]
    assert 5 <= stopped_at < 8, "stopped mid-epoch, within a step of the signal"

    # The requeued job: the same command and environment, nothing added.
    restarted = time.time()
    second = _start(command, tmp_path, env)
    assert _finish(second) == 0, (tmp_path / "run.log").read_text()[-4000:]
    output = (tmp_path / "run.log").read_text()
    assert f"Run slurm-777 ({run.relative_to(tmp_path)}): no checkpoint yet, starting from the beginning" in output
    assert f"resuming from {Path('lightning_logs/slurm-777/checkpoints/interrupted.ckpt')} (epoch 0, step " in output
    first_step = next(t for s, t in _steps(tmp_path / "steps.txt") if t > restarted)
    difference = _max_difference(_weights(straight), _weights(run / "checkpoints" / "last.ckpt"))
    print(
        f"\nSLURM requeue: signal to checkpoint written {seconds:.2f} s (one paced step is 0.25 s); restart to first "
        f"step {first_step - restarted:.1f} s; stopped after step {stopped_at}; max abs weight difference {difference}"
    )
    assert difference == 0.0
    _check_logged_once(run, 16)
    assert (run / "config.yaml").is_file() and not list(run.glob("config.restart-*.yaml"))  # same config: kept once


def test_sigterm_writes_a_checkpoint_and_exits_non_zero(tmp_path: Path) -> None:
    (tmp_path / "marker.yaml").write_text(MARKER)
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", "marker.yaml", "--run.name=term"]
    proc = _start(command, tmp_path, _env(tmp_path))
    _wait_for_step(tmp_path / "steps.txt", 3, proc)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc, 60) == 128 + signal.SIGTERM
    seconds = time.monotonic() - signalled
    checkpoint = tmp_path / "lightning_logs" / "term" / "checkpoints" / "interrupted.ckpt"
    assert _weights(checkpoint)["global_step"] >= 3
    assert "Stopping on SIGTERM: checkpoint" in (tmp_path / "run.log").read_text()
    print(f"\nSIGTERM: process gone {seconds:.2f} s after the signal, checkpoint written")
    assert seconds < 30


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-process DDP run (Lightning's own launcher): its final checkpoint."""
    work = tmp_path_factory.mktemp("straight_ddp")
    command = [sys.executable, "-m", PACKAGE, *DDP, "--run.name=straight"]
    env = _env(work, MASTER_PORT=str(_free_port()))
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "lightning_logs" / "straight" / "checkpoints" / "last.ckpt"


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def test_torchrun_restarts_a_killed_worker_and_the_run_continues_exactly(straight_ddp: Path, tmp_path: Path) -> None:
    (tmp_path / "marker.yaml").write_text(MARKER)
    command = [
        "bash", str(REPO / "scripts" / "torchrun.sh"), "--nproc_per_node=2", "--max-restarts=1",
        f"--master_port={_free_port()}", "--run_id=elastic", *DDP, "--config", "marker.yaml",
        "--run.save_every_n_steps=1",
    ]  # fmt: skip
    proc = _start(command, tmp_path, _env(tmp_path, PYTHON=sys.executable))
    _wait_for_step(tmp_path / "steps.txt", 5, proc)
    workers = _children(proc.pid)  # the script execs torchrun: its children are the two workers
    assert len(workers) == 2, workers
    killed = time.time()
    os.kill(workers[-1], signal.SIGKILL)
    assert _finish(proc, 180) == 0, (tmp_path / "run.log").read_text()[-4000:]
    output = (tmp_path / "run.log").read_text()
    assert "resuming from" in output and "last-step.ckpt" in output
    run = tmp_path / "lightning_logs" / "torchrun-elastic"
    first_step = next(t for s, t in _steps(tmp_path / "steps.txt") if t > killed)
    difference = _max_difference(_weights(straight_ddp), _weights(run / "checkpoints" / "last.ckpt"))
    print(
        f"\ntorchrun restart: worker SIGKILLed to first step of the restarted group {first_step - killed:.1f} s; "
        f"max abs weight difference against the uninterrupted DDP run {difference}"
    )
    assert difference == 0.0
    _check_logged_once(run, 16)


# Signals in every phase of fit, and Ctrl-C: each ends non-zero with interrupted.ckpt, and the same command goes on.


def _marker(tmp_path: Path, **init_args: float) -> str:
    args = ", ".join(f"{k}: {v}" for k, v in {"path": "steps.txt", **init_args}.items())
    (tmp_path / "marker.yaml").write_text(MARKER.replace("{path: steps.txt, delay: 0.25}", "{" + args + "}"))
    return "marker.yaml"


def _wait_for_mark(path: Path, prefix: str, proc: subprocess.Popen) -> int:
    """Waits for a ``<prefix> <step> <time>`` line of StepMarker (sanity, val, end); returns its step."""
    deadline = time.monotonic() + WAIT
    while True:
        lines = [line.split() for line in path.read_text().splitlines()] if path.is_file() else []
        marks = [int(line[1]) for line in lines if len(line) == 3 and line[0] == prefix]
        if marks:
            return marks[0]
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {prefix!r} mark (exit code {proc.poll()})")
        time.sleep(0.05)


def _signal_and_finish(proc: subprocess.Popen, signum: int) -> tuple[int, float]:
    signalled = time.monotonic()
    proc.send_signal(signum)
    code = _finish(proc, 60)
    return code, time.monotonic() - signalled


def _check_stopped(tmp_path: Path, run: str, signum: int, code: int) -> dict:
    """Exit code 128 + signal, the line saying so, no traceback; the checkpoint, loaded as Lightning does."""
    output = (tmp_path / "run.log").read_text()
    assert code == 128 + signum, output[-4000:]
    name = signal.Signals(signum).name
    assert f"Stopping on {name}: checkpoint " in output and "; run the same command to continue" in output
    assert "Traceback" not in output, output[-4000:]
    return _weights(tmp_path / "lightning_logs" / run / "checkpoints" / "interrupted.ckpt")


def _continue(command: list[str], tmp_path: Path, run: str, step: int) -> dict:
    """The same command again: it resumes from the step where the run stopped (from interrupted.ckpt, or from
    last.ckpt when Lightning wrote it again as the stopped fit ended) and ends normally; its last checkpoint."""
    (tmp_path / "run.log").write_text("")
    proc = _start(command, tmp_path, _env(tmp_path))
    output = lambda: (tmp_path / "run.log").read_text()  # noqa: E731
    assert _finish(proc) == 0, output()[-4000:]
    resumed = rf"resuming from \S+/(interrupted|last)\.ckpt \(epoch \d+, step {step}\)"
    assert re.search(resumed, output()), output()[-4000:]
    return _weights(tmp_path / "lightning_logs" / run / "checkpoints" / "last.ckpt")


def test_sigterm_during_the_sanity_check_exits_143_without_a_checkpoint(tmp_path: Path) -> None:
    # Nothing is trained yet: the same command starts again from the run's newest checkpoint (none on a first start).
    marker = _marker(tmp_path, val_delay=1.0)
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", marker, "--run.name=sanity"]
    proc = _start(command, tmp_path, _env(tmp_path))
    _wait_for_mark(tmp_path / "steps.txt", "sanity", proc)
    code, seconds = _signal_and_finish(proc, signal.SIGTERM)
    output = (tmp_path / "run.log").read_text()
    assert code == 128 + signal.SIGTERM, output[-4000:]
    assert "Stopping on SIGTERM in the sanity check" in output and "nothing trained yet" in output
    assert "Traceback" not in output and not _steps(tmp_path / "steps.txt")  # no step trained
    assert not list((tmp_path / "lightning_logs" / "sanity").glob("checkpoints/*.ckpt"))
    print(f"\nSIGTERM in the sanity check: exit {code} {seconds:.2f} s after the signal")


def test_sigterm_during_validation_finishes_it_stops_and_the_same_command_finishes(tmp_path: Path) -> None:
    marker = _marker(tmp_path, val_delay=0.5)
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", marker, "--run.name=val"]
    proc = _start(command, tmp_path, _env(tmp_path))
    step = _wait_for_mark(tmp_path / "steps.txt", "val", proc)  # the first validation batch after epoch 0
    code, seconds = _signal_and_finish(proc, signal.SIGTERM)
    assert step == 8 and _check_stopped(tmp_path, "val", signal.SIGTERM, code)["global_step"] == 8
    assert _continue(command, tmp_path, "val", step=8)["global_step"] == 16
    print(f"\nSIGTERM in validation: exit {code} {seconds:.2f} s after the signal; the same command ends at step 16")


def test_sigterm_after_the_last_step_exits_143_and_the_same_command_trains_no_more(tmp_path: Path) -> None:
    marker = _marker(tmp_path, end_delay=3.0)
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", marker, "--run.name=end"]
    proc = _start(command, tmp_path, _env(tmp_path))
    step = _wait_for_mark(tmp_path / "steps.txt", "end", proc)
    code, seconds = _signal_and_finish(proc, signal.SIGTERM)
    assert step == 16 and _check_stopped(tmp_path, "end", signal.SIGTERM, code)["global_step"] == 16
    trained = len(_steps(tmp_path / "steps.txt"))
    assert _continue(command, tmp_path, "end", step=16)["global_step"] == 16
    assert len(_steps(tmp_path / "steps.txt")) == trained, "the continued run trained again"
    print(f"\nSIGTERM after the last step: exit {code} {seconds:.2f} s after the signal; the same command trains none")


def test_ctrl_c_writes_a_checkpoint_exits_130_and_the_same_command_continues(tmp_path: Path) -> None:
    marker = _marker(tmp_path, delay=0.25)
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", marker, "--run.name=ctrl-c"]
    proc = _start(command, tmp_path, _env(tmp_path))
    _wait_for_step(tmp_path / "steps.txt", 3, proc)
    code, seconds = _signal_and_finish(proc, signal.SIGINT)
    stopped_at = _check_stopped(tmp_path, "ctrl-c", signal.SIGINT, code)["global_step"]
    assert 3 <= stopped_at < 8
    assert _continue(command, tmp_path, "ctrl-c", step=stopped_at)["global_step"] == 16
    print(f"\nCtrl-C: exit {code} {seconds:.2f} s after the signal at step {stopped_at}; the same command ends at 16")


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    marker = _marker(tmp_path, delay=60)  # the first Ctrl-C's safe point, the next step's end, is a minute away
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", marker, "--run.name=twice"]
    proc = _start(command, tmp_path, _env(tmp_path))
    _wait_for_step(tmp_path / "steps.txt", 1, proc)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    code = _finish(proc, 30)
    seconds = time.monotonic() - signalled
    assert code != 0 and seconds < 20, (code, seconds)
    assert not (tmp_path / "lightning_logs" / "twice" / "checkpoints" / "interrupted.ckpt").exists()
    print(f"\nCtrl-C twice: exit {code} {seconds:.2f} s after the first")


def test_sigterm_during_validation_under_ddp_stops_every_rank_with_a_checkpoint(tmp_path: Path) -> None:
    # Rank 0's exit is slowed past the 5 s at which Lightning's launcher looks at its child ranks: a child that
    # exits non-zero first gets rank 0 killed before it writes the logs (exit -9, no metrics.csv).
    marker = _marker(tmp_path, val_delay=0.5, exit_delay=6)
    command = [sys.executable, "-m", PACKAGE, *DDP, "--config", marker, "--run.name=ddp-val"]
    proc = _start(command, tmp_path, _env(tmp_path, MASTER_PORT=str(_free_port())))
    step = _wait_for_mark(tmp_path / "steps.txt", "val", proc)
    code, seconds = _signal_and_finish(proc, signal.SIGTERM)  # rank 0 only: the ranks agree at the next batch end
    assert step == 8 and _check_stopped(tmp_path, "ddp-val", signal.SIGTERM, code)["global_step"] == 8
    with (tmp_path / "lightning_logs" / "ddp-val" / "metrics.csv").open(newline="") as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")] == list(range(8))
    print(f"\nSIGTERM in validation under DDP: exit {code} {seconds:.2f} s after the signal")


def test_sigterm_mid_epoch_under_ddp_stops_at_the_next_agreement_of_the_ranks(tmp_path: Path) -> None:
    # Steps of 0.25 s: the ranks compare signals about once a second (run.preemption_check_interval), every 4 steps.
    marker = _marker(tmp_path, delay=0.25, exit_delay=6)
    command = [sys.executable, "-m", PACKAGE, *DDP, "--config", marker, "--run.name=ddp-mid", "--trainer.max_epochs=1",
               "--trainer.limit_train_batches=40"]  # fmt: skip
    proc = _start(command, tmp_path, _env(tmp_path, MASTER_PORT=str(_free_port())))
    _wait_for_step(tmp_path / "steps.txt", 20, proc)
    signalled, step = time.time(), _steps(tmp_path / "steps.txt")[-1][0]
    code, _ = _signal_and_finish(proc, signal.SIGTERM)  # rank 0 only
    stopped = _check_stopped(tmp_path, "ddp-mid", signal.SIGTERM, code)["global_step"]
    written = (tmp_path / "lightning_logs" / "ddp-mid" / "checkpoints" / "interrupted.ckpt").stat().st_mtime
    print(f"\nSIGTERM mid-epoch under DDP: signal after step {step}, checkpoint at step {stopped}, written "
          f"{written - signalled:.2f} s after the signal (steps of 0.25 s)")  # fmt: skip
    assert step <= stopped <= step + 8 and stopped < 40  # a stride of at most 2 s of steps, the next safe point


# A signal to the whole process group, as SLURM's time limit, scancel or a terminal's Ctrl-C sends it: each process of
# the job gets it, DataLoader workers and ranks still importing included (tests/jobs/test_soak.py: at random moments).


def _left(proc: subprocess.Popen) -> list[int]:
    """The processes of the job's session still there a few seconds after it ended (a SIGKILLed one is reaped late)."""
    deadline = time.monotonic() + 10
    while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_sigterm_to_the_group_with_dataloader_workers_stops_with_a_checkpoint(tmp_path: Path, persistent: bool) -> None:
    # The workers used to die of it at once, and torch's SIGCHLD handler raised "DataLoader worker (pid N) is killed
    # by signal: Terminated" in the middle of the checkpoint's write: exit 1, a traceback.
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--config", _marker(tmp_path, delay=0.25), "--run.name=group",
               "--data.num_workers=2", f"--data.persistent_workers={persistent}"]  # fmt: skip
    proc = _start(command, tmp_path, _env(tmp_path))
    _wait_for_step(tmp_path / "steps.txt", 3, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    code = _finish(proc, 60)
    stopped_at = _check_stopped(tmp_path, "group", signal.SIGTERM, code)["global_step"]
    assert not _left(proc), "a DataLoader worker outlived the run"
    assert _continue(command, tmp_path, "group", step=stopped_at)["global_step"] == 16


def test_ctrl_c_to_the_group_while_ddp_starts_stops_at_the_sanity_check(tmp_path: Path) -> None:
    # Rank 1 still imports when the signal comes: the signals wait until each rank's fit takes them (a rank launched
    # meanwhile inherits the wait), and every rank stops at the first safe point together. It used to be rank 1's
    # KeyboardInterrupt traceback, then Lightning's launcher SIGKILLing the job (exit 137).
    command = [sys.executable, "-m", PACKAGE, *DDP, "--run.name=ddp-start"]
    proc = _start(command, tmp_path, _env(tmp_path, MASTER_PORT=str(_free_port())))
    deadline = time.monotonic() + WAIT
    while "Initializing distributed: GLOBAL_RANK: 0" not in (tmp_path / "run.log").read_text():  # rank 1 launched
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    code = _finish(proc, WAIT)
    output = (tmp_path / "run.log").read_text()
    assert code == 130 and "Traceback" not in output, output[-4000:]
    assert "Stopping on SIGINT in the sanity check" in output and "nothing trained yet" in output, output[-3000:]
    assert not _left(proc), "a rank outlived the job"


@pytest.mark.parametrize("after", [0.5, 2.5], ids=["rank-1-starting", "rank-1-importing"])
def test_no_rank_outlives_the_launcher_by_a_second_after_a_signal_as_ddp_starts(tmp_path: Path, after: float) -> None:
    # It used to be rank 1 alive 3 s after the launcher ended: a rank still starting saw neither the signal (which
    # waits until its fit takes it) nor its launcher's end (watched only from its fit's setup on).
    command = [sys.executable, "-m", PACKAGE, *DDP, "--run.name=ddp-start"]
    proc = _start(command, tmp_path, _env(tmp_path, MASTER_PORT=str(_free_port())))
    deadline = time.monotonic() + WAIT
    while "Initializing distributed: GLOBAL_RANK: 0" not in (tmp_path / "run.log").read_text():  # rank 1 launched
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGTERM)
    _finish(proc, WAIT)
    ended = time.monotonic()
    while (left := session_processes(proc.pid)) and time.monotonic() < ended + 1:
        time.sleep(0.05)
    assert not left, f"processes left a second after the launcher ended: {left}"


def test_a_sigterm_lightning_catches_as_a_resumed_run_starts_stops_it_with_a_checkpoint(tmp_path: Path) -> None:
    # A resumed run has no sanity check: from Lightning's installing its handler to the run's taking SIGTERM over as
    # training starts, Lightning's handler records the signal too, and ended the run in the validation that a restart
    # from a mid-epoch last.ckpt runs first: exit 0, no checkpoint (the soak saw a run end at step 12 of 16).
    faults = {
        "first.yaml": "moment: train_batch, epoch: 0, batch: 5, signal: SIGKILL",
        "second.yaml": "moment: train_start",
    }
    for name, fault in faults.items():
        (tmp_path / name).write_text(
            f"trainer:\n  callbacks:\n    - {{class_path: fault.Fault, init_args: {{{fault}}}}}\n"
        )
    command = [sys.executable, "-m", PACKAGE, *SINGLE, "--trainer.val_check_interval=0.5", "--run.name=taken"]
    assert _finish(_start([*command, "--config", "first.yaml"], tmp_path, _env(tmp_path))) == -signal.SIGKILL
    (tmp_path / "fault.fired").unlink()
    code = _finish(_start([*command, "--config", "second.yaml"], tmp_path, _env(tmp_path)))
    output = (tmp_path / "run.log").read_text()
    assert "resuming from lightning_logs/taken/checkpoints/last.ckpt (epoch 0, step 4)" in output, output[-3000:]
    assert _check_stopped(tmp_path, "taken", signal.SIGTERM, code)["global_step"] == 5  # the first safe point
    assert _continue(command, tmp_path, "taken", step=5)["global_step"] == 16
