"""ParlAI 1.7 teacher semantics that ported code relies on: ordered training data does not cycle, reset()
clears the teacher's metrics, exs counts only turns with labels, episode_done starts a new episode, and a
DialogTeacher-style setup_data of (message, new_episode) pairs builds the episodes."""

from __future__ import annotations

import pytest
from helpers import LabelEchoTorchAgent, RecordingAgent, list_teacher

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.loader_world import LoaderWorld
from accelbatch.opts import Opts
from accelbatch.run import run
from accelbatch.tasks.files import DataFileError
from accelbatch.teachers import FixedTeacher, MultiTaskTeacher

LENGTHS = (1, 2, 3, 1, 2, 3, 1)  # 7 episodes, 13 examples
DATA_ORDER = [f"e{e}-{i}" for e, n in enumerate(LENGTHS) for i in range(n)]


class ActingTeacher(list_teacher(LENGTHS)):  # type: ignore[misc]
    """Its own act(): a BatchWorld runs its clones one by one (each clone's epoch_done decides)."""

    def act(self):
        return super().act()


def _hand_loop(world, limit: int = 100) -> int:
    parleys = 0
    while not world.epoch_done() and parleys < limit:
        world.parley()
        parleys += 1
    return parleys


# --- 1. train:ordered does not cycle: epoch_done after one pass (run() still trains -ne passes) -----------
def test_ordered_training_ends_its_epoch_after_one_pass_in_data_order():
    opts = Opts(datatype="train:ordered", batchsize=1)
    world = create_world(opts, agent=RecordingAgent, teacher=list_teacher(LENGTHS)(opts))
    assert _hand_loop(world) == 13 and world.epoch_done()
    assert world.get_model_agent().seen == DATA_ORDER  # each example once, in data order
    world.parley()  # acted again after its epoch: the next pass starts (how run() trains several passes)
    assert world.get_model_agent().seen[13:] == ["e0-0"] and not world.epoch_done()


def test_ordered_training_clones_serve_each_example_once():
    """3 rows deal episodes 0,3,6 / 1,4 / 2,5 (turns 1+1+1, 2+2, 3+3): the pass takes 6 steps."""
    opts = Opts(datatype="train:ordered", batchsize=3)
    world = create_world(opts, agent=RecordingAgent, teacher=ActingTeacher(opts))
    assert _hand_loop(world) == 6
    assert sorted(world.get_model_agent().seen) == sorted(DATA_ORDER)


def test_ordered_training_run_trains_the_epochs_asked():
    """-ne 2 on 13 examples, 3 rows padded to the pass's 6 steps: 26 examples in 12 steps."""
    opts = Opts(datatype="train:ordered", batchsize=3, num_epochs=2, progress=False, eval_splits="",
                validation_every_n_epochs=-1)
    world = create_world(opts, agent=RecordingAgent, teacher=ActingTeacher(opts))
    train = run(world, opts)["train"]
    assert (train["exs"], train["epochs"], train["steps"]) == (26, 2.0, 12)
    assert sorted(world.get_model_agent().seen) == sorted(DATA_ORDER * 2)


