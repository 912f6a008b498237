"""Small agents and teachers for tests, independent of the bundled ones."""

from __future__ import annotations

import pytest
import torch

from accelbatch.agents import Agent, TorchAgent
from accelbatch.messages import Message
from accelbatch.teachers import FixedTeacher


class ListTeacher(FixedTeacher):
    """Episodes given as lengths: example i of episode e has text 'e{e}-{i}' and label 'L{e}-{i}'."""

    lengths: tuple[int, ...] = (1,)

    def setup_data(self):
        episodes = []
        for e, n in enumerate(self.lengths):
            episodes.append([Message(text=f"e{e}-{i}", labels=[f"L{e}-{i}"], episode_done=i == n - 1)
                             for i in range(n)])
        return episodes


def list_teacher(lengths):
    return type("Teacher_", (ListTeacher,), {"lengths": tuple(lengths)})


class RecordingAgent(Agent):
    """Replies with the label and records every text it observes (shared across clones)."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.seen = shared["seen"] if shared else []

    def share(self):
        return {**super().share(), "seen": self.seen}

    def observe(self, obs):
        if obs and "text" in obs:
            self.seen.append(obs["text"])
        return super().observe(obs)

    def act(self):
        obs = self.observation or {}
        labels = obs.get("labels") or obs.get("eval_labels")
        return Message(id="rec", text=labels[0]) if labels else Message(id="rec")


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        scaled = self.w * batch["x"]
        return {"loss": scaled.mean(), "scaled": scaled}  # per-row outputs: replies() gets every row


class LabelEchoTorchAgent(TorchAgent):
    """RecordingAgent as a TorchAgent with the base observe(), so that every front end (dynamic batching,
    data workers) can batch it: replies with each row's label and records the texts it replied to, in order
    (replies() runs in the main process, also with workers; shared by clones)."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.seen = shared["seen"] if shared else []

    def share(self):
        return {**super().share(), "seen": self.seen}

    def build_model(self):
        return _Scale()

    def batchify(self, observations):
        return {"x": torch.ones(len(observations), 1)}

    def replies(self, outputs, observations):
        self.seen.extend(o.get("text") for o in observations)
        return [{"text": (o.get("labels") or o.get("eval_labels") or [""])[0]} for o in observations]


# long-lived helpers, not leaks: multiprocessing's (one per parent, shared by every pool/accessor) and the
# suite's own preloader of command-line runs (tests/zygote.py)
_MP_HELPERS = (b"resource_tracker", b"forkserver", b"zygote.py")


def process_table() -> dict[int, tuple[int, str, bytes]]:
    """Every process now: pid -> (parent pid, state letter, command line), from /proc."""
    import os

    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmd = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[0], cmd)
    return table


