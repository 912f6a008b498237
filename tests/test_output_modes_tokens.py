"""A generator's train report under --output-mode sum equals --output-mode all's: Sum returns each output summed
over the micro-batches, and the token sums (nll, tokens, correct) still give the token-weighted loss exactly."""

from __future__ import annotations

import math

import pytest
import torch

import accelbatch as ab

KEYS = ("loss", "ppl", "token_acc", "tokens", "ltpb", "exs")


def _train(mode: str, device: str) -> tuple[dict, dict[str, torch.Tensor]]:
    opts = ab.Opts(task="reverse:300", model="transformer/generator", embedding_size=16, seed=3, max_train_steps=6,
                   optimizer="sgd", learning_rate=0.5, batchsize=2, device_iterations=2, gradient_accumulation=2,
                   output_mode=mode, eval_splits="", validation_every_n_epochs=-1, progress=False,
                   log_every_n_secs=1000, device=device, ipu_emulator=device == "ipu")
    world = ab.create_world(opts)
    report = ab.run(world, opts)["train"]
    return report, {k: v.clone() for k, v in world.get_model_agent().model.state_dict().items()}


@pytest.mark.parametrize("device", ["cpu", "ipu"])
def test_sum_reports_the_token_metrics_all_reports(device):
    every, w_all = _train("all", device)
    summed, w_sum = _train("sum", device)
    for key in w_all:
        assert torch.equal(w_all[key], w_sum[key]), key  # the output mode changes no update
    assert every["exs"] == 6 * 8
    assert every["loss"] == pytest.approx(math.log(every["ppl"]), rel=1e-9)  # token-weighted: ppl = exp(loss)
    for key in KEYS:
        assert key in summed, key
        assert summed[key] == pytest.approx(every[key], rel=1e-6), key
