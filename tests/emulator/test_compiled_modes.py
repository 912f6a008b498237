"""A compiled model keeps the train/eval mode it was compiled with (PopTorch's wrapper is a copy whose mode
flags are not synced: a later ``model.train()`` / ``model.eval()`` on the host does not reach the graph), and
the executable cache tells graphs of different optimizers apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch


class LinearNorm(torch.nn.Module):
    """A linear layer and a batch norm: in training mode the norm uses the batch's statistics and updates
    its running ones, in eval mode it uses the running ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        out = self.norm(self.linear(x))
        return out if y is None else (out, F.mse_loss(out, y))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)


def test_a_training_model_compiled_in_train_mode_trains_so_after_the_host_calls_eval():
    torch.manual_seed(0)
    model, (x, y) = LinearNorm(), _batch()
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=0.0))
    training(x, y)  # compiled in train mode
    training.copyWeightsToHost()
    before = model.norm.running_mean.clone()
    model.eval()
    out, _ = training(x, y)
    training.copyWeightsToHost()
    hidden = model.linear(x).detach()
    # batch statistics, as nn.BatchNorm1d in training mode computes them
    want = (hidden - hidden.mean(0)) / torch.sqrt(hidden.var(0, unbiased=False) + model.norm.eps)
    torch.testing.assert_close(out, want * model.norm.weight.detach() + model.norm.bias.detach())
    torch.testing.assert_close(model.norm.running_mean, 0.9 * before + 0.1 * hidden.mean(0))
    assert not model.training and not model.norm.training  # the host keeps the mode it set


def test_an_inference_model_compiled_in_eval_mode_keeps_it_after_the_host_calls_train():
    torch.manual_seed(0)
    model, (x, _) = LinearNorm(), _batch()
    model.norm.running_mean.fill_(0.5)
    model.norm.running_var.fill_(2.0)
    model.eval()
    inference = poptorch.inferenceModel(model)
    inference(x)  # compiled in eval mode
    model.train()
    out = inference(x)
    hidden = model.linear(x).detach()
    want = (hidden - 0.5) / torch.sqrt(torch.tensor(2.0) + model.norm.eps)
    torch.testing.assert_close(out, want * model.norm.weight.detach() + model.norm.bias.detach())
    assert torch.equal(model.norm.running_mean, torch.full((4,), 0.5))  # no statistics updated
    assert model.training and model.norm.training


def test_a_recompiled_model_takes_the_modes_of_its_new_compilation():
    torch.manual_seed(0)
    model, (x, _) = LinearNorm(), _batch()
    model.eval()
    inference = poptorch.inferenceModel(model)
    inference(x)
    model.train()
    inference.destroy()
    inference(x)  # compiled again, now in train mode: the norm updates its statistics
    assert not torch.equal(model.norm.running_mean, torch.zeros(4))


def test_the_executable_cache_holds_one_graph_per_optimizer_type_not_per_learning_rate(tmp_path):
    def cached(optimizer_of) -> bool:
        torch.manual_seed(0)
        model = LinearNorm()
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
        training = poptorch.trainingModel(model, opts, optimizer_of(model.parameters()))
        training(*_batch())
        cached = training.loaded_from_cache
        training.destroy()
        return cached

    assert not cached(lambda p: poptorch.optim.SGD(p, lr=0.1))
    assert cached(lambda p: poptorch.optim.SGD(p, lr=0.5))  # the rate is an input of the graph
    assert not cached(lambda p: poptorch.optim.Adam(p, lr=0.01))
    assert cached(lambda p: poptorch.optim.Adam(p, lr=0.02))
    assert not cached(lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))
