"""Every bundled model trains under fp16 and bf16 autocast (on the CPU): finite loss and gradients.

Masks are filled with the dtype's own minimum: -1e9 does not fit in fp16, so ``masked_fill`` refuses it
under fp16 autocast. The batches hold a row with no candidates and a row with no memories (all masked).
"""

from __future__ import annotations

import pytest
import torch

from accelbatch.messages import Message
from accelbatch.names import resolve_agent_class
from accelbatch.opts import Opts
from accelbatch.teachers import create_teacher

TORCH_MODELS = ("memnn", "bag", "conv", "transformer/generator")
TASKS = {"memnn": "babi:1", "bag": "dialogues:20", "conv": "dialogues:20", "transformer/generator": "reverse:20"}


def model_batch(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model of ``-m name`` (seeded) and a batch of 6 examples of its task, the last one with its
    scores masked: no candidates (bag, conv: an evaluation example, left out of the loss), or a question
    without a story (no memory to attend to) and two candidates only (memnn)."""
    torch.manual_seed(0)
    opts = Opts(task=TASKS[name], model=name, embedding_size=16)
    agent = resolve_agent_class(name)(opts)
    teacher = create_teacher(opts)
    examples = [Message(m) for ep in teacher.episodes for m in ep][:6]
    last = examples[-1]
    if name == "memnn":
        label = last["labels"][0]
        other = next(c for c in last["label_candidates"] if c != label)
        examples[-1] = Message({**last, "text": last["text"].split("\n")[-1], "label_candidates": [other, label]})
    else:
        # an evaluation example (a training one without candidates is refused): its label index is -1
        examples[-1] = Message({**{k: v for k, v in last.items() if k != "labels"}, "eval_labels": last["labels"],
                                "label_candidates": []})
    observations = [agent.vectorize(m) for m in examples]
    return agent.model, agent.batchify(observations)


def test_every_bundled_agent_with_a_model_is_covered():
    from accelbatch.names import AGENT_PATHS

    with_model = {n for n in AGENT_PATHS if hasattr(resolve_agent_class(n), "build_model")}
    assert with_model == set(TORCH_MODELS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", TORCH_MODELS)
def test_forward_and_backward_under_autocast_are_finite(name, dtype):
    model, batch = model_batch(name)
    with torch.autocast("cpu", dtype=dtype):
        out = model(batch)
    if "scores" in out:  # (rankers) the masked scores really are in the low-precision dtype
        assert out["scores"].dtype == dtype
    loss = out["loss"].float()
    assert torch.isfinite(loss), f"{name} under {dtype}: loss {loss}"
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is None or bool(torch.isfinite(p.grad).all()), f"{name} {pname}: non-finite grad"
    # the same model in fp32 gives nearly the same loss (masking changes nothing but the fill value)
    with torch.no_grad():
        ref = model(batch)["loss"]
    assert loss.item() == pytest.approx(ref.item(), rel=0.05, abs=0.05)
