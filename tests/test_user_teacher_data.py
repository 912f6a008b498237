"""A user's own FixedTeacher (``import accelbatch as ab``): both setup_data forms, a list of episodes and ParlAI's
(message, new_episode) pairs, take ParlAI's conveniences (a str label, ``label`` for ``labels``) and refuse a
field of the wrong type in one line at load, naming the teacher, the episode and turn, and the field."""

from __future__ import annotations

import copy
import json
import os

import pytest

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.opts import OptionError
from accelbatch.tasks.files import DataFileError

# the right answer to each question, written by hand: the agent answers from this, never from the labels
ANSWERS = {"is it": "yes", "is not": "no", "maybe": "perhaps"}


class Answerer(ab.Agent):
    """Answers each question right (from ANSWERS) and records the labels it is shown."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.shown = shared["shown"] if shared else []

    def share(self):
        return {**super().share(), "shown": self.shown}

    def act(self):
        obs = self.observation or {}
        if "text" not in obs:
            return ab.Message(id="answerer")
        self.shown.append(obs.get("labels", obs.get("eval_labels")))
        return ab.Message(id="answerer", text=ANSWERS[obs["text"]])


def teacher_of(episodes: list[list[dict]], pairs: bool) -> type[ab.FixedTeacher]:
    """A FixedTeacher serving ``episodes`` as a list of episodes, or as ParlAI's (message, new_episode) pairs."""

    class T(ab.FixedTeacher):
        def setup_data(self):
            if not pairs:
                return episodes
            return ((turn, t == 0) for episode in episodes for t, turn in enumerate(episode))

    return T


def evaluate(episodes: list[list[dict]], pairs: bool, datatype: str = "valid") -> tuple[dict, list]:
    opts = ab.Opts(datatype=datatype, batchsize=2)
    world = ab.create_world(opts, agent=Answerer, teacher=teacher_of(episodes, pairs)(opts))
    return ab.evaluate(world), world.get_model_agent().shown


# 2 episodes: a context turn then a question; one question. 3 questions (labelled turns) by hand count.
def episodes_with(key: str, as_str: bool) -> list[list[dict]]:
    def q(text: str) -> dict:
        return {"text": text, key: ANSWERS[text] if as_str else [ANSWERS[text]]}
    return [[{"text": "maybe"}, q("is it")], [q("is not")], [q("maybe")]]


@pytest.mark.parametrize("pairs", [False, True], ids=["episodes", "pairs"])
@pytest.mark.parametrize("key, as_str", [("labels", True), ("label", True), ("label", False), ("eval_labels", True)])
def test_parlai_labels_score_the_same_in_both_forms(pairs, key, as_str):
    """Every question answered right: accuracy 1.0 over the 3 labelled turns, the labels shown as lists."""
    report, shown = evaluate(episodes_with(key, as_str), pairs)
    assert report["exs"] == 3 and report["accuracy"] == 1.0 and report["f1"] == 1.0
    assert sorted(s for s in shown if s is not None) == [["no"], ["perhaps"], ["yes"]]


@pytest.mark.parametrize("pairs", [False, True], ids=["episodes", "pairs"])
def test_training_sees_a_str_label_as_a_one_element_list(pairs):
    opts = ab.Opts(datatype="train:ordered", batchsize=1)
    world = ab.create_world(opts, agent=Answerer, teacher=teacher_of(episodes_with("label", True), pairs)(opts))
    for _ in range(4):  # the 4 turns of one pass
        world.parley()
    assert sorted(s for s in world.get_model_agent().shown if s is not None) == [["no"], ["perhaps"], ["yes"]]


def test_the_teachers_own_dicts_are_left_as_they_are():
    episodes = episodes_with("label", True)
    before = [[dict(turn) for turn in episode] for episode in episodes]
    evaluate(episodes, pairs=False)
    assert episodes == before


# a wrong field in the second turn of the first episode, or the one turn of the second
BAD = [
    (0, 1, "labels", {"text": "q", "labels": [3]}),
    (1, 0, "labels", {"text": "q", "labels": 3}),
    (1, 0, "text", {"text": 3, "labels": ["a"]}),
    (0, 1, "eval_labels", {"text": "q", "eval_labels": ["a", None]}),
    (1, 0, "label_candidates", {"text": "q", "labels": ["a"], "label_candidates": {"a", "b"}}),
    (0, 1, "label", {"text": "q", "label": [b"a"]}),
]


def bad_episodes(episode: int, turn: int, msg: dict) -> list[list[dict]]:
    episodes = [[{"text": "is it", "labels": ["yes"]}, {"text": "is not", "labels": ["no"]}],
                [{"text": "maybe", "labels": ["perhaps"]}]]
    episodes[episode][turn] = msg
    return episodes


