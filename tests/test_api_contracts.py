"""The public Python API keeps what its docstrings and the README promise: a TorchAgent's methods that break
their contract are named, a model's forward that returns no dict is named, PATH.opt describes the model that
was trained, a teacher's data cannot be changed through an observation, and Opts refuses None and unknown names."""

from __future__ import annotations

import copy
import json
import pickle
import random

import pytest
import torch
from helpers import LabelEchoTorchAgent

import accelbatch as ab
from accelbatch.agents import TorchAgent
from accelbatch.cli import main
from accelbatch.models.bag import BagAgent
from accelbatch.opts import OptionError
from accelbatch.plan import PlanError
from accelbatch.teachers import FixedTeacher, create_teacher
from accelbatch.worlds import ReplyError

VALID = ab.Opts(batchsize=4, datatype="valid", model="repeat_label")


class _Replies(LabelEchoTorchAgent):
    returned: object = None

    def replies(self, outputs, observations):
        made = type(self).returned
        return made(len(observations)) if callable(made) else made


@pytest.mark.parametrize("returned, says", [
    (None, "_Replies.replies() returned None: it must return a list of reply dicts"),
    (lambda n: [None] * n, "_Replies.replies() returned None for row 0: it must return a Message"),
    (lambda n: ["kitchen"] * n, "_Replies.replies() returned str for row 0: it must return a Message"),
    (lambda n: [{"text": "a"}] * (n - 1), "_Replies.replies returned "),  # one reply fewer than rows
])
@pytest.mark.parametrize("batching", ["none", "full"])  # the clone world, and the loader world
def test_a_bad_return_of_replies_is_refused_naming_it(returned, says, batching, monkeypatch):
    monkeypatch.setattr(_Replies, "returned", returned)
    opts = VALID.replace(dynamic_batching=batching)
    with pytest.raises(ReplyError) as refused:
        ab.run(ab.create_world(opts, agent=_Replies), opts)
    assert str(refused.value).startswith(says)
    if returned is not None and len(returned(4)) == 3:
        rows = int(str(refused.value).split(" for ")[1].split()[0])
        assert str(refused.value).startswith(f"_Replies.replies returned {rows - 1} replies for {rows} rows")


class _BareTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        return self.w * batch["x"]


class _BareAgent(LabelEchoTorchAgent):
    def build_model(self):
        return _BareTensor()


@pytest.mark.parametrize("datatype", ["train", "valid"])
def test_a_forward_that_returns_a_tensor_is_named(datatype):
    opts = VALID.replace(datatype=datatype, max_train_steps=2)
    with pytest.raises(PlanError, match=r"the model's forward\(batch\) (must return a dict with 'loss'.*\(it "
                                        r"returned Tensor\)|returned Tensor: it must return a dict)"):
        ab.run(ab.create_world(opts, agent=_BareAgent), opts)


def test_the_model_file_options_are_those_the_agent_was_built_with(tmp_path, capsys):
    agent = BagAgent(ab.Opts(model="bag", embedding_size=16))
    opts = ab.Opts(model="bag", model_file=str(tmp_path / "m.pt"), max_train_steps=2, batchsize=4)
    ab.run(ab.create_world(opts, agent=agent), opts)
    assert json.loads((tmp_path / "m.pt.opt").read_text())["embedding_size"] == 16  # not the run's default 64
    capsys.readouterr()
    assert main(["eval", "-mf", str(tmp_path / "m.pt"), "--no-progress"]) == 0
    assert "valid" in capsys.readouterr().out


def test_an_observations_lists_are_the_teachers_and_cannot_be_changed_through_a_copy():
    teacher = create_teacher(ab.Opts(datatype="valid"))
    served = ab.Message(teacher.act())  # the copy the README says to make
    before = list(served["label_candidates"])
    with pytest.raises(TypeError, match=r"copy it first, e\.g\. list\(observation\['label_candidates'\]\)"):
        random.Random(0).shuffle(served["label_candidates"])
    for change in (lambda c: c.reverse(), lambda c: c.append("x"), lambda c: c.sort()):
        with pytest.raises(TypeError):
            change(served["label_candidates"])
    teacher.reset()
    again = teacher.act()
    assert again["label_candidates"] == before and again["label_candidates"] is served["label_candidates"]
    sent = pickle.loads(pickle.dumps(teacher.act()))  # what a data process gets: as read-only as here (a
    # performance option such as --dataloader-mode async must not let an agent change the data)
    assert sent["label_candidates"] == before and type(sent) is type(teacher.act())
    with pytest.raises(TypeError, match="copy it first"):
        sent["label_candidates"].append("x")
    with pytest.raises(TypeError, match="copy it first"):
        sent["text"] = "changed"
    deep = copy.deepcopy(served)  # a deep copy is the agent's own
    deep["label_candidates"].append("x")
    deep["text"] = "changed"
    assert served["label_candidates"] == before
    mine = list(served["label_candidates"])  # a copy of the list is the agent's own
    mine.reverse()
    assert served["label_candidates"] == before


