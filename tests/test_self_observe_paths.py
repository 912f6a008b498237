"""The model's own reply in its history at every batch size (ParlAI's self_observe), the loader front end
refusing what it cannot squash, world.reset() restarting the counts, and a model file whose agent class
PATH.opt cannot name."""

from __future__ import annotations

import pytest
import torch
from helpers import StagingEngine
from torch import nn

import accelbatch as ab
from accelbatch.agents import ModelFileError
from accelbatch.loader_world import LoaderWorld
from accelbatch.model_opts import agent_name, read_model_opts, write_model_opts
from accelbatch.opts import OptionError
from accelbatch.worlds import BatchWorld, DialogPartnerWorld

# two episodes of three turns, some without a label (a conversation: the model's reply is the answer)
EPISODES = [[("q0.0", None), ("q0.1", "a0.1"), ("q0.2", None)],
             [("q1.0", "a1.0"), ("q1.1", None), ("q1.2", None)]]
# the history each turn is seen with, by hand: an earlier turn's label, else the model's reply "R"
SEEN = ["q0.0", "q0.0|R|q0.1", "q0.0|R|q0.1|a0.1|q0.2",
        "q1.0", "q1.0|a1.0|q1.1", "q1.0|a1.0|q1.1|R|q1.2"]


class Zero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        x = batch["x"]
        return {"loss": (self.w * x).pow(2).mean(), "pred": x * 0}


class Recorder(ab.TorchAgent):
    """Records the history (``full_text``) of every example it vectorizes; always replies "R"."""

    seen: list[str] = []

    def build_model(self):
        return Zero()

    def vectorize(self, obs):
        Recorder.seen.append(obs["full_text"].replace("\n", "|"))
        return obs

    def batchify(self, observations):
        return {"x": torch.ones(len(observations))}

    def replies(self, outputs, observations):
        return [{"text": "R"} for _ in observations]


@pytest.fixture
def episodes_file(write_jsonl):
    rows = []
    for episode in EPISODES:
        for t, (text, label) in enumerate(episode):
            rows.append({"text": text, **({"labels": [label]} if label else {}),
                         "episode_done": t == len(episode) - 1})
    return write_jsonl(rows)


def histories_seen(opts: ab.Opts) -> tuple[type, list[str]]:
    Recorder.seen = []
    world = ab.create_world(opts, agent=Recorder)
    while not world.epoch_done():
        world.parley()
    return type(world), sorted(Recorder.seen)


@pytest.mark.parametrize("bs, display, kind", [(1, False, DialogPartnerWorld), (2, False, BatchWorld),
                                               (2, True, BatchWorld)])
def test_model_reply_joins_history_at_every_batch_size(episodes_file, bs, display, kind, capsys):
    opts = ab.Opts(task=f"jsonl:{episodes_file}", datatype="valid", batchsize=bs, display_examples=display)
    assert histories_seen(opts) == (kind, SEEN)


def test_loader_front_end_refuses_unlabelled_turns_it_cannot_squash(episodes_file):
    opts = ab.Opts(task=f"jsonl:{episodes_file}", datatype="valid", batchsize=2, dynamic_batching="batchsort")
    with pytest.raises(OptionError, match="--dynamic-batching batchsort builds histories ahead of the model and "
                                          "cannot: run without it") as err:
        histories_seen(opts)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change", [{"context_length": 1}, {"include_labels": False}])
def test_loader_front_end_serves_them_when_no_reply_is_kept(episodes_file, change):
    """With one utterance of context, or no answers in it, no reply is part of any history: nothing to refuse,
    and the loader's texts are the agent's own."""
    opts = ab.Opts(task=f"jsonl:{episodes_file}", datatype="valid", batchsize=2, **change)
    base = histories_seen(opts)
    loader = histories_seen(opts.replace(dynamic_batching="batchsort"))
    assert (base[0], loader[0]) == (BatchWorld, LoaderWorld)
    assert loader[1] == base[1]
    if change.get("context_length") == 1:
        assert loader[1] == sorted(text for ep in EPISODES for text, _ in ep)


