"""How a training model's loss is found: PopTorch's rule (torch losses and identity_loss in the graph; a loss
used by another loss is not final; exactly one final loss), whichever output holds it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.ipu_engine import IPUEngine

from accelbatch.plan import ExecutionPlan

LR = 0.1


class Net(torch.nn.Module):
    """``forward(x, y)`` -> what ``loss_of(out, y)`` makes of the linear layer's output."""

    def __init__(self, loss_of):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2)
        self.loss_of = loss_of

    def forward(self, x, y):
        return self.loss_of(self.lin(x), y)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _train_once(loss_of):
    net = Net(loss_of)
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=LR))
    model(*_data())
    return net


def _sgd_reference(loss):
    """One SGD step on ``loss(out, y)`` by hand."""
    net = Net(lambda out, y: None)
    x, y = _data()
    loss(net.lin(x), y).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= LR * p.grad
    return net


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)


def test_the_loss_is_found_whichever_output_holds_it():
    """(loss, logits): PopTorch trains on the loss, not on the last output."""
    net = _train_once(lambda out, y: (F.mse_loss(out, y), out))
    _assert_same(net, _sgd_reference(F.mse_loss))


def test_a_hand_written_loss_needs_identity_loss():
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        _train_once(lambda out, y: (out, ((out - y) ** 2).mean()))
    net = _train_once(lambda out, y: (out, poptorch.identity_loss((out - y) ** 2, reduction="mean")))
    _assert_same(net, _sgd_reference(lambda out, y: ((out - y) ** 2).mean()))


def test_two_independent_losses_are_refused_unless_wrapped():
    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph"):
        _train_once(lambda out, y: (out, F.mse_loss(out, y) + F.l1_loss(out, y)))
    both = lambda out, y: F.mse_loss(out, y) + F.l1_loss(out, y)  # noqa: E731
    net = _train_once(lambda out, y: (out, poptorch.identity_loss(both(out, y), reduction="none")))
    _assert_same(net, _sgd_reference(both))


def test_a_loss_imported_by_name_is_found_too():
    from torch.nn.functional import smooth_l1_loss

    net = _train_once(lambda out, y: smooth_l1_loss(out, y))
    _assert_same(net, _sgd_reference(F.smooth_l1_loss))


def test_the_engine_marks_a_hand_written_loss_so_it_trains_as_on_the_cpu():
    """accelbatch's IPU engine wraps the model's loss in identity_loss: a model whose loss is hand-written
    (no torch loss function) trains on the emulated IPU exactly as on the host."""

    class DictNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, batch):
            out = self.lin(batch["x"])
            return {"out": out, "loss": ((out - batch["y"]) ** 2).mean()}

    net = DictNet()
    engine = IPUEngine(poptorch, net, torch.optim.SGD(net.parameters(), lr=LR), ExecutionPlan(micro_batch=4))
    x, y = _data()
    engine.train_step({"x": x, "y": y})
    engine.sync_to_host()
    _assert_same(net, _sgd_reference(lambda out, y: ((out - y) ** 2).mean()))