class _NoBatchify(TorchAgent):
    def build_model(self):
        return torch.nn.Linear(1, 1)


class _NoData(FixedTeacher):
    pass


def test_a_method_a_subclass_must_give_is_named_when_missing():
    with pytest.raises(NotImplementedError, match=r"_NoBatchify must implement batchify\(observations\)"):
        ab.run(ab.create_world(VALID, agent=_NoBatchify), VALID)
    with pytest.raises(NotImplementedError, match=r"TorchAgent must implement build_model\(\)"):
        TorchAgent(VALID.replace(model="bag"))
    with pytest.raises(NotImplementedError, match=r"_NoData must implement setup_data\(\)"):
        _NoData(VALID)


@pytest.mark.parametrize("name, says", [("task", "-t/--task: expected a string, got None"),
                                        ("batchsize", "-bs/--batchsize: expected an integer, got None"),
                                        ("num_epochs", "-ne/-eps/--num-epochs: expected a number, got None"),
                                        ("datatype", "-dt/--datatype: expected a string, got None")])
def test_none_for_an_option_that_needs_a_value_is_refused_naming_it(name, says):
    with pytest.raises(OptionError, match=f"^{says}$"):
        ab.Opts(**{name: None})
    assert ab.Opts(model_file=None, init_model=None).model_file is None  # these take None: no file


def test_from_args_refuses_a_default_that_names_no_option():
    with pytest.raises(OptionError, match="Opts.from_args: no option named batchsiz"):
        ab.Opts.from_args([], batchsiz=4)
    assert ab.Opts.from_args([], batchsize=4).batchsize == 4


def test_a_batch_world_clones_into_a_batch_world_of_as_many_rows():
    world = ab.create_world(VALID)
    clone = world.clone()
    assert type(clone) is type(world) and clone.rows == world.rows == 4
    for _ in range(3):
        clone.parley()
        world.parley()
    assert clone.get_total_exs() == world.get_total_exs() == 12


def test_a_save_writes_through_a_link_and_a_refused_write_is_one_line_leaving_no_part(tmp_path, monkeypatch):
    from accelbatch.checkpoint import CheckpointError

    agent = BagAgent(ab.Opts(model="bag", embedding_size=8))
    (tmp_path / "store").mkdir()
    real, link = tmp_path / "store" / "real.pt", tmp_path / "link.pt"
    agent.save(str(real))
    link.symlink_to(real)
    with torch.no_grad():
        next(agent.model.parameters()).add_(1.0)
    agent.save(str(link))
    assert link.is_symlink()  # the link is kept, and its target holds the new weights
    saved = torch.load(str(real), weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in agent.model.state_dict().items())

    def disk_full(obj, handle):
        handle.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("accelbatch.agents.torch.save", disk_full)
    with pytest.raises(CheckpointError, match=r"m\.pt: no space left on the device to write it"):
        agent.save(str(tmp_path / "m.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pt", "store"]


def test_targets_are_the_labels_else_the_eval_labels_and_a_str_is_one_answer():
    assert ab.Message(labels="yes").targets() == ["yes"]
    assert ab.Message(labels=None, eval_labels=["a"]).targets() == ["a"]
    assert ab.Message(labels=["x", "y"], eval_labels=["a"]).targets() == ["x", "y"]
    assert ab.Message(text="no answers").targets() == []


class _Frozen(LabelEchoTorchAgent):
    def build_model(self):
        model = super().build_model()
        model.requires_grad_(False)
        return model


def test_training_a_model_with_nothing_to_train_says_so():
    opts = VALID.replace(datatype="train", max_train_steps=1)
    with pytest.raises(PlanError, match="no parameter that requires grad: nothing to train"):
        ab.run(ab.create_world(opts, agent=_Frozen), opts)


@pytest.mark.parametrize("rows", [0, -1, "4", 2.0, True])
def test_create_world_refuses_rows_that_are_no_count_of_rows(rows):
    with pytest.raises(TypeError, match=r"create_world\(rows=.*\): rows is a number of batch rows, 1 or more"):
        ab.create_world(VALID, rows=rows)
