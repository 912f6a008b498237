"""Generation: greedy/beam decoding, the token loss and token metrics, the generator agent end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import accelbatch as ab
from accelbatch.generation import BOS, EOS, PAD, ByteVocab, GeneratorModel
from accelbatch.metrics import Metrics
from accelbatch.models.generator import TransformerCore, TransformerGeneratorAgent
from accelbatch.plan import LOSS_TOKENS
from accelbatch.report_merge import reduce_report
from accelbatch.tasks.reverse import generate

VOCAB = ByteVocab()


def batch_of(texts: list[str], labels: list[str] | None = None) -> dict[str, torch.Tensor]:
    def pad(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    batch = {"text_vec": pad([VOCAB.encode(t) for t in texts])}
    if labels is not None:
        batch["label_vec"] = pad([VOCAB.encode(lab) + [EOS] for lab in labels])
    return batch


class CopyCore(nn.Module):
    """Hand-set: position t of the decoder predicts the input's token t, then EOS after the input ends."""

    def encode(self, text):
        return text

    def decode(self, text, prefix):
        rows, steps = prefix.shape
        wanted = torch.full((rows, steps), EOS, dtype=torch.long)
        n = min(steps, text.shape[1])
        wanted[:, :n] = torch.where(text[:, :n] == PAD, EOS, text[:, :n])
        return torch.nn.functional.one_hot(wanted, VOCAB.size).float() * 5.0


class TableCore(nn.Module):
    """Hand-set: the logits at decoder position t are row t of a fixed table, whatever the input."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def encode(self, text):
        return text

    def decode(self, text, prefix):
        return self.table[: prefix.shape[1]].unsqueeze(0).expand(prefix.shape[0], -1, -1)


def random_model(seed: int = 0, **kwargs) -> GeneratorModel:
    torch.manual_seed(seed)
    return GeneratorModel(TransformerCore(VOCAB.size, 16, 32), max_len=12, **kwargs).eval()


def decoded(preds: torch.Tensor) -> list[str]:
    return [VOCAB.decode(row) for row in preds.tolist()]


@pytest.mark.parametrize("inference,beam", [("greedy", 1), ("beam", 1), ("beam", 3)])
def test_a_decoder_that_copies_its_input_generates_the_input(inference, beam):
    texts = ["hello", "ab", "copy me please"]
    model = GeneratorModel(CopyCore(), max_len=20, inference=inference, beam_size=beam).eval()
    assert decoded(model(batch_of(texts))["preds"]) == texts


class HalfCopyCore(CopyCore):
    """CopyCore's logits in float16, as a decoder under fp16 autocast returns them."""

    def decode(self, text, prefix):
        return super().decode(text, prefix).half()


@pytest.mark.parametrize("inference,beam,block", [("greedy", 1, -1), ("greedy", 1, 2), ("beam", 3, 2)])
def test_a_decoder_with_float16_logits_decodes_as_in_float32(inference, beam, block):
    # fp16 cannot hold the "impossible" score of a banned token: decoding must not work in the logits' dtype
    texts = ["hello", "ab", "copy me please"]
    want = GeneratorModel(CopyCore(), max_len=20, inference=inference, beam_size=beam, block_ngram=block).eval()
    half = GeneratorModel(HalfCopyCore(), max_len=20, inference=inference, beam_size=beam, block_ngram=block).eval()
    batch = batch_of(texts)
    assert torch.equal(half(batch)["preds"], want(batch)["preds"])


def test_generation_stops_at_max_len_and_pads_after_the_end_token():
    model = GeneratorModel(CopyCore(), max_len=4).eval()
    preds = model(batch_of(["abcdefgh", "ab"]))["preds"]
    assert preds.shape == (2, 4)
    assert decoded(preds) == ["abcd", "ab"]
    assert preds[1].tolist() == VOCAB.encode("ab") + [EOS, PAD]


