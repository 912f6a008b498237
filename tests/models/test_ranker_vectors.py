"""The rankers' vectorize + batchify (cached word ids, flat tensor building) against a plain reference: the
definition written out (crc32 per word, nested lists into torch.tensor), so a faster path never changes a
batch, a weight or a report."""

from __future__ import annotations

import copy
import pickle
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.dictionary import MAX_IDS, TEXT_COST_IDS, HashDictionary
from accelbatch.messages import Message
from accelbatch.models.bag import MAX_CANDIDATE_WORDS, VOCAB, BagAgent, pad_rows
from accelbatch.models.conv import ConvAgent
from accelbatch.opts import Opts
from accelbatch.tasks.dialogues import generate
from accelbatch.tasks.files import DataFileError

PUNCT = ".,?!;:\"'()"


def ref_ids(text: str, vocab: int = VOCAB) -> list[int]:
    words = "".join(" " if ch in PUNCT else ch for ch in text.lower()).split()
    return [1 + zlib.crc32(w.encode("utf-8")) % (vocab - 1) for w in words]


def ref_vectorize(obs: dict, truncate: int) -> dict:
    text = obs.get("full_text", obs.get("text")) or ""
    ids = ref_ids(text)
    if truncate > 0 and len(ids) > truncate:
        ids = ids[len(ids) - truncate:]
    cands = obs.get("label_candidates") or []
    targets = obs.get("labels") or obs.get("eval_labels") or []
    index = next((cands.index(t) for t in targets if t in cands), -1)  # the first label among the candidates
    return {"text_vec": ids, "cand_vecs": [ref_ids(c)[:MAX_CANDIDATE_WORDS] for c in cands], "label_index": index}


