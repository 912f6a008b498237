"""Anchors: Options.anchorTensor, Options.anchored_tensors and PoplarExecutor.getAnchoredTensor."""

from __future__ import annotations

import copy

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

OutputMode = poptorch.OutputMode


class Bias(torch.nn.Module):
    """loss = sum(x + b): dloss/db = batch size per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x + self.b
        return y, poptorch.identity_loss(y, reduction="sum")


def test_anchored_tensors_records_name_mode_and_period():
    opts = poptorch.Options()
    opts.anchorTensor("a", "tensor_a")
    opts.anchorTensor("b", "tensor_b", OutputMode.EveryN, 2)
    opts.anchorTensor("c", "tensor_c", OutputMode.Final, 5)  # the period only counts with EveryN
    assert opts.anchored_tensors == {"a": ["tensor_a", True, None, 1], "b": ["tensor_b", False, OutputMode.EveryN, 2],
                                     "c": ["tensor_c", False, OutputMode.Final, 1]}
    copied = copy.deepcopy(opts)
    opts.anchorTensor("d", "tensor_d")
    assert "d" not in copied.anchored_tensors
    with pytest.raises(AssertionError, match="EveryN anchor must have output_return_period"):
        opts.anchorTensor("e", "tensor_e", OutputMode.EveryN, 0)


def test_updated_weights_by_output_mode():
    # SGD lr 0.5, batch of one per step: b drops by 0.5 per step (mean over one sample, sum over 2 outputs)
    results = {}
    for mode, period in ((OutputMode.All, 1), (OutputMode.Final, 1), (OutputMode.Sum, 1), (OutputMode.EveryN, 2)):
        opts = poptorch.Options().deviceIterations(4)
        opts.anchorTensor("b", "UpdatedVar___b", mode, period)
        model = Bias()
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.5))
        training(torch.ones(4, 2))
        results[mode] = training.getAnchoredTensor("b").tolist()
    assert results[OutputMode.All] == [-0.5, -0.5, -1.0, -1.0, -1.5, -1.5, -2.0, -2.0]
    assert results[OutputMode.Final] == [-2.0, -2.0]
    assert results[OutputMode.Sum] == [-5.0, -5.0]
    assert results[OutputMode.EveryN] == [-1.0, -1.0, -2.0, -2.0]


def test_an_anchor_without_a_mode_follows_the_models_outputs():
    opts = poptorch.Options().deviceIterations(2).outputMode(OutputMode.All)
    opts.anchorTensor("b", "UpdatedVar___b")
    model = Bias()
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=1.0))
    training(torch.ones(2, 2))
    assert training.getAnchoredTensor("b").tolist() == [-1.0, -1.0, -2.0, -2.0]
    training(torch.ones(2, 2))  # each run replaces the values
    assert training.getAnchoredTensor("b").tolist() == [-3.0, -3.0, -4.0, -4.0]


def test_poptorchs_errors_for_unknown_names():
    opts = poptorch.Options()
    opts.anchorTensor("g", "Gradient___b")
    model = Bias()
    training = poptorch.trainingModel(model, opts)
    with pytest.raises(poptorch.Error, match=r"Anchor tensor `Gradient___b' not in Ir Tensors\."):
        training(torch.ones(1, 2))
    opts = poptorch.Options()
    opts.anchorTensor("ls", "finalLossScale")  # only with automatic loss scaling
    with pytest.raises(poptorch.Error, match=r"Anchor tensor `finalLossScale' not in Ir Tensors\."):
        poptorch.trainingModel(Bias(), opts).compile(torch.ones(1, 2))
    opts = poptorch.Options()
    opts.anchorTensor("b", "UpdatedVar___b")
    training = poptorch.trainingModel(Bias(), opts)
    with pytest.raises(AssertionError, match="^No tensor with name b found.$"):
        training.getAnchoredTensor("b")  # nothing has run yet
    training(torch.ones(1, 2))
    with pytest.raises(AssertionError, match="^No tensor with name nope found.$"):
        training.getAnchoredTensor("nope")