def test_greedy_is_deterministic_and_beam_size_one_equals_greedy():
    batch = batch_of(["abc", "kitchen", "", "a longer input text"])
    first = random_model(inference="greedy")(batch)["preds"]
    again = random_model(inference="greedy")(batch)["preds"]
    beam1 = random_model(inference="beam", beam_size=1)(batch)["preds"]
    beam4 = random_model(inference="beam", beam_size=4)(batch)["preds"]
    assert torch.equal(first, again) and torch.equal(first, beam1)
    assert torch.equal(beam4, random_model(inference="beam", beam_size=4)(batch)["preds"])
    # the greedy steps by hand, one host read per token: the same tokens as the fixed-shape loop
    model = random_model()
    state = model.core.encode(batch["text_vec"])
    for row in range(4):
        prefix, out = [BOS], []
        for _ in range(model.max_len):
            logits = model.core.decode(tuple(s[row:row + 1] for s in state), torch.tensor([prefix]))[0, -1]
            token = int(logits.argmax())
            out.append(token)
            prefix.append(token)
            if token == EOS:
                break
        assert first[row, : len(out)].tolist() == out
        assert set(first[row, len(out):].tolist()) <= {PAD}


def _repeats_an_ngram(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


def _until_end(row: list[int]) -> list[int]:
    return row[: row.index(EOS)] if EOS in row else row


@pytest.mark.parametrize("inference,beam", [("greedy", 1), ("beam", 1), ("beam", 3)])
def test_min_length_holds_back_the_end_token(inference, beam):
    model = GeneratorModel(CopyCore(), max_len=8, inference=inference, beam_size=beam, min_length=4).eval()
    preds = model(batch_of(["ab", "abcdef"]))["preds"].tolist()
    short, long = (_until_end(row) for row in preds)
    assert len(short) >= 4 and short[:2] == VOCAB.encode("ab") and PAD not in short and BOS not in short
    assert long == VOCAB.encode("abcdef")
    free = GeneratorModel(CopyCore(), max_len=8, min_length=0).eval()
    assert decoded(free(batch_of([""]))["preds"]) == [""]  # min length 0: an empty reply may end at once
    held = GeneratorModel(CopyCore(), max_len=8, min_length=1).eval()
    assert decoded(held(batch_of([""]))["preds"]) != [""]  # ParlAI's default 1: never empty


@pytest.mark.parametrize("n", [1, 2, 3])
def test_block_ngram_never_repeats_an_ngram_and_beam_one_is_still_greedy(n):
    batch = batch_of(["abababababab", "aaaaaaaaa", "kitchen"])
    texts = {}
    for name, kwargs in (("greedy", {}), ("beam1", dict(inference="beam", beam_size=1)),
                         ("beam3", dict(inference="beam", beam_size=3))):
        copy = GeneratorModel(CopyCore(), max_len=12, block_ngram=n, **kwargs).eval()
        for row in copy(batch)["preds"].tolist():
            assert not _repeats_an_ngram(_until_end(row), n), (name, row)
        texts[name] = random_model(block_ngram=n, **kwargs)(batch)["preds"]
    assert torch.equal(texts["greedy"], texts["beam1"])
    unblocked = GeneratorModel(CopyCore(), max_len=12).eval()(batch)["preds"]
    assert decoded(unblocked)[1] == "aaaaaaaaa"  # the blocking above changed something


def test_beam_search_finds_a_sequence_greedy_misses():
    # step 0: "a" (0.6) beats "b" (0.4); after "a" every continuation is flat, after "b" EOS is certain.
    a, b = VOCAB.encode("a")[0], VOCAB.encode("b")[0]

    class Branching(nn.Module):
        def encode(self, text):
            return text

        def decode(self, text, prefix):
            rows, steps = prefix.shape
            logits = torch.zeros(rows, steps, VOCAB.size)
            logits[:, 0, :] = -1e4
            logits[:, 0, a], logits[:, 0, b] = math.log(0.6), math.log(0.4)
            after_b = prefix[:, -1] == b
            logits[after_b, -1, :] = -1e4
            logits[after_b, -1, EOS] = 0.0
            return logits

    batch = batch_of(["x"])
    greedy = GeneratorModel(Branching(), max_len=3).eval()(batch)["preds"]
    beam = GeneratorModel(Branching(), max_len=3, inference="beam", beam_size=2).eval()(batch)["preds"]
    assert VOCAB.decode(greedy[0].tolist()).startswith("a")
    assert decoded(beam) == ["b"]


def _hand_token_metrics(table: torch.Tensor, labels: list[str]) -> tuple[float, int, int]:
    """(summed NLL, target tokens, tokens whose argmax is the target) with math on the table's logits."""
    nll, tokens, correct = 0.0, 0, 0
    for label in labels:
        for t, target in enumerate(VOCAB.encode(label) + [EOS]):
            row = table[t].tolist()
            log_z = math.log(sum(math.exp(x) for x in row))
            nll += log_z - row[target]
            tokens += 1
            correct += int(max(range(len(row)), key=row.__getitem__) == target)
    return nll, tokens, correct


def test_token_metrics_equal_a_hand_computation_and_merge_exactly_across_replicas():
    torch.manual_seed(3)
    table = torch.randn(8, VOCAB.size)
    table[1, VOCAB.encode("b")[0]] = 10.0  # some targets are the argmax: token_acc is neither 0 nor 1
    table[0, VOCAB.encode("a")[0]] = 10.0
    opts = ab.Opts(model="transformer/generator", embedding_size=8)
    agent = TransformerGeneratorAgent(opts)
    model = GeneratorModel(TableCore(table), max_len=4).eval()
    parts = [["ab", "abcdef"], ["a", "xyz", "bb"]]
    reports = []
    total = Metrics()
    for labels in parts:
        agent.metrics = Metrics()
        out = model(batch_of(["q"] * len(labels), labels))
        agent.replies({k: v for k, v in out.items() if k != "loss"}, [{}] * len(labels))
        total.merge(agent.metrics)
        reports.append({**agent.metrics.report(), "exs": len(labels)})
        nll, tokens, _ = _hand_token_metrics(table, labels)
        assert out["loss"].item() == pytest.approx(nll / tokens, rel=1e-5)  # the training loss: per token
    nll, tokens, correct = _hand_token_metrics(table, parts[0] + parts[1])
    assert 0 < correct < tokens
    want = {"loss": nll / tokens, "ppl": math.exp(nll / tokens), "token_acc": correct / tokens,
            "ltpb": tokens / 2, "tokens": tokens}
    got = total.report()
    assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-5)

    class Recorder:
        world_size = 2

        def reduce_metrics(self, sums):
            self.sums = sums
            return sums

    class TwoReplicas:
        world_size = 2

        def reduce_metrics(self, sums):
            other = Recorder()
            reduce_report(reports[1], other)
            return {k: sums.get(k, 0.0) + other.sums.get(k, 0.0) for k in set(sums) | set(other.sums)}

    merged = reduce_report(reports[0], TwoReplicas())
    assert merged["exs"] == 5
    assert {k: merged[k] for k in want} == pytest.approx(want, rel=1e-5)


