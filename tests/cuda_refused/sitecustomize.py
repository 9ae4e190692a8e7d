"""A machine with two GPUs that a CPU run must never touch: put this folder first on a child's ``PYTHONPATH``.

``torch.cuda`` then reports two GPUs (``is_available``, ``device_count``; fewer where ``CUDA_VISIBLE_DEVICES``
hides them, read at each call as torch's NVML-based count does), and whatever would initialise CUDA raises instead,
its stack appended to the file named by ``CUDA_REFUSED_LOG`` (so that a caller that swallows the error is caught
too). Every CUDA call that needs a context goes through ``torch.cuda._lazy_init`` (the C++ side calls it too, e.g.
for a tensor created on "cuda"); the submodules of ``torch.cuda`` hold their own reference to it, so each reference
is replaced; ``torch._C._cuda_init`` is its last step on a CUDA build.
"""

from __future__ import annotations

import os
import sys
import traceback

GPUS = 2


def _visible() -> int:
    """How many of the GPUS CUDA_VISIBLE_DEVICES leaves: CUDA stops at the first entry that is not a GPU."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is None:
        return GPUS
    seen: list[str] = []
    for entry in (part.strip() for part in hidden.split(",")):
        if not entry.isdigit() or int(entry) >= GPUS or entry in seen:
            break
        seen.append(entry)
    return len(seen)


def _install() -> None:
    import torch

    def refuse(*args: object, **kwargs: object) -> None:
        stack = "".join(traceback.format_stack(limit=25))
        log = os.environ.get("CUDA_REFUSED_LOG")
        if log:
            with open(log, "a") as file:
                file.write(f"--- process {os.getpid()}: CUDA initialised\n{stack}")
        raise RuntimeError("CUDA was initialised in a run that means the CPU (tests/cuda_refused)")

    fakes = {
        "_lazy_init": (torch.cuda._lazy_init, refuse),
        "is_available": (torch.cuda.is_available, lambda: _visible() > 0),
        "device_count": (torch.cuda.device_count, _visible),
    }
    for name, module in list(sys.modules.items()):
        if name == "torch.cuda" or name.startswith("torch.cuda."):
            for attribute, (original, fake) in fakes.items():
                if getattr(module, attribute, None) is original:
                    setattr(module, attribute, fake)
    torch._C._cuda_init = refuse


_install()
