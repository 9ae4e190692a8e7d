"""A user's LightningModule that shards itself in ``configure_model``, as Lightning's ModelParallelStrategy docs
show: strategy fsdp keeps that sharding and adds none of its own."""

from torch.distributed.fsdp import fully_shard

from template.model import Classifier


class SelfShardedClassifier(Classifier):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.modules():
            if layer is not self.net and next(layer.parameters(recurse=False), None) is not None:
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
