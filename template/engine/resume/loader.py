"""Exact mid-epoch resume for any map-style DataLoader, the user's code unchanged: a copy of the loader records the
random states each epoch's order and workers' seed are drawn from; on resume it draws the same order again and skips
the batches trained on as lists of indices, without reading them. Each batch is read (the dataset, then the
collate_fn) with the global torch, Python and NumPy generators seeded from the epoch's seed and the batch's place, in
whichever process reads it: random augmentation in DataLoader workers continues exactly, and does not depend on
``num_workers`` (docs/reliability.md, Exact at any step)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from enum import Enum
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from template.engine import internals


def global_states() -> dict[str, Any]:
    """The global torch, Python and NumPy random states, in plain types and tensors: a numpy array in a checkpoint
    breaks ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached = np.random.get_state()
    numpy = [str(algorithm), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss], "numpy": numpy}


def restore_global_states(state: dict[str, Any]) -> None:
    """Put back what ``global_states`` recorded (a training step's dropout draws from these), and the GPUs' states of
    a checkpoint (``cuda``: device -> state, as ``ExactResume.load_state_dict`` matched them to its devices)."""
    torch.set_rng_state(state["torch"])
    for device, rng_state in state.get("cuda", {}).items():
        torch.cuda.set_rng_state(rng_state, device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state["numpy"] is not None:
        algorithm, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((algorithm, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class Next(Enum):
    """What a resumable loader's next iterator does."""

    DRAW = "draw a new order from the states training is at"
    REPLAY = "draw the recorded epoch's order again and skip the batches trained on"
    RESEED = "start persistent workers again with the seed they were first started with"


class ResumableIndexSampler(Sampler):
    """The loader's index sampler (its batch sampler, else its sampler), able to skip batches: the same items, length
    and draws at the same moments as the wrapped one, whose other attributes (``batch_size``...) it has."""

    def __init__(self, inner: Any, generators: list[torch.Generator], epoch_samplers: list[Any]) -> None:
        self.inner = inner
        self.generators = generators
        self.epoch_samplers = epoch_samplers
        # This epoch's states: when the DataLoader created its iterator, and when the sampler started drawing.
        self.at_iterator: dict[str, Any] | None = None
        self.at_order: dict[str, Any] | None = None
        self.first: Any = None  # this epoch's first item: a stop checks that the order replays
        self._epoch_seed = 0  # drawn with the order: each batch's reads draw from it and the batch's place
        self.next = Next.DRAW
        self.done = 0  # REPLAY: the batches to skip
        self.resuming = False  # a replay was asked for, by the checkpoint this fit started from

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks; "inner" itself missing (half-built copy) must not recurse.
        if name == "inner" or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def _capture(self) -> dict[str, Any]:
        """The random states this sampler can draw from: the global ones, its own generators, its epoch."""
        state = global_states()
        state["generators"] = [generator.get_state() for generator in self.generators]
        state["epochs"] = [int(getattr(sampler, "epoch", 0)) for sampler in self.epoch_samplers]
        return state

    def _put_back(self, state: dict[str, Any], epochs: bool = False) -> None:
        restore_global_states(state)
        for generator, saved in zip(self.generators, state["generators"], strict=True):
            generator.set_state(saved)
        if epochs:
            for sampler, epoch in zip(self.epoch_samplers, state["epochs"], strict=True):
                sampler.set_epoch(epoch)

    def resume(self, at_iterator: dict[str, Any], at_order: dict[str, Any], done: int) -> None:
        """The next epoch replays the epoch drawn from these states and skips its first ``done`` items."""
        self.at_iterator, self.at_order, self.done = at_iterator, at_order, done
        self.next, self.resuming = Next.REPLAY, True

    def keep_workers_seed(self, at_iterator: dict[str, Any], at_order: dict[str, Any]) -> None:
        """Persistent workers were started once, in an earlier epoch: started again, they get the same seed."""
        self.at_iterator, self.at_order, self.next = at_iterator, at_order, Next.RESEED

    def before_iterator(self, new: bool, persistent: bool = False) -> dict[str, Any] | None:
        """Called by the loader before it creates (``new``) or resets its iterator, which draws the workers' seed;
        returns the states to put back once it has (RESEED: where training is)."""
        if self.next is Next.RESEED and not (new and persistent):
            # No workers to start again: this iterator, of the epoch stopped at its end, reads nothing, and the next
            # epoch's draws a new order, as in any epoch; the recorded states stay until then.
            self.next = Next.DRAW
            return None
        now = self._capture() if self.next is Next.RESEED else None
        if self.next is not Next.DRAW:
            self._put_back(self.at_iterator)  # the workers' seed as the uninterrupted run drew it
        elif new or self.at_iterator is None:
            self.at_iterator = self._capture()
        return now

    def __iter__(self) -> Iterator[Any]:
        # A generator, so that the wrapped sampler draws when it would unwrapped (at the first item): a DataLoader with
        # workers makes two while it builds its iterator and pulls from the second only.
        if self.next is Next.REPLAY:
            yield from self._replay()
            return
        self.next = Next.DRAW
        self.at_order = self._capture()
        for place, item in enumerate(self._draw_order()):
            if place == 0:
                self.first = _plain(item)
            yield self._seeded(item, place)

    def _draw_order(self) -> Iterator[Any]:
        self._epoch_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return iter(self.inner)

    def _seeded(self, item: Any, place: int) -> Any:
        """``item`` marked with the seed its reads draw from: the epoch's, its place and its first index (ranks read
        other indices at the same places)."""
        if isinstance(item, (list, tuple)):
            marked: Any = _Batch(item)
        elif isinstance(item, int):
            marked = _Index(item)
        else:  # a batch sampler's own type: read unseeded
            return item
        first = next(iter(marked), 0) if isinstance(marked, list) else marked
        marked.seed = hash((self._epoch_seed, place, int(first))) & 0xFFFF_FFFF
        return marked

    def _replay(self) -> Iterator[Any]:
        self.next, done = Next.DRAW, self.done
        now = self._capture()
        self._put_back(self.at_order, epochs=True)
        iterator = self._draw_order()
        first = next(iterator, None)  # the sampler draws its order here, from the recorded states
        self.first = _plain(first)
        for _ in islice(iterator, max(0, done - 1)):  # skipped as lists of indices: the dataset is not read
            pass
        # The global generators go on from where training is; the sampler's own from where its order left them.
        restore_global_states(now)
        if done == 0 and first is not None:
            yield self._seeded(first, 0)
        for place, item in enumerate(iterator, start=max(done, 1)):
            yield self._seeded(item, place)

    def order_reproducible(self) -> bool:
        """Whether this epoch's first item is drawn again from the recorded states (checked without loading data)."""
        if self.at_order is None or self.first is None:
            return True
        saved = self._capture()
        try:
            self._put_back(self.at_order, epochs=True)
            again = _plain(next(self._draw_order(), None))
        finally:
            self._put_back(saved, epochs=True)
        return again == self.first


class _Batch(list):
    """A batch's indices, with the seed its reads draw from (``seed``): a list, as workers are sent."""


class _Index(int):
    """A sample's index (a loader with ``batch_size=None``), with the seed its read draws from."""


class SeededFetch(Dataset):
    """The user's dataset and collate_fn as the loader's iterator reads them: each batch marked with a seed is read
    with the global generators seeded from it, and the reading process's own draws put back after its collate_fn (in
    the main process they are the training step's). Attributes are the user's dataset's (a ``worker_init_fn`` may set
    some on ``get_worker_info().dataset``)."""

    def __init__(self, dataset: Any, collate: Any) -> None:
        vars(self).update(_dataset=dataset, _collate=collate, _outside=None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # this object's own, missing while a copy is half-built
            raise AttributeError(name)
        return getattr(self._dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._dataset, name, value)

    def __len__(self) -> int:
        return len(self._dataset)

    def _seed(self, item: Any) -> None:
        seed = getattr(item, "seed", None)
        if seed is not None:
            vars(self)["_outside"] = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed: the GPUs' generators are training's
            random.seed(seed)
            np.random.seed(seed)

    def __getitem__(self, index: Any) -> Any:
        self._seed(index)
        return self._dataset[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        self._seed(indices)
        read = getattr(self._dataset, "__getitems__", None)
        return read(indices) if read is not None else [self._dataset[index] for index in indices]

    def collate(self, data: Any) -> Any:
        try:
            return self._collate(data)
        finally:
            if self._outside is not None:
                torch_state, python_state, numpy_state = self._outside
                torch.default_generator.set_state(torch_state)
                random.setstate(python_state)
                np.random.set_state(numpy_state)
            vars(self)["_outside"] = None


def _resumable_class(cls: type) -> type:
    """The user's DataLoader class, whose ``__iter__`` first tells the index sampler that an iterator is made, and
    makes it read through ``SeededFetch``; outside the iterator the loader holds the user's dataset."""

    def __iter__(self: DataLoader) -> Any:  # noqa: N807 - the DataLoader's own method, extended
        sampler = wrapped(self)
        if sampler is None:
            return super(subclass, self).__iter__()
        # With persistent workers only the first epoch creates the iterator (and draws the workers' seed).
        persistent = self.persistent_workers and self.num_workers > 0
        training_at = sampler.before_iterator(
            new=not (persistent and internals.has_iterator(self)), persistent=persistent
        )
        own = vars(self).copy()
        fetch = SeededFetch(self.dataset, self.collate_fn)
        # DataLoader refuses a new dataset after __init__; its iterator keeps this one, the loader gets its own back.
        vars(self).update(dataset=fetch, collate_fn=fetch.collate)
        try:
            return super(subclass, self).__iter__()
        finally:
            vars(self).update(dataset=own["dataset"], collate_fn=own["collate_fn"])
            if training_at is not None:
                sampler._put_back(training_at)

    subclass = type(
        cls.__name__, (cls,), {"__iter__": __iter__, "__module__": __name__, "__qualname__": cls.__qualname__}
    )
    return subclass


def _plain(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        return item.tolist()
    return list(item) if isinstance(item, (list, tuple)) else item


def wrapped(loader: object) -> ResumableIndexSampler | None:
    """The resumable index sampler of a loader made by ``make_resumable``; None for any other loader."""
    if not isinstance(loader, DataLoader):
        return None
    for sampler in (loader.batch_sampler, loader.sampler):
        if isinstance(sampler, ResumableIndexSampler):
            return sampler
    return None


def is_stateful(loader: object) -> bool:
    """Whether a loader saves its own place in an epoch (torchdata's StatefulDataLoader), which Lightning restores."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def not_resumable_reason(loader: object) -> str | None:
    """Why a training loader cannot be put back at its place in an epoch; None where it can."""
    if is_stateful(loader):
        return None
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        # A plain DataLoader saves no place in an iterable dataset, whatever the dataset keeps.
        name = type(loader.dataset).__name__
        return f"its dataset {name} is an IterableDataset, read by a DataLoader that saves no place in it"
    return None


def make_resumable(loader: object) -> object:
    """A copy of a map-style DataLoader whose index sampler can replay an epoch and skip into it; others unchanged."""
    if is_stateful(loader) or not_resumable_reason(loader) is not None or wrapped(loader) is not None:
        return loader
    batching = loader.batch_sampler is not None
    inner = loader.batch_sampler if batching else loader.sampler
    samplers = [inner, getattr(inner, "sampler", None), loader.sampler]
    # Each once, in the order found, by identity.
    candidates = [loader.generator, *(getattr(s, "generator", None) for s in samplers)]
    generators = {id(g): g for g in candidates if isinstance(g, torch.Generator)}
    epochs = {id(s): s for s in samplers if callable(getattr(s, "set_epoch", None)) and hasattr(s, "epoch")}
    resumable = internals.dataloader_copy(loader, _resumable_class(type(loader)))
    # DataLoader refuses new samplers after __init__; this is the copy, the user's loader keeps its own.
    wrapper = ResumableIndexSampler(inner, list(generators.values()), list(epochs.values()))
    object.__setattr__(resumable, "batch_sampler" if batching else "sampler", wrapper)
    return resumable
