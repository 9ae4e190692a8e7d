"""torchdata's StatefulDataLoader(shuffle=True) under DDP: Lightning splits it with a real DistributedSampler."""

from __future__ import annotations

import torch.utils.data

try:
    from torchdata.stateful_dataloader import sampler as _sampler
    from torchdata.stateful_dataloader import stateful_dataloader as _loader
except ImportError:  # torchdata is optional for the engine; without it there is nothing to adjust
    _loader = None


if _loader is not None and not issubclass(_loader.RandomSampler, torch.utils.data.RandomSampler):

    class RandomSampler(_sampler.RandomSampler, torch.utils.data.RandomSampler):
        """torchdata's resumable RandomSampler that is also a ``torch.utils.data.RandomSampler``.

        Lightning swaps only torch's own RandomSampler for a ``DistributedSampler``; any other sampler it wraps in a
        ``DistributedSamplerWrapper``, which draws each rank's order from a sampler seeded differently per rank and
        keeps no state: ranks overlap within an epoch and a mid-epoch resume reads other batches. Being a torch
        RandomSampler, this one gets the real ``DistributedSampler`` under DDP, whose order a resume can replay.
        """

    # StatefulDataLoader builds its sampler for shuffle=True from this module-level name.
    _loader.RandomSampler = RandomSampler
