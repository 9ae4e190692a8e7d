"""What the command line adds to a Trainer: each piece is on by default, listed in the first lines, and switches off."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from template.engine.commands import trainer_arguments
from template.engine.jobs.preemption import Preemption
from template.engine.logs import console
from template.engine.logs.console import first_lines
from template.engine.logs.loggers import LogsBeforeCheckpoints, TrackerRuns
from template.engine.resume.checkpoints import AtomicCheckpointIO
from template.engine.resume.continuation import Run
from template.engine.runs.provenance import Provenance
from template.engine.strategies import DataParallelStrategy, FSDP2Strategy
from template.engine.strategies.compile import CompileNetwork
from template.engine.strategies.ema import EMA, EMAOptions
from template.engine.strategies.scaling import BatchScaling


def _trainer(subcommand: str = "fit", **trainer_config: object) -> Trainer:
    """A Trainer with what the command line adds for ``trainer_config`` (as the parsed config holds it)."""
    run = Run(None, None, None, resume=False, preemption=trainer_config.pop("preemption", True))
    pieces = {
        **trainer_arguments.plugins(trainer_config),
        **trainer_arguments.callbacks(trainer_config, subcommand, run, None),
    }
    return Trainer(accelerator="cpu", logger=False, **{**trainer_config, **pieces})


def test_first_lines_name_the_changes_to_user_objects_and_their_switches() -> None:
    text = first_lines(_trainer(strategy=FSDP2Strategy(), devices=2), fit=True)
    for name, switch in [
        ("fsdp", "another trainer.strategy"),
        ("preemption", "--run.preemption=false"),
        ("atomic checkpoints", "--trainer.plugins=[]"),
        ("checkpoints", "--checkpoint.monitor="),
    ]:
        assert any(line.strip().startswith(name) and switch in line for line in text.splitlines()), (name, text)


@pytest.mark.parametrize(
    ("switch", "gone"),
    [
        ({"preemption": False}, ("preemption",)),
        ({"plugins": []}, ("atomic checkpoints",)),
        ({"enable_progress_bar": False}, ("progress bar",)),
    ],
)
def test_a_switched_off_mechanism_is_not_announced(switch: dict, gone: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)  # the progress bar draws on a terminal only
    before = first_lines(_trainer(), fit=True)
    after = first_lines(_trainer(**switch), fit=True)
    for name in gone:
        assert f"  {name} " in before and f"  {name} " not in after, name


def test_evaluation_announces_no_training_mechanism() -> None:
    text = first_lines(_trainer("validate"), fit=False)
    assert "preemption" not in text and "periodic checkpoint" not in text and "only last.ckpt" not in text


def test_an_idle_object_announces_nothing() -> None:
    idle = [CompileNetwork(enabled=False), BatchScaling()]
    assert [c.announcement for c in idle] == [None, None]
    busy = [CompileNetwork(enabled=True), BatchScaling(global_batch_size=64), DataParallelStrategy()]
    assert [c.announcement.name for c in busy] == ["compile", "batch scaling", "dp"]


def test_pieces_follow_their_switches() -> None:
    run = Run(None, None, None, resume=False)
    added = trainer_arguments.callbacks({}, "fit", run, "val_acc")["callbacks"]
    kinds = [type(c) for c in added]
    assert kinds == [
        console.TimedProgressBar,
        console.MonitorCheck,
        LogsBeforeCheckpoints,
        trainer_arguments.PaddedValidation,
        Preemption,
        Provenance,
    ]
    quiet = Run(None, None, None, resume=False, preemption=False)
    kinds = [
        type(c) for c in trainer_arguments.callbacks({"enable_progress_bar": False}, "fit", quiet, None)["callbacks"]
    ]
    assert kinds == [LogsBeforeCheckpoints, trainer_arguments.PaddedValidation, Provenance]  # they only write or say
    averaged = [type(c) for c in trainer_arguments.callbacks({}, "fit", run, None, EMAOptions(decay=0.9))["callbacks"]]
    # A stop's checkpoint at a batch's end holds that batch's update of the average.
    assert averaged.index(EMA) < averaged.index(Preemption)
    assert trainer_arguments.callbacks({"enable_progress_bar": False}, "validate", run, "val_acc") == {}
    assert isinstance(trainer_arguments.plugins({})["plugins"][0], AtomicCheckpointIO)
    assert trainer_arguments.plugins({"plugins": []}) == {}


def test_tracker_runs_come_with_a_tracker(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed: pip install -e '.[mlflow]'")
    from lightning.pytorch.loggers import MLFlowLogger

    run = Run(None, None, None, resume=False, preemption=False)
    tracker = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # built lazily: nothing is written
    added = [type(c) for c in trainer_arguments.callbacks({}, "fit", run, None, trackers=[tracker])["callbacks"]]
    assert TrackerRuns in added
    assert TrackerRuns not in [type(c) for c in trainer_arguments.callbacks({}, "fit", run, None)["callbacks"]]


def test_monitor_check_waits_for_training_metrics_and_names_what_is_logged() -> None:
    from types import SimpleNamespace

    from template.engine.errors import ConfigError

    after_sanity = SimpleNamespace(callback_metrics={"val_mse": 1.0}, sanity_checking=True, num_sanity_val_batches=[2])
    console.MonitorCheck({"checkpoint.monitor": "train_mse"}).on_sanity_check_end(
        after_sanity, None
    )  # not logged before training: wait
    with pytest.raises(ConfigError, match=r"it logs: val_mse\); .*--checkpoint.monitor=val_mse --checkpoint.mode=min"):
        console.MonitorCheck({"checkpoint.monitor": "val_acc"}).on_sanity_check_end(after_sanity, None)
    after_epoch = SimpleNamespace(callback_metrics={"train_mse": 1.0, "val_mse": 1.0}, sanity_checking=False)
    console.MonitorCheck({"checkpoint.monitor": "train_mse"}).on_validation_end(after_epoch, None)


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log-file"])
def test_the_progress_bar_draws_on_a_terminal_only(terminal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A log that is not a terminal (a sweep trial's, a cluster job's) gets no carriage-return redraws, and the first
    # lines do not announce a bar that is not drawn.
    monkeypatch.setattr("sys.stdout.isatty", lambda: terminal)
    trainer = _trainer()
    assert trainer.progress_bar_callback.is_enabled is terminal
    assert ("  progress bar " in first_lines(trainer, fit=True)) is terminal


def test_tracker_runs_log_restart_configs_in_their_order(tmp_path) -> None:  # noqa: ANN001
    # A W&B run's config is the newest config.restart-<n>.yaml's: restart-10 comes after restart-2, not before.
    from types import SimpleNamespace

    from lightning.pytorch.loggers import WandbLogger

    from template.engine.runs import configs

    logged = []

    class Recorded(WandbLogger):
        def __init__(self) -> None:  # no W&B run: only its config's updates are recorded
            pass

        version = "run-1"
        experiment = SimpleNamespace(config=SimpleNamespace(update=lambda values, **_: logged.append(values["config"])))

    for name, n in [("config.yaml", 0), ("config.restart-2.yaml", 2), ("config.restart-10.yaml", 10)]:
        (tmp_path / name).write_text(f"n: {n}\n")
    trainer = SimpleNamespace(log_dir=str(tmp_path), loggers=[Recorded()], is_global_zero=True)
    TrackerRuns(configs).on_fit_start(trainer, None)
    assert [config["n"] for config in logged] == [0, 2, 10]


def test_a_monitor_of_either_validation_loader_is_accepted_and_a_misspelt_one_refused_naming_both(tmp_path) -> None:  # noqa: ANN001
    """With two validation loaders Lightning keeps no metric of the sanity check: the check waits for the first
    validation."""
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    from template.engine.errors import ConfigError

    class TwoValidationSets(BoringModel):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):  # noqa: ANN001, ANN201
            self.log("val_loss", self.step(batch))

        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(RandomDataset(32, 4)), DataLoader(RandomDataset(32, 4))]

    def fit(monitor: str) -> None:
        check = console.MonitorCheck({"checkpoint.monitor": monitor})
        options = {"max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 2, "default_root_dir": tmp_path}
        quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
        _trainer(**options, **quiet, callbacks=[check]).fit(TwoValidationSets())
        assert check.unchecked == {}

    fit("val_loss/dataloader_idx_1")
    logged = r"it logs: val_loss/dataloader_idx_0, val_loss/dataloader_idx_1\); .*monitor=val_loss/dataloader_idx_0"
    with pytest.raises(ConfigError, match=r"checkpoint.monitor='val_los' is not logged by the module \(" + logged):
        fit("val_los")
