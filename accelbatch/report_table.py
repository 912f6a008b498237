"""How a report is written out: the table the command line prints, the --metrics-log records, and JSON
with no bare NaN."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

from accelbatch.tensorboard_log import TensorBoardLog

# the table's first columns, in this order, when a split has them; other metrics follow by name, then the
# speed and time of the split
LEADING = ("exs", "accuracy", "f1", "bleu-4", "loss", "ppl", "token_acc")
TRAILING = ("exs_per_s", "time_s")
NOT_COLUMNS = frozenset({"steps", "epochs", "stopped_by"})  # the run's own counts, said by --report-json
# sums of whole numbers
COUNTS = frozenset({"tokens", "batch_tokens", "skipped_updates", "dropped_exs", "scored_exs", "loss_exs"})
WIDTH = 12


def _task_rows(rep: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A multitask split's rows of its tasks: ``TASK/metric`` keys as (TASK, {metric: value}), in report order
    (a task's name may hold '/' itself, as a file path does; a metric's never does)."""
    tasks: dict[str, dict[str, Any]] = {}
    for key, value in rep.items():
        if "/" in key:
            task, metric = key.rsplit("/", 1)
            tasks.setdefault(task, {})[metric] = value
    return list(tasks.items())


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every number some row holds: ParlAI's metrics first, others by name, then the speed and time."""
    present = {key for rep in rows for key, value in rep.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in NOT_COLUMNS}
    middle = sorted(present - set(LEADING) - set(TRAILING))
    return [c for c in LEADING if c in present] + middle + [c for c in TRAILING if c in present]


def _cell(column: str, value: Any, width: int) -> str:
    if isinstance(value, float) and column in COUNTS and value.is_integer():
        text = str(int(value))
    elif isinstance(value, float) and column not in TRAILING:
        text = f"{value:.4f}" if math.isfinite(value) and abs(value) < 1e6 else f"{value:.4g}"
    else:
        text = str(value)
    return f"{text:>{width}}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain table: one row per split, ParlAI's metric names as columns (every metric the
    splits report), under a multitask split one indented row per task (its ``TASK/metric`` keys, as ParlAI
    prints them), then the report's other fields."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for name, rep in report.items():
        if isinstance(rep, dict) and "exs" in rep:
            rows.append((name, {k: v for k, v in rep.items() if "/" not in k}))
            rows.extend((f"  {task}", values) for task, values in _task_rows(rep))
    columns = _columns([rep for _, rep in rows])
    widths = [max(WIDTH, len(c) + 2) for c in columns]
    first = max([8] + [len(name) + 2 for name, _ in rows])
    header = f"{'split':<{first}}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths))
    lines = [header, "-" * len(header)]
    for name, rep in rows:
        lines.append(f"{name:<{first}}" + "".join(_cell(c, rep.get(c, ""), w) for c, w in zip(columns, widths)))
    extras = [f"{k}: " + (", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v))
              for k, v in report.items() if not (isinstance(v, dict) and "exs" in v)]
    return "\n".join(lines + extras)


def json_ready(value: Any) -> Any:
    """``value`` with every float that is not finite (a NaN loss, an infinite ppl) as None: JSON has no NaN,
    and a reader of strict JSON refuses a bare NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _warn_unwritable(option: str, path: str, exc: OSError) -> None:
    """Says once, on stderr, that a log cannot be written and the run goes on without it."""
    print(f"accelbatch: {option} {path}: cannot write ({exc.strerror or exc}); the run goes on without it",
          file=sys.stderr, flush=True)


def standard_stream(path: str) -> TextIO | None:
    """``sys.stdout`` (or ``sys.stderr``) when ``path`` names the file it writes to (``/dev/stdout``, whatever it
    is redirected to), else None: a log or report given that path is written through it, in its order and at its
    offset, never by opening or replacing its file (which would write over, or delete, what it holds)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            own = os.fstat(stream.fileno())
        except (OSError, ValueError, AttributeError):  # closed, or not a real file (a test's capture)
            continue
        if (own.st_dev, own.st_ino) == (found.st_dev, found.st_ino):
            return stream
    return None


@contextlib.contextmanager
def _locked(handle: Any) -> Iterator[None]:
    """An exclusive lock on a --metrics-log file (flock, where there is one) while a record is appended or a
    resume cuts its records: runs sharing the log never lose a line to each other."""
    try:
        import fcntl

        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
    except (ImportError, OSError):  # no flock (not POSIX, or a file system without it): as before
        handle = None
    try:
        yield
    finally:
        if handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_UN)


def _written_by(line: bytes, run: str | None, last: bool) -> bool:
    """Whether a --metrics-log line after a checkpoint is a record of ``run`` (every line, for a checkpoint of
    a log whose records had no run name); a line that is no record is the killed run's torn write when last."""
    if run is None:
        return True
    try:
        record = json.loads(line)
    except ValueError:
        return last and not line.endswith(b"\n")
    return isinstance(record, dict) and record.get("run") == run


