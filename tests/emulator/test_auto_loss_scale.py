"""Automatic loss scaling (PopART's rule, hand-computed expectations) and mixed float16 / float32 operands."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch
from helpers import needs_cpu_half

EDGE = 65504 * 0.125  # PopART's default bin edge: 8188


class SumLoss(torch.nn.Module):
    """y = W x + b, loss = sum(y): dloss/dW[i, j] = x[j] and dloss/db = 1 (per sample), exactly."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        with torch.no_grad():
            self.lin.weight.fill_(0.5)
            self.lin.bias.fill_(0.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, poptorch.identity_loss(y, reduction="sum")


def _training(model, loss_scaling, *, d=1, g=1, lr=0.0, anchor_mode=poptorch.OutputMode.Final, settings=None):
    opts = poptorch.Options().deviceIterations(d)
    opts.Training.gradientAccumulation(g).setAutomaticLossScaling(True)
    for key, value in (settings or {}).items():
        opts._Popart.set("automaticLossScalingSettings." + key, value)
    opts.anchorTensor("ls", "finalLossScale", anchor_mode)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=lr, loss_scaling=loss_scaling, use_combined_accum=False)
    return poptorch.trainingModel(model, opts, optimizer), optimizer


def _factor(optimizer) -> float:
    return float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"])


@needs_cpu_half
def test_small_gradients_double_the_factor_each_step_and_final_loss_scale_is_ls_times_factor():
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=4.0)
    x = torch.ones(1, 3).half()
    training.compile(x)
    seen = []
    for _ in range(4):
        before = _factor(optimizer)
        training(x)
        seen.append((before, float(training.getAnchoredTensor("ls"))))
    # gradients 4 * 2**k (x = 1, bias 1) stay far below the edge: the factor doubles every step
    assert seen == [(1.0, 4.0), (2.0, 8.0), (4.0, 16.0), (8.0, 32.0)]
    assert _factor(optimizer) == 16.0


@needs_cpu_half
def test_a_gradient_at_the_edge_halves_the_factor():
    model = SumLoss().half()
    training, _ = _training(model, loss_scaling=16.0, d=4, anchor_mode=poptorch.OutputMode.All)
    # dloss/dW = 1000 * loss scale: 16000 >= 8188 halves, 8000 < 8188 doubles: the scale alternates
    training(torch.full((4, 3), 1000.0).half())
    assert training.getAnchoredTensor("ls").tolist() == [16.0, 8.0, 16.0, 8.0]


@needs_cpu_half
def test_an_overflowing_gradient_counts_in_the_upper_bin():
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=2.0 ** 17)  # 2**17 > 65504: the gradients are inf
    training(torch.ones(1, 3).half())
    assert _factor(optimizer) == 0.5


@needs_cpu_half
def test_counts_add_up_over_accumulated_micro_batches_and_the_factor_moves_once_per_update():
    model = SumLoss().half()
    training, _ = _training(model, loss_scaling=1.0, d=2, g=2, anchor_mode=poptorch.OutputMode.All)
    training(torch.ones(4, 3).half())
    assert training.getAnchoredTensor("ls").tolist() == [1.0, 2.0]
    # one micro-batch of four above the edge is enough (threshold 1e-7): the second update halves
    model2 = SumLoss().half()
    training2, opt2 = _training(model2, loss_scaling=4096.0, g=4)
    x = torch.tensor([[1.0, 1.0, 1.0]] * 3 + [[2.0, 1.0, 1.0]]).half()  # 4096 * 2 = 8192 >= 8188 once
    training2(x)
    assert _factor(opt2) == 0.5


@needs_cpu_half
def test_update_period_and_threshold_settings():
    model = SumLoss().half()
    training, _ = _training(model, loss_scaling=1.0, d=5, anchor_mode=poptorch.OutputMode.All,
                            settings={"updatePeriod": 2})
    training(torch.ones(5, 3).half())
    assert training.getAnchoredTensor("ls").tolist() == [1.0, 2.0, 2.0, 4.0, 4.0]  # updates on steps 0, 2, 4
    # with threshold 0.5, 9 upper elements of 12 (3/4) still halve; 3 of 12 (1/4) double
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=16.0, settings={"thresholdUpperCountProportion": 0.5})
    training(torch.tensor([[1000.0, 1000.0, 1000.0]]).half())  # 9 weight gradients of 16000, 3 bias of 16
    assert _factor(optimizer) == 0.5
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=16.0, settings={"thresholdUpperCountProportion": 0.5})
    training(torch.tensor([[1000.0, 1.0, 1.0]]).half())  # 3 of 12 at the edge
    assert _factor(optimizer) == 2.0


