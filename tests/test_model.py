import pytest
import torch
from torch import nn
from torch.nn import functional as F

from template.engine.errors import ConfigError
from template.model import Classifier
from template.nets import MLP


def _batch(n=32, classes=10):
    generator = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 8, 8, generator=generator), torch.randint(0, classes, (n,), generator=generator)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = Classifier(
        MLP((1, 8, 8), 10, dropout=0.0), num_classes=10, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2)
    )
    optimizer = model.configure_optimizers()
    batch = _batch()
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(batch[0]), batch[1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_and_scheduler_come_from_the_injected_callables():
    model = Classifier(
        MLP((1, 8, 8), 10),
        num_classes=10,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
    )
    config = model.configure_optimizers()
    assert isinstance(config["optimizer"], torch.optim.SGD) and config["optimizer"].param_groups[0]["lr"] == 0.5
    assert config["lr_scheduler"]["monitor"] == "val_loss"


def test_predict_step_returns_one_class_per_sample():
    model = Classifier(MLP((1, 8, 8), 10), num_classes=10)
    x, y = _batch(5)
    assert model.predict_step((x, y), 0).shape == (5,)
    assert model.predict_step(x, 0).shape == (5,)


def test_state_dict_keys_are_those_of_the_net_under_net():
    net = MLP((1, 8, 8), 10)
    model = Classifier(net, num_classes=10)
    assert set(model.state_dict()) == {f"net.{k}" for k in net.state_dict()}


def test_missing_num_classes_says_where_to_set_it():
    with pytest.raises(ConfigError, match="model.num_classes"):
        Classifier(MLP((1, 8, 8), 10))


def test_net_output_size_mismatch_is_explained():
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), num_classes=10)
    with pytest.raises(ConfigError, match="returns 3 logits per sample but model.num_classes is 10"):
        model.validation_step(_batch(), 0)


def test_checkpoint_of_a_hand_built_model_loads_with_weights_only(tmp_path):
    from lightning.pytorch import Trainer

    model = Classifier(MLP((1, 8, 8), 10), num_classes=10)
    trainer = Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "hand.ckpt")
    checkpoint = torch.load(tmp_path / "hand.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"] == {"num_classes": 10}


def test_a_training_step_reads_nothing_back_from_the_device_and_the_epoch_values_weigh_every_sample():
    # On a GPU each such read (.item(), bool(tensor), torch.unique, the range torch.bincount reads) waits for the
    # work queued before it: the example's step and its metrics must not need one.
    from tests.collective_counter import HostReads

    model = Classifier(MLP((1, 8, 8), 10, dropout=0.0), num_classes=10)
    batches = [_batch(32), _batch(5)]  # a short last batch: the epoch's mean loss is per sample, not per batch
    reads: list[str] = []
    with torch.no_grad(), HostReads(reads.append):
        for index, batch in enumerate(batches):
            model.training_step(batch, index)
            model.validation_step(batch, index)
    assert reads == []
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        logits = model(x)
    assert model.train_loss.compute() == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    assert model.val_acc.compute() == pytest.approx((logits.argmax(-1) == y).float().mean().item())


@pytest.mark.gpu(1)
def test_on_a_gpu_the_example_steps_and_metrics_never_synchronise():
    model = Classifier(MLP((1, 8, 8), 10), num_classes=10).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    batch = [t.cuda() for t in _batch()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising operation raises
    try:
        for index in range(3):
            model.training_step(batch, index).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model.validation_step(batch, index)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert model.train_loss.compute().item() > 0 and 0 <= model.val_acc.compute().item() <= 1
