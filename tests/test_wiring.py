"""What the command line adds to a Trainer: each piece is on by default, listed in the first lines, and switches off."""

from __future__ import annotations

import pytest
from jsonargparse import Namespace

from template.engine import wiring
from template.engine.checkpoint_io import AtomicCheckpointIO
from template.engine.ema import EMA, EMAOptions
from template.engine.loggers import LogsBeforeCheckpoints
from template.engine.preemption import Preemption
from template.engine.provenance import Provenance
from template.engine.run import Run
from template.engine.trackers import TrackerRuns


def _config(**overrides: object) -> Namespace:
    config = Namespace()
    defaults = {
        "trainer.logger": None,
        "trainer.plugins": None,
        "trainer.enable_progress_bar": None,
        "trainer.strategy": "auto",
        "trainer.devices": 1,
        "run.preemption": True,
        "run.save_every_n_steps": None,
        "checkpoint.monitor": "val_acc",
        "scaling.global_batch_size": None,
        "scaling.lr_scaling": "none",
        "compile.enabled": False,
    }
    for key, value in {**defaults, **overrides}.items():
        config[key] = value
    return config


def test_first_lines_name_the_changes_to_user_objects_and_their_switches() -> None:
    text = wiring.announce(_config(**{"trainer.strategy": "dp"}), "fit")
    for name, switch in [
        ("dp", "another trainer.strategy"),
        ("preemption", "--run.preemption=false"),
        ("atomic checkpoints", "--trainer.plugins=[]"),
    ]:
        assert any(line.strip().startswith(name) and switch in line for line in text.splitlines()), (name, text)


@pytest.mark.parametrize(
    ("switch", "gone"),
    [
        ({"run.preemption": False}, ("preemption",)),
        ({"trainer.plugins": []}, ("atomic checkpoints",)),
        ({"trainer.enable_progress_bar": False}, ("progress bar",)),
    ],
)
def test_a_switched_off_mechanism_is_not_announced(switch: dict, gone: tuple) -> None:
    before = wiring.announce(_config(), "fit")
    after = wiring.announce(_config(**switch), "fit")
    for name in gone:
        assert f"  {name} " in before and f"  {name} " not in after, name


def test_evaluation_announces_no_training_mechanism() -> None:
    text = wiring.announce(_config(), "validate")
    assert "preemption" not in text and "periodic checkpoint" not in text


def test_pieces_follow_their_switches() -> None:
    run = Run(None, None, None, resume=False)
    added = wiring.callbacks({}, "fit", run, "val_acc")["callbacks"]
    kinds = [type(c) for c in added]
    assert kinds == [
        wiring.TimedProgressBar,
        wiring.MonitorCheck,
        TrackerRuns,
        LogsBeforeCheckpoints,
        Preemption,
        Provenance,
    ]
    quiet = Run(None, None, None, resume=False, preemption=False)
    kinds = [type(c) for c in wiring.callbacks({"enable_progress_bar": False}, "fit", quiet, None)["callbacks"]]
    assert kinds == [TrackerRuns, LogsBeforeCheckpoints, Provenance]  # they only write files in the run's folder
    averaged = [type(c) for c in wiring.callbacks({}, "fit", run, None, EMAOptions(decay=0.9))["callbacks"]]
    # A stop's checkpoint at a batch's end holds that batch's update of the average.
    assert averaged.index(EMA) < averaged.index(Preemption)
    assert wiring.callbacks({"enable_progress_bar": False}, "validate", run, "val_acc") == {}
    assert isinstance(wiring.plugins({})["plugins"][0], AtomicCheckpointIO)
    assert wiring.plugins({"plugins": []}) == {}


def test_monitor_check_waits_for_training_metrics_and_names_what_is_logged() -> None:
    from types import SimpleNamespace

    from template.engine.errors import ConfigError

    after_sanity = SimpleNamespace(callback_metrics={"val_mse": 1.0}, sanity_checking=True)
    wiring.MonitorCheck({"checkpoint.monitor": "train_mse"}).on_sanity_check_end(
        after_sanity, None
    )  # not logged before training: wait
    with pytest.raises(ConfigError, match=r"it logs: val_mse\); .*--checkpoint.monitor=val_mse --checkpoint.mode=min"):
        wiring.MonitorCheck({"checkpoint.monitor": "val_acc"}).on_sanity_check_end(after_sanity, None)
    after_epoch = SimpleNamespace(callback_metrics={"train_mse": 1.0, "val_mse": 1.0}, sanity_checking=False)
    wiring.MonitorCheck({"checkpoint.monitor": "train_mse"}).on_validation_end(after_epoch, None)
