"""Experiment trackers from YAML: MLflow (local SQLite store) and Weights & Biases (offline), beside the usual logs."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, cli_env

pytestmark = pytest.mark.slow  # every test trains in a subprocess, three with a tracker's imports

SHORT = ("--trainer.max_epochs=2", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2")
SHORT += ("--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false")


def _needs(*modules: str, extra: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed (pip install -e '.[{extra}]')")


def _csv_column(tmp_path: Path, column: str) -> list[str]:
    rows = csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open())
    return [row[column] for row in rows if row[column]]


@_needs("mlflow", "sqlalchemy", "alembic", extra="mlflow")
def test_mlflow_config_logs_the_run_to_a_local_store(run_cli, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    result = run_cli("fit", "--config", CONFIGS / "default.yaml", "--config", CONFIGS / "mlflow.yaml", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["net/class_path"].endswith("nets.MLP")  # the hyper-parameters, from the config
    # The same values as metrics.csv, which the default loggers still write.
    for column in ("train_loss", "val_acc"):
        history = client.get_metric_history(run.info.run_id, column)
        assert [m.value for m in history] == [pytest.approx(float(v)) for v in _csv_column(tmp_path, column)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 3, 5, 7, 9]
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


@_needs("wandb", extra="wandb")
def test_wandb_config_logs_offline(run_cli, tmp_path: Path) -> None:
    # No key and no network: offline mode must not ask for either.
    env = cli_env(WANDB_API_KEY="", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    result = run_cli("fit", "--config", CONFIGS / "default.yaml", "--config", CONFIGS / "wandb.yaml", *SHORT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = run_file.read_bytes()  # protobuf records: names and values are stored as plain text
    assert b"hidden_sizes" in recorded  # the hyper-parameters
    for column in ("train_loss", "val_acc"):
        values = _csv_column(tmp_path, column)
        assert len(values) > 1 and all(value.encode() in recorded for value in values), column
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_trackers_with_logging_switched_off_is_one_line(run_cli) -> None:
    result = run_cli(
        "fit",
        "--config",
        CONFIGS / "default.yaml",
        "--trainer.logger=false",
        *_tracker("CSV", "--trackers.save_dir=extra"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: trackers are set but trainer.logger is false")


def test_trackers_join_the_default_loggers(run_cli, tmp_path: Path) -> None:
    result = run_cli("fit", "--config", CONFIGS / "default.yaml", *SHORT, *_tracker("CSV", "--trackers.save_dir=extra"))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert {"metrics.csv", "config.yaml", "checkpoints"} <= {p.name for p in run_dir.iterdir()}
    assert any(run_dir.glob("events.out.tfevents.*"))  # TensorBoard, as without trackers
    (extra,) = (tmp_path / "extra" / "lightning_logs").glob("version_*/metrics.csv")
    assert [r["val_acc"] for r in csv.DictReader(extra.open()) if r["val_acc"]] == _csv_column(tmp_path, "val_acc")


def _tracker(kind: str, *init_args: str) -> tuple[str, ...]:
    return (f"--trackers+=lightning.pytorch.loggers.{kind}Logger", *init_args)


RESTART = ("--run.name=digits", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2")
RESTART += ("--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu")


@_needs("mlflow", "sqlalchemy", "alembic", extra="mlflow")
def test_a_restarted_run_continues_its_mlflow_run(run_cli, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    for epochs in (1, 2):  # the second command continues the first run from its last checkpoint
        config = ("--config", CONFIGS / "default.yaml", "--config", CONFIGS / "mlflow.yaml")
        result = run_cli("fit", *config, *RESTART, f"--trainer.max_epochs={epochs}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert "MLFlowLogger: continuing tracker run" in result.stderr

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])  # one run, not two
    assert run.info.status == "FINISHED"
    folder = tmp_path / "lightning_logs" / "digits"
    assert json.loads((folder / "trackers.json").read_text())["MLFlowLogger"]["id"] == run.info.run_id
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    for column in ("train_loss", "val_acc"):
        history = client.get_metric_history(run.info.run_id, column)
        steps = [m.step for m in history]
        assert steps == sorted(set(steps)), f"{column}: a step logged twice: {steps}"
        assert steps == [int(r["step"]) for r in rows if r[column]]  # the same steps as the CSV log, once each
        assert [m.value for m in history] == [pytest.approx(float(r[column])) for r in rows if r[column]]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epoch")][-1] == 9  # two epochs of 5 steps
    # The resolved config as an artifact of the tracker run; the restart changed max_epochs, so its config too.
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.restart-1.yaml", "config.yaml"]
    logged = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "downloaded")))
    assert logged.read_text() == (folder / "config.yaml").read_text()


@_needs("wandb", extra="wandb")
def test_a_restarted_run_continues_its_wandb_run(run_cli, tmp_path: Path) -> None:
    env = cli_env(WANDB_API_KEY="", WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    for epochs in (1, 2):
        config = ("--config", CONFIGS / "default.yaml", "--config", CONFIGS / "wandb.yaml")
        result = run_cli("fit", *config, *RESTART, f"--trainer.max_epochs={epochs}", env=env)
        assert result.returncode == 0, result.stderr[-3000:]

    folder = tmp_path / "lightning_logs" / "digits"
    run_id = json.loads((folder / "trackers.json").read_text())["WandbLogger"]["id"]
    # Offline, each start writes a folder; both hold the one run id, which `wandb sync` uploads as one run.
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    for column in ("train_loss", "val_acc"):
        steps = [step for f in files for step in _wandb_history(f, column)]
        assert steps == [int(r["step"]) for r in rows if r[column]], f"{column}: every step once, as in metrics.csv"
    assert max(int(r["step"]) for r in rows) == 9  # two epochs of 5 steps
    first = files[0].read_bytes()
    assert b"max_epochs" in first and b"digits" in first  # the resolved config, in the run's config


def _wandb_history(path: Path, key: str) -> list[int]:
    """The steps (``trainer/global_step``) at which an offline W&B run file logged ``key``.

    The file is a LevelDB-style log (what W&B's own reader walks): a 7-byte header, then 32 KiB blocks of chunks,
    each a 7-byte header (CRC, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, values, pending = path.read_bytes(), 32768, [], b""
    offset = 7
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a chunk header is padding
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if key in items:
                values.append(int(items["trainer/global_step"]))
    return values