@pytest.mark.parametrize("pairs", [False, True], ids=["episodes", "pairs"])
@pytest.mark.parametrize("episode, turn, field, msg", BAD)
def test_a_field_of_the_wrong_type_is_refused_at_load(pairs, episode, turn, field, msg):
    teacher = teacher_of(bad_episodes(episode, turn, msg), pairs)
    with pytest.raises(DataFileError) as err:
        teacher(ab.Opts(datatype="valid"))
    text = str(err.value)
    item = 2 * episode + turn  # the pair's index in the flat stream
    where = f"item {item} (episode {episode}, turn {turn})" if pairs else f"episode {episode}, turn {turn}"
    assert "\n" not in text and text.startswith(f"T.setup_data(): {where}: '{field}' is ")
    assert "give a str" in text


# what a latin-1 byte becomes in a str read with errors="surrogateescape"; a lone surrogate cannot be encoded
LATIN1_CAFE = b"caf\xe9".decode("utf-8", "surrogateescape")


@pytest.mark.parametrize("pairs", [False, True], ids=["episodes", "pairs"])
@pytest.mark.parametrize("field, msg, where", [
    ("text", {"text": LATIN1_CAFE, "labels": ["no"]}, "'text'"),
    ("labels", {"text": "is not", "labels": ["no", LATIN1_CAFE]}, "'labels'[1]"),
    ("label_candidates", {"text": "is not", "labels": ["no"], "label_candidates": ["no", LATIN1_CAFE]},
     "'label_candidates'[1]"),
])
def test_a_text_that_is_not_unicode_is_refused_at_load(pairs, field, msg, where):
    teacher = teacher_of(bad_episodes(0, 1, msg), pairs)
    with pytest.raises(DataFileError) as err:
        teacher(ab.Opts(datatype="train"))
    text = str(err.value)
    turn = "item 1 (episode 0, turn 1)" if pairs else "episode 0, turn 1"
    assert "\n" not in text and text.startswith(f"T.setup_data(): {turn}: {where} is not valid Unicode: "
                                                f"a lone surrogate \\udce9 at character 3"), text


class MiscountingTeacher(ab.FixedTeacher):
    """Three episodes, five examples, and its own counts of them (ParlAI's overrides)."""

    examples, episodes = 5, 3

    def setup_data(self):
        return bad_episodes(0, 0, {"text": "is it", "labels": ["yes"]}) + [[{"text": "maybe", "labels": ["no"]}] * 2]

    def num_examples(self):
        return self.examples

    def num_episodes(self):
        return self.episodes


@pytest.mark.parametrize("examples, episodes, wrong", [(100, 3, "num_examples() returns 100, but its data holds 5"),
                                                       (5, 1, "num_episodes() returns 1, but its data holds 3")])
def test_a_teacher_whose_own_counts_are_not_its_datas_is_refused_at_load(examples, episodes, wrong, capsys):
    # -ne counted epochs by num_examples() in one feed and by the data in the other (dynamic batching)
    MiscountingTeacher.examples, MiscountingTeacher.episodes = examples, episodes
    try:
        assert main(["train", "-t", f"{__name__}:MiscountingTeacher", "-m", "repeat_label", "--no-progress"]) == 2
    finally:
        MiscountingTeacher.examples, MiscountingTeacher.episodes = 5, 3
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert f"MiscountingTeacher.{wrong}: remove the" in err, err
    assert MiscountingTeacher(ab.Opts(datatype="train")).num_examples() == 5  # counts that agree are taken


