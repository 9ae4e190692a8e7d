"""The project's Containerfile, built and run the way its users run it: train the example inside the image, stop it
with ``podman stop`` in the middle of an epoch, start the same ``podman run`` again, and end bit for bit where a run
outside the container ends.

Slow, and skipped with the reason where Podman cannot run (``.ci/run`` installs podman, runc and debootstrap from
Debian). What belongs to this machine and not to a user's build is here in the fixtures, never in the Containerfile:
the base image made locally (no image registry is reached), the host's CA certificates, the local wheel folder and
indexes of ``pip config list`` bind-mounted into the build, and a ``containers.conf`` for VMs without
CAP_SYS_RESOURCE and with a hybrid cgroup layout. Figures: docs/results/2026-12-02-container.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PACKAGE, REPO, TESTS, cli_env, finish, made_once, pythonpath
from tests.resume.test_exact_resume import _differences, _training_state

BASE_IMAGE = "docker.io/library/debian:bookworm"  # what debootstrap's root file system is imported as
IMAGE = "localhost/template-test"
WAIT = 900  # seconds for one build or one run; measured: the base 1.5 min, the image 2-4 min, a run 15-40 s
# The run: 2 epochs of 22 steps with 2 DataLoader workers, each step paced (tests/step_marker.py) so that the stop
# lands in the middle of epoch 1; the same arguments inside and outside the container.
ARGS = [
    "fit", "--config", "configs/default.yaml", "--run.name=r", "--trainer.max_epochs=2", "--data.num_workers=2",
    "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.callbacks+=marks/marker.yaml",
]  # fmt: skip
STOP_AT = 33  # steps marked before `podman stop`: batch 11 of epoch 1
CONTAINERS_CONF = """\
[containers]
default_ulimits = []  # podman's default asks for 1,048,576 open files: EPERM without CAP_SYS_RESOURCE
netns = "host"        # the default bridge edits the host's firewall
[engine]
runtime = "runc"      # crun refuses a hybrid cgroup v1 + v2 layout
events_logger = "none"
tmp_dir = "{folder}/libpod"  # with the store: nothing of the test's is left in /run
"""


def _podman_env(store: Path) -> dict[str, str]:
    """The variables that point podman at this session's configuration and image store (under pytest's tmp)."""
    return {
        **os.environ,
        "CONTAINERS_CONF": str(store / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(store / "storage.conf"),
    }


def podman(store: Path, *args: str, timeout: float = WAIT, **kwargs) -> subprocess.CompletedProcess:
    """``podman *args`` with this session's configuration; fails the test with its output unless it exits 0."""
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    done = subprocess.run(
        ["podman", *args], env=_podman_env(store), capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert done.returncode == 0, f"podman {' '.join(args[:3])} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def _why_podman_cannot_run() -> str | None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install podman runc debootstrap; .ci/run does)"
    if os.geteuid() != 0:
        return "debootstrap and rootful podman need root"
    return None


def _debian_mirror() -> str:
    """The Debian mirror apt uses here (deb822 or one-line sources), else Debian's own."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text(errors="replace") if path.is_file() else ""
        for uri in re.findall(r"(?m)^(?:URIs:|deb)\s+(\S+/debian)/?\s*(?:$|bookworm)", text):
            return uri
    return "http://deb.debian.org/debian"


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This session's podman configuration and image store, holding ``debian:bookworm`` made by debootstrap (once a
    session, shared by pytest-xdist's workers)."""
    if reason := _why_podman_cannot_run():
        pytest.skip(reason)

    def make(folder: Path) -> None:
        (folder / "containers.conf").write_text(CONTAINERS_CONF.format(folder=folder))
        (folder / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\nrunroot = "{folder}/run"\ngraphroot = "{folder}/graph"\n'
        )
        rootfs = folder / "rootfs"
        done = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(rootfs),
                _debian_mirror(),
            ],
            capture_output=True,
            text=True,
            timeout=WAIT,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, f"debootstrap exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr}"
        # The network here inspects TLS: the base trusts what the host trusts.
        for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy(cert, rootfs / "usr/local/share/ca-certificates")
        subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True, timeout=120)
        with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
            podman(folder, "import", "-", BASE_IMAGE, stdin=tar.stdout)
        shutil.rmtree(rootfs)

    return made_once(tmp_path_factory, "container-store", make)


