"""make_loader: every mode x strategy x workers gives the same steps; collate in the workers; training and
evaluation rules."""

from __future__ import annotations

import gc
import json
import os
from collections import Counter

import pytest
import torch

from accelbatch.data import LoaderConfig, make_loader
from accelbatch.data.batching import STRATEGIES
from accelbatch.data.loader import AgentCollate
from accelbatch.messages import Message
from accelbatch.opts import Opts

from . import no_leaks  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


# --- an agent-like collate: per-row vectorize, batchify pads (module level: it runs in workers) -------

def vectorize(msg):
    msg = Message(msg)
    msg["text_vec"] = torch.tensor([len(w) for w in msg["text"].split()] or [0])
    msg["vec_pid"] = os.getpid()
    return msg


def batchify(rows):
    width = max(len(r["text_vec"]) for r in rows)
    text = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        text[i, :len(r["text_vec"])] = r["text_vec"]
    return {"text_vec": text, "vec_pid": torch.tensor([r["vec_pid"] for r in rows]),
            "batchify_pid": torch.full((len(rows),), os.getpid())}


COLLATE = AgentCollate(vectorize, batchify)


def batchify_counting_frozen(rows):
    """batchify, plus how many objects the process that runs it has frozen out of the garbage collector's reach."""
    out = batchify(rows)
    out["frozen"] = torch.full((len(rows),), gc.get_freeze_count())
    return out


def examples(n=203, seed=0):
    import random

    rng = random.Random(seed)
    return [Message({"text": f"q{i} " + "w " * int(rng.lognormvariate(1.5, 0.9)), "labels": [f"a{i}"],
                     "episode_done": True}) for i in range(n)]


def write_jsonl(path, msgs):
    with open(path, "w") as f:
        for m in msgs:
            f.write(json.dumps(dict(m)) + "\n")
    return str(path)


def key(msg):
    return msg["text"].split()[0]


def run_epoch(loader):
    seen, shapes = [], set()
    for b in loader:
        assert b.rows >= b.num_real == len(b.ids) == len(b.lengths)
        assert b.tensors["text_vec"].shape[0] == b.rows
        if loader.config.dynamic_batching == "buckets":
            assert b.tensors["text_vec"].shape[1] == b.padded_len
        seen += [key(m) for m in b.messages]
        shapes.add(tuple(b.tensors["text_vec"].shape))
    return seen, shapes


CASES = [("map", "sync", 0), ("map", "sync", 2), ("map", "async", 0), ("map", "async-rebatched", 2),
         ("stream", "sync", 0), ("stream", "sync", 2), ("stream", "async", 2)]


def steps_of(loader, passes=1):
    return [(b.step, b.ids, b.rows, b.padded_len) for _ in range(passes) for b in loader]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, mode, workers", CASES)
def test_evaluation_sees_every_example_exactly_once(tmp_path, kind, mode, workers, no_leaks):
    msgs = examples()
    data = msgs if kind == "map" else write_jsonl(tmp_path / "d.jsonl", msgs)
    expected = Counter(key(m) for m in msgs)
    for strategy in STRATEGIES:
        with make_loader(data, collate=COLLATE, training=False, batch_size=8, mode=mode, num_workers=workers,
                         dynamic_batching=strategy, num_buckets=4, batch_sort_cache_size=50) as loader:
            for epoch in range(2 if strategy == "none" else 1):
                seen, shapes = run_epoch(loader)
                assert Counter(seen) == expected, (strategy, epoch)
            if strategy == "buckets":
                assert len(shapes) <= 4


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["none", "batchsort", "buckets"])
def test_workers_async_and_streaming_never_change_the_steps(tmp_path, strategy, no_leaks):
    """The schedule decides every step; where it is collated (here, workers, the accessor) and where the
    examples live (memory, a file read on demand) do not: the same steps, the same tensors."""
    msgs = examples(90)
    path = write_jsonl(tmp_path / "d.jsonl", msgs)
    reference = None
    for data, mode, workers in [(msgs, "sync", 0), (path, "sync", 0), (msgs, "sync", 2), (path, "async", 2),
                                (msgs, "async", 0)]:
        with make_loader(data, collate=COLLATE, training=True, batch_size=8, mode=mode, num_workers=workers,
                         dynamic_batching=strategy, num_buckets=3, seed=5) as loader:
            got = [(b.step, b.ids, b.tensors["text_vec"].tolist()) for _ in range(2) for b in loader]
        reference = reference or got
        assert got == reference, (data is path, mode, workers)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, workers", [("sync", 2), ("async", 0), ("async", 2)])