@pytest.mark.parametrize("front_end, steps, exs", [
    ({"dynamic_batching": "batchsort", "drop_last": False}, 4, 13),
    ({"dynamic_batching": "batchsort"}, 3, 12),  # a pass drops its short batch by default
    pytest.param({"dataloader_mode": "async"}, 5, 13, marks=[pytest.mark.multiprocess, pytest.mark.timeout(120)]),
], ids=["dynamic-batching", "dropping-the-tail", "async"])
def test_ordered_training_on_the_loader_ends_its_epoch_after_one_pass(front_end, steps, exs):
    """The batched front end too: a hand loop stops after one pass, and the parley after that starts the next.
    13 examples, bs 4: batchsort cuts 4 batches (the last of 1 row, dropped by default); the clones' rows
    deal episodes 0,4 / 1,5 / 2,6 / 3 (3, 5, 4 and 1 turns): 5 steps, as a BatchWorld takes."""
    opts = Opts(datatype="train:ordered", batchsize=4, **front_end)
    world = create_world(opts, agent=LabelEchoTorchAgent, teacher=list_teacher(LENGTHS)(opts))
    try:
        assert isinstance(world, LoaderWorld)
        assert _hand_loop(world) == steps and world.epoch_done()
        assert world.get_total_exs() == exs and len(world.get_model_agent().seen) == exs
        assert exs < 13 or sorted(world.get_model_agent().seen) == sorted(DATA_ORDER)
        world.parley()
        assert not world.epoch_done() and len(world.get_model_agent().seen) > 13
    finally:
        world.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ordered_training_serves_the_same_rows_with_or_without_the_loader():
    """A performance option changes no result: two ordered passes through the async loader serve the rows,
    step by step, that the clones serve (a pass padded at its end, not running on into the next)."""
    seen = []
    for changes in ({}, {"dataloader_mode": "async"}):
        opts = Opts(datatype="train:ordered", batchsize=4, **changes)
        world = create_world(opts, agent=LabelEchoTorchAgent, teacher=list_teacher(LENGTHS)(opts))
        try:
            for _ in range(2):
                _hand_loop(world)
                world.parley()
            seen.append(world.get_model_agent().seen)
        finally:
            world.shutdown()
    assert seen[0] == seen[1] and len(seen[0]) == 2 * 13 + 4  # two passes and the first step of a third


def test_ordered_training_run_on_the_loader_trains_the_epochs_asked():
    opts = Opts(datatype="train:ordered", batchsize=4, num_epochs=2, progress=False, eval_splits="",
                validation_every_n_epochs=-1, dynamic_batching="batchsort", drop_last=False)
    world = create_world(opts, agent=LabelEchoTorchAgent, teacher=list_teacher(LENGTHS)(opts))
    train = run(world, opts)["train"]
    assert (train["exs"], train["steps"]) == (26, 8)
    assert sorted(world.get_model_agent().seen) == sorted(DATA_ORDER * 2)


# --- 2. reset() clears the teacher's metrics ------------------------------------------------------------
def test_teacher_reset_clears_its_metrics():
    opts = Opts(datatype="valid")
    teacher = list_teacher(LENGTHS)(opts)
    for _ in range(2):
        teacher.reset()
        while not teacher.epoch_done():
            act = teacher.act()
            teacher.observe({"text": act["eval_labels"][0]})
        assert teacher.report() == {"exs": 13, "accuracy": 1.0, "f1": 1.0}  # this pass's 13, not 26


# --- 3. exs counts turns with labels only ---------------------------------------------------------------
class ContextTeacher(FixedTeacher):
    """4 episodes: two of 3 unlabelled context turns then a question, two of one question; then a turn with an
    empty list of labels (an example ParlAI counts, not scored): 5 of 11 turns are examples, 4 scored."""

    def setup_data(self):
        def question(e):
            return {"text": f"q{e}", "labels": [f"a{e}"]}
        return [[{"text": f"c{e}.{i}"} for i in range(3)] + [question(e)] if e % 2 == 0 else [question(e)]
                for e in range(4)] + [[{"text": "r", "labels": []}]]


@pytest.mark.parametrize("rows", [1, 4])
def test_exs_counts_only_labelled_turns(rows):
    opts = Opts(datatype="valid", batchsize=rows)
    world = create_world(opts, agent=RecordingAgent, teacher=ContextTeacher(opts))
    _hand_loop(world)
    assert world.report()["exs"] == 5 and world.report()["accuracy"] == 1.0
    assert world.get_total_exs() == 11  # the world still counts every turn it served (passes, epochs)


def test_training_counts_every_turn_trained():
    """The train row's exs and epochs count the turns trained (-ne passes over all 11), context included;
    so does the teacher's exs (the train log's windows)."""
    opts = Opts(datatype="train:ordered", batchsize=1, num_epochs=2, progress=False, eval_splits="",
                validation_every_n_epochs=-1)
    world = create_world(opts, agent=RecordingAgent, teacher=ContextTeacher(opts))
    train = run(world, opts)["train"]
    assert (train["exs"], train["epochs"], train["steps"]) == (22, 2.0, 22)
    assert world.get_task_agent().report()["exs"] == 22