@needs_cpu_half
def test_weights_match_a_host_reference_whatever_the_scale():
    lr = 2.0 ** -10
    model = SumLoss().half()
    training, _ = _training(model, loss_scaling=16.0, d=3, lr=lr)
    x = torch.tensor([[1000.0, 2.0, 0.5]]).half().repeat(3, 1)
    training(x)
    # each step subtracts lr * x from every row of W and lr from b, whatever the loss scale (1, 2 or 1 / 2)
    w, b = torch.full((3, 3), 0.5), torch.zeros(3)
    for _ in range(3):
        w = (w - lr * x[0].float()).half().float()
        b = (b - lr).half().float()
    assert torch.equal(model.lin.weight.float(), w)
    assert torch.equal(model.lin.bias.float(), b)


@needs_cpu_half
def test_a_loaded_factor_reaches_the_device():
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=2.0)
    training(torch.ones(1, 3).half())
    state = optimizer.state_dict()
    assert float(state["ipu_state"]["lossScaleUpdateFactor"]) == 2.0
    state["ipu_state"]["lossScaleUpdateFactor"] = torch.tensor(8.0)
    training.destroy()
    model2 = SumLoss().half()
    training2, optimizer2 = _training(model2, loss_scaling=2.0)
    optimizer2.load_state_dict(state)
    training2(torch.ones(1, 3).half())
    assert float(training2.getAnchoredTensor("ls")) == 16.0


def test_a_model_without_float16_gradients_is_refused_with_poparts_error():
    training, _ = _training(SumLoss(), loss_scaling=1.0)
    with pytest.raises(poptorch.Error, match=r"No tracked gradient tensors of type fp16 were found\."):
        training(torch.ones(1, 3))
    training, _ = _training(SumLoss().half(), loss_scaling=1.0, settings={"binEdgeLocation": 1.5})
    with pytest.raises(poptorch.Error, match=r"Out of range value for 'binEdgeLocation'. The current value is 1.5"):
        training(torch.ones(1, 3).half())


@needs_cpu_half
def test_without_the_option_the_loss_scale_stays_and_no_factor_is_kept():
    model = SumLoss().half()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=4.0, use_combined_accum=False)
    training = poptorch.trainingModel(model, poptorch.Options(), optimizer)
    training(torch.ones(1, 3).half())
    assert "lossScaleUpdateFactor" not in optimizer.state_dict()["ipu_state"]


def test_float32_inputs_to_a_half_model_are_computed_in_float32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    ref = torch.nn.functional.linear(torch.ones(3, 4), lin.weight.half().float(), lin.bias.half().float())
    model = poptorch.inferenceModel(lin.half())
    out = model(torch.ones(3, 4))
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)


def test_float32_inputs_to_a_half_model_train_with_float16_gradients():
    model = SumLoss().half()
    training, optimizer = _training(model, loss_scaling=1.0, d=2, anchor_mode=poptorch.OutputMode.All)
    training(torch.ones(2, 3))  # float32 input: the linear layer runs in float32, its gradients come back float16
    assert training.getAnchoredTensor("ls").tolist() == [1.0, 2.0]
    assert model.lin.weight.dtype == torch.float16


class HalfCounter(torch.nn.Module):
    """A float16 buffer updated in place from float32 data keeps its type (in-place operations are not cast)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))
        self.seen += 1.0
        return self.seen * x


def test_in_place_updates_of_float16_state_keep_their_type():
    module = HalfCounter()
    model = poptorch.inferenceModel(module)
    out = model(torch.full((1, 2), 0.5))
    assert module.seen.dtype == torch.float16 and module.seen.tolist() == [1.5, 1.5]
    assert out.dtype == torch.float32 and out.tolist() == [[0.75, 0.75]]


class HalfActivations(torch.nn.Module):
    """float32 weights, float16 activations: h = half(W x + b), loss = sum(1000 h), so dloss/dh = 1000."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x).half()
        z = h * 1000.0
        return z, poptorch.identity_loss(z, reduction="sum")


def test_float16_activation_gradients_are_tracked_too():
    # loss scale 16: dloss/dz = 16 (below the edge), dloss/dh = 16000 (above): the factor halves; the float32
    # weight gradients do not count
    training, optimizer = _training(HalfActivations(), loss_scaling=16.0)
    training(torch.ones(1, 2))
    assert _factor(optimizer) == 0.5
    training, optimizer = _training(HalfActivations(), loss_scaling=4.0)  # 4000 < 8188: doubles
    training(torch.ones(1, 2))
    assert _factor(optimizer) == 2.0
