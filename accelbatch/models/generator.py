"""Generator agents: :class:`GeneratorAgent` (any core, see :mod:`accelbatch.generation`) and
``-m transformer/generator``, a small encoder-decoder transformer.

Tokens are UTF-8 bytes (:class:`~accelbatch.generation.ByteVocab`), so no dictionary is built and any task's
text round-trips. ``--text-truncate`` keeps the last tokens of the text (the latest turn matters most, as in
ParlAI), ``--label-truncate`` the first tokens of the label and its end token (32 when it is -1,
:func:`label_tokens`; a label cut there has no end token, as in ParlAI); generation runs that many steps, so
a reply is at most as long as a label kept.
Training minimises the token loss (teacher forcing); evaluation also generates (``--inference greedy|beam``,
``--beam-size``, ``--beam-min-length``, ``--beam-block-ngram``) unless ``--skip-generation``.

Metrics (ParlAI's names): ``loss`` (mean NLL per target token), ``ppl`` = exp(loss), ``token_acc``, ``ltpb``
(target tokens per micro-batch the engine ran: -bs rows in training without dynamic batching, -bs x -gas in
evaluation) and ``tokens``; they are sums in :class:`~accelbatch.metrics.Metrics`, so clones,
hogwild processes and replicas merge exactly. They count the rows the plan's output mode returns: every row
in evaluation, and in training all rows unless D x G > 1 with the default output mode Final (then the last
micro-batch of each call).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from accelbatch.agents import ModelFileError, TorchAgent
from accelbatch.generation import EOS, PAD, ByteVocab, GeneratorModel
from accelbatch.messages import EVAL_LABELS, LABELS, TEXT, Message
from accelbatch.model_opts import read_model_opts
from accelbatch.opts import OptionError
from accelbatch.plan import LOSS_TOKENS
from accelbatch.tasks.files import DataFileError

PAD_MULTIPLE = 8  # text and labels are padded to a multiple of this: few distinct shapes for graph compilers
DEFAULT_LABEL_TOKENS = 32  # label tokens kept and generated when --label-truncate is -1 (see label_tokens)


def label_tokens(opts: Any) -> int:
    """Label tokens a generator keeps and generates: --label-truncate, or 32 when it is -1. (ParlAI generates up
    to 256 and stops once every hypothesis ended; with static shapes every step costs, whether needed or not.)"""
    return DEFAULT_LABEL_TOKENS if opts.label_truncate == -1 else opts.label_truncate  # Opts refuses other < 1


ALL_TEXT_TOKENS = 1024  # text tokens a generator keeps with --text-truncate -1: the positions it has


def text_tokens(opts: Any) -> int:
    """Text tokens a generator keeps (the end of the text): --text-truncate, or with -1 the last 1024, as many
    as its learned positions (a longer text would index past them)."""
    return opts.text_truncate if opts.text_truncate > 0 else ALL_TEXT_TOKENS


def pad_to(rows: list[list[int]], width: int) -> torch.Tensor:
    """Right-pad rows with PAD into a [len(rows), width] LongTensor."""
    out = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def rounded(length: int, multiple: int = PAD_MULTIPLE) -> int:
    return max(multiple, -(-length // multiple) * multiple)


class PaddedTextLength:
    """Picklable length for dynamic batching and buckets: the width ``batchify`` gives a row's ``text_vec``, its
    text bytes (truncated) rounded up to :data:`PAD_MULTIPLE`. A bucket's planned length is then at least the
    width ``batchify`` makes for any of its batches, and at most the model's positions (``--text-truncate``
    rounded up). Like the rankers' length it counts the padded text the model computes, not the label (the
    token budget is spent on the text, see ``default_max_tokens``)."""

    def __init__(self, text_truncate: int):
        self.text_truncate = text_truncate

    def __call__(self, msg: Message) -> int:
        text = len((msg.get("full_text", msg.get(TEXT)) or "").encode("utf-8"))
        if self.text_truncate > 0:
            text = min(text, self.text_truncate)
        return rounded(text)


class GeneratorAgent(TorchAgent):
    """Base of generators: subclasses give ``build_core()`` (encode/decode, see :mod:`accelbatch.generation`)."""

    vocab = ByteVocab()
    reported_metrics = frozenset({"loss", "skipped_updates", "ppl", "token_acc", "ltpb", "tokens"})

    def __init__(self, opts: Any, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        # the loader plans batches (and buckets' static text shapes) on the width batchify pads text_vec to
        self.example_length = PaddedTextLength(text_tokens(opts))
        # (rows, rows a micro-batch) of the latest engine call, for ltpb; until one: a full call of -bs batches
        self._call = (opts.batchsize * opts.device_iterations * opts.gradient_accumulation, opts.batchsize)
        self.replies_text = not opts.skip_generation

    def build_core(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must implement build_core()")

    def build_model(self) -> nn.Module:
        o = self.opts
        if o.beam_min_length < 0 or o.beam_min_length > label_tokens(o) and not o.skip_generation:
            raise OptionError(f"--beam-min-length: must be 0 to the {label_tokens(o)} tokens a reply may have "
                              f"(--label-truncate), got {o.beam_min_length}")
        if o.inference == "beam" and o.beam_size > self.vocab.size:  # more could only repeat the first step's
            raise OptionError(f"--beam-size {o.beam_size}: more hypotheses than the {self.vocab.size} tokens a first "
                              f"step chooses from; give at most {self.vocab.size}")
        if o.beam_block_ngram == 0 or o.beam_block_ngram < -1:
            raise OptionError(f"--beam-block-ngram: must be -1 (no blocking) or at least 1, got {o.beam_block_ngram}")
        return GeneratorModel(self.build_core(), label_tokens(o), o.inference, o.beam_size, o.skip_generation,
                              o.beam_min_length, o.beam_block_ngram, vocab_size=self.vocab.size,
                              source=f"{type(self).__name__}.build_core()")

    def vectorize(self, obs: Message) -> Message:
        text = self.vocab.encode(obs.get("full_text", obs.get(TEXT)) or "")
        obs["text_vec"] = text[-text_tokens(self.opts):]
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
        if LABELS in obs and not obs[LABELS]:
            raise DataFileError(f"-t {self.opts.task}: a training example's labels are empty (text "
                                f"{str(obs.get(TEXT))[:60]!r}); a generator learns to write its first label: give "
                                "the example a label, or leave it out (a turn without 'labels' is context)")
        if targets:
            # the end token first, then the cut (as ParlAI): a cut label has none, the model learns no stop there
            obs["label_vec"] = (self.vocab.encode(targets[0]) + [EOS])[: label_tokens(self.opts)]
        return obs

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        texts = [o["text_vec"] for o in observations]
        batch = {"text_vec": pad_to(texts, rounded(max(len(t) for t in texts)))}
        labels = [o.get("label_vec") or [] for o in observations]
        if any(labels):
            batch["label_vec"] = pad_to(labels, rounded(max(len(t) for t in labels)))
            # the tokens each row's loss averages over: --loss-normalization token weighs micro-batches by them
            batch[LOSS_TOKENS] = torch.tensor([len(t) for t in labels], dtype=torch.long)
        return batch

    def before_call(self, rows: int, training: bool) -> None:
        """Note the rows of the micro-batches the engine cuts the call into."""
        self._call = (rows, self._micro_batch(rows, training))

    def _micro_batch(self, rows: int, training: bool) -> int:
        """Rows a micro-batch of a call of ``rows`` rows (the last may be shorter), from the engine's plan:
        dynamic batching changes it call to call, and evaluation runs -bs x -gas. -bs without a plan."""
        engine = self.engine
        plan = getattr(engine, "plan" if training else "eval_plan", None)
        if plan is None:
            return self.opts.batchsize
        # R processes are each given their shard of a training call (evaluation is each process's own)
        shards = getattr(engine, "world_size", 1) if training and getattr(engine, "inputs", "") == "shard" else 1
        return plan.layout(rows * shards).micro_batch

    def summed_metrics(self, outputs: dict[str, torch.Tensor], batches: int | None = None) -> None:
        """Token sums of ``outputs``, per row or (--output-mode sum) summed over micro-batches: sums either way.
        ``batches``: the micro-batches they are of (ltpb); None: every one of the call (sum mode)."""
        if "tokens" in outputs:
            self.metrics.add("token_nll", float(outputs["nll"].double().sum()))
            self.metrics.add("tokens", float(outputs["tokens"].sum()))
            self.metrics.add("token_correct", float(outputs["correct"].sum()))
            rows, micro = self._call
            self.metrics.add("token_batches", -(-rows // micro) if batches is None else batches)

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        # the returned rows are whole micro-batches of the call's (the last one of a call may be shorter)
        self.summed_metrics(outputs, -(-len(observations) // self._call[1]))
        if "preds" not in outputs:
            return [{} for _ in observations]
        return [{"text": self.vocab.decode(row)} for row in outputs["preds"].tolist()]


class TransformerCore(nn.Module):
    """A small encoder-decoder transformer over byte tokens (learned positions, no dropout)."""

    def __init__(self, vocab: int, dim: int, max_positions: int, heads: int = 4, layers: int = 2,
                 ffn: int | None = None):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.positions = nn.Embedding(max_positions, dim)
        ffn = ffn or 2 * dim
        enc = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(dim, heads, ffn, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, layers)
        self.out = nn.Linear(dim, vocab)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)
        nn.init.normal_(self.positions.weight, std=0.02)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.embed(tokens) * math.sqrt(self.dim) + self.positions(pos)

    def encode(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = text == PAD
        mask[:, 0] = False  # an empty (or padding) row attends to one position rather than none (NaN)
        return self.encoder(self._embed(text), src_key_padding_mask=mask), mask

    def decode(self, state: tuple[torch.Tensor, torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
        memory, mask = state
        steps = prefix.shape[1]
        causal = torch.triu(torch.full((steps, steps), float("-inf"), device=prefix.device), diagonal=1)
        # tgt_is_causal says what the mask is: without it torch compares the mask with a causal one on every
        # call, a host wait per decoded token on a GPU
        hidden = self.decoder(self._embed(prefix), memory, tgt_mask=causal, tgt_is_causal=True,
                              memory_key_padding_mask=mask)
        return self.out(hidden)


class TransformerGeneratorAgent(GeneratorAgent):
    """``-m transformer/generator``: :class:`TransformerCore` with ``--embedding-size`` wide layers."""

    # what its model's size follows (said when it does not fit in memory): the positions it embeds
    model_size_options = (("embedding_size", "-esz/--embedding-size"), ("text_truncate", "-tr/--text-truncate"),
                          ("label_truncate", "--label-truncate"))

    def load(self, path: str, option: str = "--model-file", optimizer: bool = True) -> None:
        """:meth:`TorchAgent.load`; a position table of another size names the options that size it."""
        try:
            super().load(path, option, optimizer)
        except ModelFileError as exc:
            head, hint, _ = str(exc).partition("; load it with")
            if not hint or "core.positions.weight is" not in head:
                raise
            saved = read_model_opts(path)
            trained = f"-tr {saved['text_truncate']} --label-truncate {saved['label_truncate']}" \
                if {"text_truncate", "label_truncate"} <= set(saved) else None
            said = f"it was trained with {trained} ({path}.opt): give those or leave them out" if trained else \
                "load it with the ones it was trained with"
            raise ModelFileError(f"{head}; its rows are the text and label tokens it keeps (-tr/--text-truncate, "
                                 f"--label-truncate): {said}") from None

    def build_core(self) -> nn.Module:
        o = self.opts
        return TransformerCore(self.vocab.size, o.embedding_size,
                               max(rounded(text_tokens(o)), rounded(label_tokens(o) + 1)))
