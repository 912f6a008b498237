"""PopTorch emulator: per-replica buffers (broadcastBuffers), the replicas' gradient summation order, the
backward-on-output and compilationTime errors, and the IPU backend's buffer option under replication."""

from __future__ import annotations

import datetime

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.ipu_graph import plan_options

from accelbatch.plan import ExecutionPlan

BROADCAST_ERR = ("PopTorch does not support broadcasting buffers. If your model is able to tolerate buffers "
                 "becoming out of sync between replicas, you can disable buffer broadcasting using "
                 "poptorch.Options.broadcastBuffers(False).")


class Accumulator(torch.nn.Module):
    """Adds its input to a buffer in place and returns the buffer (PopTorch's buffers_test model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buffer", torch.zeros(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buffer.copy_(self.buffer + x)
        return poptorch.identity_loss(self.buffer, reduction="none")


def _replicated(broadcast: bool | None, replicas: int = 2) -> poptorch.Options:
    opts = poptorch.Options().replicationFactor(replicas)
    if broadcast is not None:
        opts.broadcastBuffers(broadcast)
    return opts


# --- buffers -----------------------------------------------------------------------------------------

def test_each_replica_keeps_its_own_buffers_without_broadcast():
    model = Accumulator()
    pm = poptorch.inferenceModel(model, _replicated(False))
    x = torch.tensor([[9.0], [2.0]])
    for _ in range(50):
        y = pm(x)
    assert y.tolist() == [[450.0, 450.0], [100.0, 100.0]]  # 50 x 9 and 50 x 2
    assert model.buffer.tolist() == [[450.0, 450.0]]  # the host reads replica 0's


def test_copy_weights_to_device_gives_every_replica_the_hosts_buffers():
    model = Accumulator()
    pm = poptorch.inferenceModel(model, _replicated(False))
    x = torch.tensor([[9.0], [2.0]])
    pm(x)
    pm(x)
    model.buffer.fill_(1.0)
    pm.copyWeightsToDevice()
    assert pm(x).tolist() == [[10.0, 10.0], [3.0, 3.0]]


def test_in_place_buffer_update_with_broadcast_is_refused():
    model = Accumulator()
    pm = poptorch.inferenceModel(model, _replicated(None))  # broadcastBuffers(True) is the default
    with pytest.raises(poptorch.Error, match=BROADCAST_ERR.replace("(", r"\(").replace(")", r"\)")):
        pm(torch.tensor([[9.0], [2.0]]))
    assert model.buffer.tolist() == [[0.0, 0.0]]  # nothing ran


def test_read_only_buffers_and_one_replica_need_no_broadcast_option():
    class Reader(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.tensor([1.0, 2.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b

    assert poptorch.inferenceModel(Reader(), _replicated(None))(torch.zeros(2, 2)).tolist() == [[1, 2], [1, 2]]
    y = poptorch.inferenceModel(Accumulator(), _replicated(None, replicas=1))(torch.tensor([[3.0]]))
    assert y.tolist() == [[3.0, 3.0]]


def test_an_output_that_is_a_buffer_is_copied_per_iteration():
    opts = poptorch.Options().deviceIterations(2)
    y = poptorch.inferenceModel(Accumulator(), opts)(torch.tensor([[1.0], [2.0]]))
    assert y.tolist() == [[1.0, 1.0], [3.0, 3.0]]  # the value after each iteration


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(1)
        self.fc = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.fc(self.bn(x))
        return out, torch.nn.functional.mse_loss(out, y)


def test_batchnorm_replicas_track_their_own_batches():
    x = torch.tensor([[0.0], [2.0], [10.0], [30.0]])
    model = BNNet()
    pm = poptorch.trainingModel(model, _replicated(False))
    pm(x, torch.zeros(4, 1))
    pm(x, torch.zeros(4, 1))
    reference = torch.nn.BatchNorm1d(1)  # replica 0 sees rows 0-1 in both calls
    reference(x[:2])
    reference(x[:2])
    assert model.bn.num_batches_tracked.item() == 2
    assert torch.equal(model.bn.running_mean, reference.running_mean)
    assert torch.equal(model.bn.running_var, reference.running_var)
    with pytest.raises(poptorch.Error, match="does not support broadcasting buffers"):
        poptorch.trainingModel(BNNet(), _replicated(None))(x, torch.zeros(4, 1))


def test_ipu_backend_options_keep_buffers_per_replica():
    assert plan_options(poptorch, ExecutionPlan(replication_factor=2)).broadcast_buffers is False
    assert plan_options(poptorch, ExecutionPlan()).broadcast_buffers is True


# --- gradient summation order --------------------------------------------------------------------------

class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return poptorch.identity_loss((x * self.w).sum(), reduction="sum")


def _accumulating(replicas: int, accumulation: int) -> poptorch.Options:
    opts = poptorch.Options().replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    return opts


def test_each_replica_sums_its_micro_batches_before_the_replicas_are_added():
    # rows are [G, R]: (g0 r0, g0 r1, g1 r0, g1 r1); dL/dw of a row is the row itself
    model = Scale()
    pm = poptorch.trainingModel(model, _accumulating(2, 2), torch.optim.SGD(model.parameters(), lr=1.0))
    pm(torch.tensor([[1e8], [1.0], [-1e8], [1.0]]))
    # replica 0: 1e8 + -1e8 = 0, replica 1: 1 + 1 = 2; mean over 4 micro-batches: 0.5 ([g, r] order gives 0.25)
    assert model.w.item() == 0.5


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.fc(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def _reference_step(model: Tiny, x: torch.Tensor, y: torch.Tensor, replicas: int, accumulation: int,
                    lr: float) -> None:
    """One update by hand: replica r's G micro-batches summed, the replicas' sums added, the mean taken."""
    params = list(model.parameters())
    micro = x.shape[0] // (replicas * accumulation)
    sums = []
    for r in range(replicas):
        for p in params:
            p.grad = None
        for g in range(accumulation):
            start = (g * replicas + r) * micro
            model(x[start:start + micro], y[start:start + micro])[1].backward()
        sums.append([p.grad.clone() for p in params])
    with torch.no_grad():
        for i, p in enumerate(params):
            total = sums[0][i]
            for s in sums[1:]:
                total = total + s[i]
            p.add_(total * (1.0 / (replicas * accumulation)), alpha=-lr)  # the mean as a scale, as SGD steps


@pytest.mark.parametrize("replicas, accumulation", [(2, 2), (2, 3), (4, 2)])
def test_replicated_accumulation_is_bit_equal_to_the_per_replica_order(replicas, accumulation):
    torch.manual_seed(3)
    model = Tiny()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    pm = poptorch.trainingModel(model, _accumulating(replicas, accumulation),
                                torch.optim.SGD(model.parameters(), lr=0.5))
    for _ in range(5):
        x = torch.randn(replicas * accumulation * 4, 5) * 10
        y = torch.randint(0, 3, (x.shape[0],))
        pm(x, y)
        _reference_step(reference, x, y, replicas, accumulation, lr=0.5)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


# --- error texts -------------------------------------------------------------------------------------------

def test_backward_on_an_output_raises_poptorchs_error():
    model = BNNet()
    _, loss = poptorch.trainingModel(model)(torch.ones(4, 1), torch.zeros(4, 1))
    with pytest.raises(poptorch.Error, match="backward\\(\\) cannot be called explicitly on outputs of a "
                       "PopTorch model. If you're using a trainingModel, the backwards pass is performed "
                       "automatically"):
        loss.backward()


def test_compilation_time_needs_the_progress_bar_option():
    pm = poptorch.inferenceModel(Accumulator())
    pm(torch.tensor([[1.0]]))
    assert isinstance(pm.compilationTime(), datetime.timedelta)  # the progress bar is on by default
    quiet = poptorch.inferenceModel(Accumulator(), poptorch.Options().showCompilationProgressBar(False))
    quiet(torch.tensor([[1.0]]))
    with pytest.raises(poptorch.Error, match="Please set showCompilationProgressBar option to obtain "
                       "compilation time."):
        quiet.compilationTime()
