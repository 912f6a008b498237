"""What a ParlAI user porting an agent meets: act()/batch_act() contracts refused in one line naming the agent,
batch_act returning any iterable, ParlAI's world.get_total_epochs() and world.display(), and ParlAI's
train_step/eval_step on a TorchAgent refused (the engine runs the step)."""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingAgent, list_teacher

from accelbatch.agents import Agent, TorchAgent
from accelbatch.build import create_world
from accelbatch.messages import Message
from accelbatch.opts import Opts
from accelbatch.run import run
from accelbatch.world_display import EPISODE_END
from accelbatch.worlds import BatchWorld, DialogPartnerWorld

Teacher = list_teacher([2, 1, 3])  # 6 examples: e0-0 e0-1 | e1-0 | e2-0 e2-1 e2-2


class PerRowTeacher(Teacher):
    """Overrides act: the BatchWorld steps its rows clone by clone (not the whole-batch path)."""

    def act(self):
        return super().act()


def _world(agent_cls, rows, teacher_cls=Teacher, datatype="valid"):
    opts = Opts(batchsize=rows, datatype=datatype)
    world = DialogPartnerWorld(opts, [teacher_cls(opts), agent_cls(opts)])
    return BatchWorld(opts, world, rows) if rows > 1 else world


class NoneAct(Agent):
    def act(self):
        return None


class BatchOf(RecordingAgent):
    """batch_act answers each observation with its label; ``wrap`` shapes the returned collection."""

    @staticmethod
    def wrap(replies):
        return replies

    def batch_act(self, observations):
        labels = [(o.get("labels") or o.get("eval_labels") or ["?"])[0] if o else "?" for o in observations]
        return self.wrap(Message(id="rec", text=label) for label in labels)


class GeneratorBatch(BatchOf):
    pass


class ListBatch(BatchOf):
    wrap = staticmethod(list)


class TupleBatch(BatchOf):
    wrap = staticmethod(tuple)


class StrItems(BatchOf):
    wrap = staticmethod(lambda replies: [r["text"] for r in replies])


class NoneItem(BatchOf):
    wrap = staticmethod(lambda replies: [None, *list(replies)[1:]])


class ReturnsNothing(BatchOf):
    wrap = staticmethod(lambda replies: None)


class ReturnsOneDict(BatchOf):
    wrap = staticmethod(lambda replies: {"text": "x"})


@pytest.mark.parametrize("rows, teacher_cls", [(1, Teacher), (2, Teacher), (2, PerRowTeacher)])
def test_an_act_returning_none_is_refused_naming_the_agent_and_act(rows, teacher_cls):
    world = _world(NoneAct, rows, teacher_cls)
    with pytest.raises(TypeError, match=r"^NoneAct\.act\(\) returned None: it must return a Message \(a dict"):
        world.parley()


@pytest.mark.parametrize("teacher_cls", [Teacher, PerRowTeacher])
@pytest.mark.parametrize("agent_cls, got, row", [(StrItems, "str", 0), (NoneItem, "None", 0)])
def test_batch_act_items_that_are_not_dicts_are_refused_naming_batch_act(teacher_cls, agent_cls, got, row):
    world = _world(agent_cls, 2, teacher_cls)
    with pytest.raises(TypeError, match=rf"^{agent_cls.__name__}\.batch_act\(\) returned {got} for row {row}: "
                                        r"it must return a Message \(a dict"):
        world.parley()


@pytest.mark.parametrize("teacher_cls", [Teacher, PerRowTeacher])
@pytest.mark.parametrize("agent_cls", [GeneratorBatch, TupleBatch])
def test_batch_act_may_return_any_iterable_of_replies(teacher_cls, agent_cls):
    """Every one of the 6 examples answered with its own label: all counted, all right."""
    world = _world(agent_cls, 2, teacher_cls)
    while not world.epoch_done():
        world.parley()
    report = world.report()
    assert report["exs"] == 6 and report["accuracy"] == 1.0


@pytest.mark.parametrize("agent_cls, got", [(ReturnsNothing, "None"), (ReturnsOneDict, "dict")])
def test_batch_act_returning_no_collection_of_replies_is_refused_in_one_line(agent_cls, got):
    world = _world(agent_cls, 2)
    with pytest.raises(TypeError, match=rf"^{agent_cls.__name__}\.batch_act\(\) returned {got}: it must return a "
                                        r"list \(or iterable\) of replies"):
        world.parley()


@pytest.mark.parametrize("rows, parleys, exs", [(1, 5, 5), (2, 4, 8), (3, 5, 15)])
def test_get_total_epochs_is_examples_served_over_examples_per_epoch(rows, parleys, exs):
    """Training never pads: each parley serves ``rows`` examples of the 6 in an epoch (hand counts)."""
    world = _world(RecordingAgent, rows, datatype="train")
    assert world.get_total_epochs() == 0.0
    for _ in range(parleys):
        world.parley()
    assert world.get_total_exs() == exs
    assert world.get_total_epochs() == pytest.approx(exs / 6)


