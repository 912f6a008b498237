"""Batching semantics: device iterations, replication, gradient accumulation and output modes.

Vectors from PopTorch's tests/batching_test.py, plus checks against plain torch loops written here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch


# -- inference output modes (PopTorch test_inferenceOutputModes) ------------------------------------------
@pytest.mark.parametrize("mode", list(poptorch.OutputMode))
def test_inference_output_modes(mode):
    torch.manual_seed(42)
    model = torch.nn.Linear(6, 20)
    x = torch.randn([10, 1, 5, 6])
    native = model(x).detach()
    opts = poptorch.Options().deviceIterations(10)
    opts.outputMode(mode, output_return_period=5)
    out = poptorch.inferenceModel(model, opts)(x)
    if mode in (poptorch.OutputMode.All, poptorch.OutputMode.Default):
        assert out.shape == (10, 1, 5, 20)
        torch.testing.assert_close(out, native)
    elif mode == poptorch.OutputMode.EveryN:
        assert out.shape == (2, 1, 5, 20)
        torch.testing.assert_close(out[0], native[4])
        torch.testing.assert_close(out[1], native[9])
    elif mode == poptorch.OutputMode.Final:
        assert out.shape == (1, 1, 5, 20)
        torch.testing.assert_close(out[0], native[-1])
    else:
        assert out.shape == (1, 1, 5, 20)
        torch.testing.assert_close(out, native.sum(dim=0, keepdim=True))


# -- training output modes (PopTorch test_trainingOutputModes) --------------------------------------------
class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 10)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, data, target):
        out = self.linear(data)
        return out, self.loss(out, target)


@pytest.mark.parametrize("mode", list(poptorch.OutputMode))
def test_training_output_modes(mode):
    torch.manual_seed(42)
    x = torch.randn(1000, 10)
    label = torch.randint(0, 10, [1]).expand([1000])
    opts = poptorch.Options().deviceIterations(1000)
    opts.outputMode(mode, output_return_period=20)
    out, loss = poptorch.trainingModel(Classifier(), options=opts)(x, label)
    if mode == poptorch.OutputMode.All:
        assert out.shape == (1000, 10) and loss.shape == (1000,)
        means = loss.reshape(10, 100).mean(dim=1)
        assert bool((means[1:] < means[:-1]).all())  # the loss goes down, one update per iteration
    elif mode == poptorch.OutputMode.EveryN:
        assert out.shape == (50, 10) and loss.shape == (50,)
    else:
        assert out.shape == (1, 10) and loss.shape == ()
        if mode == poptorch.OutputMode.Sum:
            assert loss > 500.0
        else:  # Final and the training Default
            assert loss < 0.2


# -- gradient accumulation (PopTorch test_gradient_accumulation_training) ----------------------------------
class L1Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 10)
        self.loss = torch.nn.L1Loss(reduction="mean")

    def forward(self, data, target):
        out = self.linear(data)
        return out, self.loss(out, target)


def _accumulation_weights(data, target, accumulation, reduction, lr):
    torch.manual_seed(42)
    model = L1Model()
    opts = poptorch.Options()
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(accumulation)
    if reduction is not None:
        opts.Training.accumulationAndReplicationReductionType(reduction)
    pm = poptorch.trainingModel(model, options=opts, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    for _ in range(10):
        pm(data, target)
    return pm.linear.weight.data.clone()


def test_gradient_accumulation_vectors():
    torch.manual_seed(42)
    target = torch.randn(4, 10)
    data = torch.randn(4, 10)
    mean = poptorch.ReductionType.Mean
    w1 = _accumulation_weights(data, target, 1, mean, 0.01)
    torch.testing.assert_close(_accumulation_weights(data, target, 2, mean, 0.01), w1)
    torch.testing.assert_close(_accumulation_weights(data, target, 2, None, 0.01), w1)  # Mean is default
    s1 = _accumulation_weights(data, target, 1, poptorch.ReductionType.Sum, 0.02)
    torch.testing.assert_close(_accumulation_weights(data, target, 2, poptorch.ReductionType.Sum, 0.01), s1)

    # independent reference: 10 plain SGD steps on the whole batch of 4
    torch.manual_seed(42)
    ref = L1Model()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(10):
        sgd.zero_grad()
        ref(data, target)[1].backward()
        sgd.step()
    torch.testing.assert_close(w1, ref.linear.weight.data)


# -- the whole plan against a plain torch loop ------------------------------------------------------------
class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.linear(x)
        return out, torch.nn.functional.mse_loss(out, y)


class PlainTorchPlan:
    """Plain torch: rows in host order [D, G, R, b]; one SGD step per device iteration."""

    def __init__(self, model, D, G, R, reduction, lr, momentum):
        self.model, self.D, self.G, self.R, self.reduction = model, D, G, R, reduction
        self.sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

    def __call__(self, x, y):
        D, G, R = self.D, self.G, self.R
        b = x.shape[0] // (D * G * R)
        outs, losses = [], []
        for d in range(D):
            self.sgd.zero_grad()
            total = 0
            for g in range(G):
                for r in range(R):
                    k = (d * G + g) * R + r
                    out, loss = self.model(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b])
                    outs.append(out.detach())
                    losses.append(loss.detach())
                    total = total + loss
            (total / (G * R) if self.reduction == poptorch.ReductionType.Mean else total).backward()
            self.sgd.step()
        return torch.cat(outs), torch.stack(losses)


@pytest.mark.parametrize("D,R,G", [(1, 1, 1), (4, 1, 1), (1, 2, 1), (1, 1, 3), (2, 2, 2), (3, 2, 2)])
@pytest.mark.parametrize("reduction", [poptorch.ReductionType.Mean, poptorch.ReductionType.Sum])
def test_training_matches_plain_torch(D, R, G, reduction):
    torch.manual_seed(0)
    model = Regressor()
    reference = PlainTorchPlan(copy.deepcopy(model), D, G, R, reduction, lr=0.05, momentum=0.9)
    b = 2
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G).accumulationAndReplicationReductionType(reduction)
    opts.outputMode(poptorch.OutputMode.All)
    pm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for _ in range(2):
        x = torch.randn(b * D * G * R, 3)
        y = torch.randn(b * D * G * R, 2)
        out, loss = pm(x, y)
        ref_out, ref_loss = reference(x, y)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(loss, ref_loss if D * G * R > 1 else ref_loss.reshape(()))
    # the user's module holds the trained weights
    torch.testing.assert_close(model.linear.weight, reference.model.linear.weight)
    torch.testing.assert_close(model.linear.bias, reference.model.linear.bias)


@pytest.mark.parametrize("mode", [poptorch.OutputMode.Final, poptorch.OutputMode.Sum,
                                  poptorch.OutputMode.EveryN])
def test_training_output_selection_with_replicas_and_accumulation(mode):
    D, R, G, b = 4, 2, 3, 1
    torch.manual_seed(0)
    model = Regressor()
    reference = PlainTorchPlan(copy.deepcopy(model), D, G, R, poptorch.ReductionType.Mean, lr=0.01, momentum=0)
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(mode, output_return_period=2)
    x, y = torch.randn(b * D * G * R, 3), torch.randn(b * D * G * R, 2)
    out, loss = poptorch.trainingModel(model, opts)(x, y)
    ref_out, ref_loss = reference(x, y)
    ref_out, ref_loss = ref_out.reshape(D, G, R, b, 2), ref_loss.reshape(D, G, R)
    if mode == poptorch.OutputMode.Final:  # last micro-batch of each replica
        torch.testing.assert_close(out, ref_out[-1, -1].reshape(R * b, 2))
        torch.testing.assert_close(loss, ref_loss[-1, -1])
    elif mode == poptorch.OutputMode.Sum:  # per replica, summed over D and G
        torch.testing.assert_close(out, ref_out.sum(dim=(0, 1)).reshape(R * b, 2))
        torch.testing.assert_close(loss, ref_loss.sum(dim=(0, 1)))
    else:  # every micro-batch of iterations 1 and 3
        torch.testing.assert_close(out, ref_out[[1, 3]].reshape(2 * G * R * b, 2))
        torch.testing.assert_close(loss, ref_loss[[1, 3]].reshape(-1))


@pytest.mark.parametrize("group_type,same", [(poptorch.CommGroupType.Consecutive, [(0, 1), (2, 3)]),
                                             (poptorch.CommGroupType.Orthogonal, [(0, 2), (1, 3)])])
def test_input_replica_grouping(group_type, same):
    R, b = 4, 3
    opts = poptorch.Options().replicationFactor(R).inputReplicaGrouping(2, group_type)
    model = torch.nn.Linear(5, 4)
    x = torch.randn(b * R // 2, 5)  # two input groups
    out = poptorch.inferenceModel(model, opts)(x).reshape(R, b, 4)  # one result per replica
    native = model(x).detach().reshape(2, b, 4)
    for group, replicas in enumerate(same):
        for r in replicas:
            torch.testing.assert_close(out[r], native[group])


# -- shapes, dtypes and structures ------------------------------------------------------------------------
class CheckOrder(torch.nn.Module):
    def forward(self, data, expected):
        return torch.sum(data - expected)


def test_scalar_output_multiplier():
    data = torch.arange(8.0).reshape(8, 1)
    assert poptorch.inferenceModel(CheckOrder())(data, data).shape == ()  # multiplier 1: still a scalar
    out = poptorch.inferenceModel(CheckOrder(), poptorch.Options().deviceIterations(4))(data, data + 1)
    assert out.shape == (4,)
    torch.testing.assert_close(out, torch.full((4,), -2.0))


def test_output_dtypes_and_structures():
    class Net(torch.nn.Module):
        def forward(self, x, y):
            return {"b": (x + y, [x.argmax(dim=1)]), "a": (x * y).double()}

    net = Net()
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = poptorch.inferenceModel(net, poptorch.Options().deviceIterations(2))(x, y)
    ref = net(x, y)
    assert list(out) == ["b", "a"]
    torch.testing.assert_close(out["b"][0], ref["b"][0])
    assert out["b"][1][0].dtype == torch.int32  # int64 comes back as int32, as from an IPU
    assert torch.equal(out["b"][1][0].long(), ref["b"][1][0])
    assert out["a"].dtype == torch.float32


def test_weights_are_shared_with_the_host_model():
    torch.manual_seed(1)
    model = Regressor()
    plain = copy.deepcopy(model)
    training = poptorch.trainingModel(model)  # no optimizer given: SGD(lr=0.01), as in PopTorch
    inference = poptorch.inferenceModel(model)
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    training(x, y)
    # one plain SGD(lr=0.01) step gives the weights now in the user's module
    plain(x, y)[1].backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 0.01 * p.grad
    torch.testing.assert_close(model.linear.weight, plain.linear.weight)
    torch.testing.assert_close(model.linear.bias, plain.linear.bias)
    # the inference model runs the trained weights
    torch.testing.assert_close(inference(x, y)[0], plain(x, y)[0].detach())


def test_optimizer_changes_need_set_optimizer():
    torch.manual_seed(3)
    model = Regressor()
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = poptorch.trainingModel(model, optimizer=sgd)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(2, 3), torch.randn(2, 2)

    def ref_step():
        ref_sgd.zero_grad()
        reference(x, y)[1].backward()
        ref_sgd.step()

    sgd.param_groups[0]["lr"] = 0.5  # not sent to the device: the step still uses lr=0.1
    pm(x, y)
    ref_step()
    torch.testing.assert_close(model.linear.weight, reference.linear.weight)
    assert sgd.param_groups[0]["lr"] == 0.5  # the host optimizer keeps what the user set
    pm.setOptimizer(sgd)
    pm(x, y)
    ref_sgd.param_groups[0]["lr"] = 0.5
    ref_step()
    torch.testing.assert_close(model.linear.weight, reference.linear.weight)


def test_is_running_on_ipu():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(poptorch.isRunningOnIpu())
            return x * 2

    poptorch.inferenceModel(Probe())(torch.ones(1))
    assert seen == [True] and not poptorch.isRunningOnIpu()


def test_identity_loss():
    x = torch.tensor([1.0, 2.0, 3.0])
    assert poptorch.identity_loss(x, reduction="sum") == 6.0
    assert poptorch.identity_loss(x, reduction="mean") == 2.0
    assert torch.equal(poptorch.identity_loss(x, reduction="none"), x)
    with pytest.raises(AssertionError, match="Unsupported reduction type!"):
        poptorch.identity_loss(x, reduction="max")
