"""PopTorch's operations for a model's forward (ipu_print_tensor, set_available_memory, serializedMatMul,
for_loop, cond, dynamic_slice/update, ...) run on the emulator with the numbers an IPU computes: each is
checked against the plain torch expression it stands for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch


class Annotated(torch.nn.Module):
    """A linear model whose forward goes through the annotations a ported IPU model carries."""

    def __init__(self, annotate: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 2))
        self.annotate = annotate

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        if self.annotate:
            x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapAccumulationLoop)
            out = poptorch.serializedMatMul(x, self.weight, poptorch.MatMulSerializationMode.OutputChannels, 2)
            out = poptorch.set_available_memory(poptorch.nop(out), 0.3)
            out = poptorch.recomputationCheckpoint(out)
        else:
            out = x @ self.weight
        return out, F.mse_loss(out, y)


def test_a_model_with_ipu_annotations_trains_the_weights_of_the_plain_model():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=gen), torch.randn(8, 2, generator=gen)
    weights = []
    for annotate in (True, False):
        model = Annotated(annotate)
        training = poptorch.trainingModel(model, _overlap_options() if annotate else poptorch.Options(),
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            training(x, y)
        training.copyWeightsToHost()
        weights.append(model.weight.detach().clone())
    plain = Annotated(False)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        plain(x, y)[1].backward()
        optimizer.step()
    assert torch.equal(weights[0], weights[1])
    torch.testing.assert_close(weights[0], plain.weight.detach())


def _overlap_options(io_tiles: int | None = 32, strategy=poptorch.ShardedExecution, output=poptorch.OutputMode.All):
    """Options under which overlapped IO compiles: no pipelining, IO tiles, every output returned."""
    opts = poptorch.Options()
    if strategy is not None:
        opts.setExecutionStrategy(strategy())
    if io_tiles is not None:
        opts.TensorLocations.numIOTiles(io_tiles)
    if output is not None:
        opts.outputMode(output)
    return opts


OVERLAP = poptorch.OverlapMode.OverlapAccumulationLoop


class InputReadTwice(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return y, poptorch.set_overlap_for_input(x, OVERLAP)


class InputMarkedTwice(torch.nn.Module):
    def forward(self, x):
        return poptorch.set_overlap_for_input(x, OVERLAP) * poptorch.set_overlap_for_input(x, OVERLAP)


class MarkOnAMark(torch.nn.Module):  # the second mark's tensor is the first mark's output, not the input
    def forward(self, x):
        return poptorch.set_overlap_for_input(poptorch.set_overlap_for_input(x, OVERLAP), OVERLAP) * 2


class MarkOnAnOp(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return y, poptorch.set_overlap_for_input(y, OVERLAP)


class OverlappedInput(torch.nn.Module):
    def forward(self, x):
        return poptorch.set_overlap_for_input(x, OVERLAP) + 1


class OutputReturnedTwice(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return [poptorch.set_overlap_for_output(y, OVERLAP), (x, y)]


class MarkNotReturned(torch.nn.Module):
    def forward(self, x):
        return poptorch.set_overlap_for_output(x * 2, OVERLAP) + 1


class OverlappedOutputs(torch.nn.Module):
    def forward(self, x, y):
        x = poptorch.set_overlap_for_input(x, OVERLAP)
        y = poptorch.set_overlap_for_input(y, poptorch.OverlapMode.OverlapDeviceIterationLoop)
        out = x * y
        return poptorch.set_overlap_for_output(out, OVERLAP), (poptorch.set_overlap_for_output(
            x + y, poptorch.OverlapMode.NoOverlap), )


NOT_ONLY_OP = ("poptorch.set_overlap_for_input must be the only op applied to an input. This is not the case for "
               "input x to the model.")
NOT_AN_INPUT = "poptorch.set_overlap_for_input applied on a node which is not a tensor input to the model."
PIPELINED = ("Overlapped IO is not supported with poptorch.PipelinedExecution. If you are using only one IPU, please "
             "switch to poptorch.ShardedExecution.")


@pytest.mark.parametrize("model, options, error", [
    # PopTorch's own cases (test_overlapped_io.py): the rules checked when the traced graph is compiled
    (InputReadTwice, _overlap_options(), NOT_ONLY_OP),
    (InputMarkedTwice, _overlap_options(), NOT_ONLY_OP),
    (MarkOnAnOp, _overlap_options(), NOT_AN_INPUT),
    (MarkOnAMark, _overlap_options(), NOT_AN_INPUT),
    (OverlappedInput, None, PIPELINED),
    (OverlappedInput, _overlap_options(output=None, io_tiles=None),
     "No IO tiles allocated. You must allocate at least 32 IO tiles using "
     "poptorch.Options().TensorLocations.numIOTiles."),
    (OverlappedInput, _overlap_options(output=poptorch.OutputMode.Final),
     "Unsupported output mode for overlapped IO. Please switch output mode to poptorch.OutputMode.All or "
     "poptorch.OutputMode.Sum."),
    (OutputReturnedTwice, _overlap_options(), "poptorch.set_overlap_for_output cannot be used with a tensor that is "
                                              "returned twice. Please check all returned tensors including those "
                                              "nested in tuples/lists."),
    (MarkNotReturned, _overlap_options(), "poptorch.set_overlap_for_output applied on a node which is not a tensor "
                                          "output to the model."),
], ids=["input-read-twice", "input-marked-twice", "mark-on-an-op", "mark-on-a-mark", "pipelined", "no-io-tiles",
        "output-mode-final", "output-returned-twice", "mark-not-returned"])
def test_overlapped_io_is_refused_where_poptorch_refuses_it(model, options, error):
    executor = poptorch.inferenceModel(model(), options)
    with pytest.raises(poptorch.Error) as raised:
        executor(torch.tensor([1.0]))
    assert str(raised.value) == error


def test_overlapped_io_runs_with_its_settings_and_returns_the_plain_values():
    """Marks on inputs and returned outputs compile under ShardedExecution with IO tiles (inference's default
    output mode is All) and change no value; outside a model, and with NoOverlap, a mark returns its tensor."""
    x, y = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.5, -1.0], [2.0, 3.0]])
    out = poptorch.inferenceModel(OverlappedOutputs(), _overlap_options(output=None))(x, y)
    assert torch.equal(out[0], x * y) and torch.equal(out[1][0], x + y)
    assert poptorch.set_overlap_for_input(x, OVERLAP) is x
    assert torch.equal(InputMarkedTwice()(x), x * x)  # on the host: no compilation, nothing refused
    no_overlap = poptorch.inferenceModel(OverlappedOutputs(), None)  # any mode but NoOverlap needs the settings
    with pytest.raises(poptorch.Error, match="PipelinedExecution"):
        no_overlap(x, y)


def test_ipu_print_tensor_prints_the_tensor_and_its_gradient_in_poplars_layout_and_returns_it(capsys):
    x = torch.tensor([1.0, 2.5], requires_grad=True)
    out = poptorch.ipu_print_tensor(x * 3, "tripled")
    (out * torch.tensor([5.0, 7.0])).sum().backward()
    assert torch.equal(out.detach(), torch.tensor([3.0, 7.5]))
    assert capsys.readouterr().err.splitlines() == ["tripled: (3, 7.5)", "tripled_gradient: (5, 7)"]
    grid = torch.tensor([[0.5, 1.25], [-2.0, 30.0]])
    poptorch.ipu_print_tensor(grid, "fixed", float_format="fixed", digits=3, separator=" ", open_bracket="[",
                              close_bracket="]")
    assert capsys.readouterr().err == "fixed: [\n [0.50 1.25]\n [-2.00 30.0]\n]\n"
    poptorch.ipu_print_tensor(torch.arange(10), "long", summarise_threshold=5, edge_items=2, max_line_width=12)
    assert capsys.readouterr().err.splitlines() == ["long: (0, 1, ...,", "  8, 9)"]


def test_dynamic_slice_and_update_equal_python_slicing():
    t = torch.arange(24.0).reshape(4, 6)  # slices of a size that divides the dimension
    start = torch.tensor([1])
    assert torch.equal(poptorch.dynamic_slice(t, 1, start, 3, 2), t[:, 1:4:2])
    assert torch.equal(poptorch.dynamic_slice(t, 0, start, 2, 1), t[1:3])
    src = -torch.ones(4, 2)
    want = t.clone()
    want[:, 3:5] = src
    assert torch.equal(poptorch.dynamic_update(t, src, 1, torch.tensor(3), 2), want)
    assert torch.equal(t, torch.arange(24.0).reshape(4, 6))  # the input is not changed


def test_for_loop_and_cond_run_their_bodies_as_python_would():
    def body(total, step):
        return total + step, step * 2

    total, step = torch.zeros(2), torch.ones(2)
    for _ in range(4):
        total, step = body(total, step)
    looped = poptorch.for_loop(4, body, [torch.zeros(2), torch.ones(2)])
    assert [t.tolist() for t in looped] == [total.tolist(), step.tolist()] == [[15.0, 15.0], [16.0, 16.0]]
    x = torch.tensor([2.0])
    assert poptorch.cond(torch.tensor(True), lambda a: a + 1, [x], lambda a: a - 1, [x])[0].item() == 3.0
    assert poptorch.cond(torch.tensor(False), lambda a: (a + 1, a), [x], lambda a: (a - 1, a), [x])[0].item() == 1.0


class LoopModel(torch.nn.Module):
    """Doubles its input three times in an on-device loop, then scales it by a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, y=None):
        out = poptorch.for_loop(3, lambda t: t * 2, [x])[0] * self.scale
        return out if y is None else (out, F.mse_loss(out, y))


