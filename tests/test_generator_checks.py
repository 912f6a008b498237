"""What a generator refuses or tells in one line, and what it accepts: empty training labels, a core's state
(None leaves pass; tensors need their rows in dim 0), metric names a run without generation cannot report,
a chosen -vmt no validation checked; and --compile leaves the decoding loop eager."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from accelbatch.cli import main
from accelbatch.generation import PAD, ByteVocab, CoreError, GeneratorModel
from accelbatch.models.generator import TransformerGeneratorAgent

VOCAB = ByteVocab()


def _text(*texts: str) -> torch.Tensor:
    rows = [VOCAB.encode(t) for t in texts]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


class EchoCore(nn.Module):
    """Hand-set: decoder position t predicts the input's token t (EOS past its end), read from
    ``state["text"]``; the state also holds a None (a mask a core leaves out)."""

    def encode(self, text):
        return {"mask": None, "text": text}

    def decode(self, state, prefix):
        text = state["text"]
        rows, steps = prefix.shape
        wanted = torch.full((rows, steps), 2, dtype=torch.long)  # EOS
        n = min(steps, text.shape[1])
        wanted[:, :n] = torch.where(text[:, :n] == PAD, 2, text[:, :n])
        return nn.functional.one_hot(wanted, VOCAB.size).float() * 5.0


class TimeMajorCore(EchoCore):
    """Its state is [S, rows] (an RNN's time-major layout): decodes, but beam search cannot repeat its rows."""

    def encode(self, text):
        return text.t()

    def decode(self, state, prefix):
        return super().decode({"text": state.t()}, prefix)


@pytest.mark.parametrize("inference, beam", [("greedy", 1), ("beam", 3)])
def test_a_state_with_a_none_leaf_decodes_as_without_it(inference, beam):
    text = _text("abc", "hello")
    model = GeneratorModel(EchoCore(), max_len=8, inference=inference, beam_size=beam).eval()
    preds = [VOCAB.decode(row) for row in model({"text_vec": text})["preds"].tolist()]
    assert preds == ["abc", "hello"]


def test_a_state_tensor_without_the_rows_in_dim_0_is_refused_in_one_line():
    model = GeneratorModel(TimeMajorCore(), max_len=8, source="MyAgent.build_core()").eval()
    with pytest.raises(CoreError) as raised:
        model({"text_vec": _text("ab", "cdefg")})
    text = str(raised.value)
    assert text.startswith("MyAgent.build_core(): its encode(text_vec [2, 5]) returned a state holding a tensor "
                           "of shape [5, 2]") and "\n" not in text


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("bs", ["1", "2"])
def test_a_training_example_with_empty_labels_is_refused_naming_the_task_and_text(tmp_path, capsys, bs):
    data = _write(tmp_path / "d.jsonl", [{"text": "hi there", "labels": ["hello"], "episode_done": True},
                                         {"text": "foo", "labels": [], "episode_done": True},
                                         {"text": "bar", "labels": ["ok"], "episode_done": True}])
    code = main(["train", "-m", "transformer/generator", "-t", f"jsonl:{data}", "-bs", bs, "-tstep", "4",
                 "--no-progress", "--eval-splits", "", "-veps", "-1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"-t jsonl:{data}: a training example's labels are empty (text 'foo')" in err


def test_text_metrics_with_skip_generation_are_refused_before_the_first_step(tmp_path, capsys):
    path = tmp_path / "m.pt"
    code = main(["train", "-m", "transformer/generator", "-t", "reverse:50", "-tstep", "2", "--skip-generation",
                 "--metrics", "accuracy,loss", "-vmt", "loss", "-mf", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and not path.exists()
    assert "--metrics: no report of this run has accuracy (with --skip-generation no text is generated" in err


class MyGenerator(TransformerGeneratorAgent):
    """A user's generator: its -vmt is checked where it validates."""


def test_a_chosen_vmt_that_no_validation_checked_is_told_after_the_run(tmp_path, capsys):
    args = ["train", "-m", f"{__name__}:MyGenerator", "-t", "reverse:50", "-tstep", "2", "--no-progress",
            "--eval-splits", "valid", "-veps", "-1", "-mf", str(tmp_path / "m.pt")]
    assert main([*args, "-vmt", "nosuch"]) == 0
    err = capsys.readouterr().err
    assert "-vmt/--validation-metric nosuch: the final valid report has no such metric (it has " in err
    assert "no validation ran during training" in err
    assert main([*args, "-vmt", "ppl"]) == 0
    assert "--validation-metric" not in capsys.readouterr().err


def _compiled_graph_sizes(skip_generation: bool) -> list[int]:
    """The node counts of the graphs torch.compile captures for one eval forward with labels."""
    sizes = []

    def record(graph, _inputs):
        sizes.append(len(graph.graph.nodes))
        return graph.forward

    torch._dynamo.reset()
    model = GeneratorModel(EchoCore(), max_len=6, skip_generation=skip_generation).eval()
    text = _text("abc", "de")
    out = torch.compile(model, backend=record)({"text_vec": text, "label_vec": text})
    torch._dynamo.reset()
    if not skip_generation:
        assert torch.equal(out["preds"], model({"text_vec": text})["preds"])
    return sizes


def test_compile_leaves_the_decoding_loop_eager():
    """torch.compile sees encode and the token loss, not max_len decoding steps (each a new prefix shape): the
    graphs of a generating model are those of the same model without generation (traced, decoding added 144
    nodes at max_len 6)."""
    assert _compiled_graph_sizes(False) == _compiled_graph_sizes(True)
