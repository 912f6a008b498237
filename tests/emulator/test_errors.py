"""PopTorch's error texts, compilation on the first call, and the wrapper's life cycle."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

HINT = ("\nThis error occurred because the inputs passed at runtime don't match the inputs used to compile "
        "the model.\nTo recompile the model for the new inputs create a new inferenceModel / trainingModel "
        "wrapper or call destroy() on the curent one and try again.")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, y, scale=1.0):
        out = self.linear(x) * scale
        return out, torch.nn.functional.mse_loss(out, y)


def test_invalid_batch_dimension_text():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(3)
    opts.Training.gradientAccumulation(2)
    model = poptorch.trainingModel(Net(), opts)
    with pytest.raises(AssertionError) as info:
        model(torch.zeros(10, 3), torch.zeros(12, 2))
    assert str(info.value) == (
        "Invalid batch dimension: In the input torch.Size([10, 3]), the batch dimension (10) must be a "
        "multiple of Options.deviceIterations(2) * (Options.replicationFactor(3) / "
        "Options.inputReplicaGrouping.input_group_size(1)) * Options.Training.gradientAccumulation(2) = 12 "
        "because it is used to calculate the batch size which will be executed on the device in any given "
        "iteration. For a full explanation see the batching semantics page of the documentation.")
    assert not model.isCompiled() and model.compile_count == 0


def test_invalid_batch_dimension_with_input_groups():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(4)
    opts.inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2), opts)
    with pytest.raises(AssertionError, match=r"replicationFactor\(4\) / Options.inputReplicaGrouping."
                                             r"input_group_size\(2\)\) \* Options.Training."
                                             r"gradientAccumulation\(1\) = 4 because"):
        model(torch.zeros(6, 3))
    assert model(torch.zeros(8, 3)).shape == (16, 2)  # D*R*b results: every replica returns its own


def test_shape_mismatch_text_and_compile_count():
    model = poptorch.trainingModel(Net())
    assert model.compile_count == 0 and not model.isCompiled()
    model(torch.zeros(4, 3), torch.zeros(4, 2))
    model(torch.ones(4, 3), torch.ones(4, 2))
    assert model.compile_count == 1
    assert model.compiled_input_shapes == {"x": ((4, 3), torch.float32), "y": ((4, 2), torch.float32)}
    with pytest.raises(poptorch.Error) as info:
        model(torch.zeros(8, 3), torch.zeros(8, 2))
    assert str(info.value) == ("'poptorch_py_error': Shape mismatch for x: expected torch.Size([4, 3]) "
                               "but got torch.Size([8, 3])." + HINT)
    assert info.value.message.startswith("Shape mismatch for x:")
    assert model.compile_count == 1
    # a wrapper per shape: one compilation each
    other = poptorch.inferenceModel(model)
    other(torch.zeros(8, 3), torch.zeros(8, 2))
    assert other.compile_count == 1 and model.compile_count == 1


def test_other_mismatch_texts():
    model = poptorch.inferenceModel(Net())
    model(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(poptorch.Error, match="Data type mismatch for y: expected torch.float32 but got "
                                             "torch.float64."):
        model(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(poptorch.Error, match="Value mismatch for scale: expected 1.0 but got 2.0."):
        model(torch.zeros(2, 3), torch.zeros(2, 2), 2.0)
    with pytest.raises(poptorch.Error, match="Type mismatch for y: expected <class 'torch.Tensor'> but got "
                                             "<class 'list'>."):
        model(torch.zeros(2, 3), [torch.zeros(2, 2)])


def test_destroy_then_recompile():
    net = Net()
    model = poptorch.trainingModel(net)
    model(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="Model has already been wrapped in 'poptorch.trainingModel'. "
                                           r"Call model.destroy\(\) on the model to unwrap"):
        poptorch.trainingModel(net)
    model.destroy()
    assert not model.isCompiled() and not model.isAttachedToDevice()
    model(torch.zeros(5, 3), torch.zeros(5, 2))  # a new shape is fine after destroy
    assert model.compile_count == 2
    model.destroy()
    poptorch.trainingModel(net)  # unwrapped: can be wrapped again


@pytest.mark.parametrize("first", ["call", "compile"])
def test_a_model_that_fails_while_compiling_leaves_no_executable(first):
    """PopTorch compiles by tracing the model, so a model that raises on its first inputs leaves nothing
    compiled and the next call compiles for its own inputs (PopTorch's
    inputs_test.py::test_none_input_dispatch_args_kwargs)."""

    class Forwarding(Net):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = poptorch.inferenceModel(Forwarding())
    x, y = torch.ones(2, 3), torch.zeros(2, 2)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'y'"):
        model.compile(x) if first == "compile" else model(x)
    assert not model.isCompiled()
    out, _ = model(x, y)
    torch.testing.assert_close(out, model.model.linear(x))
    assert model.compiled_input_shapes == {"*args[0]": ((2, 3), torch.float32), "*args[1]": ((2, 2), torch.float32)}


def test_inference_with_gradient_accumulation_text():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(Net(), opts)
    assert info.value.message == (
        "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its default value "
        "(1) when running a poptorch.inferenceModel(). Use poptorch.Options().deviceIterations to process a "
        "sufficient number of batches each run for pipelined execution instead.")
    assert isinstance(info.value, poptorch.poptorch_core.Error)


def test_attach_detach_and_executable_errors():
    model = poptorch.inferenceModel(Net())
    assert not model.isAttachedToDevice()
    for call in (model.attachToDevice, model.detachFromDevice, model.copyWeightsToHost,
                 model.copyWeightsToDevice, model.compilationTime):
        with pytest.raises(poptorch.Error):
            call()
    with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
        model.detachFromDevice()
    model.compile(torch.zeros(1, 3), torch.zeros(1, 2))
    assert model.isCompiled() and model.isAttachedToDevice() and model.compile_count == 1
    model.compile(torch.zeros(1, 3), torch.zeros(1, 2))  # ignored
    assert model.compile_count == 1
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        model.attachToDevice()
    model.detachFromDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        model.detachFromDevice()
    model(torch.zeros(1, 3), torch.zeros(1, 2))  # a call re-attaches
    assert model.isAttachedToDevice()


def test_offline_connection():
    opts = poptorch.Options().connectionType(poptorch.ConnectionType.Never)
    model = poptorch.inferenceModel(Net(), opts)
    with pytest.raises(AssertionError, match=r"Trying to run a model on an offline device "
                                             r"\(ConnectionType.Never\): use model.compile\(inputs\)"):
        model(torch.zeros(1, 3), torch.zeros(1, 2))
    model.compile(torch.zeros(1, 3), torch.zeros(1, 2))
    assert model.isCompiled() and not model.isAttachedToDevice()


def test_training_model_needs_a_loss():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.linear(x).detach()

    model = poptorch.trainingModel(NoLoss())
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        model(torch.zeros(2, 3))


def test_inference_model_refuses_optimizer_and_forwards_attributes():
    net = Net()
    model = poptorch.inferenceModel(net)
    assert model.linear is net.linear and model.model is net
    assert model.training is False


def test_argument_binding_errors():
    model = poptorch.inferenceModel(Net())
    with pytest.raises(AssertionError, match="Too many arguments provided"):
        model(torch.zeros(1, 3), torch.zeros(1, 2), 1.0, 2.0)
    with pytest.raises(AssertionError, match="z is not a valid parameter."):
        model(torch.zeros(1, 3), z=torch.zeros(1, 2))
    with pytest.raises(poptorch.Error, match="Mandatory parameter y missing"):
        model(torch.zeros(1, 3))
    out, _ = model(y=torch.zeros(1, 2), x=torch.ones(1, 3))  # keywords are bound by name
    assert out.shape == (1, 2)


def test_a_replication_factor_that_is_no_power_of_two_needs_auto_rounding(caplog):
    """PopTorch reserves a power of 2 (or a multiple of 64) IPUs; other counts fail unless auto-rounded."""
    opts = poptorch.Options().replicationFactor(3)
    model = poptorch.trainingModel(Net(), opts)
    with pytest.raises(poptorch.Error) as info:
        model(torch.zeros(3, 3), torch.zeros(3, 2))
    assert str(info.value).endswith(
        "The model specifies the use of 3 IPUs, however PopTorch must reserve a minimum of 4 in order to allow "
        "the model to run, because PopTorch must reserve a power of 2 or a multiple of 64 IPUs. Please "
        "reconfigure your model to use a different number of IPUs or set poptorch.Options().autoRoundNumIPUs(True).")
    model.destroy()
    model = poptorch.trainingModel(Net(), poptorch.Options().replicationFactor(3).autoRoundNumIPUs(True))
    model(torch.zeros(3, 3), torch.zeros(3, 2))
    assert "Reserving 4 IPUs" in caplog.text
