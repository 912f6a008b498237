"""ParlAI code ported as its tutorials write it: a Teacher ending its epoch with ``self.epochDone``, a World of
yours counting with ``update_counters()``, an observe() that returns nothing, a FixedDialogTeacher's get()
without setup_data(), a TorchAgent with train_step: each runs as in ParlAI or is refused in one line (they
hung, trained for ever without a word, or ended with a traceback of 40-53 lines)."""

from __future__ import annotations

import random

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
def test_a_world_of_yours_counts_with_update_counters_or_is_told_to(world_cls, capsys):
    """Uncounted, it would never reach -ne (it ran for ever without a word): said once, at parley 1000."""
    opts = ab.Opts(datatype="train", batchsize=1, num_epochs=2, validation_every_n_epochs=-1, eval_splits="",
                   progress=False, max_train_steps=1001 if world_cls is SimpleWorld else -1)
    world = world_cls(opts, [list_teacher([2, 1, 3])(opts), RecordingAgent(opts)])
    report = ab.run(world, opts)["train"]
    err = capsys.readouterr().err
    if world_cls is SimpleWorld:
        assert "SimpleWorld.parley(): 1000 parleys counted no example" in err and "self.update_counters()" in err
    else:
        assert report["exs"] == 2 * 6 and "update_counters" not in err


class Wrapper(World):
    """A world of yours around a BatchWorld: its acts are the batch's, counted by update_counters()."""

    def __init__(self, opts, inner):
        super().__init__(opts, inner.get_agents())
        self.inner = inner

    def parley(self):
        self.inner.parley()
        self.acts = self.inner.get_acts()
        self.update_counters()


def test_update_counters_counts_a_wrapped_batch_worlds_examples():
    opts = ab.Opts(datatype="train", batchsize=4)
    inner = BatchWorld(opts, DialogPartnerWorld(opts, [list_teacher([1] * 8)(opts), RecordingAgent(opts)]), 4)
    world = Wrapper(opts, inner)
    world.parley()
    world.parley()
    assert (world.get_total_exs(), world.get_total_parleys()) == (8, 2)


class StoresOnly(RecordingAgent):
    """ParlAI's older observe(): stores self.observation, returns nothing; batch_act reads what it is given."""

    def observe(self, obs):
        super().observe(obs)

    def batch_act(self, observations):
        return [Message(text=o.get("eval_labels", ["?"])[0]) for o in observations]


class ActsAlone(StoresOnly):
    use_batch_act = False  # each clone acts on its stored observation: observe()'s return is not used


def test_an_observe_that_returns_nothing_is_named_before_batch_act_meets_none():
    opts = ab.Opts(datatype="valid", batchsize=2)
    world = BatchWorld(opts, DialogPartnerWorld(opts, [list_teacher([1, 1, 1, 1])(opts), StoresOnly(opts)]), 2)
    with pytest.raises(ReplyError, match=r"StoresOnly.observe\(\) returned None for row 0: return the observation"):
        world.parley()
    world = BatchWorld(opts, DialogPartnerWorld(opts, [list_teacher([1, 1, 1, 1])(opts), ActsAlone(opts)]), 2)
    assert evaluate(world)["exs"] == 4


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


