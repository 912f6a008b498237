"""``poptorch.optim`` on the emulator: the optimizer state lives on the device, one per executor; poptorch's
optimizers read it back and write it again, torch's do not; what PopTorch refuses is refused with its text.

References are plain torch: one torch optimizer stepping the same gradients (the state carried over), or a
fresh torch optimizer per executor (the state not carried over).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.poptorch_emulator import optim


class Net(torch.nn.Module):
    """forward(x, y) -> (out, loss) around a shared Linear, so several executors train the same weights."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        self.lin = lin

    def forward(self, x, y):
        out = self.lin(x)
        return out, F.mse_loss(out, y)


def batch(seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, generator=g), torch.randn(rows, 2, generator=g)


def linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def reference_step(lin: torch.nn.Linear, opt: torch.optim.Optimizer, x, y) -> None:
    opt.zero_grad()
    F.mse_loss(lin(x), y).backward()
    opt.step()


def test_torch_adam_keeps_a_state_per_executor_and_none_on_the_host():
    """As on an IPU: the host torch optimizer never steps, and a second graph starts its own moments."""
    lin = linear()
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    first = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=opt)
    second = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=opt)
    first(*batch(1))
    first.detachFromDevice()
    second(*batch(2, rows=8))
    assert not any(opt.state.values())

    ref = linear()
    reference_step(ref, torch.optim.Adam(ref.parameters(), lr=0.1), *batch(1))
    reference_step(ref, torch.optim.Adam(ref.parameters(), lr=0.1), *batch(2, rows=8))  # fresh moments
    for p, q in zip(lin.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-7, rtol=0)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "SGD", "RMSprop"])
def test_poptorch_state_is_read_back_on_detach_and_written_to_the_next_executor(kind):
    hparams = {"Adam": {"lr": 0.1}, "AdamW": {"lr": 0.1, "weight_decay": 0.1},
               "SGD": {"lr": 0.1, "momentum": 0.9}, "RMSprop": {"lr": 0.01, "momentum": 0.5}}[kind]
    lin = linear()
    opt = getattr(optim, kind)(lin.parameters(), **hparams)
    first = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=opt)
    second = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=opt)
    first(*batch(1))
    first(*batch(2))
    first.detachFromDevice()  # reads the state back
    second(*batch(3, rows=8))  # compiles, attaches: the state goes to this graph

    ref = linear()
    ref_opt = getattr(torch.optim, kind)(ref.parameters(), **hparams)
    for seed, rows in ((1, 4), (2, 4), (3, 8)):
        reference_step(ref, ref_opt, *batch(seed, rows))
    for p, q in zip(lin.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    assert not any(opt.state.values())  # the host's torch state stays empty; the device's comes back:
    state = opt.state_dict()  # (second is bound now: it reads its state back)
    names = dict(zip(("lin.weight", "lin.bias"), ref.parameters()))
    assert set(state["ipu_state"]) == set(names)
    for name, p in names.items():
        for key, value in ref_opt.state[p].items():
            assert torch.allclose(torch.as_tensor(state["ipu_state"][name][key]), torch.as_tensor(value),
                                  atol=1e-6), (name, key)


def test_a_loaded_state_reaches_a_new_executor():
    lin = linear()
    opt = optim.Adam(lin.parameters(), lr=0.1)
    model = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=opt)
    model(*batch(1))
    saved = {"weights": {k: v.clone() for k, v in lin.state_dict().items()}, "optimizer": opt.state_dict()}
    model(*batch(2))
    assert saved["optimizer"]["ipu_state"]["lin.weight"]["step"] == 1  # a copy, not a live view

    other = linear(5)
    other.load_state_dict(saved["weights"])
    other_opt = optim.Adam(other.parameters(), lr=0.1)
    other_opt.load_state_dict(saved["optimizer"])
    poptorch.trainingModel(Net(other), poptorch.Options(), optimizer=other_opt)(*batch(2))
    for p, q in zip(lin.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_a_torch_state_cannot_be_loaded_onto_the_ipu():
    lin = linear()
    torch_opt = torch.optim.Adam(lin.parameters())
    reference_step(lin, torch_opt, *batch(1))
    with pytest.raises(RuntimeError, match="^Only IPU optimizer states can be loaded onto the IPU.$"):
        optim.Adam(lin.parameters()).load_state_dict(torch_opt.state_dict())


def test_what_poptorch_cannot_run_is_refused_with_its_text():
    lin = linear()
    with pytest.raises(AssertionError) as err:
        poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=torch.optim.Adagrad(lin.parameters()))
    assert str(err.value) == (
        "Unsupported optimizer type. Types supported _OptimizerType.SGD1, _OptimizerType.SGD2, "
        "_OptimizerType.ADAM, _OptimizerType.ADAMW, _OptimizerType.ADAMW_NO_BIAS, _OptimizerType.RMSPROP, "
        "_OptimizerType.RMSPROP_CENTERED, _OptimizerType.LAMB, _OptimizerType.LAMB_NO_BIAS")
    with pytest.raises(ValueError, match="^Only non-amsgrad Adam/AdamW optimizers are supported.$"):
        poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=optim.Adam(lin.parameters(), amsgrad=True))
    with pytest.raises(AssertionError, match="^Accumulation types must be either torch.float32 or torch.float16$"):
        optim.AdamW(lin.parameters(), accum_type=torch.bfloat16)
    model = poptorch.trainingModel(Net(lin), poptorch.Options(), optimizer=optim.LAMB(lin.parameters()))
    model(*batch(1))  # LAMB is PopTorch's own and runs


