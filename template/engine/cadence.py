"""Training steps pay for logging and metric bookkeeping only when a value is written, for any LightningModule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.aggregation import BaseAggregator
from torchmetrics.wrappers.abstract import WrapperMetric

from template.engine.errors import ConfigError
from template.engine.internals import current_hook, default_logging_levels, logs_this_step

# Metric families whose inputs hold one sample per row and whose states are sums or concatenations over samples:
# how the samples are split into updates does not change the value. Others (audio signals, images, text, a user's
# own Metric) may depend on the batches they are given, so they update on every call.
_PER_SAMPLE_FAMILIES = ("torchmetrics.classification.", "torchmetrics.regression.", "torchmetrics.aggregation")


class LogCadence(Callback):
    """Skips a LightningModule's step-only ``self.log`` calls between the Trainer's logging steps.

    Lightning writes step values to the loggers every ``trainer.log_every_n_steps`` steps, but a ``self.log`` in
    ``training_step`` still costs ~1 ms on every step (the value is moved into Lightning's result collection and
    overwritten by the next step's). With this callback those calls return at once on the steps in between, so a
    textbook ``training_step`` that logs its loss costs what logging costs only on the steps that write. Values
    that accumulate over the epoch (``on_epoch=True``) and everything outside training are logged as usual. The
    progress bar and ``trainer.callback_metrics`` then show a step value as of the latest logging step.

    The same holds for torchmetrics' classification, regression and aggregation metrics (and subclasses of them)
    updated in ``training_step``: each ``update`` costs a few hundred microseconds of Python and, on a GPU, a
    host-device sync for its input checks. Their inputs hold one sample per row and their states are sums or
    concatenations over samples, so their calls are queued (the
    arguments detached, not copied) and run as one update over the concatenated batches when the metric is next
    computed, called, reset or saved, at each epoch end, or once ``metric_queue_mib`` of inputs are waiting. Calls
    whose inputs do not concatenate (shapes that differ beyond the batch dimension, non-tensor inputs) run one by
    one at that point; the computed value is the same either way, up to floating-point summation order.

    Args:
        enabled: false logs every call on every step and updates metrics on every call, as Lightning does.
        metric_queue_mib: the most input data, in MiB, a metric holds back before updating; 0 updates on each call.
    """

    def __init__(self, enabled: bool = True, metric_queue_mib: float = 16.0) -> None:
        if not (math.isfinite(metric_queue_mib) and metric_queue_mib >= 0):
            raise ConfigError(
                f"log_cadence.metric_queue_mib must be a number of MiB >= 0, got {metric_queue_mib}; "
                "e.g. 16, or 0 to update metrics on every call"
            )
        self.enabled = enabled
        self.metric_queue_mib = metric_queue_mib
        self._queues: list[_MetricQueue] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.enabled and stage == "fit" and "log" not in pl_module.__dict__:
            pl_module.log = _gated(pl_module.log, trainer, pl_module)  # an instance attribute: the class is untouched

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here rather than in setup: a module may build its metrics in its own setup or configure_model.
        if self.enabled and self.metric_queue_mib > 0 and not self._queues:
            limit = int(self.metric_queue_mib * 2**20)
            self._queues = [_MetricQueue(metric, pl_module, limit) for metric in _training_metrics(pl_module)]

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()  # before the module's own epoch-end hook, which may read metric states

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("log", None)
        for queue in self._queues:
            queue.close()
        self._queues = []

    def _flush(self) -> None:
        for queue in self._queues:
            queue.flush()


def _gated(log: Any, trainer: Trainer, pl_module: LightningModule) -> Any:
    def gated_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        # Only keyword calls are judged; a call passing on_step/on_epoch by position is always logged.
        if not args and trainer.training and not trainer.fast_dev_run and not logs_this_step(trainer):
            levels = default_logging_levels(current_hook(pl_module), kwargs.get("on_step"), kwargs.get("on_epoch"))
            if levels is not None and levels[0] and not levels[1]:  # on_step only
                return
        log(name, value, *args, **kwargs)

    return gated_log


def _training_metrics(module: nn.Module) -> Iterator[Metric]:
    """The module's per-sample metrics, whose updates may be queued: not inside a MetricCollection or a wrapper.

    A MetricCollection's compute groups share state between its metrics and a wrapper reads its inner metrics'
    states directly, so neither is descended into.
    """
    for child in module.children():
        if isinstance(child, Metric):
            if _per_sample(child) and not isinstance(child, WrapperMetric):
                yield child
        elif not isinstance(child, MetricCollection):
            yield from _training_metrics(child)


def _per_sample(metric: Metric) -> bool:
    # A subclass counts as the torchmetrics class it derives from (torchmetrics.metric.Metric for a metric of its own).
    family = next(cls.__module__ for cls in type(metric).__mro__ if cls.__module__.startswith("torchmetrics."))
    return family.startswith(_PER_SAMPLE_FAMILIES)


_CANNOT = object()  # a column of arguments that does not concatenate


class _MetricQueue:
    """Holds back one metric's ``update`` calls from ``training_step`` and runs them together when needed."""

    def __init__(self, metric: Metric, pl_module: LightningModule, limit_bytes: int) -> None:
        self.metric = metric
        self.pl_module = pl_module
        self.limit_bytes = limit_bytes
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.bytes = 0
        self.passthrough = False
        # torchmetrics keeps update and compute as instance attributes (its own wrappers); forward, reset and
        # state_dict are methods of the class, shadowed here by instance attributes that close() removes again.
        # state_dict, because Lightning takes the module's state_dict before any on_save_checkpoint hook runs.
        self.update, self.compute = metric.update, metric.compute
        metric.update = self._update
        metric.compute = self._before(metric.compute)
        metric.state_dict = self._before(metric.state_dict)
        metric.forward = self._forward
        metric.reset = self._reset

    def _update(self, *args: Any, **kwargs: Any) -> None:
        if self.passthrough or current_hook(self.pl_module) != "training_step":
            self.flush()
            self.update(*args, **kwargs)
            return
        args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        size = sum(v.nbytes for v in (*args, *kwargs.values()) if isinstance(v, Tensor))
        if size > self.limit_bytes:
            self.flush()
            self.update(*args, **kwargs)
            return
        self.calls.append((args, kwargs))
        self.bytes += size
        if self.bytes >= self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Run the queued updates: as one call when their arguments concatenate, else one by one."""
        calls, self.calls, self.bytes = self.calls, [], 0
        if not calls:
            return
        joined = _concatenated(calls, self.metric) if len(calls) > 1 else calls[0]
        for args, kwargs in [joined] if joined is not None else calls:
            self.update(*args, **kwargs)

    def _before(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def flushed_first(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            return method(*args, **kwargs)

        return flushed_first

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        # metric(x, y) updates and computes on this batch alone: the queue goes in first, then it runs as usual.
        self.flush()
        self.passthrough = True
        try:
            return type(self.metric).forward(self.metric, *args, **kwargs)
        finally:
            self.passthrough = False

    def _reset(self) -> None:
        self.calls, self.bytes = [], 0  # updates before a reset would be discarded by it anyway
        type(self.metric).reset(self.metric)

    def close(self) -> None:
        """Run what is queued and give the metric back its own methods."""
        self.flush()
        self.metric.update, self.metric.compute = self.update, self.compute
        for name in ("state_dict", "forward", "reset"):
            self.metric.__dict__.pop(name, None)


def _concatenated(
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]], metric: Metric
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The calls' arguments joined along the batch dimension into one call, or None where that would change them.

    Tensors with a batch dimension concatenate when the rest of their shape, dtype and device agree; arguments that
    are not tensors must be equal in every call. Aggregators (mean, sum, max, min, cat) combine per-call scalars
    too, such as a loss and its batch size, as one value per call.
    """
    first_args, first_kwargs = calls[0]
    if any(len(args) != len(first_args) or kwargs.keys() != first_kwargs.keys() for args, kwargs in calls):
        return None
    columns = [[args[i] for args, _ in calls] for i in range(len(first_args))]
    columns += [[kwargs[key] for _, kwargs in calls] for key in first_kwargs]
    scalars = isinstance(metric, BaseAggregator) and all(_is_scalar(v) for column in columns for v in column)
    joined = [_stacked(column, metric) if scalars else _joined(column) for column in columns]
    if any(value is _CANNOT for value in joined):
        return None
    return tuple(joined[: len(first_args)]), dict(zip(first_kwargs, joined[len(first_args) :], strict=True))


def _joined(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if all(
            isinstance(v, Tensor)
            and v.dim() >= 1
            and v.shape[1:] == first.shape[1:]
            and v.dtype == first.dtype
            and v.device == first.device
            for v in values
        ):
            return torch.cat(values)
        return _CANNOT
    if isinstance(first, (type(None), bool, int, float, str)) and all(
        type(v) is type(first) and v == first for v in values
    ):
        return first
    return _CANNOT


def _is_scalar(value: Any) -> bool:
    return (isinstance(value, Tensor) and value.dim() == 0) or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    )


def _stacked(values: list[Any], metric: Metric) -> Any:
    if all(isinstance(v, Tensor) for v in values):
        if all(v.dtype == values[0].dtype and v.device == values[0].device for v in values):
            return torch.stack(values)
        return _CANNOT
    if any(isinstance(v, Tensor) for v in values):
        return _CANNOT
    return torch.tensor(values, dtype=metric.dtype, device=metric.device)
