"""End to end: the commands a user types, run for real in a subprocess."""

import csv
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from template.model import Classifier
from tests.conftest import CONFIGS, PACKAGE, cli_env

OUR_LINES = ("Best checkpoint:", "Prepared the digits data set")


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One full run of the example config: the acceptance run, reused by the evaluation tests."""
    workdir = tmp_path_factory.mktemp("example")
    result = subprocess.run(
        [sys.executable, "-m", PACKAGE, "fit", "--config", str(CONFIGS / "default.yaml")],
        cwd=workdir,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def test_example_reaches_95_percent_validation_accuracy(trained):
    workdir, result = trained
    run_dir = workdir / "lightning_logs" / "version_0"
    val_acc = [float(r["val_acc"]) for r in _metrics(run_dir) if r["val_acc"]]
    assert len(val_acc) == 15 and max(val_acc) >= 0.95
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names[-1] == "last.ckpt" and names[0].startswith("best-") and len(names) == 2
    assert (run_dir / "config.yaml").is_file() and list(run_dir.glob("events.out.tfevents.*"))
    for line in OUR_LINES:
        assert (result.stdout + result.stderr).count(line) == 1


def test_checkpoint_loads_into_a_plain_model(trained):
    workdir, _ = trained
    model = Classifier.load_from_checkpoint(workdir / "lightning_logs/version_0/checkpoints/last.ckpt")
    images = torch.load(workdir / "data" / "digits.pt", weights_only=True)["images"][:64].float() / 16
    # Lightning puts the module where the checkpoint's tensors were saved: cuda:0 after a run on a GPU.
    assert model.eval()(images.to(model.device)).shape == (64, 10)


@pytest.mark.parametrize(
    "subcommand,metric", [("validate", "val_acc"), pytest.param("test", "test_acc", marks=pytest.mark.slow)]
)
def test_evaluate_the_checkpoint(trained, run_cli, subcommand, metric):
    workdir, _ = trained
    ckpt = workdir / "lightning_logs/version_0/checkpoints/last.ckpt"
    result = run_cli(subcommand, "--config", CONFIGS / "default.yaml", "--ckpt_path", ckpt, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    # Its logs belong with the run of the checkpoint it read, in a folder of their own.
    assert [p.name for p in (workdir / "lightning_logs").iterdir()] == ["version_0"]
    assert float(_metrics(workdir / f"lightning_logs/version_0/{subcommand}/version_0")[-1][metric]) >= 0.9


def test_predict_writes_one_prediction_per_test_sample(trained, run_cli):
    workdir, _ = trained
    ckpt = workdir / "lightning_logs/version_0/checkpoints/last.ckpt"
    result = run_cli("predict", "--config", CONFIGS / "default.yaml", "--ckpt_path", ckpt, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    path = Path((result.stdout + result.stderr).split("Predictions: ")[1].split()[0])
    assert path == workdir / "lightning_logs/version_0/predict/version_0/predictions.csv"  # with the checkpoint's run
    rows = list(csv.DictReader((workdir / path).open()))
    assert [int(r["index"]) for r in rows] == list(range(179))
    assert {int(r["prediction"]) for r in rows} <= set(range(10))
    # The runs table lists it with the run, by its stage.
    listed = run_cli("runs", "--columns", "run,status,epochs", "--csv", "-", cwd=workdir)
    assert "version_0/predict/version_0,predict,-" in listed.stdout.splitlines(), listed.stdout


@pytest.mark.slow
def test_print_config_round_trip(run_main, run_cli, tmp_path):
    printed = run_main("fit", "--config", CONFIGS / "default.yaml", "--trainer.max_epochs=1", "--print_config")
    assert printed.returncode == 0, printed.stderr
    config = yaml.safe_load(printed.stdout)
    assert config["model"]["init_args"]["net"]["class_path"].endswith("nets.MLP")
    assert config["checkpoint"]["monitor"] == "val_acc"
    (tmp_path / "full.yaml").write_text(printed.stdout)
    result = run_cli("fit", "--config", "full.yaml", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "lightning_logs/version_0/config.yaml").read_text())
    assert saved["trainer"]["max_epochs"] == 1
    # What --print_config shows is what the run used.
    assert config["checkpoint"] == saved["checkpoint"]
    assert config["checkpoint"]["filename"] == "best-{epoch}-{val_acc:.4f}"


# What needs no training answers without importing torch or Lightning: each case, its exit code and a line it prints.
LIGHT = {
    "runs": (["runs", "."], 0, "No runs under"),
    "help": (["--help"], 0, "Train (a named run continues from its newest checkpoint)"),
    "sweep help": (["sweep", "--help"], 0, "--sweep.n_trials"),
    "cv help": (["cv", "--config", "x.yaml", "--help"], 0, "--cv.folds"),
    "misspelt": (["fitt"], 2, "error: no subcommand 'fitt' (did you mean 'fit'?); use one of: fit, validate, test,"),
    "none": ([], 2, "error: no subcommand given; use one of: fit, validate"),
}


@pytest.mark.parametrize("case", list(LIGHT))
def test_what_needs_no_training_imports_neither_torch_nor_lightning(case: str, tmp_path: Path) -> None:
    args, code, line = LIGHT[case]
    if case in ("sweep help", "cv help") and importlib.util.find_spec("optuna") is None:  # no sweep extra installed
        code, line = 2, f"error: the {args[0]} needs Optuna; install the extra: pip install -e '.[sweep]'"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", PACKAGE, *args], cwd=tmp_path, env=cli_env(), capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    imported = {row.split("|")[-1].strip() for row in done.stderr.splitlines() if row.startswith("import time:")}
    assert imported and not {name for name in imported if name.split(".")[0] in ("torch", "lightning")}
    said = [row for row in (done.stdout + done.stderr).splitlines() if not row.startswith("import time:")]
    assert done.returncode == code and any(line in row for row in said), done.stdout + done.stderr[-3000:]
    if code:
        assert said == [row for row in said if row.startswith("error:")] and len(said) == 1


def test_help_names_the_program_and_every_subcommand(run_main):
    from template.engine.commands import COMMANDS

    shown = run_main("--help")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())  # argparse wraps the lines
    assert text.startswith(f"usage: python -m {PACKAGE} ")
    for name, command in COMMANDS.items():
        assert name in text and " ".join(command.description.split()) in text, name
    assert "Runs the full optimization routine" not in text  # Lightning's own text


def test_first_lines_say_what_is_on_and_how_to_switch_it_off(trained):
    _, result = trained
    output = result.stdout + result.stderr
    for switch in ("--run.preemption=false", "--trainer.plugins=[]"):
        assert output.count(switch) == 1, switch
    assert "litlogger" not in output
    # The run summary starts its own line, not the progress bar's.
    assert [line for line in output.splitlines() if line.startswith("Run: strategy")], output[-3000:]


@pytest.mark.slow
def test_stacked_configs_and_overrides(run_cli, tmp_path):
    (tmp_path / "small.yaml").write_text(
        "trainer:\n  max_epochs: 2\n  limit_train_batches: 3\ndata:\n  init_args:\n    batch_size: 16\n"
        "model:\n  net:\n    class_path: " + PACKAGE + ".nets.ConvNet\n"
    )
    result = run_cli(
        "fit",
        "--config",
        CONFIGS / "default.yaml",
        "--config",
        "small.yaml",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "lightning_logs/version_0/config.yaml").read_text())
    assert saved["trainer"]["max_epochs"] == 1  # the command line wins over both files
    assert saved["trainer"]["limit_train_batches"] == 3 and saved["data"]["init_args"]["batch_size"] == 16
    # `model.net` in YAML is short for the default model's `model.init_args.net`; the saved config spells it out.
    assert saved["model"]["class_path"] == f"{PACKAGE}.model.Classifier"
    assert saved["model"]["init_args"]["net"]["class_path"] == f"{PACKAGE}.nets.ConvNet"


def test_a_run_validates_its_config_once(run_main, tmp_path, monkeypatch):
    # Start-up: the parse validates the config; the hyper-parameters' dump and config.yaml's do not validate it again.
    import jsonargparse

    from template.engine.commands.cli import PROGRAM

    validations = []
    validate = jsonargparse.ArgumentParser.validate

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.prog.startswith(PROGRAM):  # the command line's parser and its subcommand's, not a class's
            validations.append(self.prog)
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(jsonargparse.ArgumentParser, "validate", counted)
    result = run_main(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--trainer.max_steps=1",
        "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert validations == [PROGRAM, f"{PROGRAM} [options] fit"]
    run_dir = tmp_path / "lightning_logs/version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # What the dumps wrote: config.yaml without the linked values, the hyper-parameters with them.
    assert saved["checkpoint"]["monitor"] == "val_acc" and "num_classes" not in saved["model"]["init_args"]
    hparams = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=False)["hyper_parameters"]
    assert hparams["num_classes"] == 10 and hparams["net"]["init_args"]["input_shape"] == [1, 8, 8]


@pytest.mark.slow
def test_console_script_is_installed():
    script = shutil.which(PACKAGE, path=str(Path(sys.executable).parent))
    assert script, f"console script {PACKAGE!r} not installed next to {sys.executable}"
    result = subprocess.run([script, "fit", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--trainer.strategy" in result.stdout
