"""A dropout model trains the same weights however a call's micro-batches are spread: replicas simulated in one
process, the IPU emulator and two gloo replica processes (each micro-batch draws from its own stream,
accelbatch/streams.py), and a call of one micro-batch draws from the process's stream as plain torch."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends.cpu import CPUBackend
from accelbatch.backends.distributed import spawn_replicas
from accelbatch.backends.ipu import IPUBackend
from torch import nn

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan
from accelbatch.streams import CallStreams

PLAN = dict(micro_batch=3, replication_factor=2, gradient_accumulation=2, device_iterations=2)


class DropoutRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 1))

    def forward(self, batch):
        pred = self.net(batch["x"]).squeeze(-1)
        return {"loss": ((pred - batch["y"]) ** 2).mean(), "pred": pred.detach()}


def _calls(plan: ExecutionPlan, calls: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(calls):
        x = torch.randn(plan.combined_batch, 16, generator=g)
        yield {"x": x, "y": x.sum(1).sin() * 3}


def trained(backend, plan: ExecutionPlan, calls: int = 3, rank: int | None = None) -> dict[str, torch.Tensor]:
    model = DropoutRegressor()
    torch.manual_seed(7)  # the run's seed, after the model is made (as a TorchAgent seeds)
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), plan)
    for batch in _calls(plan, calls):
        engine.train_step(batch if rank is None else plan.shard(batch, rank))
    if hasattr(engine, "sync_to_host"):
        engine.sync_to_host()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ipu_backend() -> IPUBackend:
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, seed=7))
    return backend


def assert_equal(a, b, atol=0.0):
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert diff <= atol, f"{key}: max diff {diff:.3g}"


@pytest.mark.parametrize("plan", [PLAN, dict(PLAN, replication_factor=1, gradient_accumulation=4)])
def test_simulated_replicas_and_the_emulator_draw_the_same_dropout_masks(plan):
    plan = ExecutionPlan(**plan)
    cpu, ipu = trained(CPUBackend(), plan), trained(ipu_backend(), plan)
    assert_equal(cpu, ipu)
    assert (cpu["net.0.weight"] != DropoutRegressor().state_dict()["net.0.weight"]).any()


def _replica(rank: int) -> dict[str, torch.Tensor]:
    return trained(CPUBackend(), ExecutionPlan(**PLAN), rank=rank)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_replica_processes_draw_the_masks_of_simulated_replicas():
    """Two gloo processes, seeded alike, each running its own micro-batches: the weights of one process running
    them all, up to the order of float sums (different masks differ by about 1e-2)."""
    states = spawn_replicas(_replica, 2, timeout_s=150)
    simulated = trained(CPUBackend(), ExecutionPlan(**PLAN))
    for state in states:
        assert_equal(state, simulated, atol=1e-6)


def test_a_call_of_one_micro_batch_draws_from_the_process_stream_as_plain_torch():
    plan = ExecutionPlan(micro_batch=6)
    weights = trained(CPUBackend(), plan, calls=2)
    model = DropoutRegressor()
    torch.manual_seed(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in _calls(plan, 2):
        optimizer.zero_grad()
        model(batch)["loss"].backward()
        optimizer.step()
    assert_equal(weights, model.state_dict())


def test_the_seeds_of_a_call_follow_from_the_initial_seed_alone():
    generator = torch.Generator().manual_seed(3)
    first = CallStreams(generator, 4)
    first.enter(0)
    mask = torch.rand(5, generator=generator)
    first.enter(1)
    assert not torch.equal(torch.rand(5, generator=generator), mask)
    first.end()
    after = generator.initial_seed()
    torch.rand(100, generator=generator)  # whatever draws between calls
    second = CallStreams(generator, 4)
    assert second.base == after != 3
    again = torch.Generator().manual_seed(3)
    CallStreams(again, 4).enter(0)
    assert torch.equal(torch.rand(5, generator=again), mask)
    CallStreams(generator, 1).enter(0)  # one micro-batch: the generator is left alone
    assert generator.initial_seed() == after