def test_skip_generation_gives_the_loss_and_no_preds():
    out = GeneratorModel(CopyCore(), max_len=8, skip_generation=True).eval()(batch_of(["ab"], ["ab"]))
    assert "preds" not in out and "loss" in out


def test_generation_options_are_checked():
    with pytest.raises(ab.opts.OptionError, match="--beam-size: must be at least 1"):
        ab.Opts(beam_size=0)
    with pytest.raises(ab.opts.OptionError, match="--inference: 'sample' is not one of greedy, beam"):
        ab.Opts(inference="sample")
    with pytest.raises(ab.opts.OptionError, match="--beam-block-ngram: must be -1 .* or at least 1, got 0"):
        TransformerGeneratorAgent(ab.Opts(beam_block_ngram=0, embedding_size=8))
    with pytest.raises(ab.opts.OptionError, match=r"--label-truncate: must be at least 1, or -1 .*, got 0"):
        TransformerGeneratorAgent(ab.Opts(label_truncate=0, embedding_size=8))
    default = TransformerGeneratorAgent(ab.Opts(embedding_size=8))  # -1: 32 label tokens kept and generated
    assert default.model.max_len == 32
    assert len(default.vectorize(ab.Message(text="q", labels=["x" * 40]))["label_vec"]) == 32  # cut: no end


