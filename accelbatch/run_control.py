"""When a run saves and stops: :class:`PeriodicSaver` (``--save-every-n-secs``) and :class:`StopSignals`
(SIGINT/SIGTERM become a flag the run loop checks between world steps, with a deadline); what it may write:
:func:`check_output_paths`, and :class:`ModelFileLock` (one training run at a time per ``-mf``); whether
replicas step together (:func:`steps_together`); a training world whose data ran out (:class:`SpentData`)."""

from __future__ import annotations

import errno
import math
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator, Sequence

SPENT_PARLEYS = 1000  # parleys in a row that counted nothing, after which a world that will not end is refused
# accelbatch's worlds that count every example as it is served: many parleys counting none are padding alone
_COUNTING_WORLDS = ("accelbatch.worlds", "accelbatch.multi_world", "accelbatch.loader_world")


def _teacher_name(world: Any) -> str:
    task = getattr(world, "get_task_agent", lambda: None)()
    return type(task if task is not None else world).__name__


class SpentData:
    """Refuses a world that would parley for ever: after :data:`SPENT_PARLEYS` parleys in a row that counted no
    example (many, not one: a world of yours may count an episode's examples at its end), in training a world
    whose epoch is done (a teacher of yours that set ``epochDone`` and serves nothing more; it would never reach
    -ne) or one of accelbatch's worlds whose teacher served only padding (None acts); in an evaluation
    (``split``) one of accelbatch's worlds whose teacher never ends its epoch. (A world of yours that counts
    nothing at all is told by run() instead.)"""

    def __init__(self, split: str = "train") -> None:
        self.idle, self.split, self.total = 0, split, 0

    def parleyed(self, world: Any, total: int) -> None:
        """After a parley: ``total``, the examples counted so far."""
        self.idle, self.total = 0 if total != self.total else self.idle + 1, total
        if self.idle < SPENT_PARLEYS:
            return
        from accelbatch.messages import ReplyError  # the user's teacher broke its contract: exit 2, as an agent's

        counting, name, done = type(world).__module__ in _COUNTING_WORLDS, _teacher_name(world), world.epoch_done()
        if self.split != "train" and counting and not done:
            raise ReplyError(f"{name}: the {self.split} evaluation's last {self.idle} parleys served no example and "
                             "its epoch never ended (epoch_done() stays False): a teacher of yours sets "
                             "self.epochDone = True as it serves its last example, as ParlAI's do")
        if self.split == "train" and not total and counting:
            raise ReplyError(f"{name}.act(): {self.idle} training parleys served no example, every act padding "
                             "(None, or a Message with batch_padding): a teacher's act() returns its next example")
        if self.split != "train" or not total or not done:
            return
        raise ReplyError(f"{name}: its epoch ended (epoch_done()) and the {self.idle} training parleys since served "
                         "no example, so training would never reach -ne/-tstep; a training teacher goes on "
                         "serving: start its data again when it runs out (reset in act(), as ParlAI's teachers do "
                         "in training), or derive it from FixedTeacher (setup_data()), which does")


def refuse_no_examples(world: Any, split: str) -> None:
    """A one-line DataFileError for a world whose teacher (of yours: a FixedTeacher refuses empty data as it is
    made) declares no examples, which would train for ever or report an evaluation of none."""
    try:
        count = world.num_examples()
    except (NotImplementedError, AttributeError):  # a teacher without num_examples(): what needs it says so
        return
    if count == 0:
        from accelbatch.tasks.files import DataFileError

        raise DataFileError(f"{_teacher_name(world)}: num_examples() is 0, so the {split} data holds no examples; "
                            "give it at least one")


STOP_GRACE_S = 5.0  # seconds from a stop signal to the next safe point, past which the run stops at once
# a repeat of the first stop signal this soon is that signal delivered twice, not a second request: GNU
# timeout (and other supervisors) send it to the process and then to its process group
DOUBLE_DELIVERY_S = 0.5


