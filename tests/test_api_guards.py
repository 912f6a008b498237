"""The Python API's guards: run() refuses options that are not the world's and a second training of a world;
create_world/run take a dict of Opts' fields; PATH.opt names a model given as a class; --dynamic-batching
needs an agent whose batches it can build; a plain agent's own save(path) writes -mf."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import RecordingAgent

from accelbatch.agents import Agent, TorchAgent
from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.loader_world import LoaderWorld
from accelbatch.messages import Message
from accelbatch.model_opts import opt_path
from accelbatch.opts import OptionError, Opts
from accelbatch.run import run

ROWS = 12


@pytest.fixture
def qa(write_jsonl):
    """A task of 12 single-turn examples of different lengths."""
    return "jsonl:" + write_jsonl([{"text": f"q{i}" + " w" * i, "labels": [f"a{i}"]} for i in range(ROWS)])


def _opts(task: str, **changes) -> Opts:
    return Opts(**{"task": task, "model": "repeat_label", "batchsize": 2, "num_epochs": 1,
                   "validation_every_n_epochs": -1, "eval_splits": "", "progress": False, **changes})


@pytest.mark.timeout(60)  # evaluating a training world never ended
@pytest.mark.parametrize("built, given, flag", [
    (dict(), dict(datatype="valid"), "-dt/--datatype 'valid', but the world was built with 'train'"),
    (dict(datatype="valid"), dict(datatype="train"), "-dt/--datatype 'train', but the world was built with 'valid'"),
    (dict(datatype="valid"), dict(datatype="test"), "-dt/--datatype 'test', but the world was built with 'valid'"),
    (dict(), dict(task="babi:1"), "-t/--task 'babi:1', but the world was built with 'jsonl:"),
    (dict(), dict(model="bag"), "-m/--model 'bag', but the world was built with 'repeat_label'"),
    (dict(), dict(seed=5), "--seed 5, but the world was built with 0"),
    (dict(), dict(device="ipu", ipu_emulator=True), "--device 'ipu', but the world was built with 'cpu'"),
    (dict(), dict(device_iterations=2), "-di/--device-iterations 2, but the world was built with 1"),
    (dict(), dict(num_workers=1), "--num-workers 1, but the world was built with 0"),
    (dict(batchsize=4), dict(batchsize=2), "-bs/--batchsize 2, but the world was built with 4"),
    (dict(batchsize=2), dict(batchsize=4), "-bs/--batchsize 4, but the world was built with 2"),
    (dict(), dict(output_mode="all"), "--output-mode 'all', but the world was built with 'default'"),
    (dict(), dict(reduction="sum"), "--reduction 'sum', but the world was built with 'mean'"),
    (dict(), dict(loss_normalization="token"), "--loss-normalization 'token', but the world was built with 'micro'"),
], ids=["train-world-evaluated", "valid-world-trained", "valid-world-as-test", "other-task", "other-model",
        "other-seed", "other-device", "other-plan", "other-feed", "smaller-batch", "larger-batch", "other-output-mode",
        "other-reduction", "other-loss-normalization"])
def test_run_refuses_options_that_built_another_world(qa, built, given, flag):
    """run() ran the world as built, silently, with another -m, --device, --seed, plan or feed in its opts."""
    opts = _opts(qa, **built)
    world = create_world(opts)
    with pytest.raises(OptionError, match="run\\(world, opts\\): " + flag.replace("(", "\\(")) as info:
        run(world, opts.replace(**given))
    assert "create_world(opts)" in str(info.value) and "opts.replace(" in str(info.value)
    assert world.get_total_exs() == 0  # refused before any step


def test_run_takes_the_batch_the_world_fitted_to_its_data(qa, capsys):
    """-bs 64 on 12 episodes: create_world lowers it to 12 and says so; run() with the same opts runs it."""
    opts = _opts(qa, batchsize=64)
    world = create_world(opts)
    assert world.opts.batchsize == ROWS and f"using -bs {ROWS}" in capsys.readouterr().err
    report = run(world, opts)["train"]
    assert (report["exs"], report["steps"]) == (ROWS, 1)


def test_a_world_that_trained_is_not_trained_again_and_a_new_world_on_its_model_is(qa):
    opts = _opts(qa)
    world = create_world(opts)
    first = run(world, opts)["train"]
    assert first["exs"] == ROWS and first["steps"] == ROWS // 2  # one epoch of 2-row steps
    with pytest.raises(OptionError, match=f"this world has trained {ROWS} examples already .*"
                                          "create_world\\(opts, agent=world.get_model_agent\\(\\)\\)"):
        run(world, opts)
    again = run(create_world(opts, agent=world.get_model_agent()), opts)["train"]
    assert (again["exs"], again["steps"], again["epochs"]) == (ROWS, ROWS // 2, 1.0)  # its own report


def test_create_world_and_run_take_a_dict_of_opts_fields(qa):
    fields = {"task": qa, "model": "repeat_label", "datatype": "valid", "batchsize": 4, "progress": False}
    world = create_world(fields)
    assert isinstance(world.opts, Opts) and world.opts.batchsize == 4
    report = run(world, fields)
    assert report["valid"]["exs"] == ROWS and report["valid"]["accuracy"] == 1.0
    with pytest.raises(OptionError, match="create_world\\(opts\\): 'bsz' is not an option of accelbatch.Opts"):
        create_world({**fields, "bsz": 4})
    with pytest.raises(TypeError, match="run\\(world, opts\\) takes accelbatch.Opts .*not list"):
        run(create_world(fields), [("task", qa)])


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        return {"loss": (self.w * batch["x"]).mean()}


class Echo(TorchAgent):
    """A TorchAgent with the base observe: one weight, a loss on a constant input."""

    built = 0

    def build_model(self):
        type(self).built += 1
        return _Scale()

    def batchify(self, observations):
        return {"x": torch.ones(len(observations), 1)}

    def replies(self, outputs, observations):
        return [{"text": ""} for _ in observations]


def test_the_model_file_names_an_agent_class_so_that_mf_alone_rebuilds_it(qa, tmp_path, capsys):
    path = str(tmp_path / "m.pt")
    opts = _opts(qa, model_file=path)  # opts.model stays repeat_label: the class given decides
    run(create_world(opts, agent=Echo), opts)
    assert json.loads(open(opt_path(path)).read())["model"] == f"{__name__}:Echo"
    built = Echo.built
    assert main(["eval", "-mf", path, "-t", qa, "--no-progress"]) == 0
    assert Echo.built == built + 1 and f"-m {__name__}:Echo" in capsys.readouterr().err

    def local():
        class Local(Echo):
            pass
        return Local

    for unimportable in (type("Main", (Echo,), {"__module__": "__main__"}), local()):
        run(create_world(opts, agent=unimportable), opts)
        assert "model" not in json.loads(open(opt_path(path)).read())  # nothing could import it


class HistoryEcho(Echo):
    """A TorchAgent that overrides observe()."""

    def observe(self, observation):
        return super().observe(observation)


@pytest.mark.parametrize("agent, why", [(RecordingAgent, "agent RecordingAgent is not a TorchAgent"),
                                        (HistoryEcho, "agent HistoryEcho overrides observe\\(\\)")])
def test_dynamic_batching_refuses_an_agent_whose_batches_it_cannot_build(qa, agent, why):
    for strategy in ("batchsort", "full", "buckets"):
        with pytest.raises(OptionError, match=f"--dynamic-batching {strategy}: {why}; .*without --dynamic-batching"):
            create_world(_opts(qa, dynamic_batching=strategy), agent=agent)
    world = create_world(_opts(qa, dynamic_batching="full"), agent=Echo)  # the base observe: built as before
    assert isinstance(world, LoaderWorld)
    world.shutdown()


def test_dynamic_batching_of_a_registered_observe_act_agent_is_one_line_on_the_command_line(qa, capsys):
    assert main(["train", "-t", qa, "-m", "repeat_label", "--dynamic-batching", "full", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "agent RepeatLabelAgent is not a TorchAgent" in err


class SavingAgent(Agent):
    """A plain agent that saves itself, as ParlAI's TrainLoop lets it: the examples it observed."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.seen = shared["seen"] if shared else [0]

    def share(self):
        return {**super().share(), "seen": self.seen}

    def observe(self, observation):
        self.seen[0] += bool(observation and "text" in observation)
        return super().observe(observation)

    def act(self):
        return Message(id="saving", text="")

    def save(self, path):
        with open(path, "w", encoding="utf-8") as out:
            out.write(f"observed {self.seen[0]}")


def test_a_plain_agents_own_save_writes_the_model_file(qa, tmp_path, capsys):
    path = tmp_path / "m.txt"
    # saved when training ends (one epoch observed), or at its best validation (the epoch and the valid split)
    for validate, observed in ((-1, ROWS), (1, 2 * ROWS)):
        path.unlink(missing_ok=True)
        opts = _opts(qa, model_file=str(path), validation_every_n_epochs=validate)
        run(create_world(opts, agent=SavingAgent), opts)
        assert path.read_text() == f"observed {observed}"
        assert json.loads(open(opt_path(str(path))).read())["model"] == f"{__name__}:SavingAgent"
    assert "nothing was written there" not in capsys.readouterr().err
    other = tmp_path / "none.txt"
    opts = _opts(qa, model_file=str(other))
    run(create_world(opts, agent=RecordingAgent), opts)
    assert not other.exists() and "RecordingAgent is not a TorchAgent and has no save(path); nothing was written " \
                                  "there" in capsys.readouterr().err