def test_truncation_keeps_the_end_of_the_text_and_the_start_of_the_label():
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, text_truncate=4, label_truncate=3))
    obs = agent.vectorize(ab.Message(text="abcdefgh", labels=["uvwxyz"]))
    assert VOCAB.decode(obs["text_vec"]) == "efgh"
    assert obs["label_vec"] == VOCAB.encode("uvw")  # the end token, then the cut (ParlAI's): none left
    assert agent.vectorize(ab.Message(text="a", labels=["uv"]))["label_vec"] == VOCAB.encode("uv") + [EOS]
    # the planned length is the width batchify gives text_vec: the kept text rounded up to PAD_MULTIPLE
    assert agent.example_length(obs) == 8
    assert agent.example_length(agent.vectorize(ab.Message(text="abc", labels=["uvwxyz"]))) == 8
    assert agent.example_length(agent.vectorize(ab.Message(text="", labels=["u"]))) == 8


def _eval_report(opts: ab.Opts, agent=None) -> tuple[dict, object]:
    world = ab.create_world(opts, agent=agent)
    report = ab.evaluate(world)
    world.shutdown()
    return report, world.get_model_agent()


@pytest.mark.slow
def test_skip_generation_evaluates_the_token_loss_without_replies():
    common = dict(task="reverse:200", model="transformer/generator", datatype="valid", batchsize=4,
                  embedding_size=8, label_truncate=10, progress=False)
    full, _ = _eval_report(ab.Opts(**common))
    loss_only, _ = _eval_report(ab.Opts(**common, skip_generation=True))
    assert "accuracy" in full and "accuracy" not in loss_only and "f1" not in loss_only
    assert loss_only["exs"] == full["exs"] == 10
    for key in ("loss", "ppl", "token_acc", "tokens", "ltpb"):
        assert loss_only[key] == pytest.approx(full[key], rel=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("device,bs,di", [("cpu", 7, 1), ("cpu", 4, 3), ("ipu", 5, 2)])
def test_evaluation_with_generation_scores_every_example_once(device, bs, di):
    # reverse:1340 has 67 valid examples: no batch size here divides it
    opts = ab.Opts(task="reverse:1340", model="transformer/generator", datatype="valid", batchsize=bs,
                   device_iterations=di, embedding_size=16, label_truncate=10, progress=False,
                   device=device, ipu_emulator=device == "ipu")
    report, _ = _eval_report(opts)
    valid = [ep[0] for ep in generate(67, 0, "valid")]
    assert report["exs"] == 67
    assert report["tokens"] == sum(len(m["labels"][0]) + 1 for m in valid)
    # an untrained model: compare with the same model evaluated one example at a time
    one, _ = _eval_report(opts.replace(batchsize=1, device_iterations=1, device="cpu", ipu_emulator=False))
    for key in ("loss", "ppl", "token_acc", "accuracy", "f1"):
        assert report[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


def test_batches_carry_each_rows_label_tokens_for_token_normalisation():
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=16, label_truncate=4))
    rows = [agent.vectorize(ab.Message(text=t, labels=[label])) for t, label in
            (("abc", "cba"), ("ab", "ba"), ("abcdefg", "gfedcba"))]
    batch = agent.batchify(rows)
    # a label's bytes and end token, cut to --label-truncate: the targets its row's loss averages over
    assert batch[LOSS_TOKENS].tolist() == [4, 3, 4] == (batch["label_vec"] != 0).sum(1).tolist()
    assert LOSS_TOKENS not in agent.batchify([agent.vectorize(ab.Message(text="abc"))])


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["micro", "token"])
def test_same_weights_on_cpu_and_the_ipu_emulator_under_the_same_plan(norm):
    weights, reports = [], []
    for device in ("cpu", "ipu"):
        opts = ab.Opts(task="reverse:256", model="transformer/generator", batchsize=4, device_iterations=2,
                       gradient_accumulation=2, embedding_size=16, num_epochs=1, label_truncate=10,
                       loss_normalization=norm,
                       validation_every_n_epochs=-1, eval_splits="valid", progress=False, seed=1,
                       device=device, ipu_emulator=device == "ipu", log_every_n_secs=1000)
        world = ab.create_world(opts)
        reports.append(ab.run(world, opts))
        weights.append({k: v.clone() for k, v in world.get_model_agent().model.state_dict().items()})
    start = TransformerGeneratorAgent(ab.Opts(embedding_size=16, label_truncate=10, seed=1)).model.state_dict()
    assert max((weights[0][k] - start[k]).abs().max().item() for k in start) > 1e-3  # it trained
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in start) < 1e-5
    assert reports[1]["device"] == "ipu"
    # texts of 3-8 letters pad to 8, labels of 4-9 tokens to 8 or 16: two training and two eval signatures at most
    assert 1 <= reports[1]["ipu"]["compilations"] <= 4
    cpu, ipu = reports[0]["valid"], reports[1]["valid"]
    assert cpu["exs"] == ipu["exs"] and cpu["tokens"] == ipu["tokens"]
    assert ipu["loss"] == pytest.approx(cpu["loss"], rel=1e-4)
    assert ipu["accuracy"] == cpu["accuracy"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_gloo_replicas_train_and_report_what_the_emulated_replicas_do(tmp_path):
    """-rf 2: two gloo processes vs the IPU emulator's two replicas in one process: the same weights, and the
    replicas' evaluation reports (each replica scores its own rows) merge to the one-process token metrics."""
    from accelbatch.cli import main

    common = ["train", "-t", "reverse:400", "-m", "transformer/generator", "-esz", "16", "--label-truncate", "10",
              "-tstep", "6", "-bs", "4", "-rf", "2", "--no-progress", "--eval-splits", "valid", "-veps", "-1",
              # SGD: the key bias of attention has a zero gradient up to rounding, which Adam would scale up
              # into lr-sized steps that differ with the all-reduce's summation order
              "-opt", "sgd", "-lr", "0.5"]
    reports, weights = {}, {}
    for name, device in (("cpu", ["--device", "cpu"]), ("ipu", ["--device", "ipu", "--ipu-emulator"])):
        report = tmp_path / f"{name}.json"
        assert main(common + device + ["-mf", str(tmp_path / f"{name}.pt"), "--report-json", str(report)]) == 0
        reports[name] = json.loads(report.read_text())["valid"]
        weights[name] = torch.load(tmp_path / f"{name}.pt", map_location="cpu", weights_only=True)["model"]
    for key in weights["cpu"]:
        torch.testing.assert_close(weights["cpu"][key], weights["ipu"][key], rtol=1e-5, atol=1e-6, msg=key)
    valid = [ep[0] for ep in generate(20, 0, "valid")]
    cpu, ipu = reports["cpu"], reports["ipu"]
    assert cpu["exs"] == ipu["exs"] == 20
    assert cpu["tokens"] == ipu["tokens"] == sum(len(m["labels"][0]) + 1 for m in valid)
    for key in ("loss", "ppl", "token_acc", "accuracy"):
        assert cpu[key] == pytest.approx(ipu[key], rel=1e-5), key


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_data_workers_and_dynamic_batching_change_nothing_but_speed():
    """vectorize/batchify in two data workers (token-budget batches sized by text + label): the same weights
    and the same evaluation as in the main process."""
    results = []
    for workers in (0, 2):
        opts = ab.Opts(task="reverse:320", model="transformer/generator", batchsize=8, embedding_size=16,
                       num_epochs=1, label_truncate=10, validation_every_n_epochs=-1, eval_splits="valid",
                       progress=False, num_workers=workers, dynamic_batching="full", log_every_n_secs=1000)
        world = ab.create_world(opts)
        report = ab.run(world, opts)
        results.append((report["valid"], world.get_model_agent().model.state_dict()))
    (first, w0), (second, w2) = results
    assert first["exs"] == second["exs"] == 16
    for key in ("tokens", "loss", "ppl", "token_acc", "ltpb", "accuracy"):
        assert first[key] == pytest.approx(second[key], rel=1e-6), key
    for key in w0:
        torch.testing.assert_close(w0[key], w2[key], rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
@pytest.mark.parametrize("inference,beam", [("greedy", 1), ("beam", 3)])
def test_decoding_on_a_gpu_never_waits_for_the_host(inference, beam):
    """Every decoded token is computed from device tensors only: a host wait per token (a tensor made from a
    Python list, torch checking whether a mask is causal) would serialise the GPU with the host."""
    model = random_model(inference=inference, beam_size=beam, min_length=3, block_ngram=2).cuda()
    batch = {k: v.cuda() for k, v in batch_of(["hello", "ab", "copy me please"]).items()}
    with torch.no_grad():
        model(batch)                                   # lazy CUDA and kernel set-up outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            preds = model(batch)["preds"]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert preds.shape == (3, 12) and preds.device.type == "cuda"


def test_all_of_a_long_text_is_its_last_1024_bytes_the_positions_the_generator_has():
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, text_truncate=-1, label_truncate=4))
    text = "x " * 800 + "copy: a b"  # 1609 bytes: past the 1024 positions (it indexed past them)
    obs = agent.vectorize(ab.Message(text=text, labels=["a b"]))
    assert obs["text_vec"] == VOCAB.encode(text)[-1024:]
    assert agent.example_length(obs) == 1024
    out = agent.model.eval()(agent.batchify([obs]))
    assert torch.isfinite(out["loss"]) and out["preds"].shape == (1, 4)


