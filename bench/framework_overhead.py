"""Framework overhead against the physical limit (issue 19): the time ``accelbatch train`` takes for a run of
steps over the time a plain PyTorch loop takes to train the same model with the same optimizer on the same
batches, made beforehand. Goal: <= 1.05x.

For each agent (bag, conv) at bs 32 (fewer when the data holds fewer episodes: the world lowers -bs to them,
and the header says the -bs run) and each data mode (sync: batches built in the main process; async: the
async accessor with 2 data workers), one round is:

1. a world built by ``create_world`` (as ``accelbatch train`` builds it) runs ``--warmup`` steps untimed;
   the model and optimizer state are copied;
2. the world runs ``--steps`` steps, timed (sync: this process's CPU time, which load from other processes
   disturbs far less; async: wall time, as data workers run in other processes), each step timed alone,
   while the tensors its engine receives are recorded (a reference to the batch, which the engine does not
   modify, cloned after the step outside the timed region: an async batch's tensors are views of the
   accessor's shared-memory ring, which the next batch reuses);
3. the plain loop starts from the copied state and runs ``zero_grad / forward / backward / step`` over the
   recorded batches, timed (``--interleave``, sync only: each batch's plain step right after the world's step,
   so that load from other processes on the cores hits both sides alike).

Both must end with the same weights (checked: this is what makes the batches "the same rows"; where they do
not, the script says so and exits 1 once everything is printed). Rounds are repeated (``--repeats``) and the
median of the per-round ratios printed with every round's ratio.

    python bench/framework_overhead.py --quick
    python bench/framework_overhead.py --steps 200 --repeats 5
    python bench/framework_overhead.py --quick --interleave    # on a machine other processes load
    python bench/framework_overhead.py --unique-texts 3000 --modes sync  # data whose texts never recur

``--unique-texts N`` writes N episodes of 8 turns to a temporary JSONL file, every utterance and each turn's
10 label candidates new random words (a vocabulary of 30,000), as in dialogue data read from a file; the
synthetic dialogues task instead repeats its texts, which the word-id caches then serve.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throughput import BAG, CONV, base_opts  # noqa: E402

from accelbatch.build import create_world  # noqa: E402

MODES = {"sync": {}, "async": {"dataloader_mode": "async", "num_workers": 2}}


def one_round(opts: Any, warmup: int, steps: int, now: Any, interleave: bool = False,
              parts: dict[str, float] | None = None, rows: list[int] | None = None) -> tuple[float, float, float]:
    """(framework seconds, plain-loop seconds, max weight difference at the end) for one round, timed by
    ``now``. ``interleave``: the plain loop's step on each batch runs right after the world's, each timed
    alone, so that load from other processes hits both sides alike (the sides then share the CPU caches);
    then ``parts`` (when given) also gets the seconds of the engine's train_step and of batchify. ``rows``
    (when given) gets the examples the timed steps ran (the world may run fewer than -bs per step)."""
    world = create_world(opts)
    try:
        agent = world.get_model_agent()
        for _ in range(warmup):
            world.parley()
        agent.engine.sync_to_host() if hasattr(agent.engine, "sync_to_host") else None
        model0, optim0 = copy.deepcopy(agent.model.state_dict()), copy.deepcopy(agent.optimizer.state_dict())
        recorded: list[dict[str, torch.Tensor]] = []
        engine = agent.engine
        train_step = engine.train_step
        model, optimizer = _plain_copy(agent, model0, optim0) if interleave else (None, None)

        timed = interleave and parts is not None
        batchify = agent.batchify

        def recording(batch: dict[str, torch.Tensor]) -> Any:
            recorded.append(batch)
            if not timed:
                return train_step(batch)
            start = now()
            try:
                return train_step(batch)
            finally:
                parts["engine"] = parts.get("engine", 0.0) + now() - start  # type: ignore[index]

        def timed_batchify(observations: list) -> Any:
            start = now()
            try:
                return batchify(observations)
            finally:
                parts["batchify"] = parts.get("batchify", 0.0) + now() - start  # type: ignore[index]

        engine.train_step = recording
        if timed:
            agent.batchify = timed_batchify
        framework_s = plain_s = 0.0
        exs_before = world.get_total_exs()
        if interleave:
            for _ in range(steps):
                start = now()
                world.parley()
                middle = now()
                _plain_steps(model, optimizer, recorded[-1:])
                framework_s, plain_s = framework_s + middle - start, plain_s + now() - middle
        else:
            for _ in range(steps):
                start = now()
                world.parley()
                framework_s += now() - start
                # an async batch's tensors are views of the accessor's ring, reused once the next is fetched
                recorded[-1] = {k: v.clone() for k, v in recorded[-1].items()}
        del engine.train_step
        if rows is not None:
            rows.append(world.get_total_exs() - exs_before)
        agent.__dict__.pop("batchify", None)
        final = {k: v.detach().clone() for k, v in agent.model.state_dict().items()}
        if not interleave:
            model, optimizer = _plain_copy(agent, model0, optim0)
    finally:
        world.shutdown()
    if not interleave:
        start = now()
        _plain_steps(model, optimizer, recorded)
        plain_s = now() - start
    diff = max((final[k].float() - v.detach().float()).abs().max().item() for k, v in model.state_dict().items())
    return framework_s, plain_s, diff


def _plain_copy(agent: Any, model_state: dict, optimizer_state: dict) -> tuple[torch.nn.Module, Any]:
    """A new model and optimizer of the agent's kind from the states copied after warm-up (the global torch
    RNG the model's initialisation draws from is left as it was, so the world's run does not change)."""
    with torch.random.fork_rng():
        model = agent.build_model()
    model.load_state_dict(model_state)
    model.train()
    optimizer = agent.build_optimizer(model)
    optimizer.load_state_dict(optimizer_state)
    return model, optimizer


def _plain_steps(model: torch.nn.Module, optimizer: Any, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        model(batch)["loss"].backward()
        optimizer.step()


def write_unique_dialogues(path: str, episodes: int, seed: int = 0) -> None:
    """``episodes`` episodes of 8 turns as JSONL: each text, label and candidate made of random words."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnoprstu") for _ in range(rng.randint(2, 9))) for _ in range(30000)]

    def utterance() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(6, 22))) + rng.choice(".?!")

    with open(path, "w") as out:
        for _ in range(episodes):
            for turn in range(8):
                label = utterance()
                candidates = [utterance() for _ in range(9)] + [label]
                rng.shuffle(candidates)
                out.write(json.dumps({"text": utterance(), "labels": [label], "label_candidates": candidates,
                                      "episode_done": turn == 7}) + "\n")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (bs 32; default 120, "
                                                                "--quick 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (workers start, caches warm)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per agent and data mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default=None, help="any task instead of the synthetic dialogues")
    parser.add_argument("--episodes", type=int, default=None, help="training episodes of the dialogues task")
    parser.add_argument("--unique-texts", type=int, default=None, metavar="N",
                        help="train on N episodes of 8 turns whose texts never recur (a temporary JSONL file)")
    parser.add_argument("--quick", action="store_true",
                        help="60 steps, 3 rounds, 2,000 episodes (explicit options win)")
    parser.add_argument("--modes", default="sync,async", help="data modes to run, comma separated (sync, async)")
    parser.add_argument("--interleave", action="store_true",
                        help="sync: time the plain loop's step on each batch right after the world's, so that "
                             "load from other processes on the cores hits both sides alike")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)} (comma separated)")
    for option, value in (("--steps", args.steps), ("--repeats", args.repeats), ("--unique-texts", args.unique_texts)):
        if value is not None and value < 1:
            parser.error(f"{option} {value}: give 1 or more")
    if args.unique_texts is not None and args.task is not None:  # the file written would replace the task
        parser.error("--unique-texts: trains on a file it writes, not with --task; give one of them")
    if args.episodes is not None and (args.task is not None or args.unique_texts is not None):
        parser.error("--episodes: sizes the generated dialogues, not --task's or --unique-texts' data")
    if args.unique_texts is None:
        return measure(args)
    with tempfile.TemporaryDirectory() as tmp:  # the file lives while the worlds read it
        path = os.path.join(tmp, "unique.jsonl")
        write_unique_dialogues(path, args.unique_texts, args.seed)
        args.task = f"jsonl:{path}"
        return measure(args)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Every (agent, data mode) the arguments ask for: the ratios printed, and returned by name."""
    if args.steps is None:  # an explicit --steps wins over --quick's
        args.steps = 60 if args.quick else 120
    if args.quick:
        args.episodes = args.episodes or 2000
    torch.set_num_threads(1)
    results: dict[str, float] = {}
    different: list[str] = []  # the runs whose plain loop did not end with the world's weights
    header = True  # printed with the first result: the -bs the world ran is known once a round ran
    for name, model in (("bag", BAG), ("conv", CONV)):
        for mode, changes in MODES.items():
            if mode not in args.modes.split(","):
                continue
            opts = base_opts(args, model=model, **changes)
            # sync runs in this process alone: its CPU time, which other processes on the cores disturb far
            # less than the wall clock; async has data workers in other processes: wall time
            clock = time.process_time if mode == "sync" else time.perf_counter
            interleave = args.interleave and mode == "sync"  # async: the workers would gain the plain steps' time
            parts: list[dict[str, float]] = [{} for _ in range(args.repeats)]
            rows: list[int] = []  # examples per round: -bs 32 unless the data holds fewer episodes
            rounds = [one_round(opts, args.warmup, args.steps, clock, interleave, part, rows) for part in parts]
            if header:  # a world lowers -bs 32 to the episodes when the data holds fewer (it says so on stderr)
                print(f"== framework overhead: accelbatch world steps vs a plain loop on the same batches "
                      f"({args.steps} steps of bs {rows[0] / args.steps:g}, {args.repeats} rounds) ==", flush=True)
                header = False
            ratios = [f / p for f, p, _ in rounds]
            worst = max(d for _, _, d in rounds)
            ratio = statistics.median(ratios)
            results[f"{name}_{mode}"] = ratio
            per_ex = statistics.median(p / n for (_, p, _), n in zip(rounds, rows)) * 1e6
            how = ("cpu time, interleaved" if interleave else "cpu time") if mode == "sync" else "wall time"
            print(f"{name:<5} {mode:<6} framework/plain {ratio:6.3f}x  ({how}; "
                  f"plain loop {per_ex:7.1f} us/example; "
                  f"rounds {' '.join(f'{r:.3f}' for r in ratios)}; max weight diff {worst:.1e})", flush=True)
            if interleave:  # where a world step's time goes, per example, in the median round
                k = min(range(len(ratios)), key=lambda i: abs(ratios[i] - ratio))
                us = {key: v / rows[k] * 1e6 for key, v in parts[k].items()}
                world_us, plain_us = rounds[k][0] / rows[k] * 1e6, rounds[k][1] / rows[k] * 1e6
                rest = world_us - us.get("engine", 0.0) - us.get("batchify", 0.0)
                print(f"      per example: world step {world_us:.1f} us = engine train_step {us.get('engine', 0):.1f} "
                      f"(plain step {plain_us:.1f}) + batchify {us.get('batchify', 0):.1f} + the rest {rest:.1f} "
                      "(observe and vectorize, replies, metrics, world)", flush=True)
            if worst > 1e-5:
                print(f"  !! the plain loop did not train the same weights ({worst:.2e}): not the same batches",
                      flush=True)
                different.append(f"{name} {mode}")
    if different:  # said once everything is printed: the exit status tells
        print(f"{os.path.basename(sys.argv[0])}: the plain loop did not train the same weights in "
              f"{', '.join(different)} (!! above): those ratios compare different work", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    from accelbatch.cli import run_script

    sys.exit(run_script(main))  # bad input (a task's file, an option): accelbatch's one line, exit 2
