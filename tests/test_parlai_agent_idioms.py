"""Idioms of ParlAI's own agents that a port keeps: ``self.getID()`` in act(), an agent option given in ParlAI's
hyphenated spelling, padding rows marked ``batch_padding`` (``Message.is_padding()``), and counters shared under
``global_metrics`` that a validation world does not take over."""

from __future__ import annotations

import json

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.messages import Message

ME = "test_parlai_agent_idioms"
ROWS = [{"text": f"q{i}", "labels": [f"a{i}"], "episode_done": True} for i in range(6)]


class RepeatQuery(ab.Agent):
    """ParlAI's repeat_query, its import changed: the reply's id from getID()."""

    def __init__(self, opt, shared=None):
        super().__init__(opt, shared)
        self.id = "RepeatQueryAgent"

    def act(self):
        return {"id": self.getID(), "text": self.observation.get("text", "").split("\n")[-1]}


class RepeatLabel(ab.Agent):
    """Declares its option as ParlAI's repeat_label does (underscores), which ParlAI users type hyphenated."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_argument("--cant_answer_percent", type=float, default=0)

    def act(self):
        labels = self.observation.get("eval_labels") or self.observation.get("labels") or [""]
        return {"text": "" if self.opt["cant_answer_percent"] >= 1 else labels[0]}


class PadAware(ab.Agent):
    """Counts the rows its batch_act meets that are not padding, as ParlAI agents skip them."""

    def __init__(self, opt, shared=None):
        super().__init__(opt, shared)
        self.real = shared["real"] if shared else [0]

    def share(self):
        return {**super().share(), "real": self.real}

    def batch_act(self, observations):
        self.real[0] += sum(not o.get("batch_padding") for o in observations)  # ParlAI's mark
        return [{"text": (o.get("eval_labels") or [""])[0]} for o in observations]

    def report(self):
        return {"real_rows": self.real[0]}


class Calls(ab.Agent):
    """batch_act calls counted in a dict shared with the clones as global_metrics (ParlAI's TorchAgent name)."""

    def __init__(self, opt, shared=None):
        super().__init__(opt, shared)
        self.global_metrics = shared["global_metrics"] if shared else {"calls": 0}

    def share(self):
        return {**super().share(), "global_metrics": self.global_metrics}

    def batch_act(self, observations):
        self.global_metrics["calls"] += 1
        return [{"text": (o.get("labels") or o.get("eval_labels") or [""])[0]} for o in observations]

    def report(self):
        return {"calls": self.global_metrics["calls"]}

    def reset_metrics(self):
        self.global_metrics["calls"] = 0


def test_an_agent_calling_get_id_in_act_runs(write_jsonl, capsys):
    """ParlAI's Agent.getID(): every stock agent calls it in act() (an AttributeError traceback here)."""
    task = "jsonl:" + write_jsonl(ROWS)
    assert main(["display-model", "-t", task, "-m", f"{ME}:RepeatQuery", "-n", "2", "--no-progress"]) == 0
    assert "[RepeatQueryAgent]: q0" in capsys.readouterr().out


def test_an_agents_own_option_takes_parlais_hyphenated_spelling(write_jsonl, tmp_path):
    task, report = "jsonl:" + write_jsonl(ROWS), tmp_path / "r.json"
    for spelled in ("--cant-answer-percent", "--cant_answer_percent"):
        assert main(["eval", "-t", task, "-m", f"{ME}:RepeatLabel", spelled, "1", "--no-progress",
                     "--report-json", str(report)]) == 0
        assert json.loads(report.read_text())["valid"]["accuracy"] == 0.0, spelled


def test_padding_rows_are_marked_as_parlai_marks_them(write_jsonl):
    """6 examples at -bs 4: 8 rows, 2 of them padding, which the agent counted as examples (no batch_padding)."""
    opts = ab.Opts(task="jsonl:" + write_jsonl(ROWS), datatype="valid", batchsize=4)
    with ab.create_world(opts, agent=PadAware) as world:
        report = ab.evaluate(world)
    assert report["exs"] == 6 and report["real_rows"] == 6
    assert Message({"episode_done": True, "batch_padding": True}).is_padding() and not Message(text="q").is_padding()


def test_counters_shared_as_global_metrics_stay_the_training_worlds(write_jsonl):
    """The train row reported the last validation's calls (4) for 7 training steps."""
    opts = ab.Opts(task="jsonl:" + write_jsonl(ROWS), batchsize=4, num_epochs=3, validation_every_n_epochs=1,
                   eval_splits="valid", progress=False)
    report = ab.run(ab.create_world(opts, agent=Calls), opts)
    assert report["train"]["calls"] == report["train"]["steps"] and report["valid"]["calls"] == 2
