"""The batched front end's loader options (:class:`LoaderConfig`), read from Opts or given field by field."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from accelbatch.data.batching import STRATEGIES

__all__ = ["LoaderConfig", "MODES"]

MODES = ("sync", "async", "async-rebatched")


@dataclass(frozen=True)
class LoaderConfig:
    """Every knob of the loader; :meth:`from_opts` reads the matching Opts fields."""

    batch_size: int = 32
    mode: str = "sync"
    num_workers: int = 0
    dynamic_batching: str = "none"
    max_batch_tokens: int = -1
    num_buckets: int = 8
    batch_sort_cache_size: int = 1000
    buffer_size: int = 3
    drop_last: bool = True
    shuffle: bool = True
    seed: int = 0
    text_truncate: int = 256
    label_truncate: int = -1        # with text_truncate: the default token budget (ParlAI's), -1: as text
    context_length: int = -1
    include_labels: bool = True
    row_multiple: int = 1           # rows of full/buckets batches: multiples of this (e.g. D x R x G)
    static_rows: bool = False       # pad partial fixed-row batches with padding rows to batch_size
    token_count: str = "padded"     # 'full': budget counts rows x longest ('padded') or the sum ('words')
    seq_keys: tuple[str, ...] = ("text_vec",)
    validation_max_exs: int = -1    # > 0: an evaluation capped at this many examples interleaves its tasks
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--dataloader-mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.dynamic_batching not in STRATEGIES:
            raise ValueError(f"--dynamic-batching: {self.dynamic_batching!r} is not one of {', '.join(STRATEGIES)}")
        for name in ("batch_size", "num_buckets", "batch_sort_cache_size", "buffer_size", "row_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers: must be 0 or more, got {self.num_workers}")

    @classmethod
    def from_opts(cls, opts: Any, **changes: Any) -> "LoaderConfig":
        names = {"batch_size": "batchsize", "mode": "dataloader_mode", "timeout_s": "data_timeout_s"}
        values = {f.name: opts[names.get(f.name, f.name)] for f in fields(cls)
                  if names.get(f.name, f.name) in opts}
        values.update(changes)
        return cls(**values)
