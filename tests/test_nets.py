import pytest
import torch

from template.nets import MLP, ConvNet


@pytest.mark.parametrize("net_class", [MLP, ConvNet])
@pytest.mark.parametrize("input_shape", [(1, 8, 8), (3, 5, 7)])
def test_output_is_one_logit_per_class(net_class, input_shape):
    net = net_class(input_shape=input_shape, num_classes=4)
    assert net(torch.randn(6, *input_shape)).shape == (6, 4)


def test_nets_are_plain_pytorch():
    from lightning.pytorch import LightningModule

    for net in (MLP((1, 8, 8), 10), ConvNet((1, 8, 8), 10)):
        assert not any(isinstance(m, LightningModule) for m in net.modules())


def test_mlp_layer_sizes_follow_arguments():
    net = MLP(input_shape=(2, 3), num_classes=5, hidden_sizes=(7,))
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(6, 7), (7, 5)]


def test_convnet_rejects_flat_input_shape():
    with pytest.raises(ValueError, match="channels, height, width"):
        ConvNet(input_shape=(64,), num_classes=10)