@dataclass
class MetricsLog:
    """Appends one JSON object per line to --metrics-log (nothing when no path is given). A log that cannot be
    written (a full disk, a removed folder) is said once on stderr and then left off: a run never fails for a
    log."""

    path: str | None
    # names this run's records ("run"), kept by its checkpoints: a resume cuts only its own from a shared log
    run: str = field(default_factory=lambda: os.urandom(4).hex())
    handle: TextIO | None = None
    tensorboard: TensorBoardLog | None = None  # the same records as TensorBoard scalars (optional)
    progress: Any = None  # the training's progress bar, which shows them: closed with the log, also on an error
    _borrowed: bool = False  # the handle is sys.stdout or sys.stderr (standard_stream): flushed, never closed

    def write(self, record: dict[str, Any]) -> None:
        if self.tensorboard is not None:
            try:
                self.tensorboard.write(record)
            except OSError as exc:
                self._drop_tensorboard(exc)
        if not self.path:
            return
        try:
            if self.handle is None and (stream := standard_stream(self.path)) is not None:
                self.handle, self._borrowed = stream, True
            elif self.handle is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self.handle = open(self.path, "a", encoding="utf-8")
            line = json.dumps(json_ready({**record, "run": self.run}), sort_keys=True, allow_nan=False) + "\n"
            with _locked(None if self._borrowed else self.handle):  # not while another run's resume cuts it
                self.handle.write(line)
                self.handle.flush()
        except OSError as exc:
            self._drop_file(exc)

    def end(self) -> int | None:
        """Where the log file ends now (bytes; every record written so far is flushed), kept by a checkpoint;
        None when the log is not a regular file of its own (none given, stdout or stderr, a device or pipe)."""
        if not self.path or self._borrowed or (self.handle is None and standard_stream(self.path) is not None):
            return None
        try:
            return os.path.getsize(self.path) if os.path.isfile(self.path) else \
                None if os.path.exists(self.path) else 0
        except OSError:
            return None

    def cut_to(self, saved: dict[str, Any] | None) -> None:
        """--resume: this run's records go on under the checkpoint's run name, and those it wrote after the
        checkpoint (``saved``: the log's path, size and run then) are cut from the log, as TensorBoard's
        ``purge_step`` does, so that the records of the steps the resumed run trains again are not there twice;
        other runs' records (a log shared with them) stay (a torn last line is taken for the killed run's). A
        resume that writes another file, or a file shorter than that or with no record ending there, is left
        alone."""
        self.run = str((saved or {}).get("run") or self.run)
        if not saved or not self.path or saved.get("path") != os.path.abspath(self.path) or self.handle:
            return
        size = int(saved.get("bytes", -1))
        try:
            if size < 0 or not os.path.isfile(self.path) or os.path.getsize(self.path) <= size:
                return
            with open(self.path, "r+b") as handle, _locked(handle):  # runs sharing the log wait meanwhile
                handle.seek(max(size - 1, 0))
                before = handle.read(1) if size else b"\n"
                after = handle.read().splitlines(keepends=True)
                if before != b"\n":
                    return
                others = [line for line in after if not _written_by(line, saved.get("run"), line is after[-1])]
                handle.seek(size)
                handle.truncate(size)
                handle.write(b"".join(others))
        except OSError as exc:
            print(f"accelbatch: --resume: --metrics-log {self.path}: cannot cut it back to the checkpoint "
                  f"({exc.strerror or exc}); the records after it stay", file=sys.stderr)
            return
        count, kept = len(after) - len(others), f"; {len(others)} of other runs after it kept" if others else ""
        print(f"accelbatch: --resume: --metrics-log {self.path}: {count} record{'s' * (count != 1)} written after "
              f"the checkpoint removed (this run writes them again){kept}", file=sys.stderr)

    def _drop_file(self, exc: OSError) -> None:
        """Stops writing --metrics-log after a failed write, saying so once (closing it then fails the same way:
        its buffer still holds the line that failed)."""
        _warn_unwritable("--metrics-log", str(self.path), exc)
        self.path = None
        self._close_file(warn=False)

    def _drop_tensorboard(self, exc: OSError) -> None:
        """Stops writing --tensorboard-logdir after a failed write, saying so once."""
        _warn_unwritable("--tensorboard-logdir", str(getattr(self.tensorboard, "log_dir", "")), exc)
        self._close_tensorboard(warn=False)

    def _close_file(self, warn: bool) -> None:
        handle, self.handle = self.handle, None
        try:
            if handle is not None and not self._borrowed:
                handle.close()
        except OSError as exc:
            if warn:
                _warn_unwritable("--metrics-log", str(self.path), exc)

    def _close_tensorboard(self, warn: bool) -> None:
        board, self.tensorboard = self.tensorboard, None
        try:
            if board is not None:
                board.close()
        except OSError as exc:
            if warn:
                _warn_unwritable("--tensorboard-logdir", str(getattr(board, "log_dir", "")), exc)

    def close(self) -> None:
        """Closes the progress bar and the logs; never raises for a log that cannot be written."""
        if self.progress is not None:  # before anything is printed after it: an error starts its own line
            self.progress.close()
            self.progress = None
        self._close_file(warn=True)
        self._close_tensorboard(warn=True)
