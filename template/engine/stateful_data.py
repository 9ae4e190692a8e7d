"""A resumable shuffling sampler that Lightning splits across DDP processes with a real ``DistributedSampler``."""

from __future__ import annotations

import torch.utils.data
from torchdata.stateful_dataloader.sampler import RandomSampler as _ResumableRandomSampler


class RandomSampler(_ResumableRandomSampler, torch.utils.data.RandomSampler):
    """torchdata's resumable RandomSampler that is also a ``torch.utils.data.RandomSampler``.

    Pass it as ``StatefulDataLoader(dataset, sampler=RandomSampler(dataset))`` where ``shuffle=True`` would go.
    ``StatefulDataLoader(shuffle=True)`` builds torchdata's own sampler, which is not a torch RandomSampler: under
    DDP, Lightning then wraps it in a ``DistributedSamplerWrapper``, which draws each rank's order from a sampler
    seeded differently per rank and keeps no state, so ranks overlap within an epoch and a mid-epoch resume reads
    other batches. Lightning replaces a torch RandomSampler with a real ``DistributedSampler`` (``shuffle=True``,
    ``set_epoch`` every epoch), whose order a resume replays; in a single process this sampler saves and restores
    its place in the epoch itself. The same holds under the command line and under a plain ``Trainer``.
    """