class CountsSetInInit(MiscountingTeacher):
    """ParlAI's habit: what num_examples() returns is set in __init__, after the base class's."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.told = (5, 3)

    def num_examples(self):
        return self.told[0]

    def num_episodes(self):
        return self.told[1]


def test_counts_an_init_sets_after_the_base_class_are_read_once_it_is_whole(capsys):
    assert main(["train", "-t", f"{__name__}:CountsSetInInit", "-m", "repeat_label", "-ne", "1", "--no-progress",
                 "--eval-splits", ""]) == 0, capsys.readouterr().err


class IntLabelTeacher(ab.FixedTeacher):
    def setup_data(self):
        return [[{"text": "is it", "labels": ["yes"]}], [{"text": "is not", "labels": [3]}]]


def test_the_command_line_says_it_in_one_line(capsys):
    assert main(["eval", "-t", "test_user_teacher_data:IntLabelTeacher", "-m", "repeat_label", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "IntLabelTeacher.setup_data(): episode 1, turn 0: 'labels' is [3] (holding int)" in err


class EmptyEpisodesTeacher(ab.FixedTeacher):
    def setup_data(self):
        return [[], []]


class OneEmptyEpisodeTeacher(ab.FixedTeacher):
    def setup_data(self):
        return [[{"text": "is it", "labels": ["yes"]}], [], [{"text": "maybe", "labels": ["perhaps"]}]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", ["train", "eval"])
def test_an_empty_episode_is_refused_in_one_line_not_served_forever(capsys, verb):
    """A teacher whose episodes are all empty made training loop forever looking for a turn (and evaluation
    report 0 examples); one empty episode among others made -ne count epochs wrong. Both are refused at load."""
    for teacher, says in [("EmptyEpisodesTeacher", "episode 0 is empty"),
                          ("OneEmptyEpisodeTeacher", "episode 1 is empty")]:
        assert main([verb, "-t", f"test_user_teacher_data:{teacher}", "-m", "repeat_label", "--no-progress",
                     "-ne", "1", "--eval-splits", ""][:None if verb == "train" else 6]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{teacher}.setup_data(): {says}" in err, err


class ContextFirstTeacher(ab.FixedTeacher):
    def setup_data(self):  # 3 turns, one a context turn
        return [[{"text": "maybe"}, {"text": "is it", "labels": ["yes"]}], [{"text": "is not", "labels": ["no"]}]]


class QuestionsTeacher(ab.FixedTeacher):
    def setup_data(self):  # 2 turns
        return [[{"text": "is it", "labels": ["yes"]}], [{"text": "maybe", "labels": ["perhaps"]}]]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_multitask_training_counts_each_tasks_context_turns_in_its_row(capsys, workers):
    """The train row counts every turn served, context turns too; each task's row did not (its exs left them
    out, so the task rows did not add up to the total). Two ordered epochs serve each turn twice: by hand,
    6 turns (4 labelled) of the first task and 4 of the second."""
    tasks = "test_user_teacher_data:ContextFirstTeacher,test_user_teacher_data:QuestionsTeacher"
    assert main(["train", "-t", tasks, "-m", "repeat_label", "-ne", "2", "-bs", "2", "-dt", "train:ordered",
                 "--num-workers", workers, "--eval-splits", "", "-veps", "-1", "--no-progress",
                 "--report-json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    train = report["train"] if "train" in report else report
    first, second = tasks.split(",")
    assert (train["exs"], train[f"{first}/exs"], train[f"{second}/exs"]) == (10, 6, 4)
    assert train[f"{first}/scored_exs"] == 4


class PortedFromParlAI(ab.FixedTeacher):
    """A DialogTeacher as ParlAI writes one: opt['datafile'] set on its own copy of opt, setup_data(path)."""

    def __init__(self, opt, shared=None):
        opt = copy.deepcopy(opt)
        opt["datafile"] = os.path.join(opt["datapath"], "questions.txt")
        super().__init__(opt, shared)

    def setup_data(self, path):
        with open(path) as f:
            for line in f:
                question, answer = line.rstrip("\n").split("\t")
                yield {"text": question, "labels": [answer]}, True


class PathWithoutDatafile(ab.FixedTeacher):
    def setup_data(self, path):
        yield {"text": "is it", "labels": ["yes"]}, True


def test_a_teacher_ported_from_parlai_reads_its_datafile(tmp_path):
    """ParlAI's DialogTeacher calls setup_data(opt['datafile']) after the port set opt['datafile'] on its copy
    of opt (item assignment); the caller's opts stay as they were. By hand: 3 questions, each answered right."""
    path = tmp_path / "questions.txt"
    path.write_text("is it\tyes\nis not\tno\nmaybe\tperhaps\n")
    opts = ab.Opts(datatype="valid", batchsize=2, datapath=str(tmp_path))
    world = ab.create_world(opts, agent=Answerer, teacher=PortedFromParlAI(opts))
    report = ab.evaluate(world)
    assert (report["exs"], report["accuracy"]) == (3, 1.0)
    assert world.get_model_agent().shown == [["yes"], ["no"], ["perhaps"]]
    assert "datafile" not in opts  # the port changed its own copy
    opts["batchsize"] = 4  # an option set by name is checked as when constructed
    assert opts.batchsize == 4
    with pytest.raises(OptionError):
        opts["batchsize"] = 0
    assert opts.batchsize == 4


def test_a_setup_data_taking_a_path_without_a_datafile_is_one_line():
    with pytest.raises(DataFileError, match=r"PathWithoutDatafile.setup_data\(path\) takes ParlAI's "
                                            r"opt\['datafile'\], which is not set"):
        PathWithoutDatafile(ab.Opts(datatype="valid"))
