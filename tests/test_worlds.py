from __future__ import annotations

import pytest
import torch
from helpers import RecordingAgent, list_teacher
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.build import create_world
from accelbatch.messages import Message
from accelbatch.models.memnn import MemNNAgent
from accelbatch.opts import Opts
from accelbatch.run import evaluate
from accelbatch.worlds import BatchWorld, DialogPartnerWorld


def test_parley_follows_parlai_order():
    calls = []

    class Teacher(list_teacher([2])):
        def act(self):
            calls.append("teacher.act")
            return super().act()

        def observe(self, reply):
            calls.append("teacher.observe")
            return super().observe(reply)

    class Model(RecordingAgent):
        def observe(self, obs):
            calls.append("model.observe")
            return super().observe(obs)

        def act(self):
            calls.append("model.act")
            return super().act()

    opts = Opts(batchsize=1, datatype="valid")
    world = DialogPartnerWorld(opts, [Teacher(opts), Model(opts)])
    world.parley()
    assert calls == ["teacher.act", "model.observe", "model.act", "teacher.observe"]


def _eval(opts, teacher_cls, agent_cls):
    teacher = teacher_cls(opts)
    agent = agent_cls(opts)
    world = DialogPartnerWorld(opts, [teacher, agent])
    rows = opts.batchsize
    if rows > 1:
        world = BatchWorld(opts, world, rows)
    return evaluate(world), agent


@pytest.mark.slow
def test_batchworld_metrics_equal_batchsize_one_for_a_torch_model():
    torch.manual_seed(0)
    opts = Opts(task="babi:1", datatype="valid", batchsize=1)
    reference = create_world(opts)
    ref_report = evaluate(reference)
    model = reference.get_model_agent()
    for bs in (3, 7, 32):
        world = create_world(opts.replace(batchsize=bs), agent=model)
        report = evaluate(world)
        assert report["exs"] == ref_report["exs"] == 1000
        assert report["accuracy"] == ref_report["accuracy"]
        assert abs(report["loss"] - ref_report["loss"]) < 1e-4


def test_batchworld_without_batch_act_falls_back_to_each_clones_act():
    acted = []

    class NoBatch(RecordingAgent):
        def act(self):
            acted.append(id(self))
            return super().act()

    opts = Opts(datatype="valid", batchsize=4)
    report, agent = _eval(opts, list_teacher([1] * 10), NoBatch)
    assert report["exs"] == 10 and report["accuracy"] == 1.0
    assert len(set(acted)) == 4 and id(agent) not in acted  # clones acted, not the original


def test_use_batch_act_false_falls_back_too():
    class Opted(MemNNAgent):
        use_batch_act = False

    opts = Opts(task="babi:1", datatype="valid", batchsize=5)
    batched = evaluate(create_world(opts, agent=MemNNAgent))
    unbatched = evaluate(create_world(opts, agent=Opted))
    assert batched["exs"] == unbatched["exs"] == 1000
    assert batched["accuracy"] == unbatched["accuracy"]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=40), bs=st.integers(1, 9))
def test_exactly_once_evaluation(lengths, bs):
    opts = Opts(datatype="valid", batchsize=bs)
    report, agent = _eval(opts, list_teacher(lengths), RecordingAgent)
    expected = sorted(f"e{e}-{i}" for e, n in enumerate(lengths) for i in range(n))
    assert report["exs"] == sum(lengths)
    assert sorted(agent.seen) == expected  # every example once, none repeated


def test_training_order_is_shuffled_and_covers_every_episode_each_epoch():
    opts = Opts(datatype="train", batchsize=1, seed=3)
    teacher = list_teacher([1] * 20)(opts)
    first = [teacher.act()["text"] for _ in range(20)]
    second = [teacher.act()["text"] for _ in range(20)]
    assert sorted(first) == sorted(second) == sorted(f"e{e}-0" for e in range(20))
    assert first != sorted(first) and first != second


def test_clones_share_parameters_not_conversation_state():
    opts = Opts(task="babi:1")
    agent = MemNNAgent(opts)
    clone = agent.clone()
    for p, q in zip(agent.model.parameters(), clone.model.parameters()):
        assert p.data_ptr() == q.data_ptr()
    agent.observe(Message(text="Mary went to the garden.\nWhere is Mary?", labels=["garden"],
                          label_candidates=["garden"], episode_done=False))
    assert agent.history.turns and not clone.history.turns
    assert clone.observation is None


def test_history_carries_the_episode_and_resets_after_it():
    opts = Opts(task="babi:1")
    agent = MemNNAgent(opts)
    first = agent.observe(Message(text="a", labels=["x"], label_candidates=["x"], episode_done=False))
    second = agent.observe(Message(text="b", labels=["y"], label_candidates=["y"], episode_done=True))
    third = agent.observe(Message(text="c", labels=["z"], label_candidates=["z"], episode_done=True))
    assert first["full_text"] == "a" and second["full_text"] == "a\nx\nb" and third["full_text"] == "c"


def test_multiworld_evaluates_each_task_exactly_once(write_jsonl):
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(13)])
    opts = Opts(task=f"babi:1,jsonl:{path}", model="repeat_label", datatype="valid", batchsize=4)
    world = create_world(opts)
    assert isinstance(world, BatchWorld)
    report = evaluate(world)
    assert report["exs"] == 1000 + 13
    assert report["babi:1/exs"] == 1000 and report[f"jsonl:{path}/exs"] == 13
    assert report["accuracy"] == 1.0


def test_multiworld_training_draws_from_every_task(write_jsonl):
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(5)])
    opts = Opts(task=f"babi:1,jsonl:{path}", model="repeat_label", batchsize=1)
    world = create_world(opts)
    for _ in range(60):
        world.parley()
    rep = world.report()
    assert rep["babi:1/exs"] > 0 and rep[f"jsonl:{path}/exs"] > 0


def test_a_reply_count_that_does_not_match_the_rows_is_refused_naming_the_method():
    """One reply per row or none scored: a short list would leave rows unscored and the accuracy over an
    unstated subset. Both the agent's batch_act (world of clones) and a TorchAgent's replies()."""
    import pytest

    class ShortBatchAct(RecordingAgent):
        def batch_act(self, observations):
            return [Message(id="rec", text="x")]

    class ShortReplies(MemNNAgent):
        def replies(self, outputs, observations):
            return super().replies(outputs, observations)[:1]

    opts = Opts(task="babi:1", datatype="valid", batchsize=4)
    for agent, method in ((ShortBatchAct, "ShortBatchAct.batch_act"), (ShortReplies, "ShortReplies.replies")):
        world = create_world(opts, agent=agent)
        with pytest.raises(ValueError, match=rf"{method} returned 1 replies for 4 .*one reply"):
            world.parley()
        world.shutdown()


def test_create_world_takes_a_model_name_and_refuses_what_is_no_agent():
    import pytest

    opts = Opts(task="babi:1", datatype="valid", batchsize=8)
    world = create_world(opts, agent="repeat_label")
    report = evaluate(world)
    world.shutdown()
    assert report["exs"] == 1000 and report["accuracy"] == 1.0  # every example once, answered with its label
    with pytest.raises(TypeError, match="an Agent class or an agent instance, not int"):
        create_world(opts, agent=3)
