"""Cross-validation: the split helper's folds (stratified, disjoint, seeded, the test split outside), the command's
refusals in one line before anything is written, a cv of three folds killed and continued by the same command, and a
sweep whose trials are each a cross-validation (scored by the mean, pruned between folds, continued after a kill)."""

from __future__ import annotations

import csv
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

from template.data import DigitsDataModule
from template.engine.errors import ConfigError
from template.engine.sweep.folds import fold_indices
from tests.conftest import CONFIGS, finish

# -- the split helper --------------------------------------------------------------------------------------------------
LABELS = torch.tensor([0] * 50 + [1] * 30 + [2] * 7 + [3] * 13)  # 100 samples, classes of unequal size


@pytest.mark.parametrize("labels", [LABELS, None], ids=["stratified", "plain"])
def test_folds_are_disjoint_cover_every_sample_once_and_have_equal_sizes(labels: torch.Tensor | None) -> None:
    k = 5
    splits = [fold_indices(fold, k, 100, labels, seed=3) for fold in range(k)]
    for train, val in splits:
        assert set(train.tolist()).isdisjoint(val.tolist())
        assert sorted(train.tolist() + val.tolist()) == list(range(100))
    vals = torch.cat([val for _, val in splits])
    assert sorted(vals.tolist()) == list(range(100))  # each sample validated in exactly one fold
    assert {len(val) for _, val in splits} == {20}


def test_stratified_folds_hold_each_class_in_its_proportion() -> None:
    k = 5
    for fold in range(k):
        _, val = fold_indices(fold, k, 100, LABELS, seed=0)
        counts = torch.bincount(LABELS[val], minlength=4)
        expected = torch.bincount(LABELS, minlength=4) / k
        assert ((counts - expected).abs() < 1).all(), (fold, counts.tolist(), expected.tolist())


def test_the_same_seed_gives_the_same_folds_every_call_another_seed_others() -> None:
    first = [fold_indices(f, 4, 100, LABELS, seed=7) for f in range(4)]
    again = [fold_indices(f, 4, 100, LABELS, seed=7) for f in range(4)]
    other = [fold_indices(f, 4, 100, LABELS, seed=8) for f in range(4)]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, other, strict=True))


def test_only_the_given_samples_are_split_the_test_split_stays_out() -> None:
    test = torch.arange(0, 100, 10)  # every tenth sample is the test split
    rest = torch.tensor([i for i in range(100) if i % 10])
    vals = []
    for fold in range(3):
        train, val = fold_indices(fold, 3, rest, LABELS, seed=0)
        assert not set(test.tolist()) & set(train.tolist() + val.tolist())
        vals += val.tolist()
    assert sorted(vals) == rest.tolist()


