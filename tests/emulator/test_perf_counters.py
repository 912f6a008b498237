"""getPerfCounters / getLatency: PopTorch's structure (one list per tensor, one stamp per transfer)."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.poptorch_emulator.perf_counters import latency


class MatMul(torch.nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, data, target):
        out = self.linear(data)
        return out, torch.nn.functional.mse_loss(out, target)


def _sizes(perf):
    return {key: [len(steps) for steps in perf[key]] for key in perf}


def test_not_compiled_gives_one_empty_list_per_key():
    model = poptorch.inferenceModel(MatMul())
    assert model.getPerfCounters() == {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
    assert model.getLatency() == (0.0, 0.0, 0.0)


def test_inference_one_stamp_per_input_per_iteration():
    model = poptorch.inferenceModel(MatMul(), poptorch.Options().deviceIterations(5))
    model(torch.randn(5, 4, 4), torch.randn(5, 4, 4))
    perf = model.getPerfCounters()
    # 2 inputs and 1 output, 5 iterations, output mode All for inference
    assert _sizes(perf) == {"input": [5, 5], "input_complete": [5, 5], "output": [5], "output_complete": [5]}
    for i in range(2):
        for step in range(5):
            assert perf["input"][i][step] <= perf["input_complete"][i][step] <= perf["output"][0][step]
    for step in range(4):
        assert perf["output_complete"][0][step] <= perf["input"][0][step + 1]
    low, high, mean = model.getLatency()
    assert 0 < low <= mean <= high


@pytest.mark.parametrize("mode, period, returned", [
    (poptorch.OutputMode.All, 1, 16),      # D*G*R = 4*2*2
    (poptorch.OutputMode.EveryN, 2, 8),    # D/N*G*R = 2*2*2
    (poptorch.OutputMode.Final, 1, 2),     # R
    (poptorch.OutputMode.Sum, 1, 2),       # R
])
def test_training_outputs_stamped_as_the_output_mode_returns_them(mode, period, returned):
    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    opts.outputMode(mode, period)
    model = poptorch.trainingModel(Regression(), opts)
    model(torch.randn(16, 3), torch.randn(16, 3))
    perf = model.getPerfCounters()
    assert _sizes(perf) == {"input": [16, 16], "input_complete": [16, 16],
                            "output": [returned, returned], "output_complete": [returned, returned]}
    for name in ("getHostIpuLatency", "getComputeLatency", "getIpuHostLatency", "getLatency"):
        low, high, mean = getattr(model, name)()
        assert low <= mean <= high, name


def test_synthetic_data_transfers_nothing():
    opts = poptorch.Options().deviceIterations(4)
    opts.enableSyntheticData(True)
    model = poptorch.inferenceModel(MatMul(), opts)
    model(torch.randn(4, 2, 2), torch.randn(4, 2, 2))
    assert _sizes(model.getPerfCounters()) == {"input": [0, 0], "input_complete": [0, 0], "output": [0],
                                               "output_complete": [0]}
    assert model.getLatency() == (0.0, 0.0, 0.0)


def test_latency_groups_inputs_behind_each_returned_output():
    # 2 inputs, 4 transfers each; 2 returned outputs, so each output covers 2 consecutive input transfers
    counters = {"input": [[0.0, 1.0, 4.0, 5.0], [0.5, 1.5, 4.5, 5.5]],
                "input_complete": [[0.2, 1.2, 4.2, 5.2], [0.7, 1.7, 4.7, 5.7]],
                "output": [[3.0, 8.0]], "output_complete": [[3.5, 9.0]]}
    # round trip: output 0 from min(0.0, 0.5, 1.0, 1.5) = 0.0 to 3.5; output 1 from 4.0 to 9.0
    assert latency(counters, "input", min, "output_complete", max) == (3.5, 5.0, 4.25)
    # compute: from the latest input_complete of each transfer (0.7, 1.7 | 4.7, 5.7), earliest of the group
    assert latency(counters, "input_complete", max, "output", max) == pytest.approx((2.3, 3.3, 2.8))
