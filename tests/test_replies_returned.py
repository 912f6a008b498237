"""A turn without a label that more turns of its episode follow joins their history with the model's reply
(ParlAI's self_observe). An output mode that returns the outputs of some of a training call's micro-batches
only (final with -ga/-di above 1) leaves the others' replies unknown: refused before the first step, naming
--output-mode all, with which -ga 2 trains -rf 2's weights."""

from __future__ import annotations

import json

import pytest
import torch

import accelbatch as ab
from accelbatch.opts import OptionError


def _episodes(path, mid_context: bool):
    """14 episodes of 1-5 turns; with ``mid_context`` the first turn of every fourth one has no label."""
    with open(path, "w") as f:
        for e in range(14):
            turns = [1, 2, 3, 5, 4, 1, 2][e % 7]
            for t in range(turns):
                row = {"text": f"e{e} t{t} words", "label_candidates": [f"y{e}.{t}", f"z{e}.{t}", "other"],
                       "episode_done": t == turns - 1}
                if not (mid_context and t == 0 and turns > 1 and e % 4 == 2):
                    row["labels"] = [f"y{e}.{t}"]
                f.write(json.dumps(row) + "\n")
    return path


def _opts(data, **plan):
    return ab.Opts(task=f"jsonl:{data}", model="bag", batchsize=2, num_epochs=1.0, datatype="train:ordered",
                   validation_every_n_epochs=-1, eval_splits="", progress=False, embedding_size=8, **plan)


def _weights(opts):
    world = ab.create_world(opts)
    ab.run(world, opts)
    return {k: v.clone() for k, v in world.get_model_agent().model.state_dict().items()}


@pytest.mark.parametrize("plan", [dict(gradient_accumulation=2), dict(device_iterations=2),
                                  dict(device_iterations=2, output_mode="everyn", output_return_period=2)],
                         ids=["ga2", "di2", "everyn"])
def test_an_output_mode_that_drops_rows_awaiting_replies_is_refused_before_any_step(tmp_path, plan):
    data = _episodes(tmp_path / "mid.jsonl", mid_context=True)
    with pytest.raises(OptionError, match="whose history holds the model's reply to it; --output-mode "
                                          r"(final|everyn) returns .* train with --output-mode all"):
        ab.create_world(_opts(data, **plan))
    _weights(_opts(_episodes(tmp_path / "plain.jsonl", mid_context=False), **plan))  # no such turn: trains


def test_with_every_output_returned_ga2_trains_the_weights_of_rf2(tmp_path):
    data = _episodes(tmp_path / "mid.jsonl", mid_context=True)
    accumulated = _weights(_opts(data, gradient_accumulation=2, output_mode="all"))
    replicated = _weights(_opts(data, replication_factor=2))
    for key, value in replicated.items():
        torch.testing.assert_close(accumulated[key], value, rtol=0, atol=1e-6)


def test_a_call_that_dropped_a_row_awaiting_its_reply_stops_the_run_in_one_line():
    """A user's teacher (data not known ahead): checked call by call, on the rows the output mode left out."""
    from types import SimpleNamespace

    from accelbatch.agent_checks import refuse_lost_replies
    from accelbatch.agents import History

    opts = ab.Opts(task="my.teachers:Chat", gradient_accumulation=2)
    rows = [{"text": "context", "episode_done": False}, {"text": "q", "labels": ["a"], "episode_done": False},
            {"text": "q", "labels": ["a"], "episode_done": True}, {"text": "last", "episode_done": True}]
    agent = SimpleNamespace(history=History(-1, True), opts=opts)
    refuse_lost_replies(agent, rows, [0, 1], 4)  # rows 2 and 3 left out: neither awaits a reply
    with pytest.raises(OptionError, match="-t my.teachers:Chat: a turn without a label .* --output-mode final"):
        refuse_lost_replies(agent, rows, [2, 3], 4)  # row 0 left out
    refuse_lost_replies(SimpleNamespace(history=History(1, True), opts=opts), rows, [2, 3], 4)  # no answers kept


@pytest.mark.parametrize("mode", ["batchsort", "full"])
def test_a_streamed_file_awaiting_replies_is_refused_by_dynamic_batching_before_any_step(tmp_path, mode):
    """Its batches are planned from every example's history length, read through before the first step: the
    turn is met there (it was met at its batch, after steps trained on histories without the reply)."""
    data = _episodes(tmp_path / "mid.jsonl", mid_context=True)
    opts = _opts(data, dynamic_batching=mode).replace(datatype="train:stream")
    with pytest.raises(OptionError, match=f"--dynamic-batching {mode} builds histories ahead of the model"):
        ab.create_world(opts)


@pytest.mark.parametrize("loader", [dict(num_workers=1), dict(dynamic_batching="batchsort")], ids=str)
def test_under_the_loader_front_end_its_own_refusal_is_the_one_said(tmp_path, loader):
    """--output-mode all would not help there: the line names what does."""
    data = _episodes(tmp_path / "mid.jsonl", mid_context=True)
    with pytest.raises(OptionError, match="builds histories ahead of the model and cannot") as refused:
        ab.create_world(_opts(data, gradient_accumulation=2, **loader))
    assert "--output-mode all" not in str(refused.value)
