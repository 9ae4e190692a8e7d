"""A user's own net and DataModule from a module outside the package, by YAML alone."""

import csv
import inspect
import json
import pydoc
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import LightningModule
from torch import nn

import template
from tests.conftest import TESTS, cli_env, pythonpath

PACKAGE = template.__name__

USER_CODE = TESTS / "user_code"

USER_CONFIG = {
    "trainer": {"max_epochs": 3, "accelerator": "cpu", "enable_progress_bar": False, "log_every_n_steps": 5},
    "model": {"net": {"class_path": "my_code.TinyNet", "init_args": {"width": 32}}},
    "data": {"class_path": "my_code.Blobs", "init_args": {"batch_size": 16, "data_dir": "blobs"}},
}


def _last_val_acc(run_dir: Path) -> float:
    rows = [r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("val_acc")]
    return float(rows[-1]["val_acc"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_user_net_and_data_train_from_yaml(run_cli, tmp_path, strategy):
    devices = 2 if strategy == "ddp" else 1
    config = {**USER_CONFIG, "trainer": {**USER_CONFIG["trainer"], "strategy": strategy, "devices": devices}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", "user.yaml", env=cli_env(PYTHONPATH=pythonpath(USER_CODE)))
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert _last_val_acc(run_dir) > 0.9
    # The data's own shape and class count reached the net and the metrics: nothing assumed the digits.
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["net"]["init_args"] == {"input_shape": [5], "num_classes": 3, "width": 32}
    assert hparams["num_classes"] == 3
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints
    # prepare_data ran on one process only, also with 2 DDP processes.
    assert len((tmp_path / "blobs" / "prepare_calls.log").read_text().split()) == 1


NET_ARGS = {"width": 32, "input_shape": [2], "num_classes": 1}  # one output: the regression value
REGRESSION_CONFIG = {
    "trainer": {"max_epochs": 4, "accelerator": "cpu", "enable_progress_bar": False, "log_every_n_steps": 4},
    "model": {
        "class_path": "my_code.Regressor",
        # The data links reach `model.net`; this module's network is `body`, so its shape is spelled out.
        "init_args": {"body": {"class_path": "my_code.TinyNet", "init_args": NET_ARGS}, "lr": 0.05},
    },
    "data": {"class_path": "my_code.Waves"},
    # The only lines the project's defaults need from a module that does not log val_acc.
    "checkpoint": {"monitor": "val_mse", "mode": "min"},
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_user_lightning_module_trains_by_yaml_alone(run_cli, tmp_path, strategy):
    import torch

    devices = 2 if strategy == "ddp" else 1
    config = {
        **REGRESSION_CONFIG,
        "trainer": {**REGRESSION_CONFIG["trainer"], "strategy": strategy, "devices": devices},
    }
    # One optimizer step sees 64 samples either way: 64 on one process, 32 on each of two.
    config["scaling"] = {"global_batch_size": 64}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    env = cli_env(PYTHONPATH=pythonpath(USER_CODE))
    result = run_cli("fit", "--config", "user.yaml", env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    val_mse = [float(r["val_mse"]) for r in rows if r.get("val_mse")]
    # The targets' variance is about 1.2: predicting their mean scores that; the trained net does far better.
    assert len(val_mse) == 4 and val_mse[-1] < min(0.2, val_mse[0])
    # The data has no num_classes and the net got none: links reach only the arguments a module has.
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["body"]["class_path"] == "my_code.TinyNet" and "num_classes" not in hparams
    best = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("best-")]
    assert len(best) == 1 and best[0].name.startswith("best-3-")  # named after val_mse, lowest at the last epoch
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 4 * 6  # 384 training samples / 64 per step, however many processes

    # Resume from the newest checkpoint for one more epoch, and export the user's network by its attribute name.
    more = run_cli("fit", "--config", "user.yaml", "--trainer.max_epochs=5", "--ckpt_path", "last", env=env)
    assert more.returncode == 0, more.stderr[-3000:]
    resumed = torch.load(tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 5 * 6
    exported = run_cli("export", run_dir / "checkpoints" / "last.ckpt", "--output", "body.pt", "--prefix", "body.")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert set(torch.load(tmp_path / "body.pt", weights_only=True)) == {
        f"body.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")
    }


@pytest.mark.slow
def test_a_chosen_class_gets_its_own_defaults_not_the_examples(run_cli, tmp_path):
    # jsonargparse alone would give Waves the digits' batch_size (64) and Regressor nothing of its own.
    config = {"model": REGRESSION_CONFIG["model"], "data": {"class_path": "my_code.Waves"}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    env = cli_env(PYTHONPATH=pythonpath(USER_CODE))
    printed = run_cli("fit", "--config", "user.yaml", "--data.init_args.samples=256", "--print_config", env=env)
    assert printed.returncode == 0, printed.stderr[-3000:]
    full = yaml.safe_load(printed.stdout)
    assert full["data"]["init_args"] == {"batch_size": 32, "samples": 256}  # Waves' default; the override stays
    assert set(full["model"]["init_args"]) == {"body", "lr"}


def test_a_module_without_a_checkpoint_section_keeps_last_ckpt_and_says_so(run_cli, tmp_path):
    # The example's val_acc monitor is the example's: the Regressor logs val_mse and names no monitor.
    config = {key: value for key, value in REGRESSION_CONFIG.items() if key != "checkpoint"}
    config["trainer"] = {**config["trainer"], "max_epochs": 1, "limit_train_batches": 3}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", "user.yaml", env=cli_env(PYTHONPATH=pythonpath(USER_CODE)))
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "no checkpoint.monitor set" in line], output[-3000:]
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert saved["checkpoint"]["monitor"] is None


def test_a_monitor_the_module_does_not_log_stops_before_training(run_cli, tmp_path):
    config = {**REGRESSION_CONFIG, "checkpoint": {"monitor": "val_acc", "mode": "max"}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", "user.yaml", env=cli_env(PYTHONPATH=pythonpath(USER_CODE)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for fragment in ("val_acc", "it logs: val_mse", "--checkpoint.monitor=val_mse --checkpoint.mode=min"):
        assert fragment in errors[0], errors[0]
    # Stopped after the sanity check: no training step was logged, no checkpoint written.
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert not (run_dir / "checkpoints").exists()
    rows = list(csv.DictReader((run_dir / "metrics.csv").open())) if (run_dir / "metrics.csv").exists() else []
    assert not [r for r in rows if r.get("train_mse")]


@pytest.mark.parametrize(
    ("module", "raised", "line"),
    [
        ("BrokenStep", KeyError, "error: KeyError raised in your code, BrokenStep.training_step ("),
        (
            "WrongShapes",
            RuntimeError,
            "error: RuntimeError raised by a library called from your code, WrongShapes.forward",
        ),
    ],
)
def test_an_exception_from_the_users_code_keeps_its_traceback_after_a_line_naming_their_function(
    tmp_path, monkeypatch, capsys, module, raised, line
):
    from template.engine.commands.cli import main

    monkeypatch.syspath_prepend(str(USER_CODE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["template"])
    config = {
        "trainer": {"max_epochs": 1, "accelerator": "cpu", "enable_progress_bar": False, "limit_train_batches": 2},
        "model": {"class_path": f"my_code.{module}", "init_args": {"body": {"class_path": "torch.nn.Linear",
                  "init_args": {"in_features": 2, "out_features": 1}}}},
        "data": {"class_path": "my_code.Waves"},
        "checkpoint": {"monitor": "val_mse"},
    }  # fmt: skip
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    # Raised as it is: Python prints the whole traceback, the user's frames in it.
    with pytest.raises(raised):
        main(["fit", "--config", "user.yaml"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line) and "my_code.py:" in errors[0], errors


def test_a_value_the_users_net_refuses_is_named_before_its_traceback(run_cli, tmp_path):
    # The example net is the user's code: torch refuses the layer size inside MLP.__init__.
    (tmp_path / "keep.txt").write_text("the user's file")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    done = run_cli("fit", "--model.net.init_args.hidden_sizes=[-3]", "--trainer.accelerator=cpu")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    line = lines[errors[0]]
    assert "model.init_args.net.init_args.hidden_sizes=[-3]" in line and "template.nets.MLP" in line, line
    assert "MLP.__init__" in line and "its traceback follows" in line, line
    # Their traceback follows the line, and ends with their exception, not the parser's message about it.
    assert errors[0] < lines.index("Traceback (most recent call last):"), done.stderr[-3000:]
    assert lines[-1].startswith("RuntimeError: Trying to create tensor with negative dimension -3"), lines[-1]
    assert "Does not validate against any of the Union subtypes" not in done.stderr
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before, "the failed command wrote files"


def test_a_value_the_users_class_refuses_itself_is_named_with_its_exception(tmp_path, monkeypatch, capsys):
    from template.engine.commands.cli import main

    monkeypatch.syspath_prepend(str(USER_CODE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["template"])
    # ConvNet raises its own ValueError for the 1-D samples of the user's data (input_shape comes by the data's link).
    with pytest.raises(ValueError, match=r"ConvNet needs input_shape \(channels, height, width\), got \(5,\)"):
        main(["fit", "--model.net=template.nets.ConvNet", "--data=my_code.Blobs", "--trainer.accelerator=cpu"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: model.init_args.net.init_args.input_shape=[5] refused while building "), errors
    assert "(template.nets.ConvNet): ValueError raised in your code, ConvNet.__init__ (" in errors[0], errors
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "parses"),
    [
        ([], 1),  # the classes the config file names by class_path
        (["--data=my_code.Blobs"], 1),  # an option naming another class: the last one wins
        (["--data.class_path", f"{PACKAGE}.data.DigitsDataModule"], 1),  # back to the example's
    ],
)
def test_a_chosen_class_is_parsed_once_when_named_by_class_path(tmp_path, monkeypatch, options, parses):  # noqa: ANN001
    # The classes a config names are the defaults before the only parse; the result is that of parsing twice.
    from template.engine.commands import cli

    config = {"model": REGRESSION_CONFIG["model"], "data": {"class_path": "my_code.Waves"}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(USER_CODE))
    calls, configs = [], []
    parse = cli.CLI._parse

    def counted(self, parser, args, *rest):  # noqa: ANN001, ANN002, ANN202
        calls.append(args)
        parse(self, parser, args, *rest)

    class Parsed(Exception):
        pass

    def stop(self):  # noqa: ANN001, ANN202
        configs.append(self.config)
        raise Parsed

    monkeypatch.setattr(cli.CLI, "_parse", counted)
    monkeypatch.setattr(cli.CLI, "before_instantiate_classes", stop)
    with pytest.raises(Parsed):
        cli.build_cli(["fit", "--config", "user.yaml", *options])
    assert len(calls) == parses
    fit = configs[0]["fit"]
    data = {"": ("Waves", {"batch_size": 32, "samples": 512}), "--data=my_code.Blobs": ("Blobs", None)}
    expected, init_args = data.get("".join(options), ("DigitsDataModule", None))
    assert fit["data"]["class_path"].endswith(expected)
    if init_args is not None:
        assert dict(vars(fit["data"]["init_args"])) == init_args  # Waves' own defaults, not the digits' batch_size


BORING = "lightning.pytorch.demos.boring_classes."


class OptionalNet(LightningModule):
    """A user's module whose network is optional: a layer of its own unless one is named."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.1) -> None:
        super().__init__()
        self.net, self.lr = net or nn.Linear(32, 2), lr


def _built(tmp_path, monkeypatch, options: list[str]) -> tuple[Any, int]:  # noqa: ANN001
    """The command line built in process for ``options`` (its model and data), and how many parses it took."""
    from template.engine.commands import cli

    monkeypatch.chdir(tmp_path)
    calls = []
    parse = cli.CLI._parse

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(args)
        parse(self, *args)

    monkeypatch.setattr(cli.CLI, "_parse", counted)
    return cli.build_cli([*options, "--trainer.logger=false", "--trainer.accelerator=cpu"], run=False), len(calls)


@pytest.mark.timeout(120)  # this hung for ever, at 100% CPU, in a re-parse loop
@pytest.mark.parametrize("how", ["options", "class_path", "yaml"])
def test_classes_without_arguments_are_read_in_one_parse(tmp_path, monkeypatch, how) -> None:  # noqa: ANN001
    # Lightning's demo classes take no constructor arguments, like a prototype's: named in any spelling, one parse.
    names = {"model": f"{BORING}BoringModel", "data": f"{BORING}BoringDataModule"}
    (tmp_path / "boring.yaml").write_text(yaml.safe_dump({key: {"class_path": path} for key, path in names.items()}))
    options = {
        "options": [f"--{key}={path}" for key, path in names.items()],
        "class_path": [f"--{key}.class_path={path}" for key, path in names.items()],
        "yaml": ["--config", "boring.yaml"],
    }[how]
    built, parses = _built(tmp_path, monkeypatch, options)
    assert (type(built.model).__name__, type(built.datamodule).__name__) == ("BoringModel", "BoringDataModule")
    assert parses == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("net", "built", "parses"), [([], "Linear", 1), (["--model.net=torch.nn.Identity"], "Identity", 1)]
)
def test_a_users_optional_net_builds_as_its_signature_says(tmp_path, monkeypatch, net, built, parses) -> None:  # noqa: ANN001
    # None is the module's own default: not the example's MLP, which the example's Classifier takes as its `net`.
    options = [f"--model={__name__}.OptionalNet", *net, f"--data={BORING}BoringDataModule"]
    cli, parsed = _built(tmp_path, monkeypatch, options)
    assert type(cli.model.net).__name__ == built and cli.model.lr == 0.1
    assert parsed == parses


@pytest.mark.timeout(120)
def test_a_class_in_place_of_a_signatures_default_takes_a_second_parse_and_its_own_defaults(tmp_path, monkeypatch):  # noqa: ANN001
    # The example's Classifier defaults to Adam (lr 0.001); RMSprop's own lr is 0.01. The only case for a second parse.
    cli, parses = _built(tmp_path, monkeypatch, ["--model.optimizer=torch.optim.RMSprop"])
    assert cli.config["model.init_args.optimizer.init_args.lr"] == 0.01
    assert parses == 2


@pytest.mark.slow  # a fit and a predict
def test_predict_on_new_rows_from_the_datamodules_path_option(tmp_path, monkeypatch, caplog):
    # docs/your-code.md: a DataModule reads new rows from its own option; the predictions file is predict's option.
    import numpy as np

    from template.engine.commands.cli import main
    from tests.user_code.my_code import blobs

    monkeypatch.syspath_prepend(str(USER_CODE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [PACKAGE])
    config = {**USER_CONFIG, "trainer": {**USER_CONFIG["trainer"], "max_epochs": 2}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", "user.yaml", "--run.name=blobs"])
    x, y = blobs(50, seed=7)  # rows the model never saw, their labels kept aside
    np.savetxt(tmp_path / "new.csv", x.numpy(), delimiter=",")
    checkpoint = "lightning_logs/blobs/checkpoints/last.ckpt"
    main(["predict", "--config", "user.yaml", "--ckpt_path", checkpoint, "--data.predict_path=new.csv",
          "--predictions=out/new.csv"])  # fmt: skip
    assert "Predictions: out/new.csv" in caplog.text
    rows = list(csv.DictReader((tmp_path / "out/new.csv").open()))
    assert [int(r["index"]) for r in rows] == list(range(50))  # one row per line of new.csv, in its order
    assert sum(int(r["prediction"]) == label for r, label in zip(rows, y.tolist(), strict=True)) >= 45
    # The predict run's logs went beside the run of its checkpoint.
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["blobs"]
    assert (tmp_path / "lightning_logs/blobs/predict/version_0/config.yaml").is_file()


# A user's tabular classes (tests/user_code/tabular.py): every argument name of the example's, none of its defaults.
TABULAR = {
    "trainer": {"accelerator": "cpu", "max_epochs": 1, "enable_progress_bar": False, "log_every_n_steps": 1},
    "model": {"class_path": "tabular.TabularClassifier", "init_args": {"net": {"class_path": "tabular.TabularNet"}}},
    "data": {"class_path": "tabular.TabularData"},
    "checkpoint": {"monitor": "val_acc", "mode": "max"},
}


def _defaults(path: str, *linked: str) -> dict:
    """The defaults of the class's own signature, as a config file holds them (``linked``: set by the data)."""
    parameters = inspect.signature(pydoc.locate(path)).parameters.items()
    found = {name: p.default for name, p in parameters if p.default is not p.empty and name not in linked}
    return json.loads(json.dumps(found))  # tuples as YAML lists


def _assert_users_defaults(model: dict, data: dict) -> None:
    assert data == {"class_path": "tabular.TabularData", "init_args": _defaults("tabular.TabularData")}
    net = model["init_args"]["net"]
    assert net["init_args"] == _defaults("tabular.TabularNet", "input_shape", "num_classes"), net
    # The module's own optimizer and scheduler (the example's are Adam and none).
    assert model["init_args"]["optimizer"]["class_path"] == "torch.optim.SGD"
    assert model["init_args"]["scheduler"]["class_path"] == "torch.optim.lr_scheduler.ConstantLR"


def test_every_command_reads_the_users_classes_with_their_own_defaults(tmp_path, monkeypatch, run_main) -> None:  # noqa: ANN001
    from template.engine.commands import export, tune
    from template.engine.commands.cli import build_cli

    monkeypatch.syspath_prepend(str(USER_CODE))
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(TABULAR))
    printed = run_main("fit", "--config", "user.yaml", "--print_config")  # what fit saves as config.yaml
    assert printed.returncode == 0, printed.stderr[-3000:]
    fit = yaml.safe_load(printed.stdout)
    _assert_users_defaults(fit["model"], fit["data"])
    # The module and data that tune finds a batch size (the split it sizes) and a learning rate with, export builds.
    for command in (tune._OneDevice, export.FitConfig):
        cli = build_cli(["--config", "user.yaml", "--trainer.logger=false"], False, command)
        model, data = cli.model.hparams, cli.datamodule.hparams
        assert {key: value for key, value in data.items() if not key.startswith("_")} == fit["data"]["init_args"]
        for key in ("optimizer", "scheduler"):
            assert model[key] == fit["model"]["init_args"][key], command
        net = {**fit["model"]["init_args"]["net"]["init_args"], "input_shape": [6], "num_classes": 2}  # linked
        assert model["net"]["init_args"] == net, command
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from template.engine.sweep import CV, SWEEP
    from template.engine.sweep.options import Configs

    # A sweep's trial and a cv's fold are fit's config with their values set, nothing of the example's.
    trial = Configs(["--config", "user.yaml", "--sweep.name=s", "--sweep.space={}"], SWEEP).complete({})
    assert (trial["model"], trial["data"]) == (fit["model"], fit["data"])
    fold = Configs(["--config", "user.yaml"], CV).complete({"data.fold": 1, "data.num_folds": 3})
    fold["data"]["init_args"].update(fold=None, num_folds=3)
    assert (fold["model"], fold["data"]) == (fit["model"], fit["data"])


@pytest.mark.parametrize(
    ("option", "key", "own"),
    [
        ("--model.net=tabular.TabularNet", "net", {"hidden_sizes": [12], "dropout": 0.0}),  # not MLP's
        ("--model.optimizer=torch.optim.RMSprop", "optimizer", {"lr": 0.01}),  # not Adam's 0.001
        ("--data=tabular.TabularData", None, None),
    ],
)
def test_a_class_named_in_place_of_the_examples_gets_its_own_defaults(run_main, monkeypatch, option, key, own) -> None:  # noqa: ANN001
    monkeypatch.syspath_prepend(str(USER_CODE))
    printed = run_main("fit", option, "--print_config")
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    if key is None:
        assert config["data"]["init_args"] == _defaults("tabular.TabularData")
    else:
        values = config["model"]["init_args"][key]["init_args"]
        assert {name: values[name] for name in own} == own, values


@pytest.mark.slow  # a fit, a sweep's trial and a cv's two folds: four training processes
def test_the_configs_a_sweep_and_a_cv_write_hold_the_users_classes_as_fit_saves_them(
    run_cli, tmp_path, monkeypatch
) -> None:  # noqa: ANN001
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    monkeypatch.syspath_prepend(str(USER_CODE))  # the classes' own signatures, read here
    env = cli_env(PYTHONPATH=pythonpath(USER_CODE))
    tiny = {**TABULAR["trainer"], "limit_train_batches": 3, "limit_val_batches": 2}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump({**TABULAR, "trainer": tiny}))
    # The sweep's objective is not the kept checkpoint's monitor (val_acc), and leaves it as it is.
    lr = "    model.optimizer.init_args.lr: {type: categorical, choices: [0.05]}\n"
    (tmp_path / "s.yaml").write_text(
        f"sweep:\n  name: s\n  n_trials: 1\n  objective: val_loss\n  direction: minimize\n  space:\n{lr}"
    )
    for command in (["fit"], ["sweep", "--config", "s.yaml"], ["cv", "--cv.folds=2", "--cv.name=c"]):
        done = run_cli(command[0], "--config", "user.yaml", *command[1:], env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = tmp_path / "lightning_logs"
    saved = yaml.safe_load((logs / "version_0" / "config.yaml").read_text())
    _assert_users_defaults(saved["model"], saved["data"])
    for name in ("s/trial-0000.yaml", "s/best.yaml", "c/fold-0.yaml", "c/fold-1.yaml"):
        written = yaml.safe_load((logs / name).read_text())
        model, data = written["model"]["init_args"], written["data"]["init_args"]
        if name.startswith("s/"):
            assert model["optimizer"]["init_args"]["lr"] == 0.05, name  # the trial's value
            model["optimizer"]["init_args"]["lr"] = saved["model"]["init_args"]["optimizer"]["init_args"]["lr"]
            assert written["checkpoint"]["monitor"] == "val_acc", name
        else:
            assert (data["fold"], data["num_folds"]) == (int(name[-6]), 2), name
            data.update(fold=None, num_folds=saved["data"]["init_args"]["num_folds"])
        assert (written["model"], written["data"]) == (saved["model"], saved["data"]), name
    trial = logs / "s" / "trial-0000"
    assert [p.name for p in (trial / "checkpoints").glob("best-*")] != []  # kept by val_acc, as in fit
    assert "val_loss" in (logs / "s" / "trials.csv").read_text().splitlines()[0]  # scored by the objective
