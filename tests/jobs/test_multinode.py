"""Two nodes simulated on one machine: torchrun agents through scripts/torchrun.sh, and SLURM through
scripts/slurm.sbatch with the environment srun gives its tasks. CPU processes over gloo, loopback only."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from template.data import _read_archive
from tests.conftest import CONFIGS, PACKAGE, REPO, cli_env

SCRIPTS = REPO / "scripts"
TIMEOUT = 180  # seconds for a whole simulated job; a healthy one takes 10-25 s on 2 busy cores
TRAIN = (
    "fit",
    "--config", str(CONFIGS / "ddp_cpu.yaml"),
    "--trainer.num_nodes=2",
    "--trainer.devices=1",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
)  # fmt: skip

# A DataModule that notes which node ran prepare_data, to show it runs once per node on a shared data_dir.
COUNTING_DATA = f"""
from pathlib import Path

from {PACKAGE}.data import DigitsDataModule


class CountingDigits(DigitsDataModule):
    def prepare_data(self):
        with open(Path(self.data_dir).parent / "prepare_data.log", "a") as log:
            log.write(f"node {{self.trainer.node_rank}}\\n")
        super().prepare_data()
"""

# Stands in for srun on a machine without SLURM: starts SLURM_NTASKS copies of the command with the per-task
# variables srun sets, spread over SLURM_NNODES pretend nodes; exits with the worst task's code.
FAKE_SRUN = """#!{python}
import os, subprocess, sys

args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options
    args.pop(0)
ntasks, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for rank in range(ntasks):
    node = rank // per_node
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(node),
               SLURM_STEP_ID="0", SLURM_STEPID="0", SLURMD_NODENAME=f"node{{node}}", SLURM_STEP_NUM_TASKS=str(ntasks))
    tasks.append(subprocess.Popen(args, env=env))