def test_on_device_loops_run_in_inference_models_and_are_refused_in_training_ones():
    x = torch.ones(2, 2)
    assert torch.equal(poptorch.inferenceModel(LoopModel())(x), torch.full((2, 2), 8.0))
    with pytest.raises(poptorch.Error, match=r"poptorch.for_loop\(\) is only supported in inference"):
        poptorch.trainingModel(LoopModel())(x, x)


@pytest.mark.parametrize("call, error, text", [
    (lambda: poptorch.ipu_print_tensor([1.0]), poptorch.Error,
     "ipu print tensor must take a torch.tensor argument. <class 'list'> is not supported."),
    (lambda: poptorch.set_available_memory(1.0, 0.5), poptorch.Error,
     "You may only set available memory for torch.tensor values. <class 'float'> is not supported."),
    (lambda: poptorch.dynamic_slice(torch.ones(3), 0, 1, 1, 1), poptorch.Error,
     "Slice start argument to dynamic_slice must be a torch.tensor. <class 'int'> is not supported."),
    (lambda: poptorch.dynamic_update(torch.ones(3), torch.ones(3, 1), 0, torch.tensor(0), 1), poptorch.Error,
     "input and src tensors must have same dimensionality. (1) vs (2)"),
    (lambda: poptorch.for_loop(2, lambda a: a, (torch.ones(1),)), ValueError,
     "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. (Object is not list)"),
    (lambda: poptorch.for_loop(2, lambda a: (a, a), [torch.ones(1)]), poptorch.Error,
     "the body returned 2 tensors for 1 inputs"),
    (lambda: poptorch.recomputationCheckpoint(torch.ones(1), 2.0), ValueError, "All inputs must be tensors"),
])
def test_bad_arguments_get_poptorchs_errors(call, error, text):
    with pytest.raises(error) as raised:
        call()
    assert text in str(raised.value)


def test_a_poptorch_name_the_emulator_leaves_out_names_itself_in_one_line():
    with pytest.raises(AttributeError) as raised:
        poptorch.custom_op
    assert str(raised.value).startswith("poptorch.custom_op is not emulated: it needs IPU hardware")
    assert "\n" not in str(raised.value) and "IS_EMULATOR" in str(raised.value)
    assert not hasattr(poptorch, "no_such_name") and hasattr(poptorch, "ipu_print_tensor")
