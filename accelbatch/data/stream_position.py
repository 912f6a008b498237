"""A streamed dataset's data position: what the caller has received of the epoch, per data worker.

:class:`StreamProgress` counts the batches handed to the caller (each stamped with its ``origin``) and the
workers' :class:`~accelbatch.data.datasets.ShardEnd` marks; :func:`read_stream_position` checks a saved
position against the loader resuming from it (same mode, workers and files). The loader's module docstring
describes the position and how a resume re-reads the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelbatch.data.datasets import ShardEnd, StreamResume


@dataclass
class StreamProgress:
    """What the caller has received of a stream's epoch: batches per (logical) data worker, which workers'
    shards ended (their :class:`ShardEnd` was received), and the worker of the last item received."""

    epoch: int
    counts: list[int]
    done: list[bool]
    last: int = -1

    @classmethod
    def start(cls, epoch: int, workers: int) -> "StreamProgress":
        return cls(epoch, [0] * workers, [False] * workers)

    def _enter(self, epoch: int) -> None:
        if epoch != self.epoch:  # the first item of a new epoch
            workers = len(self.counts)
            self.epoch, self.counts, self.done, self.last = epoch, [0] * workers, [False] * workers, -1

    def received(self, origin: tuple[int, int, int]) -> None:
        epoch, worker, n = (int(x) for x in origin)
        self._enter(epoch)
        self.counts[worker], self.last = n + 1, worker

    def ended(self, mark: ShardEnd) -> None:
        self._enter(mark.epoch)
        if mark.count < self.counts[mark.worker]:
            raise ValueError(f"data position: data worker {mark.worker}'s part of the stream has {mark.count} "
                             f"batches in epoch {mark.epoch}, fewer than the {self.counts[mark.worker]} the "
                             "checkpointed run had consumed; the files changed since (resume with the same "
                             "data and options)")
        self.done[mark.worker], self.last = True, mark.worker

    def position(self) -> dict[str, Any]:
        workers = len(self.counts)
        if all(self.done):  # the epoch was received to its end: the next one starts afresh
            return {"epoch": self.epoch + 1, "batches": [0] * workers, "done": [False] * workers, "rotation": 0}
        rotation = (self.last + 1) % workers if self.last >= 0 else 0
        return {"epoch": self.epoch, "batches": list(self.counts), "done": list(self.done), "rotation": rotation}


def read_stream_position(position: dict[str, Any], kind: str, workers: int, files: list[int]) -> StreamResume:
    """Check a stream position against this loader (same kind, workers and files) and read it."""
    if "plan_sha256" in position:
        raise ValueError("data position: the checkpoint was taken reading the data into memory, this run "
                         "streams it (-dt ...:stream); resume with the same -dt")
    try:
        epoch, rotation = int(position["epoch"]), int(position["rotation"])
        counts = tuple(int(n) for n in position["batches"])
        done = tuple(bool(d) for d in position["done"])
        saved_kind, saved_files = str(position["stream"]), [int(n) for n in position["files"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"data position: {position!r} is not a stream position") from None
    if saved_kind != kind:
        saved_mode = "async-rebatched" if saved_kind == "rebatched" else "sync or async"
        raise ValueError(f"data position: the checkpointed run used --dataloader-mode {saved_mode}, this one "
                         "does not; resume with the same --dataloader-mode")
    if len(counts) != workers or len(done) != workers:
        raise ValueError(f"data position: the stream was read by {len(counts)} data workers, this run has "
                         f"{workers}; resume with the same --num-workers")
    if saved_files != files:
        raise ValueError(f"data position: the streamed files are {saved_files} bytes long in the checkpoint, "
                         f"{files} now; resume with the same data, or start afresh without --resume")
    if epoch < 0 or min(counts) < 0 or not 0 <= rotation < workers:
        raise ValueError(f"data position: {position!r} is not a valid stream position")
    return StreamResume(epoch, counts, done, rotation)