@pytest.mark.parametrize("inference,beam", [("greedy", 1), ("beam", 3)])
def test_a_reply_is_at_most_label_truncate_tokens_and_min_length_beyond_it_is_refused(inference, beam):
    """ParlAI generates --label-truncate tokens at most (a reply was one longer); a --beam-min-length above
    that could never hold and was capped silently."""
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, label_truncate=3, beam_min_length=3,
                                              inference=inference, beam_size=beam))
    batch = agent.batchify([agent.vectorize(ab.Message(text=t, eval_labels=["x"])) for t in ("abc", "q")])
    preds = agent.model.eval()(batch)["preds"].tolist()
    assert [len(_until_end(row)) for row in preds] == [3, 3]  # min length 3 = the most a reply holds
    with pytest.raises(ab.opts.OptionError, match="--beam-min-length: must be 0 to the 3 tokens a reply may have"):
        TransformerGeneratorAgent(ab.Opts(embedding_size=8, label_truncate=3, beam_min_length=4))


def test_a_beam_larger_than_the_vocabulary_is_refused_and_the_vocabulary_itself_searches():
    """--beam-size 10**12 ended the final evaluation with an allocator traceback (79 lines)."""
    size = TransformerGeneratorAgent(ab.Opts(embedding_size=8)).vocab.size
    with pytest.raises(ab.opts.OptionError, match=f"--beam-size {size + 1}: more hypotheses than the {size} tokens "
                                                  f"a first step chooses from; give at most {size}"):
        TransformerGeneratorAgent(ab.Opts(embedding_size=8, inference="beam", beam_size=size + 1))
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, label_truncate=2, inference="beam", beam_size=size))
    batch = agent.batchify([agent.vectorize(ab.Message(text="abc", eval_labels=["x"]))])
    assert agent.model.eval()(batch)["preds"].shape == (1, 2)
    TransformerGeneratorAgent(ab.Opts(embedding_size=8, beam_size=size + 1))  # greedy: the beam is not used


def test_beam_min_length_is_not_checked_where_nothing_is_generated():
    agent = TransformerGeneratorAgent(ab.Opts(embedding_size=8, label_truncate=3, beam_min_length=40,
                                              skip_generation=True))
    assert agent.model.skip_generation
