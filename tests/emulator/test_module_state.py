"""What compiling fixes of a module's state besides its weights (PopTorch's user guide, "PyTorch buffers";
python/_impl.py's errorOnBufferOrParameterAddressChanges): buffers and parameters keep their storage, and a
plain tensor attribute is a constant of the graph."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch


class Counter(torch.nn.Module):
    """The user guide's counter_model_wrong: ``i`` is a plain attribute, neither buffer nor parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.i = torch.tensor([0.0])

    def forward(self) -> torch.Tensor:
        self.i += 1
        return self.i


class BufferCounter(torch.nn.Module):
    """The user guide's counter_model_correct: ``i`` is a buffer, updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("i", torch.tensor([0.0]))

    def forward(self) -> torch.Tensor:
        self.i += 1
        return self.i.clone()


def test_a_plain_tensor_attribute_is_the_graphs_constant_and_a_buffer_counts():
    model = Counter()
    compiled = poptorch.inferenceModel(model)
    assert [compiled().item() for _ in range(3)] == [1.0, 1.0, 1.0]   # the guide: tensor([1.]) every call
    assert model.i.item() == 1.0   # the trace ran the forward once on the host (buffers.py's assert_close)
    counter = BufferCounter()
    compiled = poptorch.inferenceModel(counter)
    assert [compiled().item() for _ in range(3)] == [1.0, 2.0, 3.0]
    assert counter.i.item() == 3.0


class Reassigns(torch.nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.register_buffer("y", torch.tensor([2.0]))
        self.lin = torch.nn.Linear(1, 1)
        self.norm = torch.nn.BatchNorm1d(1)   # its running statistics may change: PopTorch lets them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.lin(x))
        if self.what == "buffer":
            self.y = x.detach()
        elif self.what == "removed":
            del self._buffers["y"]
        elif self.what == "parameter":
            self.lin.weight = torch.nn.Parameter(self.lin.weight.detach().clone())
        elif self.what == "in-place":
            self.y.copy_(x.detach()[0])
        return x


@pytest.mark.parametrize("what, says", [
    ("buffer", "Buffer y is reassigned within the model when calling the forward method. This is not supported. "
               "Consider using self.y.copy_(src) to copy data from a source tensor, where src is the name of the "
               "source tensor."),
    ("removed", "Buffer y is removed from the model when calling the forward method."),
    ("parameter", "Parameter lin.weight is reassigned within the model when calling the forward method."),
    ("in-place", None),
])
def test_a_forward_that_replaces_a_buffer_or_parameter_is_refused_with_poptorchs_text(what, says):
    compiled = poptorch.inferenceModel(Reassigns(what).train())
    if says is None:
        compiled(torch.ones(4, 1))
        compiled(torch.ones(4, 1))
        return
    with pytest.raises(poptorch.Error, match=says.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        compiled(torch.ones(4, 1))