sys.exit(max(task.wait() for task in tasks))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Launched processes, each in its own process group so that a timeout can end all of their children."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = self.workdir / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append((proc, log))

    def wait(self, timeout: float) -> tuple[list[int], str, float]:
        """Exit codes, the combined output, and the wall time from the first start; fails the test on timeout."""
        start, deadline = time.monotonic(), time.monotonic() + timeout
        try:
            codes = [proc.wait(timeout=max(0.1, deadline - time.monotonic())) for proc, _ in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the simulated job did not finish in {timeout} s:\n{self.output()[-4000:]}")
        return codes, self.output(), time.monotonic() - start

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for _, log in self.procs)

    def kill(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def job(tmp_path):
    (tmp_path / "counting_data.py").write_text(COUNTING_DATA)
    launched = Job(tmp_path)
    yield launched
    launched.kill()  # nothing outlives the test, whatever happened


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The test session's cluster variables left out: each test states the ones its launcher would see."""
    env = {k: v for k, v in cli_env().items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def check_single_run(tmp_path: Path, output: str, cluster: str, folder: str = "version_0") -> None:
    """One run folder with one set of checkpoints, a sound shared data_dir, and a world of 2 processes on 2 nodes."""
    runs = list((tmp_path / "lightning_logs").iterdir())
    assert [run.name for run in runs] == [folder], output[-3000:]
    names = sorted(path.name for path in (runs[0] / "checkpoints").iterdir())
    assert len(names) == 2 and names[0].startswith("best-") and names[1] == "last.ckpt", names
    ckpt = torch.load(runs[0] / "checkpoints" / "last.ckpt", weights_only=True)
    summary = ckpt["callbacks"]["BatchScaling"]["summary"]
    assert (summary["world_size"], summary["num_nodes"], summary["devices_per_node"]) == (2, 2, 1)
    assert summary["cluster_environment"] == cluster and summary["strategy"] == "ddp"
    assert (summary["batch_per_process"], summary["effective_batch_size"]) == (32, 64)
    assert output.count("Run: strategy ddp") == 1, "the run summary is printed by rank zero only"

    # prepare_data ran on each node against the same data_dir; the cache is whole and alone there.
    assert sorted((tmp_path / "prepare_data.log").read_text().split("\n")[:-1]) == ["node 0", "node 1"]
    assert [path.name for path in (tmp_path / "data").iterdir()] == ["digits.pt"]
    cache = torch.load(tmp_path / "data" / "digits.pt", weights_only=True)
    packaged = _read_archive()
    assert torch.equal(cache["images"], packaged["images"]) and torch.equal(cache["labels"], packaged["labels"])


def report(name: str, seconds: float) -> None:
    print(f"\n{name}: wall time {seconds:.1f} s")


@pytest.mark.slow
def test_two_torchrun_agents_train_one_model(job, tmp_path):
    port = str(free_port())
    data = ("--data.class_path=counting_data.CountingDigits", f"--data.init_args.data_dir={tmp_path / 'data'}")
    # Node 0 with --flag=value from flags, node 1 from environment variables and dashed flags: both forms users write.
    job.start(
        "node0",
        ["bash", str(SCRIPTS / "torchrun.sh"), "--nnodes=2", "--nproc_per_node=1", "--node_rank=0",
         "--master_addr=127.0.0.1", f"--master_port={port}", *TRAIN, *data],
        child_env(tmp_path),
    )  # fmt: skip
    job.start(
        "node1",
        ["bash", str(SCRIPTS / "torchrun.sh"), "--node-rank", "1", "--", *TRAIN, *data],
        child_env(tmp_path, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
    )  # fmt: skip
    codes, output, seconds = job.wait(TIMEOUT)
    assert codes == [0, 0], output[-4000:]
    check_single_run(tmp_path, output, "TorchElasticEnvironment")
    report("torchrun, 2 nodes x 1 process", seconds)


@pytest.mark.slow
def test_slurm_job_with_srun_environment_trains(job, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    # What sbatch gives the batch script for `--nodes=2 --ntasks-per-node=1`; MASTER_PORT picks a free port.
    env = child_env(
        tmp_path,
        PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        SLURM_JOB_ID="4242",
        SLURM_JOBID="4242",
        SLURM_JOB_NAME="simulated",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS="2",
        SLURM_NPROCS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_NODELIST="127.0.0.1",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_SUBMIT_DIR=str(tmp_path),
        MASTER_PORT=str(free_port()),
    )
    data = ("--data.class_path=counting_data.CountingDigits", f"--data.init_args.data_dir={tmp_path / 'data'}")
    job.start("job", ["bash", str(SCRIPTS / "slurm.sbatch"), *TRAIN, *data], env)
    codes, output, seconds = job.wait(TIMEOUT)
    assert codes == [0], output[-4000:]
    # A SLURM batch job's run folder is named after the job: its requeued restarts continue there.
    check_single_run(tmp_path, output, "SLURMEnvironment", folder="slurm-4242")
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output
    report("SLURM (srun environment), 2 nodes x 1 task", seconds)


@pytest.mark.slow
def test_launcher_and_config_disagreeing_is_one_line(job, tmp_path):
    # torchrun starts 2 processes on this node but the config says 1 device on 1 node.
    port = str(free_port())
    cmd = ["bash", str(SCRIPTS / "torchrun.sh"), "--nproc_per_node=2", f"--master_port={port}", *TRAIN[:3]]
    job.start("node0", [*cmd, "--trainer.num_nodes=1", "--trainer.devices=1"], child_env(tmp_path))
    codes, output, _ = job.wait(120)
    assert codes != [0]
    assert "error: invalid trainer settings: You set `devices=1` and `num_nodes=1` in Lightning, but the product" in (
        output
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nnodes=two", "fit"], "error: nnodes must be a whole number, got 'two'"),
        (["--nnodes=2", "--node_rank=2", "fit"], "error: node_rank 2 is out of range for 2 node(s); use 0 .. 1"),
        (["--master_port=", "fit"], "error: --master_port needs a value"),
        (["fit", "--master_port"], None),  # after the command, options belong to the command: no error here
        (["--master-port"], "error: --master-port needs a value"),
        (["--max-restarts=x", "fit"], "error: max_restarts must be a whole number, got 'x'"),
        (["--run_id=../x", "fit"], "error: run_id '../x' may hold only letters, digits"),
    ],
)
def test_torchrun_script_refuses_bad_settings(args, message):
    result = subprocess.run(
        ["bash", str(SCRIPTS / "torchrun.sh"), *args],
        capture_output=True, text=True, timeout=30, env=child_env(Path("."), PYTHON="echo"),
    )  # fmt: skip
    if message is None:  # PYTHON=echo prints the command the script would run
        assert result.returncode == 0, result.stderr
        words = result.stdout.split()
        assert words[:8] + words[9:] == [
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=1",
            "--node_rank=0",
            "--master_addr=127.0.0.1",
            "--master_port=29500",
            "--max_restarts=0",
            "-m",
            PACKAGE,
            "fit",
            "--master_port",
        ]
        # One node without RUN_ID: an id of its own, so that torchrun's restarts continue the same run folder.
        assert re.fullmatch(r"--rdzv_id=\d{8}-\d{6}-\d+", words[8]), words[8]
    else:
        assert result.returncode == 2 and result.stderr.startswith(message), result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (CI installs it)")
def test_scripts_pass_shellcheck():
    scripts = sorted([*SCRIPTS.glob("*.sh"), *SCRIPTS.glob("*.sbatch")])
    assert len(scripts) >= 2
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