def test_data_processes_keep_what_they_inherit_out_of_the_collector(mode, workers, no_leaks):
    """Data workers and the accessor freeze what they start with (the dataset), so full collections there do not
    walk it (nor copy its pages in forked workers); the caller's process is left as it is."""
    frozen_here = gc.get_freeze_count()
    collate = AgentCollate(vectorize, batchify_counting_frozen)
    with make_loader(examples(60), collate=collate, training=False, batch_size=8, mode=mode,
                     num_workers=workers) as loader:
        # read while the loader is open: an async batch's tensors are views of a ring slot, which closing the
        # loader hands back to the worker (it may write the next batch there before it stops)
        frozen = int(next(iter(loader)).tensors["frozen"].min())
    assert frozen > 60  # at least the 60 examples and their dicts' contents
    assert gc.get_freeze_count() == frozen_here


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, workers", [("sync", 2), ("async", 2), ("async-rebatched", 2)])
def test_collate_runs_off_the_main_process(tmp_path, mode, workers, no_leaks):
    data = write_jsonl(tmp_path / "d.jsonl", examples(60))
    with make_loader(data, collate=COLLATE, training=False, batch_size=8, mode=mode, num_workers=workers) as loader:
        batch = next(iter(loader))
        pids = set(batch.tensors["vec_pid"].tolist()) | set(batch.tensors["batchify_pid"].tolist())
    assert os.getpid() not in pids


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_no_worker_drops_a_tail(no_leaks):
    """PopTorch's case (101 examples, 7 workers, batches of 4) loses nothing: steps are planned, not cut per
    worker; training rows run on into the next epoch, so every step is full."""
    with make_loader(examples(101), collate=COLLATE, training=True, batch_size=4, num_workers=7) as loader:
        first = [b for b in loader]
    assert len(first) == 26 and all(b.num_real == b.rows == 4 for b in first)
    assert {key(m) for b in first for m in b.messages} == {key(m) for m in examples(101)}


@pytest.mark.timeout(60)
def test_training_shuffles_each_epoch_and_only_dynamic_batches_drop_the_partial_batch(no_leaks):
    loader = make_loader(examples(50), collate=COLLATE, training=True, batch_size=8, seed=3)
    assert len(loader) == 7 and loader.dropped == 0
    first = [key(m) for b in loader for m in b.messages]
    second = [key(m) for b in loader for m in b.messages]
    assert len(set(first[:48])) == 48 and first != sorted(first) and first != second
    again = make_loader(examples(50), collate=COLLATE, training=True, batch_size=8, seed=3)
    assert [key(m) for b in again for m in b.messages] == first          # seeded
    sorted_ = make_loader(examples(50), collate=COLLATE, training=True, batch_size=8, dynamic_batching="batchsort")
    assert len(sorted_) == 6 and sorted_.dropped == 2
    keep = make_loader(examples(50), collate=COLLATE, training=True, batch_size=8, drop_last=False,
                       dynamic_batching="batchsort")
    assert sum(b.num_real for b in keep) == 50


@pytest.mark.timeout(60)
def test_a_training_pass_of_buckets_leaves_out_its_partial_batch_and_counts_it(no_leaks):
    """43 examples of 3 words and 22 of 10, 2 buckets under a 30-token budget (the hand count of
    test_buckets_take_whole_batches_and_spill_the_rest_to_a_longer_bucket): a training pass is 5 batches of 8
    and 8 of 3, every row real; the 1 example of the partial batch is left out by the plan, and counted."""
    msgs = [Message({"text": " ".join(["w"] * n), "labels": ["a"], "episode_done": True}) for n in [3] * 43 + [10] * 22]
    with make_loader(msgs, collate=COLLATE, training=True, batch_size=8, dynamic_batching="buckets", num_buckets=2,
                     max_batch_tokens=30, seed=1) as loader:
        assert len(loader) == 13 and loader.dropped == 1
        for _ in range(2):  # every pass alike
            batches = list(loader)
            assert sorted((b.rows, b.num_real) for b in batches) == [(3, 3)] * 8 + [(8, 8)] * 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_split_the_data_and_train_in_step(strategy, no_leaks):
    msgs = examples(101)
    eval_seen, train_counts = [], []
    for replica in range(3):
        shard = (replica, 3)
        with make_loader(msgs, collate=COLLATE, training=False, batch_size=4, dynamic_batching=strategy,
                         shard=shard) as loader:
            eval_seen += [key(m) for b in loader for m in b.messages]
        with make_loader(msgs, collate=COLLATE, training=True, batch_size=4, dynamic_batching=strategy,
                         shard=shard) as loader:
            train_counts.append(len(list(loader)))
    assert Counter(eval_seen) == Counter(key(m) for m in msgs)
    assert len(set(train_counts)) == 1


