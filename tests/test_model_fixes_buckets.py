"""``--dynamic-batching buckets`` with the generator and with empty texts: every batch's text tensor has its
bucket's planned width (the plan counts the width batchify makes), and evaluating through buckets gives the
report evaluating without dynamic batching gives."""

from __future__ import annotations

import pytest

import accelbatch as ab
from accelbatch.data import make_loader
from accelbatch.data.buckets import bucket_padding_bound, plan_buckets
from accelbatch.models.generator import TransformerGeneratorAgent
from accelbatch.tasks.reverse import generate

GEN = dict(model="transformer/generator", embedding_size=16, progress=False, seed=0)


def test_generator_batches_have_their_buckets_planned_width():
    # reverse's words are 3-8 bytes: text + label + 1 planned widths 7-17, where batchify pads text_vec to 8
    opts = ab.Opts(task="reverse:200", batchsize=8, dynamic_batching="buckets", **GEN)
    agent = TransformerGeneratorAgent(opts)
    data = [ep[0] for ep in generate(200, 0, "train")]
    with make_loader(data, opts, collate=agent.collate_fn(), training=False, length_fn=agent.example_length) as loader:
        planned = {s.shape for s in loader.shapes}
        seen = [b for b in loader]
    assert sum(b.num_real for b in seen) == len(data)
    for b in seen:
        assert tuple(b.tensors["text_vec"].shape) == (b.rows, b.padded_len) and (b.rows, b.padded_len) in planned
        # the planned width holds every byte of the batch's texts
        assert max(len(m["text"].encode()) for m in b.messages) <= b.padded_len


def test_generator_trains_and_evaluates_through_buckets():
    opts = ab.Opts(task="reverse:200", batchsize=8, dynamic_batching="buckets", max_train_steps=3,
                   eval_splits="valid", **GEN)
    world = ab.create_world(opts)
    try:
        for _ in range(3):
            world.parley()
        agent = world.get_model_agent()
        assert agent.report()["tokens"] > 0
        valid = {}
        for strategy in ("buckets", "none"):
            w = ab.create_world(opts.replace(datatype="valid", dynamic_batching=strategy), agent=agent)
            valid[strategy] = ab.evaluate(w)
            w.shutdown()
    finally:
        world.shutdown()
    assert valid["buckets"]["exs"] == valid["none"]["exs"] == 10
    for key in ("loss", "token_acc", "tokens", "accuracy", "f1"):
        assert valid["buckets"][key] == pytest.approx(valid["none"][key], rel=1e-4, abs=1e-6), key


def test_generator_texts_longer_than_the_truncation_fit_the_models_positions(write_jsonl):
    # text_truncate 16: the model has 16 positions; planning on text + label + 1 (16 + 9) padded text_vec to 25
    rows = [{"text": "t" * (20 + i), "labels": ["ab" * (i + 1)], "episode_done": True} for i in range(6)]
    path = write_jsonl(rows)
    common = dict(task=f"jsonl:{path}", datatype="valid", batchsize=2, text_truncate=16, label_truncate=8, **GEN)
    reports = {}
    for strategy in ("buckets", "none"):
        world = ab.create_world(ab.Opts(dynamic_batching=strategy, **common))
        reports[strategy] = ab.evaluate(world)
        world.shutdown()
    assert reports["buckets"]["exs"] == 6
    for key in ("loss", "tokens", "accuracy"):
        assert reports["buckets"][key] == pytest.approx(reports["none"][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("model", ["bag", "conv"])
def test_a_bucket_of_empty_texts_has_one_padding_position(write_jsonl, model):
    rows = [{"text": t, "labels": [lab], "label_candidates": ["x", "y"], "episode_done": True}
            for t, lab in (("apple", "x"), ("", "y"), ("", "x"), ("banana split", "y"), ("", "y"))]
    path = write_jsonl(rows)
    reports = {}
    for strategy in ("buckets", "none"):
        opts = ab.Opts(task=f"jsonl:{path}", model=model, datatype="valid", batchsize=2, embedding_size=8,
                       dynamic_batching=strategy, progress=False, seed=1)
        world = ab.create_world(opts)
        reports[strategy] = ab.evaluate(world)
        world.shutdown()
    assert reports["buckets"]["exs"] == 5
    for key in ("loss", "accuracy"):
        assert reports["buckets"][key] == pytest.approx(reports["none"][key], rel=1e-5), key


def test_plan_buckets_gives_every_static_length_one_position_at_least():
    assert [s.padded_len for s in plan_buckets([0, 0, 3], 2)] == [1, 3]
    assert [s.padded_len for s in plan_buckets([0, 1, 3], 3)] == [1, 3]  # 0 and 1 share the width-1 bucket
    # by hand: lengths 0 and 2 in buckets of width 1 and 2 feed 3 positions, 1 of them padding
    assert bucket_padding_bound([0, 2], 2) == pytest.approx(1 / 3)
