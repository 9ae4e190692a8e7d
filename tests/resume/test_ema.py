"""``ema.decay``: averaged weights in checkpoints and export, and a resumed run ends exactly as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import CONFIGS

SHORT = ("--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false")
SHORT += ("--trainer.deterministic=true", "--trainer.accelerator=cpu", "--ema.decay=0.9")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def test_ema_checkpoints_resume_exactly_and_export_the_average(run_main, tmp_path: Path) -> None:
    fit = ("fit", "--config", CONFIGS / "default.yaml", *SHORT)
    assert run_main(*fit, "--run.name=straight", "--trainer.max_epochs=2").returncode == 0
    for epochs in (1, 2):  # the same run, stopped after one epoch and continued
        result = run_main(*fit, "--run.name=resumed", f"--trainer.max_epochs={epochs}")
        assert result.returncode == 0, result.stderr[-3000:]
    straight = _load(tmp_path / "lightning_logs/straight/checkpoints/last.ckpt")
    resumed = _load(tmp_path / "lightning_logs/resumed/checkpoints/last.ckpt")
    assert straight["averaging_state"]["n_averaged"] == 8  # one update per step
    # The checkpoint's state_dict is the average; the trained weights sit beside it.
    key = "net.layers.1.weight"
    assert not torch.equal(straight["state_dict"][key], straight["current_model_state"][key])
    for part in ("state_dict", "current_model_state"):
        for name, value in straight[part].items():
            assert torch.equal(value, resumed[part][name]), f"{part}.{name} differs after the resume"

    result = run_main("export", tmp_path / "lightning_logs/straight/checkpoints/last.ckpt", "--output", "net.pt")
    assert result.returncode == 0, result.stderr
    exported = _load(tmp_path / "net.pt")
    assert torch.equal(exported["layers.1.weight"], straight["state_dict"][key])  # export writes the average


def test_a_bad_decay_is_one_line(run_main) -> None:
    result = run_main("fit", "--config", CONFIGS / "default.yaml", "--ema.decay=1.5")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: invalid value '1.5' for 'ema.decay'; expected a value > 0 and < 1 or null"
    )
