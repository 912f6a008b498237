"""Training further from Python on an agent that trained already (``create_world(opts, agent=...)``): the new
world's ``-lr`` applies to the optimizer the agent shares; another ``-opt`` is refused in one line; and
``run(world, opts)`` with another -lr/-opt than the world was built with is refused, not silently ignored."""

from __future__ import annotations

import pytest
import torch

import accelbatch as ab
from accelbatch.opts import OptionError

BASE = dict(task="babi:1", batchsize=8, max_train_steps=3, eval_splits="", progress=False, seed=5)


def _trained_agent():
    world = ab.create_world(BASE)
    ab.run(world, BASE)
    return world.get_model_agent()


def _weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in agent.model.state_dict().items()}


def _continue(agent, opts) -> dict[str, torch.Tensor]:
    world = ab.create_world(opts, agent=agent)
    ab.run(world, opts)
    return _weights(world.get_model_agent())


def test_a_new_learning_rate_applies_to_the_shared_optimizer(capsys):
    faster = dict(BASE, learning_rate=0.5)
    with_new_rate = _continue(_trained_agent(), faster)
    assert "continuing with -lr 0.5 (the agent's optimizer had 0.01)" in capsys.readouterr().err

    by_hand = _trained_agent()  # reference: the same rate set on the optimizer by hand, the world's -lr unchanged
    for group in by_hand.optimizer.param_groups:
        group["lr"] = 0.5
    reference = _continue(by_hand, BASE)
    unchanged = _continue(_trained_agent(), BASE)
    assert all(torch.equal(with_new_rate[k], reference[k]) for k in reference)
    assert not all(torch.equal(with_new_rate[k], unchanged[k]) for k in unchanged)


def test_every_later_world_on_the_agent_trains_at_its_own_rate_not_a_compounded_one(capsys):
    agent = _trained_agent()
    capsys.readouterr()
    for rate in (0.5, 0.5, 0.1, 0.01):
        world = ab.create_world(dict(BASE, learning_rate=rate), agent=agent)
        optimizer = world.get_model_agent().engine.host_optimizer()
        assert [group["lr"] for group in optimizer.param_groups] == [pytest.approx(rate, rel=1e-12)]
    said = [line for line in capsys.readouterr().err.splitlines() if "continuing with -lr" in line]
    assert said == ["accelbatch: continuing with -lr 0.5 (the agent's optimizer had 0.01)",
                    "accelbatch: continuing with -lr 0.1 (the agent's optimizer had 0.5)",
                    "accelbatch: continuing with -lr 0.01 (the agent's optimizer had 0.1)"]


def test_another_optimizer_for_a_built_agent_is_refused_in_one_line():
    with pytest.raises(OptionError, match=r"-opt/--optimizer sgd, but the agent's optimizer is adam") as refused:
        ab.create_world(dict(BASE, optimizer="sgd"), agent=_trained_agent())
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("change", [dict(learning_rate=0.5), dict(optimizer="sgd")], ids=["lr", "opt"])
def test_run_refuses_opts_whose_optimizer_settings_the_world_was_not_built_with(change):
    world = ab.create_world(BASE)
    with pytest.raises(OptionError, match=r"run\(world, opts\): .* but the world's optimizer was built with"):
        ab.run(world, dict(BASE, **change))
