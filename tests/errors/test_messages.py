"""Each of jsonargparse's messages that ``errors.PARSER_MESSAGES`` rewrites, as jsonargparse words it (made one line),
and the line a user reads: every pattern has its sample, and the sample is taken by its own pattern, not an earlier."""

from __future__ import annotations

import re

import pytest

from template.engine.errors import PARSER_MESSAGES, explain_parser_error, explain_trainer_error

UNION = "Does not validate against any of the Union subtypes"
MODEL = f"Parser key \"model\": {UNION} Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>] Errors:"  # noqa: E501
LOGGER = "Parser key \"trainer.logger\": Does not validate against any of the Union subtypes Subtypes: [<class 'lightning.pytorch.loggers.logger.Logger'>, <class 'bool'>, <class 'NoneType'>] Errors: - Problem with given class_path 'template.engine.logs.loggers.ResumableCSVLogger': Parser key \"save_interval\": Not of type NonNegativeFloat: -3 does not conform to restriction v>=0 - Expected a <class 'bool'> - Expected a <class 'NoneType'> Given value type: <class 'jsonargparse._util.NestedArg'> Given value: NestedArg(key='save_interval', val='-3')"  # noqa: E501
FSDP2 = "template.engine.strategies.FSDP2Strategy"

# name in PARSER_MESSAGES: (the message, the files the command read, the line it becomes)
SAMPLES: dict[str, tuple[str, dict, str]] = {
    "unknown option": (
        "Subcommand 'fit' does not accept option 'trainer.max_epocs'",
        {},
        "unknown option 'trainer.max_epocs'; check its spelling and nesting, or run with --help to list the valid "
        "options",
    ),
    "unknown argument": (
        "unrecognized arguments: --trainer.max_epocs=3",
        {},
        "unknown argument(s) --trainer.max_epocs=3; run with --help to list the valid options",
    ),
    "restricted value": (
        LOGGER,
        {},
        "invalid value '-3' for 'trainer.logger.init_args.save_interval'; expected a value >= 0 or null",
    ),
    "init_args value": (
        "Parser key \"data\": Does not validate against any of the Union subtypes Subtypes: [<class 'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>] Errors: - Problem with given class_path 'template.data.DigitsDataModule': Parser key \"batch_size\": Expected a <class 'int'>. Got value: x - Expected a <class 'NoneType'> Given value type: <class 'jsonargparse._util.NestedArg'> Given value: NestedArg(key='batch_size', val='x')",  # noqa: E501
        {},
        "invalid value 'x' for 'data.init_args.batch_size'; expected int",
    ),
    "class_path": (
        f"{MODEL} - Problem with given class_path 'template.model.Classifier': Parser key \"net\": Problem with given class_path 'template.nets.MLP': Option 'dropuot' is not accepted - Expected a <class 'NoneType'> Given value type: <class 'jsonargparse._util.NestedArg'> Given value: NestedArg(key='net.init_args.dropuot', val='0.2')",  # noqa: E501
        {"mine.yaml": {"model": {"init_args": {"net": {"init_args": {"dropuot": 0.2}}}}}},
        "model.init_args.net.init_args.dropuot (set in config file 'mine.yaml') is not an argument of "
        "'template.nets.MLP'; check its spelling, drop it from that file, "
        "or add the argument to the class",
    ),
    "option of a name": (
        "Parser key \"trainer.strategy\": Does not validate against any of the Union subtypes Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>] Errors: - Expected a <class 'str'> - Expected a dot import path string: fsdp Given value type: <class 'jsonargparse._util.NestedArg'> Given value: NestedArg(key='shard_layers', val=['Linear'])",  # noqa: E501
        {},
        "'trainer.strategy' is given by name, and a name takes no options such as shard_layers; give it as a class "
        "with its options: --trainer.strategy=<class path> --trainer.strategy.shard_layers=... (for fsdp: "
        f"{FSDP2}; in YAML class_path and init_args)",
    ),
    "rejected value": (
        "Parser key \"trainer.max_epochs\": Does not validate against any of the Union subtypes Subtypes: [<class 'int'>, <class 'NoneType'>] Errors: - Expected a <class 'int'> - Expected a <class 'NoneType'> Given value type: <class 'str'> Given value: abc",  # noqa: E501
        {},
        "invalid value 'abc' for 'trainer.max_epochs'; expected int or null",
    ),
    "value of one type": (
        "Parser key \"test_after_fit\": Expected a <class 'bool'>. Got value: maybe",
        {},
        "invalid value 'maybe' for 'test_after_fit'; expected bool",
    ),
    "other": (
        "Parser key \"format\": 'bar' not among choices ('weights', 'onnx')",
        {},
        "invalid value for 'format': 'bar' not among choices ('weights', 'onnx')",
    ),
    "config file": (
        "Path does not exist: '/work/nope.yaml'",
        {},
        "Path does not exist: '/work/nope.yaml'; check the path given to --config",
    ),
}
# The other ways the class_path pattern says what is wrong with the innermost class.
CLASS_PATH = {
    "needs arguments": (
        f"{MODEL} - Problem with given class_path 'template.model.Classifier': Parser key \"net\": Problem with given class_path 'torch.nn.Linear': the following arguments are required: in_features, out_features - Expected a <class 'NoneType'> Given value type: <class 'jsonargparse._namespace.Namespace'> Given value: Namespace(class_path='template.model.Classifier')",  # noqa: E501
        "class_path 'torch.nn.Linear' for 'model.net' needs in_features, out_features; set them under "
        "model.net.init_args",
    ),
    "does not import": (
        f"{MODEL} - Problem with given class_path 'template.model.Classifier': Parser key \"net\": - Expected a path but mypkg.nets.Nope either not accessible or invalid - Problem with given class_path 'mypkg.nets.Nope': No module named 'mypkg' - Expected a <class 'NoneType'> Given value type: <class 'jsonargparse._util.NestedArg'> Given value: NestedArg(key='net', val='mypkg.nets.Nope')",  # noqa: E501
        "class_path 'mypkg.nets.Nope' for 'model.net' cannot be used (No module named 'mypkg'); check its spelling "
        "and that its module is importable (on PYTHONPATH)",
    ),
}


def test_every_pattern_has_a_sample() -> None:
    assert list(SAMPLES) == list(PARSER_MESSAGES)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_sample_is_taken_by_its_own_pattern_and_said_in_one_line(name: str) -> None:
    message, files, line = SAMPLES[name]
    first = next(each for each, (pattern, _) in PARSER_MESSAGES.items() if re.search(pattern, message))
    assert first == name
    assert explain_parser_error(message, files) == line


@pytest.mark.parametrize("case", list(CLASS_PATH))
def test_the_innermost_class_is_the_one_named(case: str) -> None:
    message, line = CLASS_PATH[case]
    assert explain_parser_error(message) == line


def test_a_message_no_pattern_takes_is_kept_as_one_line() -> None:
    assert explain_parser_error("Something new\n  from jsonargparse") == "Something new from jsonargparse"


def test_a_loader_given_its_batch_size_by_position_is_one_line_naming_the_fix() -> None:
    # Lightning's predict rebuilds the user's DataLoader with its own batch sampler, and fails on a positional one.
    said = explain_trainer_error("DataLoader.__init__() got multiple values for argument 'batch_size'")
    assert said == (
        "a DataLoader of the data is given batch_size by position, and Lightning cannot rebuild it with its own "
        "sampler (Lightning issue 17991); pass it by name: DataLoader(dataset, batch_size=...)"
    )