def live_children(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of a process's children from /proc, zombies included, long-lived helpers (resource
    tracker, forkserver, the suite's preloader) left out, and the children of its forkserver counted as its
    own (accelbatch's children fork from there)."""
    import os

    pid = os.getpid() if pid is None else pid
    table = process_table()
    servers = {child for child, (parent, _, cmd) in table.items() if parent == pid and b"forkserver" in cmd}
    return [(child, state) for child, (parent, state, cmd) in table.items()  # a forked child has its server's cmd
            if parent in servers or parent == pid and not any(h in cmd for h in _MP_HELPERS)]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents = {child: parent for child, (parent, _, _) in process_table().items()}
    out, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        out.extend(children)
        frontier.extend(children)
    return out


def wait_for_first_checkpoint(proc, model_file, max_delay_s: float, rng=None, timeout_s: float = 120) -> None:
    """Block until the run ``proc`` has committed its first checkpoint of ``model_file`` (its MANIFEST.json),
    then a random moment of up to ``max_delay_s`` (a cut at a random step). Fails if the run ends first."""
    import random
    import time
    from pathlib import Path

    manifest = Path(str(model_file) + ".ckpt") / "MANIFEST.json"
    deadline = time.monotonic() + timeout_s
    while not manifest.exists():
        assert proc.poll() is None, proc.communicate(timeout=30)[1][-2000:]
        assert time.monotonic() < deadline, f"no checkpoint within {timeout_s:g} s"
        time.sleep(0.02)
    time.sleep((rng or random.Random()).uniform(0.0, max_delay_s))


def write_qa_episodes(root, episodes: int = 40, filler: bool = False) -> None:
    """``root/data/train.jsonl``: seeded where-is episodes of 1-4 turns with 5 candidate answers, for the
    kill-and-resume tests (``filler`` adds 0-6 words per turn so dynamic batching has lengths to sort)."""
    import json
    import os
    import random

    rng = random.Random(1)
    os.makedirs(root / "data")
    answers = ["red", "blue", "green", "kitchen", "garden"]
    with open(root / "data" / "train.jsonl", "w") as handle:
        for e in range(episodes):
            n = rng.randint(1, 4)
            for i in range(n):
                a = rng.choice(answers)
                words = (" ".join(["very"] * rng.randint(0, 6)) + " ") if filler else ""
                handle.write(json.dumps({"text": f"ep {e} turn {i} where is the {words}{a} thing",
                                         "labels": [a], "label_candidates": answers,
                                         "episode_done": i == n - 1}) + "\n")


TAG_ENV = "ACCELBATCH_TEST_TAG"


def tagged_pids(tag: str) -> set[int]:
    """Live (non-zombie) processes whose environment holds ``ACCELBATCH_TEST_TAG=tag``: a process tree
    started with that variable, orphans included, since children inherit the environment. (A command-line run
    forked by tests/zygote.py is known by its pid: /proc shows its preloader's environment.)"""
    import os

    import zygote

    marker = f"{TAG_ENV}={tag}".encode()
    forked = zygote.forked_pids_with(marker.decode())
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker not in handle.read().split(b"\0") and int(entry) not in forked:
                    continue
            with open(f"/proc/{entry}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.add(int(entry))
    return found


def shm_mapped(pids: set[int]) -> set[str]:
    """Names of the /dev/shm entries (POSIX semaphores, shared-memory segments) these processes map."""
    import os

    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    path = line.split(maxsplit=5)[-1].strip()
                    if path.startswith("/dev/shm/"):
                        found.add(os.path.basename(path.removesuffix(" (deleted)")))
        except OSError:
            continue
    return found


def shm_left(before: set[str], pids: set[int], settle_s: float = 2.0, seen: set[str] | None = None) -> set[str]:
    """/dev/shm entries made since ``before`` that are still there after ``settle_s`` and are ours: entries
    naming a process (torch's ``torch_<pid>_...``) count only for ``pids``; unnamed ones (semaphores,
    ``psm_``) only if in ``seen`` (what the run's processes mapped, see :func:`shm_mapped`), or all of them
    when ``seen`` is None. Entries other processes make and drop meanwhile are ignored."""
    import os
    import re
    import time

    def suspects() -> set[str]:
        out = set()
        for entry in set(os.listdir("/dev/shm")) - before:
            named = re.match(r"torch_(\d+)_", entry)
            if named is not None:
                if int(named.group(1)) in pids:
                    out.add(entry)
            elif seen is None or entry in seen:
                out.add(entry)
        return out

    deadline = time.monotonic() + settle_s
    left = suspects()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = suspects()
    return left


class ActOverridingTeacher(ListTeacher):
    """A teacher with its own act(): it tags every example it hands out (the loader must not bypass it)."""

    lengths = (2, 3, 1, 2, 2, 1, 3, 2)

    def act(self):
        msg = super().act()
        return msg if msg.get("text") is None else Message({**msg, "text": f"acted:{msg['text']}"})


def _cpu_half_matmul() -> bool:
    """Whether this torch multiplies float16 matrices on the CPU (2.1 and later; the emulator's fp16 needs it)."""
    try:
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
    except RuntimeError:
        return False
    return True


needs_cpu_half = pytest.mark.skipif(not _cpu_half_matmul(), reason=f"torch {torch.__version__} has no float16 "
                                    "matmul on the CPU, which the emulator's fp16 runs on (a real IPU does not)")


class TwoReplicas:
    """reduce_report's backend: this replica's sums added to the other replica's."""

    world_size = 2

    def __init__(self, other: dict | None = None):
        self.other, self.sent = other or {}, None

    def reduce_metrics(self, sums: dict) -> dict:
        self.sent = dict(sums)
        return {k: sums.get(k, 0) + self.other.get(k, 0) for k in {*sums, *self.other}}


def eval_valid(path: str, tmp_path, capsys, *given: str) -> tuple[dict, str]:
    """``accelbatch eval -mf path`` (in this process): its valid scores (accuracy, f1, loss, exs: not its
    timings) and its stderr."""
    import json

    from accelbatch.cli import main

    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert main(["eval", "-mf", path, "--report-json", str(report), *given, "--no-progress"]) == 0
    scores = json.loads(report.read_text())["valid"]
    return {k: scores[k] for k in ("accuracy", "f1", "loss", "exs")}, capsys.readouterr().err


class StagingEngine:
    """An engine that copies batches to a device ahead of their step (CUDA's), which picks the loader front
    end itself: wraps a real engine and says it stages."""

    stages = True

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


def sigint_at_batch(base: type, batches: int) -> type:
    """A ``base`` agent that sends this process a SIGINT, as a terminal's Ctrl-C would, at its ``batches``-th
    batch_act (counted per class made: each call gives a fresh count)."""
    import os
    import signal

    seen = {"batches": 0}

    class SignalsWhileTraining(base):  # type: ignore[misc, valid-type]
        def batch_act(self, observations):
            seen["batches"] += 1
            if seen["batches"] == batches:
                os.kill(os.getpid(), signal.SIGINT)
            return super().batch_act(observations)

    return SignalsWhileTraining

