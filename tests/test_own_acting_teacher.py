"""A teacher of yours that acts by itself (a Teacher subclass with its own act(), observe(), report(), as
ParlAI's teachers before FixedDialogTeacher): what it gets wrong is one line naming it, never a hang, a
traceback from accelbatch's own code or a report of nothing; and a str label is one answer.

Hand counts: SelfScored serves N one-turn episodes "s0".."s{N-1}", each answered by "ans s{i}", then sets
epochDone; it scores the replies itself (exs, accuracy)."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main
from accelbatch.messages import Message
from accelbatch.opts import Opts
from accelbatch.teachers import Teacher

pytestmark = pytest.mark.timeout(120)  # what these refuse would run for ever

N = 5
RUN = ["-m", "repeat_label", "--no-progress"]


class SelfScored(Teacher):
    """N examples, then epochDone (and padding acts); accuracy scored in observe()."""

    labels_as: str = "list"

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.served, self.last = 0, None
        self.counts = shared["counts"] if shared else {"exs": 0, "correct": 0}

    def share(self):
        return {**super().share(), "counts": self.counts}

    def num_examples(self):
        return N

    def num_episodes(self):
        return N

    def act(self):
        if self.served >= N:
            self.epochDone, self.last = True, None
            return Message(episode_done=True, batch_padding=True)
        i, self.served = self.served, self.served + 1
        self.epochDone = self.served >= N
        answer = {"list": [f"ans s{i}"], "str": f"ans s{i}", "int": 7}[self.labels_as]
        self.last = {"text": f"s{i}", "eval_labels": answer, "episode_done": True}
        return Message(self.last)

    def observe(self, reply):
        if self.last is not None:
            answers = self.last["eval_labels"]
            self.counts["exs"] += 1
            self.counts["correct"] += reply.get("text") in ([answers] if isinstance(answers, str) else answers)
        return reply

    def report(self):
        return {"exs": self.counts["exs"], "accuracy": self.counts["correct"] / max(1, self.counts["exs"])}

    def reset(self):
        super().reset()
        self.served, self.last = 0, None


class StrLabels(SelfScored):
    labels_as = "str"


class IntLabels(SelfScored):
    labels_as = "int"


class NoneActs(SelfScored):
    def act(self):
        return None


class NeverEnds(SelfScored):
    def act(self):
        message = super().act()
        self.epochDone = False
        return message


class Empty(SelfScored):
    def num_examples(self):
        return 0

    def num_episodes(self):
        return 0


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize("bs", ["1", "3"])
def test_every_example_is_served_and_scored_once_by_each_row(capsys, tmp_path, bs):
    report = tmp_path / "r.json"
    assert main(["eval", "-t", f"{__name__}:SelfScored", *RUN, "-bs", bs, "--report-json", str(report)]) == 0
    valid = json.loads(report.read_text())["valid"]
    assert valid["exs"] == N * int(bs) and valid["accuracy"] == 1.0  # each row's clone serves its data (ParlAI's)


@pytest.mark.parametrize("bs", ["1", "2"])
def test_a_str_label_is_one_answer_not_its_first_character(tmp_path, bs):
    report = tmp_path / "r.json"
    assert main(["eval", "-t", f"{__name__}:StrLabels", *RUN, "-bs", bs, "--report-json", str(report)]) == 0
    valid = json.loads(report.read_text())["valid"]
    assert valid["exs"] == N * int(bs) and valid["accuracy"] == 1.0  # not "a", the first character of "ans s0"


@pytest.mark.parametrize("bs", ["1", "2"])
def test_labels_that_are_not_text_are_one_line_naming_the_teachers_act(capsys, bs):
    assert main(["eval", "-t", f"{__name__}:IntLabels", *RUN, "-bs", bs]) == 2
    err = _error_line(capsys)
    assert "IntLabels.act() returned an example whose 'eval_labels' is 7 (holding int)" in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bs", ["1", "2"])
def test_training_on_acts_that_are_all_none_is_refused_not_a_hang(capsys, bs):
    assert main(["train", "-t", f"{__name__}:NoneActs", *RUN, "-bs", bs, "-ne", "1", "--eval-splits", ""]) == 2
    err = _error_line(capsys)
    assert "NoneActs.act(): 1000 training parleys served no example" in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bs", ["1", "2"])
def test_an_evaluation_whose_teacher_never_ends_its_epoch_is_refused_not_a_hang(capsys, bs):
    assert main(["eval", "-t", f"{__name__}:NeverEnds", *RUN, "-bs", bs]) == 2
    err = _error_line(capsys)
    assert "NeverEnds: the valid evaluation's last 1000 parleys served no example" in err, err
    assert "self.epochDone = True" in err, err


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_a_teacher_of_no_examples_is_one_line_in_training_and_evaluation(capsys, verb):
    assert main([verb, "-t", f"{__name__}:Empty", *RUN, *(["-ne", "1"] if verb == "train" else [])]) == 2
    err = _error_line(capsys)
    assert "Empty: num_examples() is 0" in err, err


def test_repeat_label_answers_a_str_label_whole():
    from accelbatch.models.utility import RepeatLabelAgent

    agent = RepeatLabelAgent(Opts())
    agent.observe(Message(text="q", eval_labels="ans s0", episode_done=True))
    assert agent.act()["text"] == "ans s0"


def test_each_rows_act_is_checked_against_its_own_teacher_in_several_tasks(capsys):
    """babi:1 with a teacher of yours: the rows on the second task are checked too (one line naming it)."""
    assert main(["eval", "-t", f"babi:1,{__name__}:IntLabels", *RUN, "-bs", "2"]) == 2
    assert "IntLabels.act() returned an example whose 'eval_labels' is 7" in _error_line(capsys)


def test_an_acts_label_is_left_as_it_is_not_made_labels():
    """'label' is setup_data's shorthand: made 'labels' in an act it would train a model during evaluation."""
    from accelbatch.data.datasets import checked_teacher_act

    act = Message(text="q", label="a", eval_labels="a", episode_done=True)
    checked = checked_teacher_act(SelfScored(Opts()), act)
    assert checked["label"] == "a" and "labels" not in checked and checked["eval_labels"] == ["a"]
    same = Message(text="q", label="a", episode_done=True)
    assert checked_teacher_act(SelfScored(Opts()), same) is same


def test_a_teacher_without_num_examples_is_not_refused_as_empty():
    from accelbatch.run_control import refuse_no_examples

    class NoCount:
        def num_examples(self):
            raise AttributeError("no count")

    refuse_no_examples(NoCount(), "valid")  # what needs the count says so; an evaluation does not
