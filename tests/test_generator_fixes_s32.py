"""Generator fixes (session 32): ltpb is the same in every output mode under dynamic batching; a label cut at
--label-truncate has no end token (ParlAI); loading a model file with another position table names -tr and
--label-truncate; --skip-generation with -vmt accuracy says why and what to give. Expected values are hand counts."""

from __future__ import annotations

import json

import pytest
import torch

import accelbatch as ab
from accelbatch.agents import ModelFileError
from accelbatch.generation import EOS, ByteVocab
from accelbatch.metric_names import metric_names_problem
from accelbatch.model_opts import write_model_opts
from accelbatch.models.generator import TransformerGeneratorAgent
from accelbatch.plan import LOSS_TOKENS

VOCAB = ByteVocab()


def _task(tmp_path, rows: int = 12) -> str:
    """rows examples of 1..7 text bytes (each padded to 8 tokens), every label 'ab': 2 bytes + the end token."""
    for split in ("train", "valid"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(rows):
                f.write(json.dumps({"text": "abcdefg"[: 1 + i % 7], "labels": ["ab"], "episode_done": True}) + "\n")
    return f"jsonl:{tmp_path}"


@pytest.mark.parametrize("mode", ["all", "sum", "final"])
def test_ltpb_is_tokens_per_micro_batch_run_in_every_output_mode_under_dynamic_batching(tmp_path, mode):
    # a budget of 56 tokens holds 7 rows of 8 text tokens; with -di 2 a call takes 6 (a multiple of D):
    # 12 rows are 2 calls of 2 micro-batches of 3 rows, 3 target tokens each: 9 tokens a micro-batch
    opts = ab.Opts(task=_task(tmp_path), model="transformer/generator", embedding_size=8, batchsize=7,
                   device_iterations=2, output_mode=mode, dynamic_batching="full", max_batch_tokens=56,
                   num_epochs=1, eval_splits="", validation_every_n_epochs=-1, progress=False,
                   log_every_n_secs=1000)
    report = ab.run(ab.create_world(opts), opts)["train"]
    assert (report["exs"], report["steps"], report["batch_tokens"]) == (12, 2, 12 * 8)
    # all and sum count every row (12 x 3 tokens over 4 micro-batches); final the last micro-batch of each call
    assert report["tokens"] == (18.0 if mode == "final" else 36.0)
    assert report["ltpb"] == 9.0  # all said 18 (36 tokens over one "batch of -bs 7 rows" a call)


def test_a_label_cut_at_label_truncate_keeps_no_end_token():
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, label_truncate=3))
    label = {t: agent.vectorize(ab.Message(text="q", labels=[t]))["label_vec"] for t in ("uvwxyz", "uvw", "uv")}
    # ParlAI: the end token is added, then the whole is cut to 3 tokens
    assert label["uvwxyz"] == VOCAB.encode("uvw")  # was uvw + EOS: 4 tokens, past --label-truncate 3
    assert label["uvw"] == VOCAB.encode("uvw")
    assert label["uv"] == VOCAB.encode("uv") + [EOS]
    batch = agent.batchify([agent.vectorize(ab.Message(text="q", labels=[t])) for t in ("uvwxyz", "u", "uv")])
    assert batch[LOSS_TOKENS].tolist() == [3, 2, 3] and batch["label_vec"].shape == (3, 8)
    # generation runs --label-truncate steps (ParlAI's), within the positions the core has
    out = agent.model.eval()(batch)
    assert agent.model.max_len == 3 and out["preds"].shape == (3, 3) and int(out["tokens"].sum()) == 8


def test_a_position_table_of_another_size_names_the_truncation_options_and_their_trained_values(tmp_path):
    path = str(tmp_path / "m.pt")
    trained = ab.Opts(model="transformer/generator", embedding_size=8, text_truncate=16, label_truncate=4)
    TransformerGeneratorAgent(trained).save(path)
    write_model_opts(path, trained, "transformer/generator")
    with pytest.raises(ModelFileError) as err:  # 16 positions: max(-tr 16, 4 + 1 rounded up to 8); -tr 40: 40
        TransformerGeneratorAgent(trained.replace(text_truncate=40, model_file=path))
    text = str(err.value)
    assert "core.positions.weight is [16, 8] in the file but [40, 8]" in text
    assert "(-tr/--text-truncate, --label-truncate)" in text
    assert f"it was trained with -tr 16 --label-truncate 4 ({path}.opt)" in text and "-esz" not in text
    loaded = TransformerGeneratorAgent(trained.replace(model_file=path))  # the trained options load it
    assert torch.equal(loaded.model.core.positions.weight, torch.load(path)["model"]["core.positions.weight"])


def test_skip_generation_with_the_default_vmt_says_why_and_names_a_metric_that_works(tmp_path):
    opts = ab.Opts(task=_task(tmp_path, 4), model="transformer/generator", embedding_size=8, skip_generation=True,
                   num_epochs=1, progress=False)
    problem = metric_names_problem(ab.create_world(opts), opts)
    assert problem is not None and problem.startswith(
        "-vmt/--validation-metric accuracy (the default when -vmt is not given): with --skip-generation "
        "TransformerGeneratorAgent")
    assert "give -vmt loss" in problem and "leave --skip-generation out" in problem
    for vmt in ("loss", "ppl", "token_acc"):
        fine = opts.replace(validation_metric=vmt)
        assert metric_names_problem(ab.create_world(fine), fine) is None
    with pytest.raises(ab.opts.OptionError, match=r"accuracy \(the default when -vmt is not given\): with --skip"):
        ab.run(ab.create_world(opts), opts)
