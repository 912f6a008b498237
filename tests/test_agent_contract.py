"""A user's TorchAgent (build_model, vectorize, batchify, replies: the README's custom agent) is held to its
contract in one line naming the class and method, the same with or without data workers:

- the rows of a step are judged by the observations observe() saw, not by what vectorize returns: a vectorize
  that returns a new dict of features alone trains the same weights as one returning the observation;
- a vectorize, batchify or build_model returning the wrong kind of value, or a method the subclass must define
  and does not, is refused naming it (exit 2 on the command line), not a traceback deep in the step;
- a model whose outputs have other rows than the call returns is refused naming its forward, whatever the
  plan (-ga, -di, -rf, --output-mode, the IPU emulator), and a correct one is not;
- a teacher's candidates given as one str ("red|blue|green") are refused where a non-str text is.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import accelbatch as ab
from accelbatch.agents import hash_tokens, pad_2d, tokenize
from accelbatch.cli import main
from accelbatch.messages import ReplyError
from accelbatch.tasks.files import DataFileError

VOCAB = 1024
COLOURS = ["red", "blue", "green", "yellow"]


class Ranker(nn.Module):
    """The README's sample ranker: scores each row's candidates against its text."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.text = nn.EmbeddingBag(VOCAB, dim, mode="sum", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.cand = nn.Embedding(VOCAB, dim, padding_idx=0)

    def forward(self, batch):
        q = self.mlp(self.text(batch["text_vec"]))
        scores = torch.einsum("rd,rcd->rc", q, self.cand(batch["cand_ids"]))
        scores = scores.masked_fill(batch["cand_ids"] == 0, torch.finfo(scores.dtype).min)
        out = {"scores": scores}
        if "label_index" in batch:
            out["loss"] = F.cross_entropy(scores, batch["label_index"])
        return out


class MyAgent(ab.TorchAgent):
    def build_model(self):
        return Ranker(self.opts.embedding_size, 32)

    def vectorize(self, obs):
        obs["text_vec"] = hash_tokens(tokenize(obs.get("text", "")), VOCAB)
        cands = obs.get("label_candidates") or []
        obs["cand_ids"] = [hash_tokens([c], VOCAB)[0] for c in cands]
        answers = obs.get("labels") or obs.get("eval_labels") or []
        obs["label_index"] = next((i for i, c in enumerate(cands) if c in answers), -1)
        return obs

    def batchify(self, observations):
        batch = {"text_vec": pad_2d([o["text_vec"] for o in observations]),
                 "cand_ids": pad_2d([o["cand_ids"] for o in observations])}
        if all(o["label_index"] >= 0 for o in observations):
            batch["label_index"] = torch.tensor([o["label_index"] for o in observations])
        return batch

    def replies(self, outputs, observations):
        best = outputs["scores"].float().argmax(-1).tolist()
        return [{"text": (o.get("label_candidates") or [""])[i]} for o, i in zip(observations, best)]


class FeaturesOnly(MyAgent):
    """vectorize returns a new dict holding only the features (no text, no labels)."""

    def vectorize(self, obs):
        full = super().vectorize(ab.Message(obs))
        return {key: full[key] for key in ("text_vec", "cand_ids", "label_index")}


class LabelsPopped(MyAgent):
    """vectorize returns the observation, its text and labels taken out once read."""

    def vectorize(self, obs):
        obs = super().vectorize(obs)
        for key in ("text", "labels", "eval_labels"):
            obs.pop(key, None)
        return obs


class NoReturn(MyAgent):
    def vectorize(self, obs):
        super().vectorize(obs)  # forgot `return obs`


class ListBatch(MyAgent):
    def batchify(self, observations):
        return list(super().batchify(observations).values())


class ListValue(MyAgent):
    def batchify(self, observations):
        return {**super().batchify(observations), "ids": [o["label_index"] for o in observations]}


class FewerBatchRows(MyAgent):
    def batchify(self, observations):
        return {k: v[:-1] for k, v in super().batchify(observations).items()}


class NoModelReturned(MyAgent):
    def build_model(self):
        Ranker(self.opts.embedding_size, 32)  # forgot `return`


class NoBatchify(ab.TorchAgent):
    build_model, vectorize, replies = MyAgent.build_model, MyAgent.vectorize, MyAgent.replies


class NoReplies(ab.TorchAgent):
    build_model, vectorize, batchify = MyAgent.build_model, MyAgent.vectorize, MyAgent.batchify


class NoBuildModel(ab.TorchAgent):
    vectorize, batchify, replies = MyAgent.vectorize, MyAgent.batchify, MyAgent.replies


