"""The batched front end (LoaderWorld) and what must not change when it takes over: examples, weights,
metrics."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch
from helpers import LabelEchoTorchAgent
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.agents import History
from accelbatch.build import attach_runtime, create_world
from accelbatch.data.squash import squash_episode
from accelbatch.loader_world import LoaderWorld
from accelbatch.messages import Message
from accelbatch.opts import Opts
from accelbatch.run import evaluate, run
from accelbatch.worlds import BatchWorld


@pytest.fixture
def qa_file(write_jsonl):
    # 101 examples: one line per example, varied lengths so dynamic batching has work to do
    return write_jsonl([{"text": " ".join(["w"] * (1 + (i * 7) % 23)) + f" q{i}", "labels": [f"a{i}"]}
                        for i in range(101)])


@pytest.mark.parametrize("strategy", ["batchsort", "full", "buckets"])
def test_every_strategy_evaluates_each_example_once(qa_file, strategy):
    opts = Opts(task=f"jsonl:{qa_file}", datatype="valid", batchsize=8, dynamic_batching=strategy, progress=False)
    world = create_world(opts, agent=LabelEchoTorchAgent(opts))
    assert isinstance(world, LoaderWorld)
    report = evaluate(world)
    world.shutdown()
    assert report["exs"] == 101 and report["accuracy"] == 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, workers", [("sync", 2), ("async", 0), ("async-rebatched", 1)])
def test_worker_modes_evaluate_each_example_once(qa_file, mode, workers):
    opts = Opts(task=f"jsonl:{qa_file}", model="repeat_label", datatype="valid", batchsize=8,
                dataloader_mode=mode, num_workers=workers, progress=False)
    world = create_world(opts)
    try:
        report = evaluate(world)
    finally:
        world.shutdown()
    assert report["exs"] == 101 and report["accuracy"] == 1.0


def test_streaming_split_reads_the_file_lazily(qa_file):
    opts = Opts(task=f"jsonl:{qa_file}", model="repeat_label", datatype="valid:stream", batchsize=4,
                progress=False)
    world = create_world(opts)
    assert world.num_examples() == 101
    report = evaluate(world)
    world.shutdown()
    assert report["exs"] == 101 and report["accuracy"] == 1.0


def test_loader_world_and_batch_world_agree_on_the_same_model():
    """Squashing in the loader and the agent's own history give the model the same text."""
    opts = Opts(task="babi:1", datatype="valid", batchsize=16, progress=False)
    reference = create_world(opts)
    assert isinstance(reference, BatchWorld)
    attach_runtime(reference, opts)
    ref = evaluate(reference)
    model = reference.get_model_agent()
    for strategy in ("batchsort", "buckets"):
        world = create_world(opts.replace(dynamic_batching=strategy), agent=model)
        report = evaluate(world)
        world.shutdown()
        assert report["exs"] == ref["exs"] == 1000
        assert report["accuracy"] == ref["accuracy"]
        if strategy == "batchsort":  # buckets leave out the loss of batches with padding rows
            assert abs(report["loss"] - ref["loss"]) < 1e-4


@pytest.mark.slow
def test_training_through_the_loader_learns():
    opts = Opts(task="babi:1", dynamic_batching="batchsort", batchsize=32, progress=False)
    world = create_world(opts)
    attach_runtime(world, opts)
    for _ in range(200):
        world.parley()
    world.reset_metrics()
    for _ in range(20):
        world.parley()
    assert world.report()["accuracy"] > 0.8
    assert world.get_total_exs() == 220 * 32
    world.shutdown()


def test_multitask_through_the_loader(qa_file):
    opts = Opts(task=f"babi:1,jsonl:{qa_file}", datatype="valid", batchsize=8, dynamic_batching="batchsort",
                progress=False)
    world = create_world(opts, agent=LabelEchoTorchAgent(opts))
    assert isinstance(world, LoaderWorld)
    report = evaluate(world)
    world.shutdown()
    assert report["exs"] == 1101 and report[f"jsonl:{qa_file}/exs"] == 101


@settings(max_examples=60, deadline=None)
@given(turns=st.integers(1, 6), context_length=st.sampled_from([-1, 1, 2, 3, 5]),
       include_labels=st.booleans())
