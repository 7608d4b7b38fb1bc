"""Adam state primed for a resharded load sits where torch's own Adam keeps it.

``load_resharded`` creates the optimizer state itself (DeepSpeed's per-parameter views of the moments
need it before the first step), bypassing ``Optimizer.load_state_dict``, which would have placed the
step count: on the parameter's device for fused or capturable kernels (fused CUDA AdamW refuses a CPU
step: pytorch/pytorch#104767), on the CPU otherwise. Meta tensors stand in for an accelerator here.
"""

from __future__ import annotations

import pytest
import torch

from lnstrain.checkpoint.reshard import _prime_optimizer_state


@pytest.mark.parametrize("kernel", [{}, {"fused": True}, {"capturable": True}])
def test_primed_adam_step_is_placed_as_torch_places_a_loaded_one(kernel):
    flat = torch.nn.Parameter(torch.zeros(6, device="meta"))
    optimizer = torch.optim.AdamW([flat])
    optimizer.param_groups[0].update(kernel)
    _prime_optimizer_state(optimizer, step=7)
    primed = optimizer.state[flat]

    optimizer.load_state_dict(optimizer.state_dict())  # torch's placement policy for loaded state
    loaded = optimizer.state[flat]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert (primed[key].device, primed[key].dtype) == (loaded[key].device, loaded[key].dtype), (key, kernel)
