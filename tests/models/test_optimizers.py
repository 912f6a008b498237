"""The bundled agents' optimizers are fused on --device cuda (one kernel per step), plain elsewhere."""

from __future__ import annotations

import pytest
import torch

from accelbatch.names import resolve_agent_class
from accelbatch.opts import Opts


@pytest.mark.parametrize("name, optimizer", [("memnn", "sgd"), ("memnn", "adam"), ("memnn", "adamw"),
                                             ("bag", "sgd"), ("conv", "sgd")])
def test_fused_on_cuda_only(name, optimizer):
    for device, fused in (("cuda", True), ("cpu", False)):
        agent = resolve_agent_class(name)(Opts(model=name, device=device, optimizer=optimizer, embedding_size=8))
        assert bool(agent.optimizer.defaults.get("fused")) is fused, (name, device)
    # a fused optimizer steps on the CPU too (torch >= 2.4), so the same agent works in every test
    params = list(agent.model.parameters())
    fused = type(agent.optimizer)(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    before = params[0].detach().clone()
    fused.step()
    assert not torch.equal(before, params[0])
