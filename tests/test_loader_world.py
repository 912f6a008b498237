import pytest
from hypothesis import given, settings, strategies as st

from accelbatch.agents import History
from accelbatch.data.squash import squash_episode
from accelbatch.loader_world import LoaderWorld
from accelbatch.messages import Message
from accelbatch.opts import Opts
from accelbatch.run import attach_backend, evaluate
from accelbatch.worlds import BatchWorld, MultiWorld, create_world


@pytest.fixture
def qa_file(write_jsonl):
    # 101 examples: one line per example, varied lengths so dynamic batching has work to do
    return write_jsonl([{"text": " ".join(["w"] * (1 + (i * 7) % 23)) + f" q{i}", "labels": [f"a{i}"]}
                        for i in range(101)])


@pytest.mark.parametrize("strategy", ["batchsort", "full", "buckets"])
def test_every_strategy_evaluates_each_example_once(qa_file, strategy):
    opts = Opts(task=f"jsonl:{qa_file}", model="repeat_label", datatype="valid", batchsize=8,
                dynamic_batching=strategy, progress=False)
    world = create_world(opts)
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
    attach_backend(reference, opts)
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


def test_training_through_the_loader_learns():
    opts = Opts(task="babi:1", dynamic_batching="batchsort", batchsize=32, progress=False)
    world = create_world(opts)
    attach_backend(world, opts)
    for _ in range(200):
        world.parley()
    world.reset_metrics()
    for _ in range(20):
        world.parley()
    assert world.report()["accuracy"] > 0.8
    assert world.get_total_exs() == 220 * 32
    world.shutdown()


def test_multitask_through_the_loader(qa_file):
    opts = Opts(task=f"babi:1,jsonl:{qa_file}", model="repeat_label", datatype="valid", batchsize=8,
                dynamic_batching="batchsort", progress=False)
    world = create_world(opts)
    assert isinstance(world, MultiWorld)
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


def test_bucket_training_leaves_padding_rows_out_of_the_loss():
    opts = Opts(task="babi:1", dynamic_batching="buckets", batchsize=16, progress=False)
    world = create_world(opts)
    attach_backend(world, opts)
    steps = 0
    while world.loader.epoch < 2 and steps < 2000:  # a full epoch, with each bucket's partial tail
        world.parley()
        steps += 1
    report = world.report()
    world.shutdown()
    assert report["dropped_exs"] > 0  # partial bucket batches were left out, and counted
    assert world.get_total_exs() + report["dropped_exs"] >= world.num_examples()