@pytest.mark.timeout(60)
def test_buckets_pad_to_static_shapes(no_leaks):
    with make_loader(examples(300), collate=COLLATE, training=False, batch_size=8, dynamic_batching="buckets",
                     num_buckets=3) as loader:
        assert loader.shapes is not None and len(loader.shapes) <= 3
        planned = {s.shape for s in loader.shapes}
        shapes = {tuple(b.tensors["text_vec"].shape) for b in loader}
        assert shapes <= planned


@pytest.mark.timeout(60)
def test_static_rows_pad_the_last_evaluation_batch(no_leaks):
    with make_loader(examples(10), collate=COLLATE, training=False, batch_size=4, static_rows=True) as loader:
        batches = list(loader)
    assert [b.rows for b in batches] == [4, 4, 4] and batches[-1].num_real == 2
    assert batches[-1].tensors["text_vec"][2:].abs().sum() == 0


def short_length(msg):
    return 1


@pytest.mark.timeout(60)
def test_bucket_length_fn_that_undercounts_is_a_clear_error(no_leaks):
    loader = make_loader(examples(20), collate=COLLATE, training=False, batch_size=4, dynamic_batching="buckets",
                         length_fn=short_length)
    with pytest.raises(ValueError, match="length_fn"):
        list(loader)


def test_config_from_opts_and_errors(tmp_path):
    opts = Opts(batchsize=5, dataloader_mode="async", dynamic_batching="full", num_workers=1, buffer_size=2)
    config = LoaderConfig.from_opts(opts, num_workers=0)
    assert (config.batch_size, config.mode, config.dynamic_batching, config.num_workers, config.buffer_size) == \
        (5, "async", "full", 0, 2)
    with pytest.raises(ValueError, match="--dataloader-mode"):
        LoaderConfig(mode="threads")
    with pytest.raises(ValueError, match="no examples"):
        make_loader([], batch_size=2)
    stream = make_loader(write_jsonl(tmp_path / "d.jsonl", examples(5)), batch_size=2, training=False)
    assert len(stream) == 3 and sum(b.num_real for b in stream) == 5


def test_episodes_are_squashed_and_no_collate_means_no_tensors():
    episode = [Message({"text": "x1", "labels": ["y1"]}), Message({"text": "x2", "labels": ["y2"],
                                                                   "episode_done": True})]
    rows = make_loader([episode], batch_size=2, training=False, context_length=-1, include_labels=True)
    first, second = list(rows)  # a row serves its episode turn by turn, as a teacher clone does
    assert [m["full_text"] for m in first.messages + second.messages] == ["x1", "x1\ny1\nx2"]
    assert first.tensors is None and first.ids + second.ids == [0, 1]
    (batch,) = list(make_loader([episode], batch_size=2, training=False, dynamic_batching="batchsort"))
    assert sorted(m["full_text"] for m in batch.messages) == ["x1", "x1\ny1\nx2"]
    assert [m["text"] for m in batch.messages] == [batch.messages[i]["text"] for i in range(2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("label_truncate, rows", [(-1, 6), (4, 4)])
def test_full_default_budget_is_parlais(no_leaks, label_truncate, rows):
    """Default budget (text_truncate + label_truncate) x bs, counted on the padded text: 40 examples of exactly
    10 words (MessageLength), -bs 2, --text-truncate 16. By hand: label truncation -1 means 16, so the budget is
    (16 + 16) x 2 = 64 tokens: 6 rows of 10 (60 <= 64 < 70); with --label-truncate 4: (16 + 4) x 2 = 40 tokens:
    4 rows. The old default (bs x median length = 20 tokens) gave 2."""
    msgs = [Message({"text": " ".join(["w"] * 10), "labels": ["a"], "episode_done": True}) for _ in range(40)]
    opts = Opts(batchsize=2, text_truncate=16, label_truncate=label_truncate, dynamic_batching="full")
    with make_loader(msgs, opts, training=False) as loader:
        batches = list(loader)
    assert sorted(i for b in batches for i in b.ids) == list(range(40))
    assert all(b.padded_len == 10 for b in batches)
    assert max(b.num_real for b in batches) == rows


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_async_batches_reach_the_caller_in_the_accessors_ring(workers, no_leaks):
    """With or without data workers, an async batch's tensors are views of the accessor's shared-memory ring:
    a data worker's pickled batch is unpickled in the accessor's process, not copied out of its bytes in the
    caller's, on the training step's path."""
    with make_loader(examples(60), collate=COLLATE, training=False, batch_size=8, mode="async",
                     num_workers=workers) as loader:
        shared = [t.is_shared() for batch in loader for t in batch.tensors.values()]
    assert len(shared) == 3 * 8 and all(shared)
