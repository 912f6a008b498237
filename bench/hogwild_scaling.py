"""Hogwild scaling: training examples/s with --numthreads 2 against 1, on a CPU-bound model, in one run.

The model is an MLP over a bag of hashed words (bAbI task 1: pick the answer among the six places), wide
enough that its forward/backward/optimizer step (``--optimizer``: sgd by default, or adam / adamw) dominates a
parley. Each configuration is measured in turn, in
interleaved rounds (so a neighbour's load hits them alike), and the median of the rounds is compared:

* ``single``: one process, ``--numthreads 1`` (the plain world create_world builds), one torch thread;
* ``hogwild-1``: a HogwildWorld with one child process (shows the cost of the process/pipe machinery);
* ``hogwild-N``: N child processes on one shared model, one torch thread each.

Run: ``python bench/hogwild_scaling.py [--numthreads 2] [--rounds 3] [--seconds 4]`` (model width:
HOGWILD_BENCH_HIDDEN=1024, an environment variable so the child processes build the same model).
The ratios printed are ``hogwild-N / single`` (the speed-up --numthreads N gives) and ``hogwild-N /
hogwild-1``. Beside each speed: CPU ms per example (all the processes that step the world) and the cores they
kept busy, so a ratio below N can be read: same CPU per example but fewer cores busy means the machine had no
free core to give (neighbours' load), more CPU per example means contention on the shared weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from accelbatch.agents import TorchAgent, hash_tokens, pad_2d, tokenize  # noqa: E402
from accelbatch.messages import EVAL_LABELS, LABELS, Message  # noqa: E402
from accelbatch.opts import Opts  # noqa: E402
from accelbatch.tasks.babi import PLACES  # noqa: E402

VOCAB = 4096
HIDDEN = int(os.environ.get("HOGWILD_BENCH_HIDDEN", "1024"))


class WideMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 256, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, len(PLACES)))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scores = self.mlp(self.emb(batch["text"]))
        out = {"scores": scores}
        if "label" in batch:
            out["loss"] = F.cross_entropy(scores, batch["label"])
        return out


class WideMLPAgent(TorchAgent):
    """A CPU-bound agent: the step (3 x hidden^2 weights, the --optimizer's update) costs far more than the data
    handling."""

    def build_model(self) -> nn.Module:
        return WideMLP(HIDDEN)

    def vectorize(self, obs: Message) -> Message:
        obs["text_vec"] = hash_tokens(tokenize(obs.get("full_text", obs.get("text", "")))[-64:], VOCAB)
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS) or []
        obs["label_index"] = PLACES.index(targets[0]) if targets and targets[0] in PLACES else -1
        return obs

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        batch = {"text": pad_2d([o["text_vec"] for o in observations])}
        labels = [o["label_index"] for o in observations]
        if all(i >= 0 for i in labels):
            batch["label"] = torch.tensor(labels, dtype=torch.long)
        return batch

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        return [{"text": PLACES[i]} for i in outputs["scores"].argmax(dim=-1).tolist()]


def _cpu_seconds(world: Any) -> float:
    """CPU time (user + system) used so far by the processes that step ``world`` (this one included)."""
    total = time.process_time()
    for pid in getattr(world, "pids", []):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(world: Any, seconds: float, warmup: int) -> tuple[float, float, float]:
    """(examples/s, CPU ms per example, cores busy) of ``world`` over about ``seconds``, after warm-up."""
    for _ in range(warmup):
        world.parley()
    world.report()  # a HogwildWorld answers only after the parleys released so far are done
    start_exs, start, start_cpu = world.get_total_exs(), time.perf_counter(), _cpu_seconds(world)
    while True:  # at least one parley: a window the scheduler skipped whole would measure nothing
        world.parley()
        if time.perf_counter() - start >= seconds:
            break
    world.report()  # wait for the parleys in flight, so every example counted was computed in the window
    wall, cpu = time.perf_counter() - start, _cpu_seconds(world) - start_cpu
    exs = world.get_total_exs() - start_exs
    return exs / wall, 1000 * cpu / max(exs, 1), cpu / wall


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numthreads", type=int, default=2, help="processes of the hogwild-N configuration (2+)")
    parser.add_argument("--batchsize", type=int, default=128)
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"),
                        help="sgd: the step is matrix work; adam adds a memory-bound pass over the weights")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per config and round")
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    if args.numthreads < 2:  # hogwild-1 is measured anyway: N must differ from it
        parser.error(f"--numthreads {args.numthreads}: give 2 or more (it is compared with 1 process)")
    for option, value in (("--batchsize", args.batchsize), ("--rounds", args.rounds), ("--seconds", args.seconds)):
        if value <= 0:
            parser.error(f"{option} {value:g}: give a number above 0")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: give 0 or more")

    from accelbatch.build import create_hogwild_world, create_world

    torch.set_num_threads(1)
    opts = Opts(task="babi:1", batchsize=args.batchsize, optimizer=args.optimizer, progress=False)
    hog = f"hogwild-{args.numthreads}"
    worlds: dict[str, Any] = {}
    try:  # made inside: a world that fails to start still has the others shut down
        worlds["single"] = create_world(opts, agent=WideMLPAgent)
        worlds["hogwild-1"] = create_hogwild_world(opts, agent=WideMLPAgent, processes=1)
        worlds[hog] = create_hogwild_world(opts.replace(numthreads=args.numthreads), agent=WideMLPAgent)
        params = sum(p.numel() for p in worlds["single"].get_model_agent().model.parameters())
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in worlds}
        for _ in range(args.rounds):
            for name, world in worlds.items():
                runs[name].append(measure(world, args.seconds, args.warmup))
    finally:
        for world in worlds.values():
            world.shutdown()
    median = {name: statistics.median(r[0] for r in v) for name, v in runs.items()}
    print(f"hogwild scaling: WideMLP ({params / 1e6:.1f}M parameters, hidden {HIDDEN}), "
          f"batch {args.batchsize}, "
          f"{args.optimizer}, {args.rounds} rounds x {args.seconds:.0f}s, os.cpu_count()={os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in runs.items():
        cpu_ms = statistics.median(r[1] for r in values)
        cores = statistics.median(r[2] for r in values)
        print(f"  {name:<10} {median[name]:8.1f} ex/s  {cpu_ms:6.3f} CPU ms/ex  {cores:4.2f} cores busy  "
              f"(rounds: {', '.join(f'{r[0]:.1f}' for r in values)} ex/s)")
    cpu = {name: statistics.median(r[1] for r in v) for name, v in runs.items()}
    busy = {name: statistics.median(r[2] for r in v) for name, v in runs.items()}
    ratios = {"vs_single": median[hog] / median["single"], "vs_hogwild_1": median[hog] / median["hogwild-1"],
              "cpu_efficiency": cpu["single"] / cpu[hog]}
    print(f"ratio {hog} / single    = {ratios['vs_single']:.2f}x   (examples/s)")
    print(f"ratio {hog} / hogwild-1 = {ratios['vs_hogwild_1']:.2f}x   (examples/s)")
    print(f"CPU per example, single / {hog} = {ratios['cpu_efficiency']:.2f}  (1.0: sharing the weights costs "
          f"nothing); cores busy {busy['single']:.2f} -> {busy[hog]:.2f}")
    if busy[hog] < 0.8 * min(args.numthreads, os.cpu_count() or 1):
        print(f"note: the {args.numthreads} processes kept only {busy[hog]:.2f} cores busy: this machine had no "
              "free cores to give them, so the examples/s ratio measures its load, not hogwild's scaling")
    return ratios


if __name__ == "__main__":
    main()