class PeriodicSaver:
    """``--save-every-n-secs``: :meth:`due` is True once per period (and then the period restarts).

    ``every_n_secs <= 0`` turns it off (never due). ``clock`` is injectable for tests. Call :meth:`mark`
    after a save made for another reason (end of training, a signal) to restart the period.
    """

    def __init__(self, every_n_secs: float, clock: Callable[[], float] = time.monotonic):
        self.every_n_secs = float(every_n_secs)
        self.clock = clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return self.every_n_secs > 0 and not math.isinf(self.every_n_secs)

    def due(self) -> bool:
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.last >= self.every_n_secs:
            self.last = now
            return True
        return False

    def mark(self) -> None:
        self.last = self.clock()


class StopSignals:
    """Turn SIGINT/SIGTERM into a flag checked at safe points (between world steps: save, then stop).

    ``with StopSignals() as stop: ... stop.at_safe_point(); if stop.requested: save; break``. The run stops
    within seconds whatever a step costs: when no safe point comes within ``grace_s`` of the first signal (a
    step that takes minutes), a timer sends the signal again, which raises KeyboardInterrupt where the run is
    (nothing saved), as a second signal from the user does at once (a hung save can still be interrupted); the
    first one again within ``DOUBLE_DELIVERY_S`` is the same request delivered twice.
    The previous handlers come back on exit. Outside the main thread (where handlers cannot be set) it does
    nothing. ``announce=False`` keeps it quiet (replicas other than rank 0: one line per run, not one per
    replica); ``then`` says what the first signal does (its announcement).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM), announce: bool = True,
                 grace_s: float = STOP_GRACE_S, then: str = "saving a checkpoint after this step, then stopping"):
        self.signals = tuple(signals)
        self.announce, self.grace_s, self.then = announce, grace_s, then
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._overdue = False
        self._requested_at = 0.0
        self._agreed = False

    def agree(self) -> None:
        """The replicas decided to stop together on another one's signal: this one stops as if it had its own
        (the parent's forward of that signal, if it comes later, is the same request, not a second one)."""
        if self.requested is None:
            self.requested, self._requested_at, self._agreed = signal.SIGTERM, time.monotonic(), True

    def _handle(self, signum: int, frame: Any) -> None:
        if self._agreed:  # the request agreed to, now delivered here too
            self.requested, self._requested_at, self._agreed = signum, time.monotonic(), False
            return
        if self.requested is not None:
            if (signum == self.requested and not self._overdue
                    and time.monotonic() - self._requested_at < DOUBLE_DELIVERY_S):
                return
            self._disarm()
            if self._overdue:
                raise KeyboardInterrupt(f"{self.name}: the step had not ended {self.grace_s:g} s after the signal; "
                                        "stopped at once, nothing saved")
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: stopped at once, nothing saved")
        self.requested, self._requested_at = signum, time.monotonic()
        if self.announce:
            print(f"accelbatch: {signal.Signals(signum).name} received: {self.then}; at once if the step has "
                  f"not ended in {self.grace_s:g} s, or on a second signal", file=sys.stderr, flush=True)
        if self._previous and self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._expire, args=(signum, threading.main_thread().ident))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, signum: int, main_ident: int | None) -> None:
        """The grace is over and no safe point came: the signal again, to the main thread (it interrupts a
        sleep or a wait there)."""
        if self._timer is not None and self._previous and main_ident is not None:
            self._overdue = True
            signal.pthread_kill(main_ident, signum)

    def at_safe_point(self) -> None:
        """The run is between steps: a stop asked for now goes on to save (the grace timer is off)."""
        self._disarm()

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    @property
    def name(self) -> str | None:
        return None if self.requested is None else signal.Signals(self.requested).name

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self._disarm()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


@contextmanager
def steps_together(agent: Any, on: bool) -> Iterator[None]:
    """The agent's engine's ``train_together`` set to ``on`` for the block (replicas of a training run decide
    together whether a call trains; evaluations decide alone), then back; nothing for an agent without one."""
    engine = getattr(agent, "engine", None)
    before = getattr(engine, "train_together", None)
    if before is None:
        yield
        return
    engine.train_together = on
    try:
        yield
    finally:
        engine.train_together = before