def test_multitask_evaluation_counts_labelled_turns_per_task():
    opts = Opts(datatype="valid", task="a,b")
    parts = [ContextTeacher(opts), list_teacher((2, 1))(opts)]
    teacher = MultiTaskTeacher(opts, teachers=parts, names=["a", "b"])
    world = create_world(opts.replace(batchsize=3), agent=RecordingAgent, teacher=teacher)
    _hand_loop(world)
    report = world.report()
    assert (report["a/exs"], report["b/exs"], report["exs"]) == (5, 3, 8)


# --- 4. episode_done inside an episode starts a new one, on every path ------------------------------------
class MidDoneTeacher(FixedTeacher):
    def setup_data(self):
        return [[{"text": "q0", "labels": ["a0"], "episode_done": True}, {"text": "q1", "labels": ["a1"]},
                 {"text": "q2", "labels": ["a2"]}]]


class HistoryAgent(LabelEchoTorchAgent):
    """Records the history (full_text) of every example it replies to, in ``seen``."""

    def replies(self, outputs, observations):  # in the main process, also with data workers
        self.seen.extend(o["full_text"] for o in observations)
        return [{} for _ in observations]


def test_mid_episode_done_splits_the_episode_for_the_agent_and_the_data_workers():
    expected = ["q0", "q1", "q1\na1\nq2"]  # q0 ends its episode; q2's history is q1, its label, q2
    opts = Opts(datatype="valid", batchsize=1)
    teacher = MidDoneTeacher(opts)
    assert (teacher.num_episodes(), teacher.num_examples()) == (2, 3)
    store = teacher.store
    assert [o["full_text"] for o in store.observations([0, 1, 2], -1, True)] == expected  # what workers vectorize
    world = create_world(opts, agent=HistoryAgent, teacher=teacher)
    _hand_loop(world)
    assert world.get_model_agent().seen == expected  # the agent's own history


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_mid_episode_done_histories_from_a_data_worker():
    opts = Opts(datatype="valid", batchsize=1, num_workers=1)
    world = create_world(opts, agent=HistoryAgent, teacher=MidDoneTeacher(opts))
    assert isinstance(world, LoaderWorld)
    try:
        _hand_loop(world)
        assert world.get_model_agent().seen == ["q0", "q1", "q1\na1\nq2"]
    finally:
        world.shutdown()


# --- 5. setup_data yielding ParlAI's (message, new_episode) pairs -------------------------------------------
class PairTeacher(FixedTeacher):
    def setup_data(self):
        for e in range(3):
            for t in range(2):
                yield {"text": f"q{e}.{t}", "labels": f"a{e}.{t}"}, t == 0  # a str label, as ParlAI allows


class MixedTeacher(FixedTeacher):
    def setup_data(self):
        return [({"text": "q", "labels": ["a"]}, True), [{"text": "q", "labels": ["a"]}]]


def test_setup_data_pairs_build_episodes():
    opts = Opts(datatype="valid", batchsize=2)
    teacher = PairTeacher(opts)
    assert [[(m["text"], m["episode_done"]) for m in ep] for ep in teacher.episodes] == [
        [(f"q{e}.0", False), (f"q{e}.1", True)] for e in range(3)]
    assert teacher.episodes[0][0]["eval_labels"] == ["a0.0"]
    world = create_world(opts, agent=RecordingAgent, teacher=teacher)
    _hand_loop(world)
    assert world.report()["exs"] == 6 and world.report()["accuracy"] == 1.0


@pytest.mark.parametrize("name", ["MixedTeacher", "BoolTeacher"])
def test_malformed_setup_data_is_one_line_naming_the_teacher(name, capsys):
    with pytest.raises(DataFileError, match=rf"^{name}\.setup_data\(\): item \d .*\(message dict, new_episode"):
        globals()[name](Opts(datatype="valid"))
    assert main(["eval", "-t", f"test_parlai_teacher_semantics:{name}", "-m", "repeat_label", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{name}.setup_data()" in err


class BoolTeacher(FixedTeacher):
    def setup_data(self):
        return [True, False]
