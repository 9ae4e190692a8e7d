"""A refusal while the parser builds the config's classes is blamed on the option that built the object, as the
parser's instantiator hook was called for it: not guessed from the class's name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint

from template.engine.commands.cli import main
from template.engine.errors.blame import Build, Instantiator, built
from tests.conftest import PACKAGE

ES = "lightning.pytorch.callbacks.EarlyStopping"


def _linear(in_features: int) -> Namespace:
    return Namespace(class_path="torch.nn.Linear", init_args=Namespace(in_features=in_features, out_features=2))


def test_the_option_is_the_one_whose_class_and_values_the_parser_built() -> None:
    # Two options name the same class; the arguments the parser passed tell which one raised.
    config = Namespace(first=_linear(4), second=_linear(-3), checkpoint=Namespace(monitor="val_acc"))
    build = Instantiator(config, {"checkpoint": ModelCheckpoint})
    assert isinstance(build(torch.nn.Linear, in_features=4, out_features=2), torch.nn.Linear)
    with pytest.raises(RuntimeError) as raised:
        build(torch.nn.Linear, in_features=-3, out_features=2, bias=True)
    expected = {"second.init_args.in_features": -3, "second.init_args.out_features": 2, "second.init_args.bias": True}
    assert built(raised.value) == Build("second", "torch.nn.Linear", expected)
    # Found through the exceptions that wrap it, as jsonargparse wraps a constructor's.
    try:
        raise ValueError("Does not validate against any of the Union subtypes") from raised.value
    except ValueError as wrapper:
        assert built(wrapper) == built(raised.value)
    assert built(RuntimeError("raised elsewhere")) is None
    # A section of its own (checkpoint:) is known by its class; its values are the section's options.
    with pytest.raises(Exception) as refused:
        build(ModelCheckpoint, monitor="val_acc", mode="maximum")
    found = built(refused.value)
    assert found is not None and found.option == "checkpoint" and found.class_path is None
    assert found.values["checkpoint.mode"] == "maximum"


@pytest.mark.parametrize("bad", [0, 1])
def test_of_two_callbacks_of_one_class_the_refused_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, bad: int
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [PACKAGE])
    modes = ["min", "min"]
    modes[bad] = "maximum"
    callbacks = [
        arg
        for monitor, mode in zip(["val_acc", "val_loss"], modes, strict=True)
        for arg in (
            f"--trainer.callbacks+={ES}",
            f"--trainer.callbacks.monitor={monitor}",
            f"--trainer.callbacks.mode={mode}",
        )
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.max_epochs=1", *callbacks])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: trainer.callbacks[{bad}].init_args.mode='maximum' refused by "), errors[0]
    assert list(tmp_path.iterdir()) == []