def _local_pip_sources() -> tuple[list[str], list[str]]:
    """The ``pip config list`` lines naming local folders (find-links, indexes) and the folders to mount for them."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    lines, folders = [], []
    for key, value in re.findall(r"(?m)^\S*?\.?((?:find-links|extra-index-url|index-url))='([^']*)'", listed):
        local = [v.removeprefix("file://") for v in value.split() if v.startswith(("file://", "/"))]
        if local and not any(line.startswith(f"{key} =") for line in lines):
            lines.append(f"{key} = {value}")
            # A local simple index links its files beside it (../../files/...): its parent folder is mounted.
            folders += [str(Path(p).parent) if Path(p).name == "simple" else p for p in local]
    return lines, sorted(set(folders))


@pytest.fixture(scope="session")
def image(store: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's image, built from this working tree by its Containerfile (once a session). Where pip finds
    torch in local folders (``pip config list``), the build sees them through a pip.conf and read-only mounts, and
    takes torch from PyPI's index name (its CPU build lies in those folders); elsewhere the Containerfile's defaults."""

    def make(folder: Path) -> None:
        lines, folders = _local_pip_sources()
        args = ["build", "--pull=never", "-t", IMAGE, "--build-arg", f"BASE={BASE_IMAGE}", "-f", "Containerfile"]
        if lines:
            conf = folder / "pip.conf"
            conf.write_text("\n".join(["[global]", *lines, "cert = /etc/ssl/certs/ca-certificates.crt", ""]))
            args += ["--build-arg", "TORCH_INDEX=https://pypi.org/simple", "-v", f"{conf}:/etc/pip.conf:ro"]
            args += [arg for path in folders for arg in ("-v", f"{path}:{path}:ro")]
        start = time.monotonic()
        podman(store, *args, str(REPO), cwd=REPO)
        (folder / "seconds").write_text(f"{time.monotonic() - start:.0f}\n")

    made_once(tmp_path_factory, "container-image", make)
    return IMAGE


def _marks(work: Path, delay: float, inside: bool) -> None:
    """``work/marks``: tests/step_marker.py and a callback config pacing each step by ``delay`` s and writing
    ``marks/steps`` (inside the container, at the mount /app/marks, writable by its user)."""
    marks = work / "marks"
    marks.mkdir(parents=True)
    marks.chmod(0o777)
    shutil.copy(TESTS / "step_marker.py", marks)
    steps = "/app/marks/steps" if inside else str(marks / "steps")
    (marks / "marker.yaml").write_text(
        f"class_path: step_marker.StepMarker\ninit_args: {{path: {steps}, delay: {delay}}}\n"
    )


def _outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run without a stop and outside any container, in this session's environment (made once)."""

    def make(work: Path) -> None:
        _marks(work, 0.0, inside=False)
        shutil.copytree(REPO / "configs", work / "configs")
        env = cli_env(PYTHONPATH=pythonpath(work / "marks"))
        with (work / "run.log").open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", PACKAGE, *ARGS],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        assert finish(proc, WAIT, log=work / "run.log") == 0, (work / "run.log").read_text()[-4000:]

    return made_once(tmp_path_factory, "container-outside", make)


