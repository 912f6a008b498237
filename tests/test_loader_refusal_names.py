"""The loader front end's refusal of a turn without a label that more turns follow names the options without
which the run would not build histories ahead of the model: those that ask for the loader; a file's
``:stream`` only where it is one of them (an engine that stages batches keeps the clones for episodes held in
memory, not for a streamed file). Leaving out what the line names runs (checked here), and a validation
world's derived datatype (``valid:stream``) is never blamed as if the user had typed it."""

from __future__ import annotations

import pytest
import torch
from helpers import StagingEngine
from torch import nn

import accelbatch as ab
from accelbatch.build import build_world
from accelbatch.cli import main
from accelbatch.loader_world import LoaderWorld
from accelbatch.opts import OptionError
from accelbatch.worlds import BatchWorld

CANDIDATES = ["a0", "a1", "a2"]
REFUSED = "a turn without a label is followed by more turns of its episode"


def _labelled(n: int) -> list[dict]:
    return [{"text": f"q{i}", "labels": [f"a{i % 3}"], "label_candidates": CANDIDATES, "episode_done": True}
            for i in range(n)]


def _awaiting(n: int, key: str = "eval_labels") -> list[dict]:
    """Episodes of two turns, the first without a label: the second's history holds the model's reply."""
    rows: list[dict] = []
    for e in range(n):
        rows += [{"text": f"v{e}.0", "label_candidates": CANDIDATES, "episode_done": False},
                 {"text": f"v{e}.1", key: ["a1"], "label_candidates": CANDIDATES, "episode_done": True}]
    return rows


@pytest.fixture
def folder(tmp_path, write_jsonl):
    """train and test labelled; valid's episodes await the model's reply."""
    (tmp_path / "d").mkdir()
    for name, rows in (("train", _labelled(16)), ("valid", _awaiting(4)), ("test", _labelled(8))):
        write_jsonl(rows, f"d/{name}.jsonl")
    return str(tmp_path / "d")


def _train(folder: str, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", "-t", f"jsonl:{folder}", "-m", "bag", "-tstep", "2", "-bs", "2", "--no-progress",
                 "-veps", "-1", "-ltim", "-1", *extra])
    errors = [line for line in capsys.readouterr().err.splitlines() if REFUSED in line]
    return code, (errors[0] if errors else "")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, named", [
    # the validation world reads valid:stream, derived from -dt train:stream: in memory it is refused as well
    (["-dt", "train:stream"], "--dynamic-batching batchsort"),
    (["-dt", "train:stream", "-veps", "0.125"], "--dynamic-batching batchsort"),  # validating after step 1
    (["-dt", "train", "--eval-splits", "valid:stream"], "--dynamic-batching batchsort"),
    pytest.param(["-dt", "train:stream"], "--num-workers 1", marks=pytest.mark.multiprocess),
])
def test_a_validation_world_names_the_options_that_chose_the_loader(folder, capsys, extra, named):
    code, line = _train(folder, capsys, *extra, *named.split())
    assert code != 0
    assert f"; {named} builds histories ahead of the model and cannot: run without it, or with " in line, line
    assert " -dt " not in line and "valid:stream" not in line
    code, line = _train(folder, capsys, *extra)
    assert (code, line) == (0, "")  # without the option named, the same run validates: it was the cause


class Zero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        return {"loss": (self.w * batch["x"]).pow(2).mean(), "pred": batch["x"] * 0}


class Plain(ab.TorchAgent):
    """The base observe (the loader may build its batches); always replies "R"."""

    def build_model(self):
        return Zero()

    def vectorize(self, obs):
        return obs

    def batchify(self, observations):
        return {"x": torch.ones(len(observations))}

    def replies(self, outputs, observations):
        return [{"text": "R"} for _ in observations]


def _staged_world(opts: ab.Opts):
    agent = ab.create_world(opts.replace(datatype="valid", dynamic_batching="none"), agent=Plain).get_model_agent()
    agent.slot.engine = StagingEngine(agent.engine)
    return build_world(opts, agent)


def _refusal(opts: ab.Opts) -> str:
    """The refusal of a staged world for ``opts``: when it is built (episodes in memory) or as it parleys."""
    with pytest.raises(OptionError, match=REFUSED) as err:
        world = _staged_world(opts)
        assert isinstance(world, LoaderWorld)
        for _ in range(4):
            world.parley()
    return str(err.value)


@pytest.mark.parametrize("datatype, named", [
    ("train:stream", "; -dt train:stream, read through the loader front end (which --device cpu stages batches "
                     "through), builds histories ahead of the model and cannot: run without it, or with "),
    ("valid:stream", "; -dt ...:stream (this evaluation reads valid:stream), read through the loader front "
                     "end (which --device cpu stages batches through), builds histories"),
])
def test_a_staging_engine_on_a_streamed_file_names_the_stream(write_jsonl, datatype, named):
    """A staging engine keeps the clones for such episodes held in memory; a streamed file is not read ahead,
    so the loader refuses it batch by batch: the stream is what to leave out."""
    path = write_jsonl(_awaiting(4, "labels" if datatype.startswith("train") else "eval_labels"))
    opts = ab.Opts(task=f"jsonl:{path}", datatype=datatype, batchsize=2)
    line = _refusal(opts)
    assert named in line, line
    assert isinstance(_staged_world(opts.replace(datatype=datatype.replace(":stream", ""))), BatchWorld)


def test_an_evaluation_streamed_by_eval_splits_says_so(write_jsonl):
    path = write_jsonl(_awaiting(4))
    opts = ab.Opts(task=f"jsonl:{path}", datatype="valid:stream", batchsize=2, eval_splits="valid:stream")
    assert "; -dt or --eval-splits ...:stream (this evaluation reads valid:stream), read" in \
        _refusal(opts)


@pytest.mark.parametrize("datatype, named", [
    ("train:stream", "; --dynamic-batching batchsort -dt train:stream builds histories ahead of the model and "
                     "cannot: run without them, or "),
    ("train", "; --dynamic-batching batchsort builds histories ahead of the model and cannot: run without it, or "),
])
def test_a_staging_engine_with_the_loader_asked_for(write_jsonl, datatype, named):
    """With --dynamic-batching as well, leaving it out alone still streams through the staging engine's loader:
    both are named; in memory only the option (the staging engine alone keeps the clones)."""
    path = write_jsonl(_awaiting(4, "labels"))
    opts = ab.Opts(task=f"jsonl:{path}", datatype=datatype, batchsize=2, dynamic_batching="batchsort")
    line = _refusal(opts)
    assert named in line, line
