"""ParlAI code ported as its tutorials write it: a Teacher ending its epoch with ``self.epochDone``, a World of
yours counting with ``update_counters()``, an observe() that returns nothing, a FixedDialogTeacher's get()
without setup_data(), a TorchAgent with train_step: each runs as in ParlAI or is refused in one line (they
hung, trained for ever, or ended with a traceback of 40-53 lines)."""

from __future__ import annotations

import pytest
from helpers import RecordingAgent, list_teacher

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.messages import Message, ReplyError
from accelbatch.run import evaluate
from accelbatch.worlds import BatchWorld, DialogPartnerWorld, World

ME = __name__
DATA = [("a", "1"), ("b", "2"), ("c", "3")]


class EpochDoneTeacher(ab.Teacher):
    """ParlAI's way: act() sets self.epochDone with the last example; epoch_done() is the base class's."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.served = 0

    def num_examples(self):
        return len(DATA)

    def num_episodes(self):
        return len(DATA)

    def act(self):
        if self.served >= len(DATA):
            self.epochDone = True
            return Message(episode_done=True)
        text, label = DATA[self.served]
        self.served += 1
        self.epochDone = self.served == len(DATA)
        return Message(text=text, eval_labels=[label], episode_done=True)

    def reset(self):
        super().reset()
        self.served = 0


def test_a_teacher_setting_epochdone_ends_the_evaluation():
    opts = ab.Opts(datatype="valid", batchsize=1)
    world = DialogPartnerWorld(opts, [EpochDoneTeacher(opts), RecordingAgent(opts)])
    evaluate(world)
    assert world.epoch_done() and world.get_total_exs() == len(DATA)
    world.reset()
    assert not world.epoch_done()


class SimpleWorld(World):
    """The ParlAI docs' world: the teacher acts, the model observes and replies, the teacher observes."""

    counts = False

    def parley(self):
        teacher, model = self.agents
        self.acts[0] = teacher.act()
        model.observe(self.acts[0])
        self.acts[1] = model.act()
        teacher.observe(self.acts[1])
        if self.counts:
            self.update_counters()


class CountingWorld(SimpleWorld):
    counts = True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_cls", [SimpleWorld, CountingWorld], ids=["uncounted", "update_counters"])
def test_a_world_of_yours_counts_with_update_counters_or_is_refused(world_cls):
    opts = ab.Opts(datatype="train", batchsize=1, num_epochs=2, validation_every_n_epochs=-1, eval_splits="",
                   progress=False)
    teacher = list_teacher([2, 1, 3])(opts)
    world = world_cls(opts, [teacher, RecordingAgent(opts)])
    if world_cls is SimpleWorld:
        with pytest.raises(ReplyError, match=r"SimpleWorld.parley\(\): 10 parleys counted no example .* "
                                             r"self.update_counters\(\)"):
            ab.run(world, opts)
    else:
        assert ab.run(world, opts)["train"]["exs"] == 2 * 6


class StoresOnly(RecordingAgent):
    """ParlAI's older observe(): stores self.observation, returns nothing; batch_act reads what it is given."""

    def observe(self, obs):
        super().observe(obs)

    def batch_act(self, observations):
        return [Message(text=o.get("eval_labels", ["?"])[0]) for o in observations]


def test_an_observe_that_returns_nothing_is_named_before_batch_act_meets_none():
    opts = ab.Opts(datatype="valid", batchsize=2)
    world = BatchWorld(opts, DialogPartnerWorld(opts, [list_teacher([1, 1, 1, 1])(opts), StoresOnly(opts)]), 2)
    with pytest.raises(ReplyError, match=r"StoresOnly.observe\(\) returned None for row 0: return the observation"):
        world.parley()


class GetTeacher(ab.FixedTeacher):
    """A FixedDialogTeacher port: get(episode_idx, entry_idx), no setup_data()."""

    def get(self, episode_idx, entry_idx=0):
        return Message(text="x", labels=["y"], episode_done=True)


def test_teacher_contract_errors_are_one_line_on_the_command_line(capsys):
    assert main(["eval", "-t", f"{ME}:GetTeacher", "-m", "repeat_label", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GetTeacher must implement setup_data()" in err
    assert "ParlAI's FixedDialogTeacher get(episode_idx, entry_idx) is not read" in err


def test_a_torch_agent_with_train_step_named_by_m_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "portedagent.py").write_text(
        "import accelbatch as ab\n\n\nclass Ported(ab.TorchAgent):\n    def train_step(self, batch):\n"
        "        return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "-m", "portedagent:Ported", "-tstep", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Ported.train_step: accelbatch's TorchAgent never calls" in err
