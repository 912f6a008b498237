"""Generation for seq2seq and decoder-only models: byte tokens, the token loss, greedy and beam search.

A *core* is any ``nn.Module`` with two methods:

- ``encode(text_vec [rows, S]) -> state``: a tensor or a tuple/list/dict of tensors with rows in dim 0
  (a seq2seq encoder's memory; a decoder-only core returns the context itself; other leaves, such as None,
  pass along untouched);
- ``decode(state, prefix [rows, T]) -> logits [rows, T, vocab]``: causal, so position t sees prefix[:, :t+1].

:class:`GeneratorModel` wraps a core into the model a :class:`~accelbatch.agents.TorchAgent` compiles:
``forward(batch)`` returns the teacher-forced token loss (mean over the micro-batch's target tokens) and
per-row sums (``nll``, ``tokens``, ``correct``) the agent turns into ParlAI's loss / ppl / token_acc / ltpb;
in eval mode it also generates ``preds [rows, max_len]`` (never padding or the begin token; ParlAI's
``--beam-min-length`` and ``--beam-block-ngram`` apply to greedy and beam alike, so beam size 1 is greedy).
Decoding is a Python loop of exactly ``max_len`` steps over tensors whose shapes depend only on the step
number: no data-dependent branch and no host read per token, so a graph compiler (IPU) traces one graph per
input shape and CUDA never syncs mid-decoding. A row that emitted the end token keeps emitting padding.

A core without ``encode``/``decode`` is refused when the model is made, a state tensor without the rows in
dim 0 at each encode, and logits of another shape than [rows, T, vocab.size] where they are first met (the
loss, the first decoding steps), each as a :class:`CoreError` in one line naming who built the core
(``MyAgent.build_core()``) and the shapes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from accelbatch.messages import ReplyError

PAD, BOS, EOS = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB = 256 + BYTE_OFFSET
NEG = -1e9  # a finite "impossible" score: -inf would turn 0 * -inf into NaN


class ByteVocab:
    """UTF-8 bytes as tokens (ids 3..258; 0 pad, 1 begin, 2 end): any text, no dictionary to build."""

    size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Text of the ids up to the first end token (padding and begin tokens skipped)."""
        out = bytearray()
        for i in ids:
            if i == EOS:
                break
            if i >= BYTE_OFFSET:
                out.append(i - BYTE_OFFSET)
        return out.decode("utf-8", errors="replace")


class CoreError(ReplyError):
    """A generator's core breaks the contract above (no encode/decode, or logits of another shape): the user's
    code to fix, told in one line (a usage error: exit 2)."""

    usage_error = True


CONTRACT = ("a core is an nn.Module with encode(text_vec [rows, S]) -> state and decode(state, prefix [rows, T]) "
            "-> logits [rows, T, vocab.size] (accelbatch/generation.py)")


def check_core(core: Any, source: str) -> None:
    """A :class:`CoreError` naming ``source`` (who made the core: ``MyAgent.build_core()``) unless ``core`` is
    an nn.Module with callable ``encode`` and ``decode``."""
    name = type(core).__name__
    kind = f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
    if not isinstance(core, nn.Module):
        raise CoreError(f"{source}: the core is {kind}, not an nn.Module; {CONTRACT}")
    missing = [method for method in ("encode", "decode") if not callable(getattr(core, method, None))]
    if missing:
        raise CoreError(f"{source}: the core is {kind}, which has no {' and no '.join(missing)}(); {CONTRACT}")


def _shape_hint(got: tuple[int, ...], expected: tuple[int, int, Any]) -> str:
    """What a decode returning logits of shape ``got`` (not ``expected``) most likely did."""
    rows, steps, vocab = expected
    if len(got) == 2:
        return "the logits of every prefix position are needed (the loss reads them all), not only the last one's"
    if len(got) == 3 and got[:2] == (steps, rows):
        return "rows come first: a time-major [T, rows, vocab] output (an RNN or transformer without " \
               "batch_first=True) needs batch_first=True or a transpose(0, 1)"
    if len(got) == 3 and got[:2] == (rows, steps):
        return f"its output layer must have vocab.size = {vocab} classes (nn.Linear(dim, self.vocab.size))"
    return "one row per prefix row, one position per prefix token, one score per vocabulary token"


def repeat_rows(state: Any, times: int) -> Any:
    """Each row of every tensor in ``state`` repeated ``times`` times in place (beam expansion)."""
    if isinstance(state, torch.Tensor):
        # expand + reshape rather than repeat_interleave, whose output size torch may read back from a GPU
        return state.unsqueeze(1).expand(-1, times, *state.shape[1:]).reshape(-1, *state.shape[1:])
    if isinstance(state, (tuple, list)):
        return type(state)(repeat_rows(s, times) for s in state)
    if isinstance(state, dict):
        return {k: repeat_rows(v, times) for k, v in state.items()}
    return state


