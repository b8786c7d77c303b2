"""FLOPs of convolutions as commlab/costmodel/hardware/flops.py counts them, against closed forms."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from commlab.costmodel.hardware import flops


@pytest.mark.parametrize("groups", [1, 4, 32])
def test_a_convolutions_backward_is_twice_its_forward_grouped_or_not(groups):
    conv = nn.Conv2d(64, 128, 3, padding=1, groups=groups, bias=False)
    x = torch.randn(2, 64, 8, 8, requires_grad=True)
    forward = 2 * 2 * 8 * 8 * 128 * (64 // groups) * 9  # 2 x batch x output pixels x c_out x c_in/groups x kernel
    with FlopCounterMode(display=False, custom_mapping=flops.CORRECTED) as counted:
        conv(x).sum().backward()
    assert counted.get_total_flops() == 3 * forward  # forward, input gradient, weight gradient
    with FlopCounterMode(display=False, custom_mapping=flops.CORRECTED) as weight_only:
        conv(x.detach()).sum().backward()  # no input gradient asked for
    assert weight_only.get_total_flops() == 2 * forward