class Doubled(Ranker):
    def forward(self, batch):
        out = super().forward(batch)
        out["scores"] = out["scores"].repeat(2, 1)
        return out


class Fewer(Ranker):
    def forward(self, batch):
        out = super().forward(batch)
        out["scores"] = out["scores"][:-1]
        return out


class DoubledRows(MyAgent):
    def build_model(self):
        return Doubled(self.opts.embedding_size, 32)


class FewerRows(MyAgent):
    def build_model(self):
        return Fewer(self.opts.embedding_size, 32)


@pytest.fixture
def colours(tmp_path):
    """A folder of train (32 turns) / valid / test (8 each) JSONL files: 'item i is COLOUR', 4 candidates."""
    for split, n in (("train", 32), ("valid", 8), ("test", 8)):
        rows = [{"text": f"item {i} is {COLOURS[i % 4]}", "labels": [COLOURS[i % 4]], "label_candidates": COLOURS}
                for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return f"jsonl:{tmp_path}"


def trained(task, agent, **extra):
    """(report, model weights) of one epoch at -bs 4, validated on the valid split."""
    opts = ab.Opts(task=task, batchsize=4, num_epochs=1, embedding_size=16, eval_splits="valid", progress=False,
                   **extra)
    world = ab.create_world(opts, agent=agent)
    report = ab.run(world, opts)
    return report, world.get_model_agent().model.state_dict()


def scores(report):
    return {split: {k: v for k, v in rows.items() if k in ("exs", "accuracy", "f1", "loss")}
            for split, rows in report.items() if split in ("train", "valid")}


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("agent", [FeaturesOnly, LabelsPopped])
def test_what_vectorize_returns_never_makes_a_row_padding(colours, agent):
    """Every turn trains: the same weights and scores as the sample agent, whose vectorize returns the
    observation (before, every row was padding: nothing trained, the report held exs alone)."""
    want_report, want = trained(colours, MyAgent)
    report, weights = trained(colours, agent)
    assert want_report["train"]["exs"] == 32 and "loss" in want_report["train"]
    assert scores(report) == scores(want_report)
    assert same_weights(weights, want)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_features_only_vectorize_trains_the_same_with_a_data_worker(colours):
    """--num-workers 1 (vectorize and batchify in a worker) trains the weights the clones' world trains."""
    want_report, want = trained(colours, MyAgent)
    report, weights = trained(colours, FeaturesOnly, num_workers=1)
    assert scores(report) == scores(want_report)
    assert same_weights(weights, want)


BAD_AGENTS = [
    (NoReturn, "NoReturn.vectorize returned None; return the observation (a dict)"),
    (ListBatch, "ListBatch.batchify returned list: it must return a dict of tensors"),
    (ListValue, "ListValue.batchify returned a dict whose 'ids' is list: every value must be a tensor"),
    (FewerBatchRows, "FewerBatchRows.batchify returned 3 rows for 4 observations"),
    (NoModelReturned, "NoModelReturned.build_model() returned NoneType: it must return the torch.nn.Module"),
    (NoBatchify, "NoBatchify must implement batchify(observations)"),
    (NoReplies, "NoReplies must implement replies(outputs, observations)"),
    (NoBuildModel, "NoBuildModel must implement build_model()"),
    (DoubledRows, "DoubledRows's model (Doubled.forward) returned 'scores' with 8 rows for the batch's 4 rows"),
    (FewerRows, "FewerRows's model (Fewer.forward) returned 'scores' with 3 rows for the batch's 4 rows"),
]


@pytest.mark.parametrize("device", ["cpu", "ipu"])  # the IPU's engine (its emulator) is refused the same
@pytest.mark.parametrize("agent, says", BAD_AGENTS, ids=[a.__name__ for a, _ in BAD_AGENTS])
def test_a_method_breaking_the_contract_is_named_in_one_line(colours, agent, says, device):
    with pytest.raises(ReplyError) as refused:
        trained(colours, agent, device=device, ipu_emulator=device == "ipu")
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    assert type(refused.value).usage_error is True
    if agent in (NoBatchify, NoReplies, NoBuildModel):  # still what `except NotImplementedError` catches
        assert isinstance(refused.value, NotImplementedError)


@pytest.mark.parametrize("agent, says", [BAD_AGENTS[i] for i in (0, 1, 5, 8)],
                         ids=["vectorize", "batchify", "missing", "forward"])
def test_the_command_line_says_it_in_one_line_exit_2(colours, agent, says, capsys):
    args = ["train", "-t", colours, "-m", f"test_agent_contract:{agent.__name__}", "-bs", "4", "-esz", "16",
            "--eval-splits", "valid", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("agent, says", [BAD_AGENTS[i] for i in (0, 2, 8)], ids=["vectorize", "batchify", "forward"])
def test_a_data_worker_refuses_the_same_in_one_line_exit_2(colours, agent, says, capsys):
    """What the main process refuses, a data worker refuses too (before, NoReturn crashed in the worker and
    ListValue trained)."""
    args = ["train", "-t", colours, "-m", f"test_agent_contract:{agent.__name__}", "-bs", "4", "-esz", "16",
            "--eval-splits", "valid", "--no-progress", "--num-workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


PLANS = [  # (plan, rows a call holds, rows its outputs have: the output mode's, as the layout gives them)
    ({}, 4, 4),
    ({"gradient_accumulation": 2}, 8, 4),  # final: the last micro-batch
    ({"gradient_accumulation": 2, "output_mode": "all"}, 8, 8),
    ({"device_iterations": 2, "output_mode": "final"}, 8, 4),
    ({"gradient_accumulation": 2, "output_mode": "sum"}, 8, 4),  # the two micro-batches added up row by row
    ({"replication_factor": 2, "output_mode": "sum"}, 8, 8),  # one micro-batch per replica: rows as they are
    ({"device_iterations": 2, "replication_factor": 2, "output_mode": "sum"}, 16, 8),
]


@pytest.mark.parametrize("device", ["cpu", "ipu"])
@pytest.mark.parametrize("plan, rows, out", PLANS, ids=[f"{p}" for p, _, _ in PLANS])
def test_model_rows_are_checked_against_the_output_mode(colours, device, plan, rows, out):
    """A correct model trains under every plan (scored per row unless sum adds several micro-batches); one
    returning twice or one row fewer than the rows the output mode returns is refused naming its forward."""
    extra = dict(plan, device=device, ipu_emulator=device == "ipu", max_train_steps=2)
    report, _ = trained(colours, MyAgent, **extra)
    assert report["train"]["exs"] == 2 * rows and report["valid"]["exs"] == 8
    assert ("accuracy" in report["train"]) == (plan.get("output_mode") != "sum" or out == rows)
    mode = "--output-mode sum" if plan.get("output_mode") == "sum" else "the output mode" if out != rows else ""
    of = f"the {out} rows {mode} returns of this {rows}-row batch" if mode else f"the batch's {rows} rows:"
    for agent, model, got in ((DoubledRows, "Doubled", 2 * out), (FewerRows, "Fewer", out - out // 4)):
        with pytest.raises(ReplyError) as refused:
            trained(colours, agent, **extra)
        said = str(refused.value)
        assert said.startswith(f"{agent.__name__}'s model ({model}.forward) returned 'scores' with {got} rows for {of}")


class StrCandidates(ab.FixedTeacher):
    pairs = False

    def setup_data(self):
        turns = [{"text": "is it red", "labels": "red", "label_candidates": ["red", "blue"]},  # a str label: fine
                 {"text": "which", "labels": ["red"], "label_candidates": "red|blue|green"}]
        return [((turn, True)) for turn in turns] if self.pairs else [[turn] for turn in turns]


class StrCandidatePairs(StrCandidates):
    pairs = True


@pytest.mark.parametrize("teacher, where", [(StrCandidates, "episode 1, turn 0"),
                                            (StrCandidatePairs, "item 1 (episode 1, turn 0)")])
def test_candidates_given_as_one_str_are_refused_naming_the_turn(teacher, where):
    """ParlAI leaves a str of candidates a str, which a ranker reads as one candidate (bag: the label is
    not among its 1 candidates; repeat_label: accuracy 1.0): refused as a non-str text is."""
    with pytest.raises(DataFileError) as refused:
        teacher(ab.Opts(datatype="valid"))
    assert str(refused.value) == (f"{teacher.__name__}.setup_data(): {where}: 'label_candidates' is str "
                                  "'red|blue|green'; give a list of str, e.g. 'label_candidates': ['red', 'blue', "
                                  "'green'] (one str is one candidate, which no model can rank)")


def test_a_jsonl_file_with_a_str_of_candidates_is_refused_naming_its_line(write_jsonl, capsys):
    path = write_jsonl([{"text": "a", "labels": "red", "label_candidates": ["red", "blue"]},
                        {"text": "b", "labels": ["red"], "text_candidates": "red"}])
    assert main(["eval", "-t", f"jsonl:{path}", "-m", "repeat_label", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2: 'text_candidates' is str 'red'; give a list of str" in err