def _eager(decoding: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``decoding`` run eagerly under ``--compile`` (torch.compile), encode and the token loss compiled: traced,
    its loop of max_len steps over prefixes of every length is a graph per step and shape, minutes of
    compiling for a first batch."""
    compiler = getattr(torch, "compiler", None)  # torch >= 2.1
    return compiler.disable(decoding) if compiler is not None else decoding


def length_penalty(lengths: torch.Tensor, alpha: float = 0.65) -> torch.Tensor:
    """GNMT's length penalty ((5 + length) / 6) ** alpha, which beam search divides final scores by."""
    return ((5.0 + lengths.float()) / 6.0) ** alpha


class GeneratorModel(nn.Module):
    """forward(batch) -> {"loss", "nll", "tokens", "correct"[, "preds"]} around a core (module docstring).

    ``batch["text_vec"]`` [rows, S] is the input; ``batch["label_vec"]`` [rows, T], when given, holds the target
    tokens ending with :data:`EOS`, padded with :data:`PAD` (an all-padding row is left out of the loss).
    """

    def __init__(self, core: nn.Module, max_len: int, inference: str = "greedy", beam_size: int = 1,
                 skip_generation: bool = False, min_length: int = 0, block_ngram: int = -1,
                 vocab_size: int | None = None, source: str = "GeneratorModel(core)"):
        super().__init__()
        if inference not in ("greedy", "beam"):
            raise ValueError(f"--inference {inference!r}: expected greedy or beam")
        check_core(core, source)
        self.core, self.source = core, source
        self.vocab_size = vocab_size  # the logits' last dim, checked with their shape (None: not checked)
        self.max_len, self.inference, self.beam_size = max_len, inference, beam_size
        self.skip_generation = skip_generation
        self.min_length, self.block_ngram = min_length, block_ngram

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = batch["text_vec"]
        state = self.core.encode(text)
        self._check_state(state, tuple(text.shape))
        out: dict[str, torch.Tensor] = {}
        if "label_vec" in batch:
            out.update(self.token_loss(state, batch["label_vec"]))
        if not self.training and not self.skip_generation:
            if self.inference == "beam":
                out["preds"] = self.beam_search(state, text.shape[0], self.beam_size)
            else:
                out["preds"] = self.greedy(state, text.shape[0])
        return out

    def _check_state(self, state: Any, text_shape: tuple[int, ...]) -> None:
        """A :class:`CoreError` unless every tensor of the state has the text's rows in dim 0 (beam search
        repeats each row per hypothesis); shapes only."""
        rows = text_shape[0]
        for tensor in _tensors(state):
            if tensor.dim() == 0 or tensor.shape[0] != rows:
                raise CoreError(f"{self.source}: its encode(text_vec {list(text_shape)}) returned a state holding a "
                                f"tensor of shape {list(tensor.shape)}; every tensor of the state needs the "
                                f"{rows} rows in dim 0 (a time-major RNN state [layers, rows, dim]: "
                                "transpose(0, 1) in encode and back in decode)")

    def decode(self, state: Any, prefix: torch.Tensor) -> torch.Tensor:
        """The core's logits [rows, T, vocab] for ``prefix`` [rows, T]; a :class:`CoreError` for another shape
        (shapes only: no host read, the same graph)."""
        logits = self.core.decode(state, prefix)
        if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != prefix.shape \
                or self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            self._refuse_logits(logits, prefix)
        return logits

    def _step(self, state: Any, prefix: torch.Tensor, t: int) -> torch.Tensor:
        """Decoding step ``t``'s logits, their shape checked at the first two steps (prefixes of 1 and 2 tokens
        tell a [rows, T] layout from a [T, rows] one even for one row); later steps call the core alone, as the
        check's microseconds would show on a small model's steps."""
        return self.core.decode(state, prefix) if t > 1 else self.decode(state, prefix)

    def _refuse_logits(self, logits: Any, prefix: torch.Tensor) -> None:
        """A :class:`CoreError` saying what decode returned for ``prefix`` instead of [rows, T, vocab] logits."""
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
        rows, steps = prefix.shape
        vocab = self.vocab_size or (got[-1] if got else "vocab.size")
        said = f"logits of shape {list(got)}" if got is not None else type(logits).__name__
        hint = _shape_hint(got, (rows, steps, vocab)) if got is not None else "return the logits tensor itself"
        raise CoreError(f"{self.source}: its decode(state, prefix [{rows}, {steps}]) returned {said}, expected "
                        f"[{rows}, {steps}, {vocab}] ([rows, T, vocab.size]); {hint}")

    def token_loss(self, state: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Teacher forcing: the decoder reads [BOS, labels[:-1]] and is scored on every non-pad label token."""
        begin = torch.full_like(labels[:, :1], BOS)
        logits = self.decode(state, torch.cat([begin, labels[:, :-1]], dim=1))
        nll = F.cross_entropy(logits.transpose(1, 2).float(), labels, ignore_index=PAD, reduction="none")
        mask = labels != PAD
        tokens = mask.sum(dim=1)
        correct = ((logits.argmax(dim=-1) == labels) & mask).sum(dim=1)
        row_nll = nll.sum(dim=1)
        loss = row_nll.sum() / tokens.sum().clamp_min(1)
        return {"loss": loss, "nll": row_nll.detach(), "tokens": tokens, "correct": correct}

    def constrain(self, scores: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """``scores`` [N, vocab] of the next token with what may not come next made impossible: padding and the
        begin token always, the end token before ``min_length`` tokens, and (``block_ngram`` n > 0) a token that
        would repeat an n-gram of ``generated`` [N, t]. Shapes depend on t only, so this stays static."""
        steps = generated.shape[1]
        ids = torch.arange(scores.shape[1], device=scores.device)  # made on the device: no copy, no host wait
        banned = (ids == PAD) | (ids == BOS)
        if steps < self.min_length:
            banned = banned | (ids == EOS)
        scores = scores.masked_fill(banned, NEG)
        n = self.block_ngram
        if n < 1 or steps < n:
            return scores
        if n == 1:
            return scores.scatter(1, generated, NEG)
        # n-gram i is generated[i : i + n]; the next token would complete generated[t-n+1:] + [token]
        heads = generated.unfold(1, n - 1, 1)[:, : steps - n + 1]        # [N, t-n+1, n-1]
        match = (heads == generated[:, steps - n + 1:].unsqueeze(1)).all(dim=-1)
        return scores.scatter_add(1, generated[:, n - 1:], match.to(scores.dtype) * NEG)

    @_eager
    def greedy(self, state: Any, rows: int) -> torch.Tensor:
        """[rows, max_len] tokens: the most likely token at each of max_len steps; padding after the end."""
        device = _device_of(state)
        buf = torch.full((rows, self.max_len + 1), PAD, dtype=torch.long, device=device)
        buf[:, 0] = BOS
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        positions = torch.arange(self.max_len + 1, device=device).unsqueeze(0)
        for t in range(self.max_len):
            # in float32: a float16 decoder (fp16 autocast) cannot hold NEG, and the argmax is the same
            logits = self.constrain(self._step(state, buf[:, : t + 1], t)[:, -1].float(), buf[:, 1: t + 1])
            token = logits.argmax(dim=-1).masked_fill(done, PAD)
            buf = torch.where(positions == t + 1, token.unsqueeze(1), buf)
            done = done | (token == EOS)
        return buf[:, 1:]

    @_eager
    def beam_search(self, state: Any, rows: int, beam: int) -> torch.Tensor:
        """[rows, max_len] tokens: the best of ``beam`` hypotheses (log-probability over GNMT's length
        penalty) kept over max_len steps; a finished hypothesis only extends with padding at no cost."""
        device = _device_of(state)
        state = repeat_rows(state, beam)
        flat = rows * beam
        buf = torch.full((flat, self.max_len + 1), PAD, dtype=torch.long, device=device)
        buf[:, 0] = BOS
        done = torch.zeros(flat, dtype=torch.bool, device=device)
        lengths = torch.zeros(flat, dtype=torch.long, device=device)
        scores = torch.full((rows, beam), NEG, device=device)
        scores[:, 0] = 0.0  # one live hypothesis at first, so the beams do not start as copies
        positions = torch.arange(self.max_len + 1, device=device).unsqueeze(0)
        base = (torch.arange(rows, device=device) * beam).unsqueeze(1)
        finished = None  # what a finished hypothesis extends with: padding at no cost, nothing else
        for t in range(self.max_len):
            logp = F.log_softmax(self._step(state, buf[:, : t + 1], t)[:, -1].float(), dim=-1)
            logp = self.constrain(logp, buf[:, 1: t + 1])
            vocab = logp.shape[-1]
            if finished is None:  # a mask made on the device: an item assignment would be a host wait on a GPU
                finished = torch.full_like(logp[0], NEG).masked_fill(torch.arange(vocab, device=device) == PAD, 0.0)
            logp = torch.where(done.unsqueeze(1), finished.unsqueeze(0), logp)
            candidates = (scores.reshape(flat, 1) + logp).reshape(rows, beam * vocab)
            scores, index = candidates.topk(beam, dim=1)
            source = (base + torch.div(index, vocab, rounding_mode="floor")).reshape(flat)
            token = (index % vocab).reshape(flat)
            buf, done, lengths = buf[source], done[source], lengths[source]
            buf = torch.where(positions == t + 1, token.unsqueeze(1), buf)
            lengths = lengths + (~done).long()
            done = done | (token == EOS)
        final = scores / length_penalty(lengths).reshape(rows, beam)
        best = (base.squeeze(1) + final.argmax(dim=1))
        return buf[best, 1:]


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a state (a tensor, or tuples, lists and dicts of them; other leaves such as None are
    passed along untouched)."""
    return [leaf for leaf in pytree.tree_leaves(state) if isinstance(leaf, torch.Tensor)]


def _device_of(state: Any) -> torch.device:
    tensors = _tensors(state)
    return tensors[0].device if tensors else torch.device("cpu")