def ref_batchify(vecs: list[dict], multiple: int = 1) -> dict[str, torch.Tensor]:
    width = max(1, max(len(v["text_vec"]) for v in vecs))
    width = -(-width // multiple) * multiple
    n_cand = max(1, max(len(v["cand_vecs"]) for v in vecs))
    n_words = max([1] + [len(c) for v in vecs for c in v["cand_vecs"]])
    cands, mask = [], []
    for v in vecs:
        rows = [c + [0] * (n_words - len(c)) for c in v["cand_vecs"]]
        cands.append(rows + [[0] * n_words] * (n_cand - len(rows)))
        mask.append([1] * len(rows) + [0] * (n_cand - len(rows)))
    return {"text_vec": torch.tensor([v["text_vec"] + [0] * (width - len(v["text_vec"])) for v in vecs]),
            "candidates": torch.tensor(cands), "cand_mask": torch.tensor(mask),
            "label_index": torch.tensor([v["label_index"] for v in vecs])}


def assert_same_batch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == torch.long and got[key].is_contiguous(), key
        assert torch.equal(got[key], want[key]), key


words = st.text(alphabet="aB .,?!'é\n", min_size=0, max_size=40)
messages = st.fixed_dictionaries(  # evaluation examples: a training one whose label is no candidate is refused
    {"text": words, "eval_labels": st.lists(words, min_size=0, max_size=2)},
    optional={"label_candidates": st.lists(words, min_size=0, max_size=5)})


@settings(max_examples=60, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.sampled_from([-1, 1, 3]))
def test_vectorize_and_batchify_equal_the_reference(msgs, truncate):
    agent = BagAgent(Opts(embedding_size=4, text_truncate=truncate))
    vecs = [agent.vectorize(Message(m)) for m in msgs]
    refs = [ref_vectorize(m, truncate) for m in msgs]
    for got, want in zip(vecs, refs):
        assert {k: got[k] for k in want} == want
    assert_same_batch(agent.batchify(vecs), ref_batchify(refs))


@pytest.mark.parametrize("cls", [BagAgent, ConvAgent])
def test_dialogue_batches_equal_the_reference_twice(cls):
    """Second pass: every word and candidate comes from the caches; the batches stay the same."""
    agent = cls(Opts(embedding_size=4, text_truncate=20))
    msgs = [m for ep in generate(30, 0, "train") for m in ep]
    want = [ref_batchify([ref_vectorize(m, 20) for m in msgs[i:i + 8]], cls.pad_multiple)
            for i in range(0, len(msgs), 8)]
    for _ in range(2):
        for i, batch in zip(range(0, len(msgs), 8), want):
            assert_same_batch(agent.batchify([agent.vectorize(Message(m)) for m in msgs[i:i + 8]]), batch)
    assert agent.dictionary.cached()[1] > 0


def test_full_caches_still_give_the_same_ids():
    small = HashDictionary(VOCAB, max_words=3, max_ids=8 + 2 * TEXT_COST_IDS)  # room for 2 short texts
    texts = ["Älpha beta, gamma delta", "epsilon zeta", "éta theta iota", "alpha"]  # two through the word cache
    for _ in range(2):
        for text in texts:
            assert small.text_ids(text) == ref_ids(text)
            assert small.short_texts_ids([text], 2)[0] == ref_ids(text)[:2]
    assert small.cached() == (3, 2)


def test_cached_ids_are_copies():
    d = HashDictionary(VOCAB)
    first = d.short_texts_ids(["a b"], 8)[0]
    first.append(99)
    assert d.short_texts_ids(["a b"], 8)[0] == ref_ids("a b")


def test_clones_share_the_dictionary_and_pickles_start_empty():
    agent = BagAgent(Opts(embedding_size=4))
    agent.vectorize(Message(text="x y", labels=["x"], label_candidates=["x", "z"]))
    assert agent.clone().dictionary is agent.dictionary
    copied = pickle.loads(pickle.dumps(agent.dictionary))
    assert copied.cached() == (0, 0) and agent.dictionary.cached() != (0, 0)
    assert copied.text_ids("x y") == ref_ids("x y") and copy.copy(agent).dictionary is agent.dictionary


def test_pad_rows_of_no_rows_and_multiple():
    assert pad_rows([]).shape == (0,)
    assert pad_rows([[5], [1, 2, 3]], 4).tolist() == [[5, 0, 0, 0], [1, 2, 3, 0]]


def test_vocab_size_below_two_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        HashDictionary(1)


@pytest.mark.parametrize("model", ["bag", "conv"])
def test_world_trains_the_weights_of_reference_batches(model):
    """Through create_world: every batch the engine trains on equals the reference built from the same
    examples, and a plain loop over the reference batches ends with equal weights."""
    from accelbatch.build import create_world

    opts = Opts(task="dialogues:40", model=model, batchsize=8, embedding_size=8, text_truncate=16,
                learning_rate=0.1, eval_splits="", progress=False, log_every_n_secs=1e9)
    world = create_world(opts)
    try:
        agent = world.get_model_agent()
        model0 = copy.deepcopy(agent.model.state_dict())
        seen, batch_act = [], agent.batch_act

        def recording(observations):
            seen.append([ref_vectorize(o, 16) for o in observations])
            return batch_act(observations)

        agent.batch_act, trained, train_step = recording, [], agent.engine.train_step
        agent.engine.train_step = lambda batch: trained.append(batch) or train_step(batch)
        for _ in range(12):
            world.parley()
        final = agent.model.state_dict()
        plain = agent.build_model()
        plain.load_state_dict(model0)
        optimizer = agent.build_optimizer(plain)
    finally:
        world.shutdown()
    assert len(seen) == len(trained) == 12
    for refs, batch in zip(seen, trained):
        want = ref_batchify(refs, agent.pad_multiple)
        assert_same_batch(batch, want)
        optimizer.zero_grad()
        plain(want)["loss"].backward()
        optimizer.step()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_text_caches_keep_truncations_apart_and_stay_in_bounds():
    bound = 12 + 3 * TEXT_COST_IDS
    d = HashDictionary(VOCAB, max_ids=bound)
    text = "one two three four five"
    for _ in range(2):
        assert d.text_ids(text, 2) == ref_ids(text)[-2:]
        assert d.text_ids(text) == d.text_ids(text, -1) == ref_ids(text)
        assert d.short_texts_ids([text], 2)[0] == ref_ids(text)[:2]
        assert d.short_texts_ids([text], 0)[0] == []
    assert d.held_ids <= bound and d.cached()[1] == 3


def test_label_index_in_candidates_of_any_sequence():
    agent = BagAgent(Opts(embedding_size=4))
    for cands in (["x", "y", "y"], ("x", "y"), _Seq(["x", "y"])):
        obs = agent.vectorize(Message(text="t", labels=["y"], label_candidates=cands))
        assert obs["label_index"] == 1 and len(obs["cand_vecs"]) == len(list(cands))
    assert agent.vectorize(Message(text="t", eval_labels=["z"], label_candidates=("x",)))["label_index"] == -1
    with pytest.raises(DataFileError, match="a training example's label 'z' is not among its 1 label_candidates"):
        agent.vectorize(Message(text="t", labels=["z"], label_candidates=("x",)))


class _Seq:
    """A sequence without .index (what a user's task might hand over)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)

    def __bool__(self):
        return bool(self.items)


@pytest.mark.parametrize("truncate", [-1, 1, 3])
def test_example_length_from_the_cache_counts_the_reference_tokens(truncate):
    agent = BagAgent(Opts(embedding_size=4, text_truncate=truncate))
    texts = ["a b c d e", "it's the end. of, the world", "", "x\ny z"]
    for _ in range(2):  # empty caches, then from them (after vectorize filled them)
        for text in texts:
            want = len(ref_vectorize({"text": text}, truncate)["text_vec"])
            assert agent.example_length(Message(text=text, full_text=text)) == want
            agent.vectorize(Message(text=text))


def test_length_and_collate_pickled_together_share_one_dictionary():
    agent = BagAgent(Opts(embedding_size=4))
    collate = agent.collate_fn()
    length, vectorize = pickle.loads(pickle.dumps((agent.example_length, collate.vectorize)))
    assert length.dictionary is vectorize.__self__.dictionary
    length(Message(text="p q r"))
    assert vectorize.__self__.dictionary.cached()[1] == 1


_TEXT = st.lists(st.sampled_from(list("aZ Σσς\0\t\x1c\x1f\x85\xa0\n.,'İß") + ["ab", "ΣΑ", "x.y"]),
                 max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, max_size=6), st.integers(0, 5))
def test_texts_hashed_as_ascii_bytes_or_word_by_word_get_the_reference_ids(texts, keep_first):
    """ASCII texts are split and hashed as bytes, others word by word: the same ids as the reference either way
    (separators str.split() takes and bytes.split() does not, final sigmas, NULs), cached or not."""
    d = HashDictionary(VOCAB, max_words=4)
    d.short_texts_ids(texts[::2], keep_first)  # some cached first
    want = [ref_ids(t)[:keep_first] for t in texts]
    assert d.short_texts_ids(texts, keep_first) == want
    assert d.short_texts_ids(tuple(texts), keep_first) == want
    assert [d.text_ids(t) for t in texts] == [ref_ids(t) for t in texts]
    assert [d.text_ids(t, 2) for t in texts] == [ref_ids(t)[-2:] if len(ref_ids(t)) > 2 else ref_ids(t) for t in texts]


@settings(max_examples=200, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=6), st.integers(0, 8))
def test_a_history_gets_the_ids_of_its_whole_text_line_by_line(turns, keep_last):
    """A text of several lines takes each line's ids from the cache (the turns met before) and joins them:
    the reference ids of the whole text, truncated to its last ``keep_last`` words."""
    d = HashDictionary(VOCAB, max_ids=100)  # small: some lines and histories are not kept
    for end in range(1, len(turns) + 1):  # the history as it grows, turn by turn
        text = "\n".join(turns[:end])
        want = ref_ids(text)
        assert d.text_ids(text, keep_last) == (want[-keep_last:] if 0 < keep_last < len(want) else want)
        assert d.text_ids(text) == want


@pytest.mark.parametrize("words", [1, 10])
def test_the_text_caches_memory_is_bounded_however_short_the_texts(words):
    """At the bound the caches hold about 13 bytes per id of ``max_ids`` (55 MB at MAX_IDS), one-word texts
    too: each text's own key and tuple count against the bound (measured with tracemalloc)."""
    import tracemalloc

    bound = 1 << 15
    d = HashDictionary(VOCAB, max_ids=bound)
    tracemalloc.start()
    for i in range(2 * bound // (words + 1)):  # more texts than the bound holds, counting 1 per text or more
        d.text_ids(" ".join(f"w{i}x{j}" for j in range(words)))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert d.held_ids <= bound and d.cached()[1] > 0
    assert held <= 16 * bound, f"{held / bound:.0f} bytes per id of the bound; {MAX_IDS} ids would hold " \
                               f"{held / bound * MAX_IDS / 2**20:.0f} MB"


def test_long_texts_truncated_to_few_ids_count_their_characters():
    """A conversation's history of 130,000 characters kept as its last 256 ids counted 266 ids: at the bound
    the caches held 100 bytes of text per id (a 2.7 MB file of long episodes took 1.6 GB)."""
    import tracemalloc

    bound = 1 << 15
    d = HashDictionary(VOCAB, max_ids=bound)
    history = " ".join(f"w{j}" for j in range(20000))
    tracemalloc.start()
    for i in range(50):
        assert d.text_ids(f"{i} {history}", keep_last=256) == ref_ids(history)[-256:]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert d.held_ids <= bound and d.cached()[1] > 0
    assert held <= 16 * bound, f"{held / bound:.0f} bytes per id of the bound"