def test_loader_front_end_serves_labelled_episodes(write_jsonl):
    path = write_jsonl([{"text": f"q{t}", "labels": [f"a{t}"], "episode_done": t == 2} for t in range(3)])
    opts = ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=1, dynamic_batching="batchsort")
    assert histories_seen(opts) == (LoaderWorld, ["q0", "q0|a0|q1", "q0|a0|q1|a1|q2"])


def passes_after_reset(opts: ab.Opts, agent=None) -> list[tuple[int, float]]:
    world = ab.create_world(opts, agent=agent)
    counts = []
    for _ in range(2):
        world.reset()
        while not world.epoch_done():
            world.parley()
        counts.append((world.get_total_exs(), world.get_total_epochs()))
    return counts


@pytest.mark.parametrize("bs, dynamic", [(1, "none"), (3, "none"), (3, "batchsort")])
def test_world_reset_restarts_its_counts(write_jsonl, bs, dynamic):
    """ParlAI's World.reset: 13 examples parleyed after each reset, one epoch (not 26 and 2.0)."""
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(13)])
    opts = ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=bs, dynamic_batching=dynamic)
    assert passes_after_reset(opts, Recorder) == [(13, 1.0), (13, 1.0)]


def test_world_reset_restarts_the_report(write_jsonl):
    """The report after the second pass counts that pass's 13 examples (the teacher's metrics reset too)."""
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(13)])
    world = ab.create_world(ab.Opts(task=f"jsonl:{path}", model="repeat_label", datatype="valid", batchsize=3))
    for _ in range(2):
        world.reset()
        while not world.epoch_done():
            world.parley()
    assert world.report()["exs"] == 13


def test_unrecordable_agent_class_is_said_once(tmp_path, capsys):
    path = str(tmp_path / "m.pt")
    opts = ab.Opts(model_file=path)
    main_class = type("MainAgent", (Recorder,), {"__module__": "__main__"})
    assert agent_name(main_class.__new__(main_class), opts) is None
    for _ in range(3):  # a run's saves: the first one says it
        write_model_opts(path, opts, None)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot be recorded" in lines[0] and "-m module:Class" in lines[0]
    assert "model" not in read_model_opts(path)


def test_loading_a_file_whose_opt_names_no_model_says_so(tmp_path):
    path = str(tmp_path / "m.pt")
    Recorder(ab.Opts()).save(path)
    write_model_opts(path, ab.Opts(), None)
    with pytest.raises(ModelFileError, match=r"\.opt names no model .* give -m module:Class"):
        ab.create_world(ab.Opts(task="babi:1", model_file=path, datatype="valid"))
    write_model_opts(path, ab.Opts(), "tests.test_self_observe_paths:Recorder")  # named: the weights' error
    with pytest.raises(ModelFileError, match="its weights are not a MemNNAgent's"):
        ab.create_world(ab.Opts(task="babi:1", model="memnn", model_file=path, datatype="valid"))


@pytest.mark.parametrize("change, named", [
    ({"num_workers": 2}, "--num-workers 2 builds histories ahead of the model and cannot: run without it,"),
    ({"dataloader_mode": "async", "datatype": "valid:stream"},
     "--dataloader-mode async builds histories ahead of the model and cannot: run without it,"),
    ({"device": "cuda"}, "the loader front end (which --device cuda stages batches through) builds histories ahead "
                         "of the model and cannot: run with --context-length 1")])
def test_refusal_names_the_option_that_chose_the_loader(change, named):
    from accelbatch.loader_world import _replies_unknown

    assert named in _replies_unknown(ab.Opts(task="t", **change))


@pytest.mark.parametrize("labelled, kind", [(False, BatchWorld), (True, LoaderWorld)])
def test_a_staging_engine_keeps_clones_for_episodes_whose_histories_hold_replies(episodes_file, write_jsonl,
                                                                               labelled, kind):
    """The loader front end a staging engine gets by itself would refuse unlabelled turns: such data keeps the
    clones (nothing asked for the loader); labelled data still gets the loader."""
    from accelbatch.build import build_world

    path = write_jsonl([{"text": f"q{t}", "labels": [f"a{t}"], "episode_done": t == 2} for t in range(3)]) \
        if labelled else episodes_file
    opts = ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=2)
    agent = ab.create_world(opts, agent=Recorder).get_model_agent()
    agent.slot.engine = StagingEngine(agent.engine)
    assert type(build_world(opts, agent)) is kind