def test_get_total_epochs_agrees_with_the_train_reports_epochs():
    opts = Opts(task="babi:1", batchsize=4, max_train_steps=3, eval_splits="", progress=False)
    world = create_world(opts, agent=RecordingAgent)
    report = run(world, opts)
    assert report["train"]["exs"] == 12
    assert report["train"]["epochs"] == round(12 / world.num_examples(), 4) == round(world.get_total_epochs(), 4)


@pytest.mark.parametrize("rows, teacher_cls", [(1, Teacher), (2, Teacher), (2, PerRowTeacher)])
def test_display_shows_the_last_parleys_examples_and_replies(rows, teacher_cls):
    world = _world(RecordingAgent, rows, teacher_cls)
    assert world.display() == ""
    world.parley()
    name = teacher_cls.__name__  # the teacher's messages' id
    first = f"[{name}]: e0-0  (eval_labels: L0-0)\n[rec]: L0-0"  # as ParlAI names them
    second = f"[{name}]: e1-0  (eval_labels: L1-0)\n[rec]: L1-0"  # row 1 starts on the second episode, of one
    assert world.display() == (first if rows == 1 else f"{first}\n{second}\n{EPISODE_END}")  # turn: ParlAI's line
    world.parley()
    assert world.display().splitlines()[:2] == [f"[{name}]: e0-1  (eval_labels: L0-1)", "[rec]: L0-1"]


@pytest.mark.parametrize("method", ["train_step", "eval_step"])
def test_parlai_train_step_or_eval_step_on_a_torch_agent_is_refused_when_the_class_is_made(method):
    with pytest.raises(TypeError, match=rf"^Ported\.{method}: accelbatch's TorchAgent never calls ParlAI's "
                                        r"train_step/eval_step.*build_model\(\).*vectorize\(\), batchify\(\) and "
                                        r"replies\(\)"):
        type("Ported", (TorchAgent,), {method: lambda self, batch: None})
    mixin = type("ParlAIHabits", (), {method: lambda self, batch: None})
    with pytest.raises(TypeError, match=rf"^Mixed\.{method}:"):
        type("Mixed", (mixin, TorchAgent), {})


def test_a_torch_agent_without_parlai_steps_and_a_plain_agent_with_them_are_made():
    class Fine(TorchAgent):
        def build_model(self):
            return torch.nn.Linear(1, 1)

    class Plain(Agent):  # not a TorchAgent: its train_step is its own business
        def train_step(self, batch):
            return batch

    assert issubclass(Fine, TorchAgent) and Plain(Opts()).train_step(1) == 1


def test_the_batched_front_end_displays_its_rows_and_replies(write_jsonl):
    from helpers import LabelEchoTorchAgent

    from accelbatch.loader_world import LoaderWorld

    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(3)])
    opts = Opts(task=f"jsonl:{path}", datatype="valid", batchsize=2, dynamic_batching="batchsort", progress=False)
    world = create_world(opts, agent=LabelEchoTorchAgent)
    assert isinstance(world, LoaderWorld) and world.display() == ""
    world.parley()
    shown = world.display().splitlines()
    agent_id = world.get_model_agent().id
    assert shown == [f"[jsonl:{path}]: q0  (eval_labels: a0)", f"[{agent_id}]: a0", EPISODE_END,
                     f"[jsonl:{path}]: q1  (eval_labels: a1)", f"[{agent_id}]: a1", EPISODE_END]
    world.shutdown()


def test_without_labels_the_models_own_reply_joins_the_history_as_parlai_self_observe_does():
    """interactive (and any one-row act()) without labels: the next turn's history holds the model's reply,
    the turn the model trained on with --include-labels; with a label, the label does."""
    from helpers import LabelEchoTorchAgent

    class Numbered(LabelEchoTorchAgent):
        def replies(self, outputs, observations):
            return [{"text": f"R{len(self.seen) + i}"} for i in range(len(observations))]

        def vectorize(self, obs):
            self.seen.append(obs["full_text"])
            return obs

    from accelbatch.build import compile_agent, setup_runtime

    agent = Numbered(Opts())
    compile_agent(agent, setup_runtime(agent.opts))
    for text in ("hello", "how are you"):
        agent.observe(Message(text=text, episode_done=False))
        agent.act()
    agent.observe(Message(text="and then", labels=["fine"], episode_done=False))
    agent.act()
    agent.observe(Message(text="bye", episode_done=True))
    assert agent.seen == ["hello", "hello\nR1\nhow are you", "hello\nR1\nhow are you\nR2\nand then",
                          "hello\nR1\nhow are you\nR2\nand then\nfine\nbye"]


@pytest.mark.parametrize("agent", ["NoneAct", "ReturnsOneDict"])
def test_the_cli_refuses_a_reply_that_is_not_a_message_in_one_line(capsys, agent):
    """The user's agent broke act()'s contract: exit 2 and the one line naming it, no traceback."""
    from accelbatch.cli import main

    assert main(["eval", "-t", "test_parlai_porting:Teacher", "-m", f"test_parlai_porting:{agent}",
                 "-bs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accelbatch: error: {agent}.") and err.count("\n") == 1, err