def _start(store: Path, work: Path, name: str, *options: str) -> subprocess.Popen:
    """``podman run`` of ARGS in a container ``name``: the run folder and the data on host folders (``:U``: owned by
    the image's user inside), the marks mounted beside them; output appended to ``work/run.log``."""
    volumes = [f"-v={work / d}:/app/{d}:U" for d in ("lightning_logs", "data")] + [f"-v={work / 'marks'}:/app/marks"]
    command = [
        "podman",
        "run",
        "--rm",
        f"--name={name}",
        *volumes,
        "-e",
        "PYTHONPATH=/app/marks",
        "-e",
        "OMP_NUM_THREADS=1",
        *options,
        IMAGE,
        *ARGS,
    ]
    with (work / "run.log").open("a") as log:
        return subprocess.Popen(
            command,
            env=_podman_env(store),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


@pytest.fixture
def containers(store: Path):  # noqa: ANN201
    """The names of the test's two containers, removed after it whatever happened (a run it gave up on included)."""
    names = ("fit-stopped", "fit-continued")
    yield names
    subprocess.run(
        ["podman", "rm", "--force", "--ignore", *names], env=_podman_env(store), capture_output=True, timeout=120
    )


def _steps(work: Path) -> int:
    path = work / "marks" / "steps"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _stop_in_epoch_1(store: Path, work: Path, name: str) -> tuple[int, float, str]:
    """Start ARGS in container ``name``, and once STOP_AT steps are marked, ``podman stop`` it: the run's exit code,
    the seconds ``podman stop`` took, the run's output. The DataLoader workers are checked to be running then."""
    proc = _start(store, work, name)
    deadline = time.monotonic() + WAIT
    while _steps(work) < STOP_AT and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before the stop:\n{(work / 'run.log').read_text()[-4000:]}"
    processes = podman(store, "top", name, "comm").stdout.split()
    assert processes.count("pt_data_worker") >= 2, processes  # the run's DataLoader workers, as torch names them
    start = time.monotonic()
    podman(store, "stop", "--time=60", name, timeout=120)
    stopped_in = time.monotonic() - start
    code = finish(proc, 120, "the stopped podman run", work / "run.log")
    return code, stopped_in, (work / "run.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_container_podman_stop_mid_epoch_then_the_same_run_ends_as_outside_bit_for_bit(
    store: Path, image: str, containers: tuple[str, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`podman stop` (SIGTERM to the container's PID 1, SIGKILL after its timeout) in the middle of epoch 1: the run
    writes its checkpoint and exits 143 well before the timeout, the DataLoader workers end with it, no traceback;
    the same `podman run` with the same folders continues and ends where the run outside ends, bit for bit."""
    for folder in ("lightning_logs", "data"):
        (tmp_path / folder).mkdir()
    _marks(tmp_path, 0.2, inside=True)
    code, stopped_in, output = _stop_in_epoch_1(store, tmp_path, containers[0])
    assert code == 143, f"exit {code}, expected 143 (128 + SIGTERM):\n{output[-4000:]}"
    assert stopped_in < 30, f"podman stop took {stopped_in:.0f} s (SIGKILL after 60)"
    assert "Stopping on SIGTERM: checkpoint" in output and "run the same command to continue" in output, output[-3000:]
    assert "Traceback" not in output and "killed by signal" not in output, output[-4000:]
    checkpoints = tmp_path / "lightning_logs" / "r" / "checkpoints"
    stopped_at = torch.load(checkpoints / "interrupted.ckpt", weights_only=True)["global_step"]

    code = finish(_start(store, tmp_path, containers[1]), WAIT, "the same podman run", tmp_path / "run.log")
    output = (tmp_path / "run.log").read_text()
    assert code == 0, f"the same podman run again exited {code}:\n{output[-4000:]}"
    assert "resuming from lightning_logs/r/checkpoints/interrupted.ckpt" in output, output[-3000:]
    outside = torch.load(_outside(tmp_path_factory) / "lightning_logs/r/checkpoints/last.ckpt", weights_only=True)
    inside = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert stopped_at % (outside["global_step"] // 2) > 0, f"stopped at step {stopped_at}: not within an epoch"
    differences = _differences(_training_state(outside), _training_state(inside))
    assert not differences, "the container's run differs from the run outside:\n" + "\n".join(differences[:12])


@pytest.mark.slow
@pytest.mark.gpu(1)
@pytest.mark.timeout(3 * WAIT)
def test_container_trains_on_the_gpu_of_a_cuda_build(store: Path, tmp_path: Path) -> None:
    """The image with a CUDA build of torch (``TORCH_INDEX``), run with the GPU passed in by the Container Device
    Interface (``--device nvidia.com/gpu=all``; nvidia-container-toolkit's ``nvidia-ctk cdi generate`` on the
    host): the example trains on ``cuda``. Needs the CUDA index reachable, so no local wheel folder is used."""
    tag = "localhost/template-test-cuda"
    podman(
        store,
        "build",
        "--pull=never",
        "-t",
        tag,
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "--build-arg",
        "TORCH_INDEX=https://download.pytorch.org/whl/cu128",
        "-f",
        "Containerfile",
        str(REPO),
        cwd=REPO,
    )
    done = podman(
        store,
        "run",
        "--rm",
        "--device=nvidia.com/gpu=all",
        tag,
        "fit",
        "--config",
        "configs/default.yaml",
        "--trainer.max_epochs=1",
        "--trainer.accelerator=gpu",
        "--trainer.enable_progress_bar=false",
    )
    assert "Run: strategy single_device on cuda" in done.stdout + done.stderr, done.stdout[-3000:]
