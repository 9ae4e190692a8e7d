"""``torch.compile`` from YAML: the LightningModule's network compiled in place, checkpoint keys unchanged."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from template.engine.errors import ConfigError
from template.engine.internals import is_compiled_in_place
from template.engine.logs.console import Mechanism


class CompileNetwork(Callback):
    """Compiles the LightningModule's network with ``torch.compile`` before training or evaluation, in place: its
    weights keep their names (no ``_orig_mod.``), so checkpoints load into uncompiled runs. Under ``strategy: dp``
    every GPU's replica runs the compiled code.

    Args:
        enabled: compile (off by default: compiling takes seconds to minutes before the first step).
        module_name: the LightningModule attribute holding the network (``self.net`` in the example).
        mode: ``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``...).
        fullgraph: fail instead of falling back to eager code where the network cannot be captured whole.
        dynamic: treat input shapes as dynamic (None lets torch decide after a shape changes).
    """

    def __init__(
        self,
        enabled: bool = False,
        module_name: str = "net",
        mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.module_name = module_name
        self.options: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}

    @property
    def announcement(self) -> Mechanism | None:
        if not self.enabled:
            return None
        return Mechanism("compile", "torch.compile of your module's network, in place", "--compile.enabled=false")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Callbacks' setup runs before the strategy wraps the model (DDP, dp), so the wrappers see a compiled net.
        if not self.enabled:
            return
        net = dict(pl_module.named_children()).get(self.module_name)
        if not isinstance(net, nn.Module):
            names = [name for name, _ in pl_module.named_children()]
            raise ConfigError(
                f"compile.module_name='{self.module_name}' is not a network of {type(pl_module).__name__} (its "
                f"modules: {names}); set --compile.module_name to the attribute holding the network"
            )
        if not is_compiled_in_place(net):
            net.compile(**self.options)