def test_constructors_take_torchs_arguments_then_poptorchs():
    """PopTorch 3.3's signatures (python/optim.py): torch 2.0's parameters in order, then its extras."""
    expected = {
        optim.SGD: ["lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
                    "differentiable", "loss_scaling", "velocity_scaling", "use_combined_accum", "accum_type",
                    "velocity_accum_type", "max_grad_norm"],
        optim.Adam: ["lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                     "differentiable", "fused", "loss_scaling", "accum_type", "first_order_momentum_accum_type",
                     "second_order_momentum_accum_type", "max_grad_norm"],
        optim.AdamW: ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                      "differentiable", "fused", "loss_scaling", "bias_correction", "accum_type",
                      "first_order_momentum_accum_type", "second_order_momentum_accum_type", "max_grad_norm"],
        optim.LAMB: ["lr", "betas", "eps", "weight_decay", "bias_correction", "loss_scaling", "max_weight_norm",
                     "accum_type", "first_order_momentum_accum_type", "second_order_momentum_accum_type"],
    }
    for cls, names in expected.items():
        assert list(inspect.signature(cls.__init__).parameters)[2:] == names, cls.__name__
    lin = linear()
    sgd = optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, loss_scaling=128.0)
    assert isinstance(sgd, torch.optim.SGD) and sgd.loss_scaling == 128.0 and sgd.param_groups[0]["momentum"] == 0.9
    adam = optim.Adam(lin.parameters())
    assert adam.defaults["lr"] == torch.optim.Adam(lin.parameters()).defaults["lr"]  # None -> torch's default
    assert sgd.variable_attrs.isConstant("dampening") and not sgd.variable_attrs.isConstant("momentum")


def test_lamb_step_follows_the_paper():
    """One step from zero moments: m_hat = g, v_hat = g^2, u = g / (|g| + eps) + wd w, trust = |w| / |u|."""
    w = torch.nn.Parameter(torch.tensor([3.0, -4.0]))
    w.grad = torch.tensor([0.5, 2.0])
    lr, wd, eps = 0.1, 0.01, 1e-8
    expected_u = w.grad / (w.grad.abs() + eps) + wd * w.detach()
    trust = w.detach().norm() / expected_u.norm()
    expected = w.detach() - lr * trust * expected_u
    optim.LAMB([w], lr=lr, weight_decay=wd, eps=eps).step()
    assert torch.allclose(w.detach(), expected, atol=1e-6)


def test_adamw_without_bias_correction_uses_the_raw_moments():
    """Two steps by hand: w <- w (1 - lr wd) - lr m / (sqrt(v) + eps), m and v without 1 / (1 - beta^t)."""
    lr, wd, eps, (b1, b2) = 0.1, 0.2, 1e-8, (0.9, 0.99)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = optim.AdamW([w], lr=lr, weight_decay=wd, eps=eps, betas=(b1, b2), bias_correction=False)
    expected, m, v = w.detach().clone(), torch.zeros(2), torch.zeros(2)
    for g in (torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 0.25])):
        w.grad = g
        opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        expected = expected * (1 - lr * wd) - lr * m / (v.sqrt() + eps)
    assert torch.allclose(w.detach(), expected, atol=1e-6)