def test_agent_history_matches_squashing(turns, context_length, include_labels):
    episode = [Message(text=f"x{i}", labels=[f"y{i}"], episode_done=i == turns - 1) for i in range(turns)]
    squashed = [m["text"] for m in squash_episode(episode, context_length, include_labels)]
    history, texts, previous = History(context_length, include_labels), [], None
    for msg in episode:
        texts.append(history.add(msg["text"], previous))
        previous = msg["labels"][0]
    assert texts == squashed


@pytest.mark.slow
def test_bucket_training_leaves_padding_rows_out_of_the_loss():
    opts = Opts(task="babi:1", dynamic_batching="buckets", batchsize=16, progress=False)
    world = create_world(opts)
    attach_runtime(world, opts)
    steps = 0
    while world.loader.steps.pass_ < 2 and steps < 2000:  # a full epoch, with each bucket's partial tail
        world.parley()
        steps += 1
    report = world.report()
    world.shutdown()
    assert report["dropped_exs"] > 0  # partial bucket batches were left out, and counted
    assert world.get_total_exs() + report["dropped_exs"] >= world.num_examples()


@pytest.fixture
def two_lengths_file(write_jsonl):
    """43 examples of 3 tokens and 22 of 10 (the hand count of tests/data' bucket spill test): buckets
    (2, 30-token budget) train 5 batches of 8 and 8 of 3 a pass and leave 1 out; batchsort (-bs 6) 10 of 6 and
    leaves 5 out."""
    return write_jsonl([{"text": " ".join(["w"] * n), "labels": ["a"], "label_candidates": ["a", "b"]}
                        for n in [3] * 43 + [10] * 22])


PASS_OPTS = dict(model="bag", batchsize=6, num_buckets=2, max_batch_tokens=30, progress=False, eval_splits="",
                 validation_every_n_epochs=-1, embedding_size=8, seed=3)
KEPT = {"buckets": (64, 1), "batchsort": (60, 5)}  # (examples trained, left out) per pass


@pytest.mark.parametrize("strategy", ["buckets", "batchsort"])
def test_a_plan_world_counts_passes_with_their_dropped_examples(two_lengths_file, strategy):
    """passes() is whole passes once a pass's last kept batch is parleyed (its dropped examples passed over
    with it, not after the next pass's first batch), and continues after a restore where it was."""
    opts = Opts(task=f"jsonl:{two_lengths_file}", dynamic_batching=strategy, **PASS_OPTS)
    world = create_world(opts)
    attach_runtime(world, opts)
    kept, dropped = KEPT[strategy]
    steps = 0
    while world.passes() < 1:
        world.parley()
        steps += 1
        if steps == 3:
            state, at = world.state_dict(), world.passes()
    assert world.passes() == world.get_total_epochs() == 1.0
    assert world.get_total_exs() == kept and world.report()["dropped_exs"] == dropped
    assert kept + dropped == world.num_examples() == 65
    while world.passes() < 2:
        world.parley()
    assert world.passes() == 2.0 and world.get_total_exs() == 2 * kept and world.report()["dropped_exs"] == 2 * dropped
    world.load_state_dict(state)
    assert world.passes() == at == 3 / steps
    world.shutdown()


