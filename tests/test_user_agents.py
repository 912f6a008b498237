"""Agents a ParlAI user writes: an agent that keeps its own Metrics (and shares them with its clones, as ParlAI
agents do) reports beside the teacher's counts and keeps its own metrics per world; a reply whose text is not a
str, a class not derived from Agent and ``evaluate(world, opts)`` are refused in one line before any work."""

from __future__ import annotations

import re

import pytest
from helpers import list_teacher

import accelbatch as ab
from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import PlanError
from accelbatch.run import evaluate, run
from accelbatch.worlds import DialogPartnerWorld, ReplyError

EXAMPLES = 6
Teacher = list_teacher([2, 1, 3])  # 6 examples, labels L{e}-{i}


class CountingAgent(ab.Agent):
    """Answers with the label and counts its replies in its own Metrics, shared with its clones."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.metrics = shared["metrics"] if shared else ab.Metrics()

    def share(self):
        return {**super().share(), "metrics": self.metrics}

    def act(self):
        self.metrics.add("replies", 1)
        labels = (self.observation or {}).get("labels") or (self.observation or {}).get("eval_labels")
        return {"id": "counter", "text": labels[0] if labels else ""}

    def report(self):
        return self.metrics.report()

    def reset_metrics(self):
        self.metrics.clear()


def _qa(write_jsonl) -> str:
    return "jsonl:" + write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(EXAMPLES)])


@pytest.mark.parametrize("rows", [1, 2])
def test_an_agents_own_metrics_add_to_the_teachers_counts(rows):
    opts = Opts(batchsize=rows, datatype="valid")
    world = DialogPartnerWorld(opts, [Teacher(opts), CountingAgent(opts)])
    if rows > 1:
        world = ab.BatchWorld(opts, world, rows)
    while not world.epoch_done():
        world.parley()
    report = world.report()
    assert report["exs"] == EXAMPLES and report["accuracy"] == 1.0
    # the agent's own count is its own: with 2 rows it also answered the padding of the row whose episodes
    # ended first (episodes of 2 and 3 turns in one row, 1 in the other: 5 steps, 10 acts)
    assert report["replies"] == (EXAMPLES if rows == 1 else 10)


def test_validation_keeps_the_training_agents_metrics(write_jsonl):
    """3 epochs of 6 examples, validated after each: the train row counts the 18 replies trained; each valid
    row its own 6 (the validation world's agent is a fork with its own metrics)."""
    opts = Opts(task=_qa(write_jsonl), batchsize=1, num_epochs=3, validation_every_n_epochs=1,
                eval_splits="valid", progress=False)
    report = run(create_world(opts, agent=CountingAgent), opts)
    assert report["train"]["exs"] == 3 * EXAMPLES and report["train"]["replies"] == 3 * EXAMPLES
    assert report["train"]["accuracy"] == 1.0
    assert report["valid"]["exs"] == EXAMPLES and report["valid"]["replies"] == EXAMPLES


class NumberReply(ab.Agent):
    def act(self):
        return {"text": 5}


class ListTexts(ab.Agent):
    def batch_act(self, observations):
        return [{"text": ["a"]} for _ in observations]


@pytest.mark.parametrize("agent_cls, rows, said", [
    (NumberReply, 1, "NumberReply.act() returned a reply whose 'text' is int 5: a reply's text is a str"),
    (ListTexts, 2, "ListTexts.batch_act() returned a reply for row 0 whose 'text' is list ['a']"),
])
def test_a_reply_text_that_is_not_a_str_is_refused_at_once(agent_cls, rows, said):
    opts = Opts(batchsize=rows, datatype="valid")
    world = DialogPartnerWorld(opts, [Teacher(opts), agent_cls(opts)])
    if rows > 1:
        world = ab.BatchWorld(opts, world, rows)
    with pytest.raises(ReplyError, match=re.escape(said)):
        world.parley()


class Duck:
    """A ParlAI-style agent not derived from Agent."""

    def __init__(self, opt, shared=None):
        self.opt = opt

    def observe(self, observation):
        self.observation = observation

    def act(self):
        return {"text": "quack"}


def test_a_class_not_derived_from_agent_is_refused_naming_it(write_jsonl):
    opts = Opts(task=_qa(write_jsonl), batchsize=2, datatype="valid")
    with pytest.raises(TypeError, match=r"create_world\(agent=Duck\): Duck is not an accelbatch Agent; derive"):
        create_world(opts, agent=Duck)
    with pytest.raises(OptionError, match=r"-m test_user_agents:Duck: Duck is not an accelbatch Agent; derive"):
        create_world(opts.replace(model="test_user_agents:Duck"))


class NoShared(ab.Agent):
    """An agent whose __init__ cannot take the clones' ``shared`` argument."""

    def __init__(self, opts):
        super().__init__(opts)

    def act(self):
        return {"text": "x"}


NO_SHARED = ("NoShared.__init__ takes no shared argument: accelbatch builds its clones (one per batch row, and "
             "validation's) as NoShared(opts, shared), as ParlAI does; declare __init__(self, opts, shared=None)")


def test_an_agent_whose_init_takes_no_shared_is_told_how_to_declare_it(write_jsonl, capsys):
    opts = Opts(task=_qa(write_jsonl), batchsize=2, datatype="valid")
    with pytest.raises(ReplyError, match=re.escape(NO_SHARED)):
        create_world(opts, NoShared(opts))
    assert main(["eval", "-t", _qa(write_jsonl), "-m", "test_user_agents:NoShared", "-bs", "2",
                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and NO_SHARED in err, err


class ForgetsSuper(ab.Agent):
    """An agent whose share() builds its own dict (or None) instead of adding to super().share()'s."""

    def act(self):
        return {"text": "x"}

    def share(self):
        return None if self.opts.agent_args.get("none") else {"opts": self.opts}


@pytest.mark.parametrize("args, got", [({}, "a dict without 'class'"), ({"none": True}, "NoneType")])
def test_an_agent_whose_share_lacks_the_class_is_told_to_start_from_super(write_jsonl, args, got):
    opts = Opts(task=_qa(write_jsonl), batchsize=2, datatype="valid", agent_args=args)
    with pytest.raises(ReplyError, match=re.escape(f"ForgetsSuper.share() returned {got}: it must return a dict "
                                                   "with the clone's 'class' and 'opts'; start from super().share()")):
        create_world(opts, ForgetsSuper(opts))


def test_opt_is_parlais_name_for_opts():
    opts = Opts(batchsize=3)

    class Ported(ab.Agent):
        def __init__(self, opt, shared=None):
            super().__init__(opt, shared)
            self.rows = self.opt["batchsize"]  # ParlAI's base agent keeps its options as self.opt

    class SetsItsOwn(ab.Agent):
        def __init__(self, opt, shared=None):
            super().__init__(opt, shared)
            self.opt = opt  # as some ParlAI agents do again

    assert Ported(opts).rows == 3 and Ported(opts).opt is opts
    assert SetsItsOwn(opts).opts is SetsItsOwn(opts).opt is opts


def test_evaluate_given_opts_for_its_log_is_refused_before_evaluating(write_jsonl):
    opts = Opts(task=_qa(write_jsonl), batchsize=2, datatype="valid", model="repeat_label")
    world = create_world(opts)
    with pytest.raises(TypeError, match="evaluate.world, log=....: log is a MetricsLog or None, not Opts"):
        evaluate(world, opts)
    assert world.get_total_exs() == 0
    assert evaluate(world)["exs"] == EXAMPLES


def _breaking_agent(breaks: str) -> type:
    """examples/custom_agent.py's agent with a model whose forward returns a number or a list where a tensor
    belongs: ``breaks`` is "loss" (loss.item()) or "scores" (scores.tolist())."""
    import runpy

    example = runpy.run_path("examples/custom_agent.py", run_name="example")

    class Breaking(example["BagOfWordsRanker"]):
        def forward(self, batch):
            out = super().forward(batch)
            out[breaks] = out[breaks].item() if breaks == "loss" else out[breaks].tolist()
            return out

    class Agent(example["MyAgent"]):
        def build_model(self):
            return Breaking(8)

    return Agent


@pytest.mark.parametrize("device", ["cpu", "ipu"])
@pytest.mark.parametrize("breaks, says", [
    ("loss", "the model's (-m) 'loss' is a float, not a tensor: return the loss tensor itself"),
    ("scores", "the model's forward(batch) returned 'scores' as a list: every output is a tensor with one row per "
               "row of the batch"),
])
def test_a_forward_returning_a_number_or_list_for_a_tensor_is_one_line_on_every_device(breaks, says, device):
    """The IPU's graph adapter and the engine loop check a model's outputs alike (an AttributeError deep in
    either before)."""
    opts = Opts(task="babi:1", batchsize=4, max_train_steps=2, device=device, ipu_emulator=device == "ipu",
                validation_every_n_epochs=-1, eval_splits="", progress=False)
    with pytest.raises(PlanError, match=re.escape(says)):
        run(create_world(opts, agent=_breaking_agent(breaks)), opts)