@pytest.mark.timeout(60)
def test_training_on_a_teacher_whose_data_ran_out_is_one_line(capsys):
    """EpochDoneTeacher serves nothing once its epoch is done: -ne 2 was never reached (it hung without a word)."""
    args = ["train", "-t", f"{ME}:EpochDoneTeacher", "-m", "repeat_label", "-bs", "1", "-veps", "-1", "--no-progress"]
    assert main([*args, "-ne", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "EpochDoneTeacher: its epoch ended (epoch_done()) and the 1000 training " \
        "parleys since served no example" in err
    assert main([*args, "-ne", "1", "-veps", "1"]) == 2  # one epoch trained, then validated
    err = capsys.readouterr().err
    assert "the valid report has no such metric; it is empty: a teacher of yours reports" in err


class WritesObservation(RecordingAgent):
    def observe(self, observation):
        observation["seen"] = True  # the teacher's shared message: refused
        return super().observe(observation)


class ChangesCandidates(RecordingAgent):
    def observe(self, observation):
        observation["label_candidates"].append("z")
        return super().observe(observation)


@pytest.mark.parametrize("agent", ["WritesObservation", "ChangesCandidates"])
def test_changing_a_served_observation_is_one_line_naming_the_line(agent, capsys):
    assert main(["eval", "-t", "babi:1", "-m", f"{ME}:{agent}", "-bs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = next(n for n, text in enumerate(open(__file__), 1) if f"class {agent}(" in text) + 2
    assert err.count("\n") == 1 and f"observe() at test_parlai_ports.py:{line}: this " in err
    assert "read-only" in err and "copy" in err


class RepliesWithMetrics(RecordingAgent):
    """ParlAI's local metrics: a 'metrics' dict in each reply, which ParlAI's teacher averages."""

    def act(self):
        return Message(super().act(), metrics={"my_metric": 0.5})


@pytest.mark.parametrize("agent", [RepliesWithMetrics, RecordingAgent])
def test_replies_carrying_parlai_local_metrics_are_told_once_in_a_process(agent, capsys):
    """They were dropped without a word: the report has no my_metric. Once in a process, not once per split,
    task, replica or hogwild process's Metrics (a reviewer counted 4 to 8 in one run)."""
    from accelbatch.metrics import _tell_reply_metrics

    _tell_reply_metrics.cache_clear()  # what this process has said so far
    opts = ab.Opts(datatype="valid", batchsize=2)
    for _ in range(2):  # two worlds (a run's valid and test): two teachers' Metrics
        world = BatchWorld(opts, DialogPartnerWorld(opts, [list_teacher([1, 2, 1])(opts), agent(opts)]), 2)
        report = evaluate(world)
        assert report["exs"] == 4 and "my_metric" not in report
    told = capsys.readouterr().err.count("the model's replies carry 'metrics' (my_metric)")
    assert told == (1 if agent is RepliesWithMetrics else 0)


class PortedWorld(CountingWorld):
    """ParlAI's world signature, World(opt, agents=None, shared=None), passed on to the base class."""

    def __init__(self, opt, agents=None, shared=None):
        super().__init__(opt, agents, shared)


def test_a_world_takes_parlais_signature_and_is_copied_from_its_share():
    """super().__init__(opt, agents, shared) was a TypeError (4 positional arguments)."""
    opts = ab.Opts(datatype="valid", batchsize=1)
    world = PortedWorld(opts, [list_teacher([2, 1])(opts), RecordingAgent(opts)])
    shared = world.share()
    copy = shared["world_class"](opts, None, shared)
    assert type(copy) is PortedWorld and [type(a) for a in copy.agents] == [type(a) for a in world.agents]
    assert copy.agents[1] is not world.agents[1]  # a clone: its own conversation state
    assert evaluate(copy)["exs"] == evaluate(world)["exs"] == 3


class CyclingTeacher(EpochDoneTeacher):
    """ParlAI's way in training: it loops, setting epochDone on each pass's last example only."""

    def act(self):
        text, label = DATA[self.served % len(DATA)]
        self.served += 1
        self.epochDone = self.served % len(DATA) == 0
        return Message(text=text, labels=[label], episode_done=True)


@pytest.mark.timeout(60)
def test_a_world_that_counts_nothing_is_told_not_refused_when_its_teacher_ends_a_pass(capsys):
    """A reviewer's find: the spent-data refusal fired at the first parley after a pass's last example, for a
    world that counts nothing (run() tells it to call update_counters()), naming a teacher still serving."""
    opts = ab.Opts(datatype="train", batchsize=1, num_epochs=2, validation_every_n_epochs=-1, eval_splits="",
                   progress=False, max_train_steps=1500)
    report = ab.run(SimpleWorld(opts, [CyclingTeacher(opts), RecordingAgent(opts)]), opts)
    assert report["train"]["steps"] == 1500
    assert "SimpleWorld.parley(): 1000 parleys counted no example" in capsys.readouterr().err


class ShufflesCandidates(RecordingAgent):
    def observe(self, observation):
        random.shuffle(observation["label_candidates"])  # the standard library changes the served list
        return super().observe(observation)


def test_a_served_list_changed_by_the_standard_library_names_the_users_line(capsys):
    """A reviewer's find: the error named shuffle() at random.py, the frame that changed the list."""
    assert main(["eval", "-t", "babi:1", "-m", f"{ME}:ShufflesCandidates", "-bs", "2", "--no-progress"]) == 2
    line = next(n for n, text in enumerate(open(__file__), 1) if "random.shuffle(observation[" in text)
    assert f"observe() at test_parlai_ports.py:{line}: this list belongs to a shared" in capsys.readouterr().err
