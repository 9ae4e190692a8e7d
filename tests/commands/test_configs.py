"""Every shipped config file runs for a few steps, so that none can go stale: examples, presets, trackers, sweeps.

Each file under configs/ gets a case; a new file without one fails ``test_every_config_file_has_a_case``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml

from template.engine.resume import checkpoints
from tests.conftest import CONFIGS, REPO, cli_env

FEW_STEPS = ("--trainer.max_steps=3", "--trainer.limit_val_batches=2", "--trainer.num_sanity_val_steps=0")
FEW_STEPS += ("--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")
MULTI_PROCESS_TIMEOUT = 420  # two processes start, import and rendezvous: slow on a shared 2-core machine
DEFAULT = CONFIGS / "default.yaml"
GPUS = torch.cuda.device_count()
# The GPU-only examples run on the CPU where that still runs the file's strategy, else only with enough GPUs.
ON_CPU = ("--trainer.accelerator=cpu", "--trainer.devices=2")
NEEDS_GPUS = {"dp.yaml": [pytest.mark.gpu(2)]}


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _all_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))


def _is_sweep(name: str) -> bool:
    loaded = yaml.safe_load((CONFIGS / name).read_text())
    return isinstance(loaded, dict) and "sweep" in loaded


# name -> (extra arguments, several processes?, reason to skip or None). Presets and trackers stack on default.yaml,
# as the parallelism and precision files do (the GPU-only ones alone here, so that ON_CPU comes after them).
CASES: dict[str, tuple[tuple[str, ...], bool, str | None]] = {
    "default.yaml": ((), False, None),
    "bf16.yaml": (("--config", str(DEFAULT)), False, None),  # bf16-mixed runs on the CPU too
    "ddp_cpu.yaml": (("--config", str(DEFAULT)), True, None),
    "ddp.yaml": (() if GPUS >= 2 else ON_CPU, True, None),
    "fsdp_cpu.yaml": (("--config", str(DEFAULT)), True, None),
    "fsdp.yaml": (() if GPUS >= 2 else ON_CPU, True, None),  # FSDP2 and bf16-mixed run on CPU processes too
    "dp.yaml": ((), False, None),  # GPU only: marked gpu(2), the file lists devices [0, 1]
    # Its 2 nodes x 4 GPUs become 1 node x 2 CPU processes: the strategy and the split batch still apply.
    "multinode.yaml": (("--trainer.num_nodes=1", *ON_CPU), True, None),
    "mlflow.yaml": (
        ("--config", str(DEFAULT)),
        False,
        "mlflow not installed (pip install -e '.[mlflow]')" if _missing("mlflow", "sqlalchemy", "alembic") else None,
    ),
    "wandb.yaml": (
        ("--config", str(DEFAULT)),
        False,
        "wandb not installed (pip install -e '.[wandb]')" if _missing("wandb") else None,
    ),  # fmt: skip
}


def _case(name: str) -> tuple[tuple[str, ...], bool, str | None]:
    if name.startswith("presets/"):
        return ("--config", str(DEFAULT)), False, None
    if name in CASES:
        return CASES[name]
    if _is_sweep(name):
        return (), False, None
    raise KeyError(name)


@cache
def _has_sweep_command() -> bool:
    done = subprocess.run(
        [*_python_m(), "sweep", "--help"], capture_output=True, text=True, timeout=180, env=cli_env()
    )  # fmt: skip
    return done.returncode == 0


def _python_m() -> list[str]:
    from tests.conftest import PACKAGE

    return [sys.executable, "-m", PACKAGE]


def _params() -> list:
    params = []
    for name in _all_configs():
        try:
            _, multi, _ = _case(name)
        except KeyError:
            multi = False
        marks = [pytest.mark.slow, pytest.mark.timeout(MULTI_PROCESS_TIMEOUT + 60)] if multi else []
        params.append(pytest.param(name, id=name, marks=[*marks, *NEEDS_GPUS.get(name, [])]))
    return params


def test_every_config_file_has_a_case() -> None:
    unknown = []
    for name in _all_configs():
        try:
            _case(name)
        except KeyError:
            unknown.append(name)
    assert not unknown, f"add a case for {unknown} to {Path(__file__).resolve().relative_to(REPO)}"


def test_a_config_without_a_case_names_the_file_that_takes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cancer.yaml").write_text("model:\n  class_path: lab.model.CancerMLP\n")  # a user's new config
    monkeypatch.setattr(sys.modules[__name__], "CONFIGS", tmp_path)
    with pytest.raises(AssertionError, match=r"add a case for \['cancer.yaml'\] to ") as failed:
        test_every_config_file_has_a_case()
    named = str(failed.value).splitlines()[0].rsplit(" to ", 1)[1]
    assert (REPO / named).resolve() == Path(__file__).resolve()


@pytest.mark.slow  # one training subprocess per shipped file: a staleness guard for CI
@pytest.mark.parametrize("name", _params())
def test_config_runs_a_few_steps(name: str, run_cli, tmp_path: Path) -> None:
    try:
        extra, multi, skip = _case(name)
    except KeyError:
        pytest.skip(f"no case for {name} (test_every_config_file_has_a_case fails for it)")
    if skip:
        pytest.skip(skip)
    config = CONFIGS / name
    env = cli_env(WANDB_API_KEY="", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    timeout = MULTI_PROCESS_TIMEOUT if multi else 240
    if _is_sweep(name):
        if not _has_sweep_command():
            pytest.skip(f"{name} has a `sweep:` section but `python -m ... sweep` does not exist yet")
        # A trial scores at its validations: three-step epochs, so that the few steps end with one.
        few = (*FEW_STEPS, "--trainer.limit_train_batches=3")
        result = run_cli("sweep", *extra, "--config", config, "--sweep.n_trials=2", *few, env=env, timeout=timeout)
        assert result.returncode == 0, result.stderr[-3000:]
        folder = tmp_path / "lightning_logs" / yaml.safe_load(config.read_text())["sweep"]["name"]
        assert (folder / "best.yaml").is_file() and len((folder / "trials.csv").read_text().splitlines()) == 3
        return
    # A tracker or a preset goes after the config it is stacked on.
    arguments = (*extra, "--config", config) if "--config" in extra else ("--config", config, *extra)
    result = run_cli("fit", *arguments, *FEW_STEPS, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "lightning_logs").iterdir()
    assert (run / "config.yaml").is_file()
    assert checkpoints.check(run / "checkpoints" / "last.ckpt")["global_step"] == 3  # a file, or fsdp's folder
    if name == "presets/profile.yaml":
        report = (run / "fit-profile.txt").read_text()
        assert "run_training_batch" in report  # the profiler's report, in the run folder


@pytest.mark.parametrize(
    "name", [n for n in _all_configs() if n != "default.yaml" and not n.startswith("presets/") and not _is_sweep(n)]
)
def test_a_file_stacked_after_the_users_changes_only_its_concern(name: str, run_main, tmp_path: Path) -> None:
    # Parallelism, precision, trackers: the user's training length and logging stay theirs (later files win).
    (tmp_path / "mine.yaml").write_text("trainer:\n  max_epochs: 7\n  log_every_n_steps: 3\n")
    printed = run_main("fit", "--config", "mine.yaml", "--config", CONFIGS / name, "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    trainer = yaml.safe_load(printed.stdout)["trainer"]
    assert (trainer["max_epochs"], trainer["log_every_n_steps"]) == (7, 3)


# The parallelism files, and how many processes each runs.
PARALLELISM = {"ddp_cpu.yaml": 2, "ddp.yaml": 2, "dp.yaml": 1, "fsdp.yaml": 2, "fsdp_cpu.yaml": 2, "multinode.yaml": 8}
USERS = "trainer:\n  max_epochs: 7\ndata:\n  init_args:\n    batch_size: 48\nmodel:\n  init_args:\n    optimizer:\n"
USERS += "      class_path: torch.optim.Adam\n      init_args:\n        lr: 0.003\n"


def _keys(section: object, above: str = "") -> list[str]:
    items = section.items() if isinstance(section, dict) else ()
    return [name for key, value in items for name in (f"{above}{key}", *_keys(value, f"{above}{key}."))]


@pytest.mark.parametrize("name", list(PARALLELISM))
def test_a_parallelism_file_keeps_the_configs_batch_and_learning_rate(name: str, run_main, tmp_path: Path) -> None:
    from lightning.pytorch import Trainer

    from template.data import DigitsDataModule
    from template.engine.strategies.scaling import BatchScaling

    assert not [key for key in _keys(yaml.safe_load((CONFIGS / name).read_text())) if key.endswith("batch_size")]
    (tmp_path / "mine.yaml").write_text(USERS)
    printed = run_main("fit", "--config", "mine.yaml", "--config", CONFIGS / name, "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    assert config["data"]["init_args"]["batch_size"] == 48
    assert config["model"]["init_args"]["optimizer"]["init_args"]["lr"] == 0.003
    # What each of the file's processes then loads: its share of the batch of one optimizer step, 48 as on one device.
    scaling, world = BatchScaling(**config["scaling"]), PARALLELISM[name]
    assert scaling.lr_scaling == "none"
    if world > 1:  # dp's one process loads the whole batch and splits it over the GPUs
        nodes = 2 if world == 8 else 1
        trainer = Trainer(accelerator="cpu", devices=world // nodes, num_nodes=nodes, strategy="ddp", logger=False)
        assert scaling.apply_batch_size(trainer, DigitsDataModule(batch_size=48)) * world == 48


def test_two_batch_settings_that_clash_are_one_line(run_main, tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(f"{USERS}scaling:\n  global_batch_size: 64\n")
    done = run_main("fit", "--config", "mine.yaml", "--config", CONFIGS / "ddp_cpu.yaml", "--trainer.logger=false")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: data.batch_size=48 and scaling.global_batch_size=64 both set the batch (the global one gives 32 per "
        "process); keep one of them"
    )