def check_output_paths(opts: Any) -> None:
    """Refuse (OptionError, one line) an output path the run could not write, before any work: the model
    file (training), --report-json, --metrics-log, --tensorboard-logdir. Their folders are made now (the run
    would make them) and a temporary file is written there and removed: a true test, also for root."""
    from accelbatch.opts import OptionError
    from accelbatch.teachers import is_training

    outputs = [("-mf/--model-file", opts.model_file if is_training(opts.datatype) else None, False),
               ("--report-json", opts.report_json, False), ("--metrics-log", opts.metrics_log, False),
               ("--tensorboard-logdir", opts.tensorboard_logdir, True),
               ("--ipu-cache-dir", getattr(opts, "ipu_cache_dir", None), True)]
    model_file = outputs[0][1]
    folder = (model_file or "").rstrip("/\\")
    if folder.endswith(MODEL_FILE_SIDES[-1]):
        raise OptionError(f"-mf/--model-file {model_file}: a training run writes its checkpoints to PATH.ckpt beside "
                          f"the model file PATH, and this path is such a folder, so the model file could not be "
                          f"written; give the model file's own path ({folder[:-len(MODEL_FILE_SIDES[-1])]})")
    _check_distinct(outputs)
    for flag, path, is_dir in outputs:
        if not path:
            continue
        target = os.path.abspath(path)  # as the run writes it (the CLI has expanded a ~)
        if os.path.exists(target) and os.path.isdir(target) != is_dir:
            kind = "a folder" if is_dir else "a file"
            raise OptionError(f"{flag}: {path} exists and is not {kind}; give the path of {kind}")
        if flag in REPLACED and os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
            raise OptionError(f"{flag} {path}: {_kind(target)}, not a regular file, which a save would replace "
                              "with one; give the path of a regular file")
        for side in MODEL_FILE_SIDES[:2] if flag in REPLACED else ():  # files the run writes beside the model
            if os.path.isdir(path + side):
                raise OptionError(f"{flag} {path}: {path}{side} is a folder, where the run writes a file beside the "
                                  f"model; move it away, or give another {flag.split('/')[0]}")
        if not is_dir and path.endswith(("/", os.sep)):
            raise OptionError(f"{flag} {path}: names a folder (it ends with /); give the path of a file in it")
        folder = target if is_dir else os.path.dirname(target)
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            blocker = _file_in_the_way(folder)
            if blocker is not None:
                raise OptionError(f"{flag} {path}: its folder {blocker} is a file, not a folder; give a path in a "
                                  "folder, or move that file away") from None
            why = "no file can be made there" if exc.errno == errno.ENOENT and os.path.isdir(folder) \
                else exc.strerror  # ENOENT in a folder that exists: a file system such as /proc
            raise OptionError(f"{flag}: cannot write {path} (its folder {folder}: {why}); give a path "
                              "in a folder you can write") from None
        _check_name_length(flag, target, folder, is_dir)


# what a training run writes beside its model file PATH: PATH.opt, PATH.trainstats, the checkpoints PATH.ckpt
MODEL_FILE_SIDES = (".opt", ".trainstats", ".ckpt")


def _check_distinct(outputs: list[tuple[str, str | None, bool]]) -> None:
    """Refuse two outputs that would write the same regular file (each would replace the other's: -mf and
    --report-json both m.pt lost the model), a model file's own PATH.opt, PATH.trainstats and PATH.ckpt
    included. Folders (TensorBoard's and the IPU cache's files have their own names) and devices or pipes
    (written in place: --report-json /dev/null --metrics-log /dev/null) may be shared."""
    from accelbatch.opts import OptionError

    written: dict[str, tuple[str, str]] = {}
    for flag, path, is_dir in outputs:
        if not path or is_dir:
            continue
        sides = MODEL_FILE_SIDES if flag == "-mf/--model-file" else ()
        for name in (path, *(path + side for side in sides)):
            target = os.path.realpath(name)
            if os.path.exists(target) and not os.path.isfile(target) and not target.endswith(".ckpt"):
                continue
            if target in written and written[target][0] != flag:
                raise OptionError(f"{flag} {path} and {' '.join(written[target])} both write {name}, so one would "
                                  "replace the other; give them different paths")
            written[target] = (flag, path)


# the outputs a save replaces (a new file renamed over the path's target): --report-json and --metrics-log
# are written in place, so a pipe or a device (--report-json /dev/stdout) stays one
REPLACED = ("-mf/--model-file",)


