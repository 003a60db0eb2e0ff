"""`framework.backend.head`: a function run as a module's forward for one call, through the
module's own call and hooks, the module's forward its own again after (also after an error).
Under ZeRO-3 on 2 ranks: tests/methods/test_chunked.py."""

from __future__ import annotations

import pytest
import torch

from framework.backend.head import call_as_forward, hold_with, inner_module


def test_a_function_runs_as_the_forward_of_one_call_with_the_modules_hooks():
    module = torch.nn.Linear(3, 2)
    seen = []
    module.register_forward_pre_hook(lambda _m, args: seen.append(("pre", len(args))))
    module.register_forward_hook(lambda _m, _args, out: seen.append(("post", out)))
    out = call_as_forward(module, lambda x, scale: x.sum() * scale, torch.ones(4, 3), scale=2.0)
    assert out.item() == 24.0 and seen == [("pre", 1), ("post", out)]
    assert "forward" not in vars(module) and module(torch.ones(1, 3)).shape == (1, 2)
    with pytest.raises(ValueError):
        call_as_forward(module, lambda: (_ for _ in ()).throw(ValueError("no")))
    assert "forward" not in vars(module)


def test_a_forward_set_on_the_instance_is_kept_and_plain_models_need_nothing_gathered():
    module = torch.nn.Linear(3, 2)
    own = module.forward
    module.forward = own  # a forward of the instance's own (a wrapper's)
    assert call_as_forward(module, lambda: 7) == 7 and vars(module)["forward"] is own
    assert inner_module(module) is module
    hold_with(module, [torch.nn.Linear(2, 2).weight, None])  # not partitioned: nothing to do
