"""PopTorch 3.3 behaviours met by user code written from its tutorials and tests.

Sources (graphcore/poptorch, tag sdk/poptorch/3.3.0): tests/norms_test.py ``test_batchNorm_eval_during_training``
(a training model whose parameters are all frozen still finds its loss), python/enums.py
(``HalfFloatCastingBehavior`` is deprecated but present), python/_poplar_executor.py (the executor's own
methods; those needing the compiled executable are not emulated and say so), docs/user_guide/overview.rst
"16-bit float support" and tests/half_test.py ``test_8bit_io_casting`` (float32 parameters meeting a float16
input are used as float16; mixed activations are computed in float32).
"""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch


class FrozenNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, target):
        y = self.bn(x)
        return y, self.loss(y, target)


def test_a_training_model_whose_parameters_are_frozen_runs_its_loss():
    torch.manual_seed(0)
    model = FrozenNorm()
    for p in model.parameters():
        p.requires_grad = False
    model.bn.eval()
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    stats = model.bn.running_mean.clone()
    out, loss = poptorch.trainingModel(model)(x, target)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model.bn(x), target)
    assert torch.allclose(loss, expected) and torch.equal(model.bn.running_mean, stats)


def test_half_float_casting_behavior_is_accepted_with_popTorchs_deprecation(caplog):
    opts = poptorch.Options()
    with caplog.at_level("WARNING"):
        opts.Precision.halfFloatCasting(poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat)
    assert "HalfUpcastToFloat is now the only supported option" in caplog.text
    assert [m.name for m in poptorch.HalfFloatCastingBehavior] == ["FloatDowncastToHalf", "HalfUpcastToFloat",
                                                                   "Default"]


class OwnSave(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.saved = False

    def forward(self, x):
        return self.linear(x)

    def save(self, path):
        self.saved = True


@pytest.mark.parametrize("name", ["getTensorNames", "save", "cycleCount", "compileAndExport", "rng_state"])
def test_executor_methods_needing_the_compiler_name_themselves(name):
    """They reached the user's module: its own save() ran, unnoticed, for the executor's."""
    model = OwnSave()
    executor = poptorch.inferenceModel(model)
    executor(torch.ones(1, 2))
    with pytest.raises(AttributeError, match=rf"poptorch.PoplarExecutor.{name} is not emulated"):
        getattr(executor, name)
    assert not model.saved and executor.linear is model.linear  # the module's own names still reach it


class HalfAndFloat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.register_buffer("shift", torch.ones(1))

    def forward(self, x):
        return self.linear(x), self.linear(x.float()), x + self.shift


def test_float32_parameters_meeting_a_float16_input_are_used_as_float16():
    """PyTorch refuses the first two mixes on the CPU; PopTorch computes the first in float16, the last (a
    float16 activation and a float32 buffer, not a parameter) in float32."""
    torch.manual_seed(0)
    model = HalfAndFloat()
    x = torch.tensor([[3.0]]).half()
    half_out, float_out, shifted = poptorch.inferenceModel(model)(x)
    assert (half_out.dtype, float_out.dtype, shifted.dtype) == (torch.float16, torch.float32, torch.float32)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, model.linear.weight.half(), model.linear.bias.half())
    assert torch.equal(half_out, expected) and torch.equal(shifted, x.float() + 1)


class HalfData(torch.nn.Module):
    """The mixed-precision tutorial's --data-half without --model-half: float16 data, float32 weights."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.linear(x)
        return out, self.loss(out.float(), y)


def test_training_a_float32_model_on_float16_data_updates_its_float32_weights():
    torch.manual_seed(0)
    model = HalfData()
    weight, bias = (p.detach().clone().requires_grad_() for p in (model.linear.weight, model.linear.bias))
    x, y = torch.randn(2, 4).half(), torch.tensor([0, 2])
    trainer = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = trainer(x, y)
    # by hand: the parameters cast to float16 for the float16 input, the gradient reaching them in float32
    reference = torch.nn.functional.linear(x, weight.half(), bias.half())
    torch.nn.functional.cross_entropy(reference.float(), y).backward()
    assert out.dtype == torch.float16 and torch.equal(out, reference.detach())
    assert model.linear.weight.dtype == torch.float32
    assert torch.allclose(model.linear.weight, weight.detach() - 0.1 * weight.grad)


class FrozenLosses(torch.nn.Module):
    def __init__(self, wrapped: bool):
        super().__init__()
        self.a, self.b, self.wrapped = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), wrapped

    def forward(self, x, y):
        first = torch.nn.functional.mse_loss(self.a(x), y)
        if self.wrapped:  # the final loss wraps the other: found as with gradients
            return poptorch.identity_loss(first, reduction="mean")
        return first, torch.nn.functional.l1_loss(self.b(x), y)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_frozen_model_finds_its_loss_by_the_same_rule(frozen):
    """Two independent losses are PopTorch's error whether the parameters train or not (frozen, the emulator
    took the last one); a loss wrapped in identity_loss is not final."""
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = FrozenLosses(wrapped)
        for p in model.parameters():
            p.requires_grad = not frozen
        trainer = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(2, 4), torch.randn(2, 4)
        if wrapped:  # the loss of the weights before the update
            expected = torch.nn.functional.mse_loss(model.a(x), y).detach()
            assert torch.allclose(trainer(x, y), expected)
        else:
            with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph"):
                trainer(x, y)