def test_the_example_data_keeps_its_test_split_and_folds_the_rest(tmp_path: Path) -> None:
    plain = DigitsDataModule(data_dir=str(tmp_path))
    plain.setup("fit")
    seen = []
    for fold in range(3):
        data = DigitsDataModule(data_dir=str(tmp_path), fold=fold, num_folds=3)
        data.setup("fit")
        assert torch.equal(data.splits["test"].tensors[0], plain.splits["test"].tensors[0])
        assert len(data.splits["train"]) + len(data.splits["val"]) == len(plain.splits["train"]) + len(
            plain.splits["val"]
        )
        seen.append(data.splits["val"].tensors[1])
    # Each fold's validation labels in the proportions of the whole (within one sample a class).
    whole = torch.bincount(torch.cat(seen), minlength=10) / 3
    assert all((torch.bincount(s, minlength=10) - whole).abs().max() < 1 for s in seen)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 1, 10), "at least 2 folds"),
        ((3, 3, 10), "fold=3 is not one of the 3 folds"),
        ((0, 11, 10), "11 folds of 10 samples: use at most 10 folds"),
        ((0, 8, 100, LABELS), "class 2 has 7 samples: use at most 7 folds"),
    ],
)
def test_impossible_splits_are_refused(args: tuple, expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        fold_indices(*args)


# -- the command's refusals --------------------------------------------------------------------------------------------
class Unlabelled(LightningDataModule):
    """A regression DataModule following the protocol: its folds are plain k-fold (it has no labels)."""

    def __init__(self, samples: int = 40, fold: int | None = None, num_folds: int = 5) -> None:
        super().__init__()
        self.samples, self.fold, self.num_folds = samples, fold, num_folds

    def setup(self, stage: str) -> None:
        x = torch.linspace(0, 1, self.samples).unsqueeze(1)
        train, val = fold_indices(self.fold or 0, self.num_folds, self.samples)
        self.train, self.val = TensorDataset(x[train], x[train]), TensorDataset(x[val], x[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=8)


class NoProtocol(Unlabelled):
    """A DataModule that does not take ``fold``."""

    def __init__(self, samples: int = 40) -> None:
        super().__init__(samples)


REFUSED = {
    "folds < 2": (["--cv.folds=1"], "invalid value '1' for 'cv.folds'; expected a value >= 2"),
    "more folds than the smallest class": (["--cv.folds=400"], "use at most"),
    "more folds than samples": (
        ["--cv.folds=11", "--data=tests.sweep.test_cv.Unlabelled", "--data.samples=10"],
        "11 folds of 10 samples: use at most 10 folds",
    ),
    "stratify without labels": (
        ["--cv.folds=3", "--cv.stratify=true", "--data=tests.sweep.test_cv.Unlabelled"],
        "cv.stratify=true, but tests.sweep.test_cv.Unlabelled gives fold_indices no labels",
    ),
    "an objective without its direction": (
        ["--cv.folds=3", "--cv.objective=val_loss"],
        "cv.objective=val_loss is not checkpoint.monitor, whose mode says nothing of it; "
        "set cv.direction to minimize or maximize",
    ),
    "no protocol": (
        ["--cv.folds=3", "--data=tests.sweep.test_cv.NoProtocol"],
        "tests.sweep.test_cv.NoProtocol cannot be cross-validated: its __init__ needs the arguments (fold: int | None",
    ),
}


# The same mistakes in a sweep with --cv.folds (its trials each a cross-validation), and one of its own.
SWEEP_REFUSED = {
    **{case: REFUSED[case] for case in ("folds < 2", "stratify without labels", "no protocol")},
    "a cv option the sweep has itself": (
        ["--cv.folds=3", "--cv.workers=2"],
        "unknown argument(s) --cv.workers=2; in a sweep, cv takes folds and stratify only",
    ),
}


@pytest.mark.parametrize(
    ("command", "case"), [*(("cv", case) for case in REFUSED), *(("sweep", case) for case in SWEEP_REFUSED)]
)
def test_mistakes_are_one_line_before_anything_is_written(command: str, case: str, run_main, tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    args, expected = (REFUSED if command == "cv" else SWEEP_REFUSED)[case]
    done = run_main(command, "--config", CONFIGS / f"{'default' if command == 'cv' else 'sweep'}.yaml", *args)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "lightning_logs").exists()  # the data's own cache (data/) is what fit would write too


# -- a cv of three folds, killed and continued -------------------------------------------------------------------------
LIMIT = 480  # seconds for one cv command of three tiny folds on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_three_folds_killed_mid_fold_continue_with_the_same_command_and_summarise(tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.sweep.test_sweep import PACED, TINY, _start, _steps

    (tmp_path / "paced.yaml").write_text(PACED)
    args = ["cv", "--config", CONFIGS / "default.yaml", "--config", tmp_path / "paced.yaml", "--cv.folds=3", *TINY]
    args += ["--cv.name=digits", "--trainer.max_epochs=2"]
    folder = tmp_path / "lightning_logs" / "digits"
    driver = _start(args, tmp_path)
    deadline = time.monotonic() + LIMIT
    while not (folder / "fold-1" / "checkpoints" / "last.ckpt").is_file():  # killed in fold 1, after its epoch 0
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    assert not (folder / "folds.csv").exists()
    again = _start(args, tmp_path)
    assert finish(again, LIMIT, "the same cv command") == 0
    out = again.stdout.read()
    assert "fold 1 continues" in out and "fold-2" in out, out[-3000:]
    # Each fold's line says the mean so far over the folds that ended, never one fold's as if it were the best.
    progress = [line for line in out.splitlines() if " finished; fold " in line]
    assert progress and all(re.search(r"; mean val_acc=[\d.]+ over [123] folds$", line) for line in progress), progress
    log = (folder / "fold-1.log").read_text()
    resumed = re.search(r"resuming from .*\(epoch \d+, step (\d+)\)", log)
    assert resumed and int(resumed.group(1)) >= 4, log[-2000:]  # from its checkpoint, not from step 0
    assert _steps(folder / "fold-1")[-1] == 7  # 2 epochs of 4 steps, to the end
    assert (folder / "fold-0.log").read_text().count("starting from the beginning") == 1  # fold 0 not run again
    with (folder / "folds.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["fold"] for r in rows] == ["0", "1", "2", "mean", "std"]
    scores = [float(r["val_acc"]) for r in rows[:3]]
    assert float(rows[3]["val_acc"]) == pytest.approx(sum(scores) / 3)
    assert float(rows[4]["val_acc"]) == pytest.approx(torch.tensor(scores).std().item())
    assert all(r["val_loss"] for r in rows)
    assert (folder / "folds.md").read_text().startswith("| fold | val_acc | val_loss |")
    assert (folder / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # Each fold ran with its own fold of three, as its run folder's config says.
    configs = [(folder / f"fold-{k}" / "config.yaml").read_text() for k in range(3)]
    assert all(f"fold: {k}" in c and "num_folds: 3" in c for k, c in enumerate(configs))
    # Started again once finished: nothing runs, the summary again.
    third = _start(args, tmp_path)
    assert finish(third, LIMIT, "the cv command a third time") == 0
    out = third.stdout.read()
    assert "starts" not in out and "continues" not in out and "val_acc" in out and "over 3 folds" in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(LIMIT)
def test_a_failing_fold_stops_the_cv_with_its_one_line_reason(tmp_path: Path, run_cli) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.sweep.test_sweep import TINY

    args = ["cv", "--config", CONFIGS / "default.yaml", "--cv.folds=2", "--cv.name=c", *TINY]
    done = run_cli(*args, "--model.net.init_args.dropout=2.0", timeout=LIMIT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert errors[0].startswith("error: fold 0: ") and "dropout probability has to be between 0 and 1" in errors[0]
    assert errors[0].endswith("fix it and run the same command") and "max_failures" not in errors[0], errors[0]
    assert not (tmp_path / "lightning_logs" / "c" / "fold-1").exists()  # the cv stopped at its first failure


# -- --cv.folds in a sweep: each trial a cross-validation --------------------------------------------------------------
def test_the_sweeps_help_names_cv_folds(run_main) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    done = run_main("sweep", "--help")
    assert done.returncode == 0 and "--cv.folds=k (or a cv: section): each trial a k-fold" in done.stdout


def test_a_sweep_does_not_mix_trials_scored_over_folds_with_single_fits(run_main, tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.sweep.test_sweep import LR, _journal, _sweep_args, _worker

    folder = tmp_path / "lightning_logs" / "s"
    folder.mkdir(parents=True)
    _worker(_journal(folder, "study.journal"), {"model.optimizer.init_args.lr": yaml.safe_load(LR.split(": ", 1)[1])})
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    done = run_main(*_sweep_args(tmp_path), "--cv.folds=2")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "sweep 's' exists with another space (differs in: cv.folds)" in errors[0]
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_a_sweep_with_folds_scores_the_mean_prunes_between_folds_and_continues_after_a_kill(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.resume.test_exact_resume import _differences, _training_state
    from tests.sweep.test_sweep import PACED, TINY, _start, _study, _val_acc

    (tmp_path / "paced.yaml").write_text(PACED)
    lrs = [0.01, 0.003, 1.0e-6]  # in this order; the last learns nothing and is pruned after its first fold
    (tmp_path / "s.yaml").write_text(
        "sweep:\n  name: s\n  n_trials: 3\n  n_startup_trials: 2\n  space:\n"
        f"    model.optimizer.init_args.lr: {{type: categorical, choices: {lrs}}}\n"
        f"  enqueue: {[{'model.optimizer.init_args.lr': lr} for lr in lrs]}\n"
    )
    args = ["sweep", "--config", CONFIGS / "default.yaml", "--config", tmp_path / "s.yaml", "--cv.folds=2", *TINY]
    args += ["--config", tmp_path / "paced.yaml", "--trainer.max_epochs=2"]
    folder = tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    deadline = time.monotonic() + LIMIT
    trial0 = folder / "trial-0000"
    while not (trial0 / "fold-1" / "checkpoints" / "last.ckpt").is_file():  # killed in trial 0's second fold
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    again = _start(args, tmp_path)
    assert finish(again, LIMIT, "the same sweep command") == 0
    out = again.stdout.read()
    assert f"trial 0 continues in {Path('lightning_logs/s/trial-0000/fold-1')}" in out, out[-3000:]
    resumed = re.search(r"resuming from .*\(epoch \d+, step (\d+)\)", (trial0 / "fold-1.log").read_text())
    assert resumed and int(resumed.group(1)) >= 4  # from its checkpoint
    assert (trial0 / "fold-0.log").read_text().count("starting from the beginning") == 1  # not run again

    # The killed fold ended exactly where its fit run without a stop ends: weights, optimizer and RNG bit for bit.
    alone = _start(["fit", "--config", trial0 / "fold-1.yaml", "--run.name=alone"], tmp_path)
    assert finish(alone, LIMIT, "fold 1 without a stop") == 0, alone.stdout.read()[-3000:]
    ends = [
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        for run in (trial0 / "fold-1", folder.parent / "alone")
    ]
    assert _differences(*map(_training_state, ends)) == []
    trials = _study(folder).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2 + [optuna.trial.TrialState.PRUNED]
    for t in trials[:2]:  # each fold's best validation, their mean the trial's value, the running mean per fold
        best = [max(_val_acc(folder / f"trial-{t.number:04d}" / f"fold-{k}")) for k in range(2)]
        assert t.user_attrs["fold_scores"] == best
        assert t.value == pytest.approx(sum(best) / 2)
        assert t.intermediate_values == pytest.approx({0: best[0], 1: sum(best) / 2})
    assert trials[2].user_attrs["fold_scores"] == [max(_val_acc(folder / "trial-0002" / "fold-0"))]
    assert not (folder / "trial-0002" / "fold-1").exists()  # pruned before its second fold
    # Each fold trained with its own fold of two; best.yaml trains the best values on the DataModule's own split.
    for k in range(2):
        config = yaml.safe_load((trial0 / f"fold-{k}" / "config.yaml").read_text())
        assert (config["data"]["init_args"]["fold"], config["data"]["init_args"]["num_folds"]) == (k, 2)
    best = yaml.safe_load((folder / "best.yaml").read_text())
    assert best["data"]["init_args"]["fold"] is None and best["run"]["name"] is None
    winner = max(trials[:2], key=lambda t: t.value).params["model.optimizer.init_args.lr"]
    assert best["model"]["init_args"]["optimizer"]["init_args"]["lr"] == winner
    with (folder / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(rows[0][f"fold {k}"]) for k in range(2)] == trials[0].user_attrs["fold_scores"]
    assert float(rows[0]["std"]) == pytest.approx(torch.tensor(trials[0].user_attrs["fold_scores"]).std().item())
    assert rows[2]["fold 1"] == rows[2]["std"] == "" and rows[2]["state"] == "pruned"


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
def test_a_trial_whose_worker_died_elsewhere_is_retried_from_its_first_fold_without_a_score(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.sweep.test_sweep import _start, _study, _sweep_args, _val_acc

    args = [*_sweep_args(tmp_path, n_trials=1, extra="  pruner: none\n  heartbeat: 1\n"), "--cv.folds=2"]
    folder = tmp_path / "lightning_logs" / "s"
    driver = _start(args, tmp_path)
    deadline = time.monotonic() + LIMIT
    while not (folder / "trial-0000" / "fold-1.yaml").is_file():  # fold 0 recorded, fold 1 about to start
        assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()[-3000:]
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    # As if that worker ran on another machine: this one does not take the trial up as its own, but waits for its
    # heartbeat to go silent, fails it and asks the same values again.
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "study.journal")))
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("s"), 0)
    assert storage.get_trial(trial_id).user_attrs["fold_scores"]  # fold 0 ended and was recorded
    storage.set_trial_user_attr(trial_id, "worker", "elsewhere.0")
    again = _start(args, tmp_path)
    assert finish(again, LIMIT, "the same sweep command") == 0
    out = again.stdout.read()
    trials = _study(folder).get_trials(deepcopy=False)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"], out[-3000:]
    assert trials[0].user_attrs["reason"] == "worker elsewhere.0 stopped"
    retry = trials[1]
    assert retry.params == trials[0].params
    assert (retry.user_attrs["folder"], retry.user_attrs["retry_of"]) == ("trial-0000", 0)
    # Fold 0 is not run again: its score is carried over, and only fold 1 trained in the retry.
    best = [max(_val_acc(folder / "trial-0000" / f"fold-{k}")) for k in range(2)]
    assert retry.user_attrs["fold_scores"] == best and retry.value == pytest.approx(sum(best) / 2)
    assert "resuming from" not in (folder / "trial-0000" / "fold-0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(3 * LIMIT)
@pytest.mark.parametrize("moment", ["fold 0 ended, not yet recorded", "fold 0 recorded, fold 1 not yet started"])
def test_a_sweep_killed_between_a_trials_folds_continues_with_the_same_command(moment: str, tmp_path: Path) -> None:
    pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    from tests.sweep.test_sweep import _start, _study, _sweep_args, _val_acc
    from tests.sweep.test_sweep_restarts import _as_if_never_stopped, _ended, _trial_pid, _wait

    args = [*_sweep_args(tmp_path, n_trials=1, extra="  pruner: none\n"), "--cv.folds=2"]
    trial0 = tmp_path / "lightning_logs" / "s" / "trial-0000"
    driver = _start(args, tmp_path)
    if moment.endswith("not yet recorded"):
        _wait(lambda: (trial0 / "fold-0.yaml").is_file() and _trial_pid(driver) is not None, "fold 0", driver)
        os.kill(driver.pid, signal.SIGSTOP)  # the driver cannot record the fold's end
        pid = _trial_pid(driver)
        _wait(lambda: _ended(pid), "the end of fold 0")
    else:
        _wait(lambda: (trial0 / "fold-1.yaml").is_file(), "fold 1's config", driver)  # written just before it starts
    os.killpg(driver.pid, signal.SIGKILL)
    finish(driver, LIMIT, "the killed sweep")
    again = _start(args, tmp_path)
    assert finish(again, LIMIT, "the same sweep command") == 0
    out = again.stdout.read()
    (trial,) = _study(trial0.parent).get_trials(deepcopy=False)
    assert trial.state.name == "COMPLETE", out[-3000:]
    best = [max(_val_acc(trial0 / f"fold-{k}")) for k in range(2)]
    assert trial.user_attrs["fold_scores"] == best and trial.value == pytest.approx(sum(best) / 2)
    assert trial.intermediate_values == pytest.approx({0: best[0], 1: sum(best) / 2})
    logs = [(trial0 / f"fold-{k}.log").read_text() for k in range(2)]
    # Each fold trained once from the beginning; an ended fold not yet recorded resumes at its end to give its score.
    assert [log.count("starting from the beginning") for log in logs] == [1, 1]
    assert ("resuming from" in logs[0]) == moment.endswith("not yet recorded")
    for k in range(2):
        _as_if_never_stopped(trial0 / f"fold-{k}.yaml", trial0 / f"fold-{k}", tmp_path)
