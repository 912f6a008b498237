"""The memory network's vectorize + batchify (cached ids per line, flat tensor building) against the
definition written out: each line, question and candidate tokenized and hashed word by word, and every
row copied into zero tensors one by one. Same batches, so the same training."""

from __future__ import annotations

import pickle

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from accelbatch.agents import History
from accelbatch.dictionary import hash_tokens, tokenize
from accelbatch.messages import Message
from accelbatch.models.memnn import MAX_MEMORIES, MAX_WORDS, VOCAB, MemNNAgent
from accelbatch.opts import Opts
from accelbatch.tasks.babi import generate


def ref_vectorize(obs: dict) -> dict:
    lines = obs.get("full_text", obs.get("text", "")).split("\n")
    question, story = lines[-1], lines[:-1][-MAX_MEMORIES:]
    cands = obs.get("label_candidates") or []
    targets = obs.get("labels") or obs.get("eval_labels") or []
    return {"query_vec": hash_tokens(tokenize(question)[-256:], VOCAB),
            "memory_vecs": [hash_tokens(tokenize(line)[-256:], VOCAB) for line in story],
            "cand_vecs": [hash_tokens(tokenize(c)[:MAX_WORDS], VOCAB) for c in cands],
            "label_index": next((cands.index(t) for t in targets if t in cands), -1)}


def ref_batchify(vecs: list[dict]) -> dict[str, torch.Tensor]:
    rows = len(vecs)
    n_mem = min(MAX_MEMORIES, -(-max(1, max(len(v["memory_vecs"]) for v in vecs)) // 8) * 8)
    n_cand = max(1, max(len(v["cand_vecs"]) for v in vecs))
    longest = max([1] + [len(m) for v in vecs for m in v["memory_vecs"] + [v["query_vec"]]])
    words = -(-longest // MAX_WORDS) * MAX_WORDS
    memories = torch.zeros(rows, n_mem, words, dtype=torch.long)
    age = torch.zeros(rows, n_mem, dtype=torch.long)
    query = torch.zeros(rows, words, dtype=torch.long)
    cands = torch.zeros(rows, n_cand, MAX_WORDS, dtype=torch.long)
    mask = torch.zeros(rows, n_cand, dtype=torch.long)
    for r, v in enumerate(vecs):
        for m, vec in enumerate(v["memory_vecs"]):
            memories[r, m, :len(vec)] = torch.tensor(vec, dtype=torch.long)
            age[r, m] = len(v["memory_vecs"]) - m
        query[r, :len(v["query_vec"])] = torch.tensor(v["query_vec"], dtype=torch.long)
        for c, vec in enumerate(v["cand_vecs"]):
            cands[r, c, :len(vec)] = torch.tensor(vec, dtype=torch.long)
            mask[r, c] = 1
    batch = {"memories": memories, "memory_age": age, "query": query, "candidates": cands, "cand_mask": mask}
    if any(v["label_index"] >= 0 for v in vecs):
        batch["label_index"] = torch.tensor([v["label_index"] for v in vecs])
    return batch


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _observed(turns: list[dict]) -> list[dict]:
    """The turns with ``full_text`` as TorchAgent.observe squashes them (labels included)."""
    history, last, out = History(), None, []
    for turn in turns:
        obs = dict(turn, full_text=history.add(turn.get("text"), last))
        last = (turn.get("labels") or [None])[0]
        out.append(obs)
    return out


def test_babi_batches_equal_the_reference():
    agent = MemNNAgent(Opts(embedding_size=8))
    observed = [obs for episode in generate("1", "train", 40) for obs in _observed(episode)]
    for _ in range(2):  # empty caches, then from them
        for i in range(0, len(observed), 8):
            rows = observed[i:i + 8]
            got = agent.batchify([agent.vectorize(Message(o)) for o in rows])
            assert_same(got, ref_batchify([ref_vectorize(o) for o in rows]))
    assert agent.dictionary.cached()[1] > 0


_LINE = st.lists(st.sampled_from(["Mary", "went", "to", "the", "kitchen.", "Où", "ΣΑΣ", "x,y", "", "a"]),
                 max_size=20).map(" ".join)
_TURN = st.fixed_dictionaries({"text": _LINE},
                              optional={"labels": st.lists(_LINE, min_size=1, max_size=2),
                                        "label_candidates": st.lists(_LINE, max_size=5)})


_LONG = [{"text": f"line {i} has words " * (i % 3 + 1), "labels": [f"answer {i}"],
          "label_candidates": [f"answer {i}", "other"]} for i in range(40)]  # 80 lines, up to 21 words


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_TURN, min_size=1, max_size=40), min_size=1, max_size=4))
@example([_LONG, _LONG[:3]])
def test_any_rows_equal_the_reference(episodes):
    """Histories past MAX_MEMORIES lines, lines past MAX_WORDS words, rows without candidates or labels."""
    agent = MemNNAgent(Opts(embedding_size=8))
    # as evaluation sees them (eval_labels): a training example whose label no candidate holds is refused
    rows = [{("eval_labels" if k == "labels" else k): v for k, v in obs.items()}
            for episode in episodes for obs in _observed(episode)]
    got = agent.batchify([agent.vectorize(Message(o)) for o in rows])
    assert_same(got, ref_batchify([ref_vectorize(o) for o in rows]))


def test_clones_share_the_dictionary_and_pickles_start_empty():
    agent = MemNNAgent(Opts(embedding_size=8))
    agent.vectorize(Message(text="Mary went home.\nWhere is Mary?", label_candidates=["home"]))
    assert agent.clone().dictionary is agent.dictionary
    assert pickle.loads(pickle.dumps(agent.dictionary)).cached() == (0, 0)


def test_a_training_example_whose_label_no_candidate_holds_is_refused_and_scored_as_a_miss_in_evaluation():
    import pytest

    from accelbatch.tasks.files import DataFileError

    agent = MemNNAgent(Opts(embedding_size=8, task="jsonl:f.jsonl"))
    for bad, said in (({"labels": ["7"], "label_candidates": ["0", "1"]}, "label '7' is not among its 2"),
                      ({"labels": ["7"]}, "label '7' is not among its 0"), ({"labels": []}, "labels are empty")):
        with pytest.raises(DataFileError, match=f"-t jsonl:f.jsonl: a training example's {said}"):
            agent.vectorize(Message(text="x", **bad))
    torch.manual_seed(0)
    model = agent.build_model()
    rows = [Message(text="a b", eval_labels=["1"], label_candidates=["0", "1"]),
            Message(text="c", eval_labels=["7"], label_candidates=["0", "1"])]
    both = agent.batchify([agent.vectorize(r) for r in rows])
    assert both["label_index"].tolist() == [1, -1]  # the miss stays in the batch, out of the loss
    alone = agent.batchify([agent.vectorize(rows[0])])
    assert torch.allclose(model(both)["loss"], model(alone)["loss"])