@pytest.mark.parametrize("strategy", ["buckets", "batchsort"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_num_epochs_counts_passes_over_the_data_not_examples_trained(two_lengths_file, strategy, epochs):
    """ParlAI's -ne N: N passes over the training data. A plan that leaves examples out trains exactly the
    kept examples of N passes: exs + dropped_exs is N x the file's examples, epochs N."""
    opts = Opts(task=f"jsonl:{two_lengths_file}", dynamic_batching=strategy, num_epochs=epochs, **PASS_OPTS)
    train = run(create_world(opts), opts)["train"]
    kept, dropped = KEPT[strategy]
    assert (train["exs"], train["dropped_exs"], train["epochs"]) == (epochs * kept, epochs * dropped, epochs)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_num_epochs_counts_passes_of_a_streamed_file_through_workers(two_lengths_file):
    opts = Opts(task=f"jsonl:{two_lengths_file}", datatype="train:stream", num_workers=2,
                dynamic_batching="buckets", num_epochs=1, **PASS_OPTS)
    train = run(create_world(opts), opts)["train"]
    assert (train["exs"], train["dropped_exs"], train["epochs"]) == (*KEPT["buckets"], 1)


@pytest.fixture
def dialogue_dir(tmp_path):
    """A folder of train/valid files of multi-turn episodes with candidates (the bag model can learn it)."""
    import random

    rng = random.Random(0)
    for split, episodes in (("train", 60), ("valid", 20)):
        lines = []
        for e in range(episodes):
            turns = rng.randint(1, 3)
            for t in range(turns):
                label = f"l{rng.randint(0, 4)}"
                words = " ".join(f"w{rng.randint(0, 30)}" for _ in range(rng.randint(1, 12)))
                lines.append(json.dumps({"text": f"{words} {label}x", "labels": [label],
                                         "label_candidates": [f"l{i}" for i in range(5)],
                                         "episode_done": t == turns - 1}))
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["bag", "memnn"])
def test_performance_options_never_change_weights_or_metrics(dialogue_dir, model):
    """Same seed, same weights (torch.equal) and the same train and valid metrics: the world of clones,
    2 data workers, the async accessor with and without workers, and the file streamed from disk."""
    base = Opts(task=f"jsonl:{dialogue_dir}", model=model, batchsize=4, max_train_steps=25, progress=False,
                eval_splits="valid", validation_every_n_epochs=-1, log_every_n_secs=1e9, learning_rate=0.05,
                embedding_size=8, seed=7)
    variants = {"clones": {}, "workers": dict(num_workers=2), "async": dict(dataloader_mode="async"),
                "async+workers": dict(dataloader_mode="async", num_workers=2), "stream": dict(datatype="train:stream"),
                "stream+workers": dict(datatype="train:stream", num_workers=2)}
    results = {}
    for name, changes in variants.items():
        opts = base.replace(**changes)
        world = create_world(opts)
        assert isinstance(world, LoaderWorld if "workers" in name or "async" in name else BatchWorld)
        report = run(world, opts)
        weights = [p.detach().clone() for p in world.get_model_agent().model.parameters()]
        results[name] = (weights, {k: v for k, v in report["train"].items() if k in ("exs", "accuracy", "loss")},
                         {k: v for k, v in report["valid"].items() if k in ("exs", "accuracy", "f1", "loss")},
                         {split: sorted(set(report[split]) - {"exs_per_s", "time_s"}) for split in ("train", "valid")})
    reference = results["clones"]
    for name, (weights, train, valid, keys) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(weights, reference[0])), name
        assert train == reference[1] and valid == reference[2], name
        assert keys == reference[3], name  # the same figures reported, none only with workers


class _Staging:
    """An engine that copies batches to a device (here: records what it was asked to stage)."""

    def __init__(self, engine):
        self.engine, self.staged, self.stepped = engine, [], []

    stages = True

    def stage(self, batch):
        self.staged.append(id(batch))

    def train_step(self, batch):
        self.stepped.append(id(batch))
        return self.engine.train_step(batch)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.multiprocess
def test_a_staging_engine_gets_each_batch_one_step_ahead_and_resumes_exactly(dialogue_dir):
    """Cross-call prefetch: the world hands the engine batch k+1 to stage before stepping batch k; the same
    weights as without it, and a checkpoint taken meanwhile resumes with the held batch, not after it."""
    opts = Opts(task=f"jsonl:{dialogue_dir}", model="bag", batchsize=4, num_workers=1, progress=False, seed=3,
                learning_rate=0.05, embedding_size=8, optimizer="sgd")  # the resume below carries weights only
    plain = create_world(opts)
    for _ in range(12):
        plain.parley()
    staged = create_world(opts)
    agent = staged.get_model_agent()
    spy = _Staging(agent.engine)
    agent.slot.engine = spy
    for _ in range(5):
        staged.parley()
    position = json.loads(json.dumps(staged.state_dict()))
    assert spy.staged[:-1] == spy.stepped[1:]  # what was staged at step k is what step k+1 trains
    resumed = create_world(opts)
    resumed.load_state_dict(position)
    resumed.get_model_agent().model.load_state_dict(agent.model.state_dict())
    for _ in range(7):
        resumed.parley()
    for world in (plain, staged, resumed):
        world.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(plain.get_model_agent().model.parameters(),
                                                 resumed.get_model_agent().model.parameters()))


