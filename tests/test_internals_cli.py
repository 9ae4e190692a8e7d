"""The private names of Lightning and jsonargparse the command line relies on: each fails here when it changes."""

from __future__ import annotations

import sys

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from template.engine import internals


def test_print_config_can_be_deferred_and_then_printed(capsys: pytest.CaptureFixture) -> None:
    action = internals.print_config_action()
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--print_config", action=action)
    parser.add_argument("--epochs", type=int, default=1)
    with action.skip_print_config():
        config = parser.parse_args(["--epochs=3", "--print_config"])
    assert capsys.readouterr().out == ""  # deferred: the run may still change the config
    config.epochs = 4
    with pytest.raises(SystemExit) as exit_info:
        action.print_config_if_requested(parser, config)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == "epochs: 4"


@pytest.fixture(autouse=True)
def _no_outer_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["probe"])


def test_lightning_instantiator_records_the_links_it_is_given() -> None:
    instantiator = internals.instantiator_class()

    class Probe(LightningCLI):
        def before_instantiate_classes(self) -> None:
            self.hparams_seen = None
            call = instantiator(cli=self, key="model")

            class Recording(LightningModule):
                def __init__(self, size: int = 1) -> None:
                    super().__init__()
                    self.save_hyperparameters()

            module = call(Recording, size=5, applied_instantiation_links={"model.size": 5})
            raise _Stop(dict(module.hparams))

    with pytest.raises(_Stop) as stop:
        Probe(BoringModel, args=["fit"], save_config_callback=None, seed_everything_default=0)
    assert stop.value.args[0]["size"] == 5


class _Stop(Exception):
    """Ends a LightningCLI right after its parse, carrying what a probe found."""