def _kind(path: str) -> str:
    """What an existing path that is neither a file nor a folder is, in words (a link's target is told)."""
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    found = next((name for test, name in kinds if test(mode)), "a special file")
    real = os.path.realpath(path)
    return found if real == os.path.abspath(path) else f"a link to {found} at {real}"


# the longest name written beside each output: PATH.trainstats's staging file (a pid of up to 7 digits)
COMPANION = {"-mf/--model-file": ".trainstats.tmp-4194304", "--report-json": ".tmp-4194304"}


def _check_name_length(flag: str, target: str, folder: str, is_dir: bool) -> None:
    """Refuse a file name that fits the file system but whose companion files (PATH.trainstats, staging
    files) would not: the run would fail after its training."""
    from accelbatch.opts import OptionError

    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no such limit to read (not POSIX)
        return
    name = os.path.basename(target)
    longest = name + ("" if is_dir else COMPANION.get(flag, ""))
    if len(os.fsencode(longest)) > limit:
        raise OptionError(f"{flag}: the name {name[:40]}... is too long: with the files written beside it "
                          f"({longest[len(name):]}) it passes the {limit} bytes a file name may have here; give a "
                          "shorter name")


def _file_in_the_way(folder: str) -> str | None:
    """The nearest existing one of ``folder`` and the folders above it, when it is a file (so the folder cannot
    be made); None when it is a folder."""
    here = folder
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here if os.path.exists(here) and not os.path.isdir(here) else None


class ModelFileLock:
    """A training run's hold on ``-mf PATH``: an exclusive lock on ``PATH.lock`` (flock, released by the
    kernel however the run ends), so that a second run writing the same model file is refused in one line
    before it trains, not left to delete the first one's checkpoint staging mid-save. Where flock is not
    available it holds nothing."""

    def __init__(self, model_file: str):
        from accelbatch.opts import OptionError

        # the file a save writes (a link's target): a second -mf naming it through a link is the same model
        self.path, self._handle = os.path.realpath(model_file) + ".lock", None
        try:
            import fcntl
        except ImportError:  # not a POSIX system
            return
        for _ in range(LOCK_TRIES):
            handle = open(self.path, "a+")  # noqa: SIM115 - held for the run's life
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise OptionError(f"-mf/--model-file {model_file}: another training run ({holder}) is writing it "
                                  f"now ({self.path} is locked); wait for it, or give another -mf") from None
            if _still_named(handle, self.path):
                break
            handle.close()  # a run that ended removed it between the open and the lock: lock the file there now
        else:
            raise OptionError(f"-mf/--model-file {model_file}: {self.path} was removed {LOCK_TRIES} times as it was "
                              "locked (runs starting and ending on it); try again, or give another -mf")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Remove PATH.lock, then unlock it: a run that opened it before the removal finds it is no longer the
        file named PATH.lock once it locks it, and locks the file there now instead."""
        if self._handle is not None:
            with suppress(OSError):
                os.unlink(self.path)
            self._handle.close()
            self._handle = None


LOCK_TRIES = 100  # a lock file removed under a run that locked it: it opens the new one, so many times at most


def _still_named(handle: Any, path: str) -> bool:
    """Whether the file ``handle`` locked is still the one named ``path`` (not removed, nor replaced by
    another since it was opened)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def lock_model_file(model_file: str, main: bool, decide: Callable[..., tuple[bool, ...]]) -> ModelFileLock | None:
    """The lock of a training run's ``-mf`` (:class:`ModelFileLock`), taken by rank 0; every replica learns
    whether it could (``decide``: one all-reduce), so that a refusal ends them all at once: the others would
    wait for rank 0 in their first collective until the group's timeout (replicas started by torchrun)."""
    from accelbatch.opts import OptionError  # (opts imports this module)

    lock, refused = None, None
    if main:
        try:
            lock = ModelFileLock(model_file)
        except OptionError as exc:
            refused = exc
    if decide(refused is not None)[0]:
        raise refused or OptionError(f"-mf/--model-file {model_file}: replica 0 could not take the model file's "
                                     "lock (another training run is writing it): see replica 0's message")
    return lock