class _CheckingStaging(_Staging):
    """A staging engine that keeps what each batch held when it was staged (what a GPU copy would read) and
    checks, after letting the async worker run, that the batch it steps still holds it."""

    def __init__(self, engine):
        super().__init__(engine)
        self.at_stage, self.changed = {}, []

    def stage(self, batch):
        self.at_stage[id(batch)] = {k: v.clone() for k, v in batch.items()}

    def train_step(self, batch):
        time.sleep(0.05)  # the async worker refills every slot handed back meanwhile
        kept = self.at_stage.pop(id(batch), None)
        if kept is not None and not all(torch.equal(v, batch[k]) for k, v in kept.items()):
            self.changed.append(len(self.stepped))
        return super().train_step(batch)


FEEDS = [  # (the feed, what it is compared with)
    pytest.param(dict(dataloader_mode="async"), dict(), id="async"),
    pytest.param(dict(dataloader_mode="async", num_workers=2), dict(), id="async-workers", marks=pytest.mark.slow),
    pytest.param(dict(num_workers=2), dict(), id="workers", marks=pytest.mark.slow),
    pytest.param(dict(dataloader_mode="async", datatype="train:stream"), dict(), id="async-stream",
                 marks=pytest.mark.slow),
    pytest.param(dict(dataloader_mode="async", dynamic_batching="full"), dict(dynamic_batching="full"),
                 id="async-dynamic", marks=pytest.mark.slow),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("feed, reference", FEEDS)
def test_a_staging_engine_steps_the_batch_it_staged_on_every_feed(dialogue_dir, feed, reference):
    """A CUDA engine stages batch k+1 while batch k steps; through the async accessor's shared-memory ring
    (and data workers, a streamed file, dynamic batching) the world holds both, so neither is refilled before
    it is used: the same weights as the sync feed in the main process."""
    common = dict(task=f"jsonl:{dialogue_dir}", model="bag", batchsize=4, progress=False, seed=3,
                  learning_rate=0.05, embedding_size=8, optimizer="sgd", buffer_size=1)
    weights = {}
    for name, changes in (("reference", reference), ("feed", feed)):
        world = create_world(Opts(**common, **changes))
        agent = world.get_model_agent()
        spy = _CheckingStaging(agent.engine)
        agent.slot.engine = spy
        for _ in range(8):
            world.parley()
        world.shutdown()
        assert len(spy.stepped) == 8 and spy.changed == [], (name, spy.changed)
        weights[name] = [p.detach().clone() for p in agent.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights["reference"], weights["feed"]))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_streamed_file_trains_every_example_once_per_epoch(tmp_path, monkeypatch, workers):
    """`-dt train:stream --num-workers 2 -bs 8 -ne 3` on a 120-example ParlAI file: every epoch trains each
    example once (15 steps of 8 distinct examples), and the report counts what was trained."""
    from accelbatch.cli import main

    lines = [f"text:q{i} w{i % 7}\tlabels:l{i % 3}\tlabel_candidates:l0|l1|l2\tepisode_done:True" for i in range(120)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    record = tmp_path / "trained.txt"
    monkeypatch.setenv("RECORD_TRAINED", str(record))
    report = tmp_path / "report.json"
    assert main(["train", "-t", f"parlai:{tmp_path / 'train.txt'}", "-m", "recording_agent:RecordingBag",
                 "-dt", "train:stream", "--num-workers", str(workers), "-bs", "8", "-ne", "3", "--no-progress",
                 "-vp", "-1", "--eval-splits", "", "--report-json", str(report)]) == 0
    steps = [[int(i) for i in line.split()] for line in record.read_text().splitlines()]
    assert len(steps) == 45 and all(len(s) == len(set(s)) == 8 for s in steps)
    for epoch in range(3):
        trained = sorted(i for s in steps[epoch * 15:(epoch + 1) * 15] for i in s)
        assert trained == list(range(120)), epoch
    assert json.loads(report.read_text())["train"]["exs"] == 360


@pytest.mark.timeout(180)
def test_padding_and_left_out_examples_of_a_resumed_run_and_of_log_windows_add_up_to_one_run(dialogue_dir, tmp_path):
    """Dynamic batching reports pad_fraction over batch_tokens (the tokens fed, padding included) and the
    examples partial buckets left out: a run cut after 7 steps and resumed reports those of the run in one
    go, and the run's log windows, weighted by their tokens, add up to its train row."""
    from accelbatch.cli import main

    common = ["train", "-t", f"jsonl:{dialogue_dir}", "-m", "bag", "-bs", "4", "--dynamic-batching", "buckets",
              "--num-buckets", "3", "--text-truncate", "16", "-ne", "3", "-lr", "0.05", "-esz", "8", "--seed", "5",
              "--no-progress", "-veps", "-1", "--eval-splits", ""]
    log = tmp_path / "log.jsonl"
    assert main([*common, "-ltim", "0.000001", "--metrics-log", str(log),
                 "--report-json", str(tmp_path / "one.json")]) == 0
    model = tmp_path / "m" / "model.pt"
    assert main([*common, "-ltim", "-1", "-tstep", "7", "-mf", str(model), "--save-every-n-secs", "1000"]) == 0
    assert main([*common, "-ltim", "-1", "-mf", str(model), "--resume",
                 "--report-json", str(tmp_path / "two.json")]) == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text())["train"] for n in ("one", "two"))
    assert one["dropped_exs"] > 0 and 0 < one["pad_fraction"] < 1
    for key in ("exs", "dropped_exs", "batch_tokens"):
        assert two[key] == one[key], key
    assert two["pad_fraction"] == pytest.approx(one["pad_fraction"], abs=1e-12)
    windows = [r for r in map(json.loads, log.read_text().splitlines()) if r["split"] == "train" and "exs_per_s" in r]
    assert len(windows) > 3
    assert sum(w.get("batch_tokens", 0) for w in windows) == one["batch_tokens"]
    assert sum(w.get("dropped_exs", 0) for w in windows) == one["dropped_exs"]
    weighted = sum(w["pad_fraction"] * w["batch_tokens"] for w in windows if w.get("batch_tokens"))
    assert weighted / one["batch_tokens"] == pytest.approx(one["pad_fraction"], abs=1e-9)


