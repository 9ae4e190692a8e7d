"""The command-line splitter the fit command and the sweep share, and a parser's refusal as one ConfigError."""

from __future__ import annotations

import pytest
from jsonargparse import ArgumentError, ArgumentParser

from template.engine.commands.preflight import split, split_options
from template.engine.errors import ConfigError, parser_error


def test_the_splitter_takes_the_options_asked_for_in_order_and_leaves_the_rest() -> None:
    argv = ["--config", "a.yaml", "--trainer.max_epochs=2", "-c", "b.yaml", "--config=c.yaml", "--sweep.n_trials", "3"]
    argv += ["--sweep.workers=2", "--sweeps=x", "--config"]  # no value after the last: the parser says so
    taken, rest = split_options(argv, "--config", "-c", "--sweep.")
    assert taken == [
        ("--config", "a.yaml"), ("-c", "b.yaml"), ("--config", "c.yaml"), ("--sweep.n_trials", "3"),
        ("--sweep.workers", "2"),
    ]  # fmt: skip
    assert rest == ["--trainer.max_epochs=2", "--sweeps=x", "--config"]
    others = ["--trainer.max_epochs=2", "--sweep.n_trials", "3", "--sweep.workers=2", "--sweeps=x", "--config"]
    assert split(argv) == (["a.yaml", "b.yaml", "c.yaml"], others)


def test_a_parsers_refusal_is_one_config_error() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--epochs", type=int)
    with pytest.raises(ArgumentError) as refused:
        parser.parse_args(["--epochs=many"])
    mistake = parser_error(refused.value, "trial 3: ")
    assert isinstance(mistake, ConfigError) and "\n" not in str(mistake)
    assert str(mistake) == "trial 3: invalid value 'many' for 'epochs'; expected int"
    # A ConfigError raised by the code the parser ran is kept as it is.
    try:
        raise ValueError("Does not validate") from ConfigError("config file x.yaml does not exist")
    except ValueError as wrapper:
        assert str(parser_error(wrapper)) == "config file x.yaml does not exist"