def _without_time(report):
    return {k: v for k, v in report.items() if not k.endswith("time_s") and "per_s" not in k}


@pytest.mark.parametrize("options", [dict(dynamic_batching="batchsort"),
                                     pytest.param(dict(num_workers=1), marks=[pytest.mark.multiprocess,
                                                                              pytest.mark.timeout(120)]),
                                     pytest.param(dict(dataloader_mode="async"),
                                                  marks=[pytest.mark.multiprocess, pytest.mark.timeout(120)])],
                         ids=["batchsort", "workers", "async"])
def test_a_world_run_has_shut_down_runs_again_and_parleys_on_as_a_batch_world_does(qa_file, options):
    """run() shuts its world down (the loader's processes stop); an evaluation world runs again with the
    same report, and a training world parleyed by hand after its run trains on, as a BatchWorld does."""
    opts = Opts(task=f"jsonl:{qa_file}", datatype="valid", batchsize=8, progress=False, **options)
    world = create_world(opts, agent=LabelEchoTorchAgent)
    assert isinstance(world, LoaderWorld)
    first, again = run(world, opts)["valid"], run(world, opts)["valid"]
    assert first["exs"] == again["exs"] == 101 and _without_time(first) == _without_time(again)
    world.reset()  # shut down by run(): nothing starts until it is used again
    assert not multiprocessing.active_children()
    train = opts.replace(datatype="train", max_train_steps=3, eval_splits="", validation_every_n_epochs=-1)
    world = create_world(train, agent=LabelEchoTorchAgent)
    assert run(world, train)["train"]["exs"] == 24
    world.parley()
    assert world.get_total_exs() == 32
