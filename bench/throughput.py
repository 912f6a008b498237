"""Throughput benchmark of issue 8: every figure is a ratio of two variants measured in this one run.

Default workload: accelbatch's own generated dialogues (``-t dialogues``, :mod:`accelbatch.tasks.dialogues`;
not ParlAI's synthetic data, and not a ParlAI task): 10,000 training episodes of 1-3 turns, log-normal turns of
median 12 words clipped at 300, labels of 1-4 words with 10 label candidates; 3,000 validation episodes; text
truncated at 256 tokens, torch threads 1 per process. ``--task`` runs the same parts on any task instead (e.g.
``--task jsonl:PATH`` or ``parlai:PATH``: ParlAI-format data, whose examples need label_candidates for the bag
and conv models). Agents:
trivial (a fixed reply with text, so the teacher scores accuracy and F1), bag (EmbeddingBag + Linear, SGD),
conv (Embedding + Conv1d + pooling + Linear, so padding costs compute).

Parts (``--parts``, comma separated; all by default):

``overhead``  world overhead: the trivial agent through the world with teacher metrics vs a bare loop that
              iterates the same prepared examples and calls ``batch_act`` (bs 1, 32, 128; goal >= 0.50 at 32);
              also the bare loop over the world's own batches in its shuffled order, and the bare loop plus
              the world's scoring.
``metrics``   accuracy + F1 for a batch in one pass (``Metrics.add_batch``) vs one reply at a time
              (``exact_match`` + ``f1_score`` per reply), over ``--eval-episodes`` episodes of the valid split
              (of ``--task`` when given); the one pass's values must equal (==) a per-reply reference summed
              exactly (``math.fsum``), else the script exits 1 once everything is printed.
``async``     bag at bs 32: ``--dataloader-mode async`` with 2 workers (vectorize + batchify in the workers)
              vs sync with the same 2 workers, and vs sync with everything in the main process; also the CPU
              per example of the main process and of the data processes (accessor + workers, from /proc), and
              the ratio those allow on this machine's cores at best.
``dynamic``   conv at bs 32: dynamic batching batchsort / full / buckets vs none, with the pad fraction (pad
              tokens over all tokens of the text tensors fed to the model in 50 untimed steps after the timed
              ones, none's too; goal >= 1.8x, pad <= 0.05) and the rows per step; full and buckets use the
              default token budget, ParlAI's (text truncation + label truncation) x bs
              (``--max-batch-tokens`` to set one).
``hogwild``   conv at bs 32: ``--numthreads 2`` vs 1 (goal >= 1.8x on 2 cores).

Compared variants are interleaved and repeated (``--repeats``) so that load from other processes hits both
sides alike; the median of the per-round ratios is printed with the individual rounds. Every part runs
through ``create_world`` and the world, as ``accelbatch train`` does.

    python bench/throughput.py --quick            # about a minute and a half
    python bench/throughput.py                    # the full workload
    python bench/throughput.py --parts overhead --repeats 7
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelbatch.build import create_world  # noqa: E402
from accelbatch.messages import Message  # noqa: E402
from accelbatch.metrics import Metrics, exact_match, f1_score  # noqa: E402
from accelbatch.models.trivial import REPLY_TEXT  # noqa: E402
from accelbatch.opts import Opts  # noqa: E402

TRIVIAL = "accelbatch.models.trivial:TrivialAgent"
BAG = "accelbatch.models.bag:BagAgent"
CONV = "accelbatch.models.conv:ConvAgent"
LEARNING_RATES = {BAG: 0.5, CONV: 0.05}  # with SGD, as every earlier figure of these benchmarks


def say(line: str = "") -> None:
    print(line, flush=True)


def median_ratio(pairs: list[tuple[float, float]]) -> tuple[float, list[float]]:
    ratios = [a / b if b else float("nan") for a, b in pairs]
    return statistics.median(ratios), ratios


def fmt_rounds(ratios: list[float]) -> str:
    return "rounds " + " ".join(f"{r:.3f}" for r in ratios)


def task_name(args: argparse.Namespace) -> str:
    if args.task:
        return args.task
    return "dialogues" if args.episodes is None else f"dialogues:{args.episodes}"


def base_opts(args: argparse.Namespace, **changes: Any) -> Opts:
    values = dict(task=task_name(args), seed=args.seed, batchsize=32, progress=False, text_truncate=256,
                  eval_splits="", validation_every_n_epochs=-1, log_every_n_secs=1e9)
    values.update(changes)
    if values.get("model") in LEARNING_RATES and "learning_rate" not in changes:
        values["learning_rate"] = LEARNING_RATES[values["model"]]
        values.setdefault("optimizer", "sgd")
    return Opts(**values)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], int], min_seconds: float, now: Callable[[], float]) -> float:
    """Examples per second of ``fn`` (returns examples done), called until ``min_seconds`` have passed.

    Single-process parts pass ``--clock`` (wall by default; ``cpu`` counts this process's CPU seconds, which
    other processes competing for the cores disturb far less); multi-process parts always pass wall time."""
    done, start = 0, now()
    while True:
        done += fn()
        elapsed = now() - start
        if elapsed >= min_seconds:
            return done / elapsed


# --------------------------------------------------------------------------------------------------
# overhead: world + teacher metrics vs bare loop
# --------------------------------------------------------------------------------------------------

def prepared_examples(teacher: Any) -> list[Message]:
    """The teacher's examples as it serves them (id and episode_done set, read-only), in data order."""
    return list(teacher.store.examples[:-1])


def batches_seen(world: Any, agent: Any, steps: int) -> list[list[Message]]:
    """The observation lists ``agent.batch_act`` gets in ``steps`` parleys of ``world`` (then restored)."""
    seen: list[list[Message]] = []
    original = agent.batch_act

    def recording(observations: list[Message]) -> list[Message]:
        seen.append(list(observations))
        return original(observations)

    _parley_through(world, steps, agent, "batch_act", recording)
    return seen


def _parley_through(world: Any, steps: int, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """``steps`` parleys of ``world`` with ``owner.name`` replaced by ``wrapper`` on the instance (then the
    class's own again)."""
    setattr(owner, name, wrapper)
    try:
        for _ in range(steps):
            world.parley()
    finally:
        delattr(owner, name)


def part_overhead(args: argparse.Namespace) -> dict[str, float]:
    say("== world overhead: trivial agent, world + teacher metrics vs bare loop (examples/s) ==")
    results = {}
    for asked in args.batchsizes:
        opts = base_opts(args, model=TRIVIAL, batchsize=asked)
        world = create_world(opts)
        # a world lowers -bs to the episodes when the data holds fewer (and says so on stderr): every loop
        # below runs the rows per step that the world runs
        bs = getattr(world, "opts", opts).batchsize
        agent = world.get_model_agent()
        examples = prepared_examples(world.get_task_agent())
        # examples per timed call: a quarter of the data in whole batches, at least one batch, at most the data
        chunk = min(max(bs, (len(examples) // 4) // bs * bs), len(examples))
        position = [0]

        def bare() -> int:  # the examples it handed batch_act (the last batch of a chunk may be short)
            start = position[0] if position[0] + chunk <= len(examples) else 0
            batch_act = agent.batch_act
            for i in range(start, start + chunk, bs):
                batch_act(examples[i:min(i + bs, start + chunk)])
            position[0] = start + chunk
            return chunk

        def in_world() -> int:
            before = world.get_total_exs()
            for _ in range(-(-chunk // bs)):
                world.parley()
            return world.get_total_exs() - before

        # the batches the world hands the model over an epoch, in its (shuffled) order
        served = batches_seen(world, agent, -(-len(examples) // bs))
        per_call = -(-chunk // bs)  # batches per timed call
        served_position = [0]

        def bare_world_order() -> int:  # the rows of the batches it ran
            start = served_position[0] if served_position[0] + per_call <= len(served) else 0
            batch_act, rows = agent.batch_act, 0
            for batch in served[start:start + per_call]:
                batch_act(batch)
                rows += len(batch)
            served_position[0] = start + per_call
            return rows

        metrics = Metrics()
        store = world.get_task_agent().store
        answer_ids = store.ids  # the answers' ids the teacher scores against

        def bare_with_metrics() -> int:  # the bare loop plus the world's scoring of its replies: metrics' share
            start = position[0] if position[0] + chunk <= len(examples) else 0
            batch_act, add_replies = agent.batch_act, metrics.add_replies
            for i in range(start, start + chunk, bs):
                end = min(i + bs, start + chunk)
                replies = batch_act(examples[i:end])
                add_replies(replies, answer_ids[i:end], store.answers, end - i)  # as many rows as it scored
            position[0] = start + chunk
            return chunk

        pairs, floor, same_order = [], [], []
        for _ in range(args.repeats):
            w = timed(in_world, args.min_seconds, args.now)
            b = timed(bare, args.min_seconds, args.now)
            m = timed(bare_with_metrics, args.min_seconds, args.now)
            o = timed(bare_world_order, args.min_seconds, args.now)
            pairs.append((w, b))
            floor.append((m, b))
            same_order.append((w, o))
        ratio, ratios = median_ratio(pairs)
        floor_ratio, _ = median_ratio(floor)
        order_ratio, order_ratios = median_ratio(same_order)
        report = world.report()
        lowered = f" (the world runs -bs {bs}: the data holds fewer episodes than {asked})" if bs != asked else ""
        accuracy, f1 = report.get("accuracy", float("nan")), report.get("f1", float("nan"))
        # the figures show the world scored every reply; the trivial agent's one reply matches no label of most data
        why = f": its one reply, {REPLY_TEXT!r}, shares no word with the labels" if accuracy == f1 == 0 else ""
        say(f"bs {asked:>4}{lowered}: world {statistics.median(p[0] for p in pairs):>12,.0f}  bare "
            f"{statistics.median(p[1] for p in pairs):>12,.0f}  ratio {ratio:.3f}  ({fmt_rounds(ratios)})"
            f"  [teacher metrics: accuracy {accuracy:.3f} f1 {f1:.3f}{why}]" + ("   goal >= 0.50" if bs == 32 else ""))
        say(f"          bare loop over the world's own batches, in its shuffled order: "
            f"{statistics.median(p[1] for p in same_order):>12,.0f}  ratio {order_ratio:.3f}  "
            f"({fmt_rounds(order_ratios)}) (what a shuffled order costs a loop that does not prefetch)")
        if bs > 1:  # BatchWorld scores with add_replies; one row at a time a world scores each reply alone
            say(f"          bare loop + the world's scoring (Metrics.add_replies), no world: ratio {floor_ratio:.3f} "
                "(the most a world that scores replies this way could reach)")
        results[f"overhead_bs{asked}"] = ratio
        results[f"overhead_metrics_only_bs{asked}"] = floor_ratio
        results[f"overhead_same_order_bs{asked}"] = order_ratio
        if bs > 1 and getattr(world, "_teacher", None) is not None:
            row_world = create_world(opts)
            row_world._teacher = None  # every clone acts and observes in turn: ParlAI's BatchWorld

            def per_row() -> int:
                before = row_world.get_total_exs()
                for _ in range(-(-chunk // bs)):
                    row_world.parley()
                return row_world.get_total_exs() - before

            rows = [(timed(in_world, args.min_seconds, args.now), timed(per_row, args.min_seconds, args.now))
                    for _ in range(args.repeats)]
            speedup, speedups = median_ratio(rows)
            say(f"          whole-batch path vs clone by clone (ParlAI's BatchWorld, same metrics): {speedup:.2f}x "
                f"({fmt_rounds(speedups)})")
            results[f"overhead_block_speedup_bs{asked}"] = speedup
            row_world.shutdown()
        world.shutdown()
    return results


# --------------------------------------------------------------------------------------------------
# metrics: one pass over a batch vs per reply
# --------------------------------------------------------------------------------------------------

def metrics_examples(args: argparse.Namespace) -> tuple[str, list[Message]]:
    """(what they are, the examples the metrics part scores): the first ``--eval-episodes`` episodes of
    ``--task``'s valid split, or, by default, as many generated dialogues of the valid split."""
    if args.task is None:
        from accelbatch.tasks.dialogues import generate

        examples = [m for ep in generate(args.eval_episodes, args.seed, "valid") for m in ep]
        return f"{args.eval_episodes} episodes of the generated dialogues' valid split", examples
    from accelbatch.opts import OptionError
    from accelbatch.teachers import create_teacher

    teacher = create_teacher(Opts(task=args.task, datatype="valid", seed=args.seed))
    if teacher is None:  # several tasks, one of them not fixed data
        raise OptionError(f"--task {args.task}: the metrics part reads fixed data; one of these tasks is not")
    episodes = min(args.eval_episodes, teacher.num_episodes())
    # evaluation turns hold their answers as eval_labels; turns without answers are not scored
    examples = [m for e in range(episodes) for m in teacher.store.episode(e) if m.get("eval_labels")]
    if not examples:
        raise OptionError(f"--task {args.task}: its valid split holds no turn with labels for the metrics part "
                          "to score")
    return f"{episodes} episodes of -t {args.task}'s valid split", examples


def part_metrics(args: argparse.Namespace) -> dict[str, float]:
    what, examples = metrics_examples(args)
    say(f"== metrics: accuracy + F1, one pass per batch vs per reply (bs 32), over the {len(examples)} turns of "
        f"{what} ==")
    rng = random.Random(args.seed)
    golds = [list(m.get("labels") or m["eval_labels"]) for m in examples]
    every_label = [g[0] for g in golds]
    # predictions like a half-trained ranker's: the label or another candidate (partial overlaps for F1);
    # without candidates, another example's label
    preds = [g[0] if rng.random() < 0.5 else rng.choice(m.get("label_candidates") or every_label)
             for m, g in zip(examples, golds)]
    batches = [(preds[i:i + 32], golds[i:i + 32]) for i in range(0, len(preds), 32)]

    def one_pass() -> tuple[Metrics, int]:
        metrics = Metrics()
        for p, g in batches:
            metrics.add_batch(p, g)
        return metrics, len(preds)

    def per_reply() -> tuple[dict[str, float], int]:  # timed: ParlAI's running sums
        exs = correct = 0
        f1 = 0.0
        for p, g in batches:
            for text, answers in zip(p, g):
                reply = Message(id="model", text=text)  # one reply object at a time, ParlAI's way
                exs += 1
                correct += exact_match(reply["text"], answers)
                f1 += f1_score(reply["text"], answers)
        return {"accuracy": correct / exs, "f1": f1 / exs}, exs

    # a memo of scores per (prediction, answers), if the core keeps one: 'cold' clears it before each pass
    import accelbatch.metrics as metrics_module

    memo_clear = getattr(metrics_module, "clear_score_memos", None)

    def one_pass_cold() -> int:
        if memo_clear is not None:
            memo_clear()
        return one_pass()[1]

    pairs, cold = [], []
    for _ in range(args.repeats):
        a = timed(lambda: one_pass()[1], args.min_seconds / 2, args.now)
        b = timed(lambda: per_reply()[1], args.min_seconds / 2, args.now)
        c = timed(one_pass_cold, args.min_seconds / 2, args.now) if memo_clear is not None else a
        pairs.append((a, b))
        cold.append((c, b))
    ratio, ratios = median_ratio(pairs)
    cold_ratio, cold_ratios = median_ratio(cold)
    say(f"one pass {statistics.median(p[0] for p in pairs):>12,.0f}/s  per reply "
        f"{statistics.median(p[1] for p in pairs):>12,.0f}/s  speedup one pass / per reply {ratio:.2f}x  "
        f"({fmt_rounds(ratios)})")
    if memo_clear is not None:
        say(f"one pass with its memo cleared before every pass over the {len(preds)} replies: "
            f"{statistics.median(p[0] for p in cold):>12,.0f}/s  speedup over per reply {cold_ratio:.2f}x  "
            f"({fmt_rounds(cold_ratios)})")
    # the check: the one pass's report against an exact reference, compared with ==. The reference scores
    # each reply alone (exact_match, f1_score) and sums the F1s exactly (math.fsum: the correctly rounded sum,
    # as the one pass's exact sums), each sum divided by the replies, as Metrics.report() divides.
    mine = one_pass()[0].report()
    hits = [exact_match(text, answers) for p, g in batches for text, answers in zip(p, g)]
    f1s = [f1_score(text, answers) for p, g in batches for text, answers in zip(p, g)]
    ref = {"accuracy": sum(hits) / len(hits), "f1": math.fsum(f1s) / len(f1s)}
    same = all(mine[k] == ref[k] for k in ref)
    say(f"values compared exactly (==): one pass Metrics.add_batch().report() accuracy {mine['accuracy']!r} "
        f"f1 {mine['f1']!r}; per reply exact_match / f1_score, summed exactly (math.fsum) over the "
        f"{len(f1s)} replies: accuracy {ref['accuracy']!r} f1 {ref['f1']!r} -> {'identical' if same else 'DIFFERENT'}")
    return {"metrics_speedup": ratio, "metrics_speedup_cold": cold_ratio, "metrics_identical": float(same)}


# --------------------------------------------------------------------------------------------------
# through the world
# --------------------------------------------------------------------------------------------------

def descendants_cpu_s(root: int) -> float | None:
    """CPU seconds (user + system) used so far by every live descendant of process ``root`` (data workers, an
    async accessor started through the forkserver, which is a child of ``root``); None without Linux's /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += cpu[pid]
        todo.extend(children.get(pid, []))
    return total


def text_padding(world: Any, steps: int) -> float:
    """Pad tokens over all tokens of the ``text_vec`` tensors the model gets in ``steps`` more parleys of
    ``world`` (token id 0 is padding; the columns a ``pad_multiple`` adds count too, as the model computes
    them). Counted from the tensors, so that every strategy is counted alike: ``none`` runs through the
    clones, whose world keeps no count; a loader world counts from its planned lengths, without those columns."""
    engine = world.get_model_agent().engine
    train_step, counts = engine.train_step, [0, 0]

    def counting(batch: dict[str, torch.Tensor]) -> Any:
        text = batch["text_vec"]
        counts[0] += int((text == 0).sum())
        counts[1] += text.numel()
        return train_step(batch)

    _parley_through(world, steps, engine, "train_step", counting)
    return counts[0] / counts[1] if counts[1] else float("nan")


def world_speed(opts: Opts, min_seconds: float, warmup_steps: int = 5,
                padding_steps: int = 0) -> tuple[float, dict[str, Any]]:
    """(examples/s of world.parley() on the --device backend, the world's report over the timed steps);
    start-up (workers, compile) excluded. The report also holds ``main_cpu_exs_per_s`` (examples per CPU
    second of this process) and, where /proc tells, ``data_cpu_s_per_ex`` (CPU seconds of the processes this
    one started, per example: the accessor and data workers). ``padding_steps``: the report's ``pad_fraction``
    is counted from the text tensors of that many more steps, after the timed ones (so that counting costs
    the timing nothing)."""
    world = create_world(opts)
    try:
        for _ in range(warmup_steps):
            world.parley()
        world.reset_metrics()

        parleys = 0

        def steps() -> int:
            nonlocal parleys
            before = world.get_total_exs()
            for _ in range(10):
                world.parley()
            parleys += 10
            return world.get_total_exs() - before

        others_start = descendants_cpu_s(os.getpid())
        cpu_start, exs_start = time.process_time(), world.get_total_exs()
        speed = timed(steps, min_seconds, time.perf_counter)  # wall: workers run in other processes
        cpu = time.process_time() - cpu_start
        others_end = descendants_cpu_s(os.getpid())
        exs = world.get_total_exs() - exs_start
        report = dict(world.report())
        report["main_cpu_exs_per_s"] = exs / max(cpu, 1e-9)
        report["rows_per_step"] = exs / max(parleys, 1)
        if others_start is not None and others_end is not None and exs:
            report["data_cpu_s_per_ex"] = max(0.0, others_end - others_start) / exs
        if padding_steps:
            report["pad_fraction"] = text_padding(world, padding_steps)
        return speed, report
    finally:
        world.shutdown()
        world.runtime.backend.teardown()


# --------------------------------------------------------------------------------------------------
# async workers vs main process
# --------------------------------------------------------------------------------------------------

def part_async(args: argparse.Namespace) -> dict[str, float]:
    say("== batching off the critical path: bag bs 32, async + 2 workers vs sync + 2 workers vs main process ==")
    variants = {"async": dict(dataloader_mode="async", num_workers=2),
                "sync": dict(dataloader_mode="sync", num_workers=2),
                "main": dict(dataloader_mode="sync", num_workers=0)}
    main_cpu: dict[str, list[float]] = {}
    data_cpu: list[float] = []
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, changes in variants.items():
            speed, report = world_speed(base_opts(args, model=BAG, **changes), args.min_seconds * 2)
            speeds[name].append(speed)
            main_cpu.setdefault(name, []).append(report["main_cpu_exs_per_s"])
            if name == "async" and "data_cpu_s_per_ex" in report:
                data_cpu.append(report["data_cpu_s_per_ex"])
    same, same_rounds = median_ratio(list(zip(speeds["async"], speeds["sync"])))
    alone, alone_rounds = median_ratio(list(zip(speeds["async"], speeds["main"])))
    say(f"async+2 workers {statistics.median(speeds['async']):>10,.0f}/s  sync+2 workers "
        f"{statistics.median(speeds['sync']):>10,.0f}/s  ratio async / sync, same workers {same:.2f}x  "
        f"({fmt_rounds(same_rounds)})")
    say(f"                                  main process   {statistics.median(speeds['main']):>10,.0f}/s  ratio "
        f"async / main process alone {alone:.2f}x  ({fmt_rounds(alone_rounds)})")
    results = {"async_vs_sync_same_workers": same, "async_vs_main_process": alone}
    a, b = statistics.median(main_cpu["async"]), statistics.median(main_cpu["main"])
    say(f"main process CPU per example: async {1e6 / a:,.0f} us, main process alone {1e6 / b:,.0f} us -> the "
        f"critical path is {a / b:.2f}x shorter (what async can reach with a free core per process)")
    results["async_main_cpu_ratio"] = a / b
    if data_cpu:
        say(async_ceiling(1e6 / a, 1e6 * statistics.median(data_cpu), 1e6 / b, alone, results))
    return results


def async_ceiling(main_us: float, data_us: float, sync_us: float, measured: float, results: dict[str, float]) -> str:
    """The best the async run can do on this machine's cores, from the CPU each process spent per example:
    the main process cannot go faster than its own CPU, and all processes together share the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    floor_us = max(main_us, (main_us + data_us) / cores)
    results["async_data_cpu_us"], results["async_ceiling"] = data_us, sync_us / floor_us
    return (f"data processes (accessor + workers) CPU per example: {data_us:,.0f} us; on {cores} cores an example "
            f"takes at least max(main, (main + data) / {cores}) = {floor_us:,.0f} us of wall time: at most "
            f"{sync_us / floor_us:.2f}x the main-process run's CPU per example (measured {measured:.2f}x)")


# --------------------------------------------------------------------------------------------------
# dynamic batching
# --------------------------------------------------------------------------------------------------

def part_dynamic(args: argparse.Namespace) -> dict[str, float]:
    say(f"== dynamic batching: conv bs 32, examples/s vs none, pad fraction of the text tensors (of "
        f"{PADDING_STEPS} untimed steps after the timed ones) ==")
    strategies = ["none", "batchsort", "full", "buckets"]
    speeds: dict[str, list[float]] = {s: [] for s in strategies}
    pads: dict[str, float] = {}
    rows: dict[str, float] = {}
    for _ in range(args.repeats):
        for s in strategies:
            # the padding of every strategy, the baseline "none" too (its world keeps no count), counted alike:
            # from the text tensors of PADDING_STEPS untimed steps after the timed ones
            speed, report = world_speed(base_opts(args, model=CONV, dynamic_batching=s,
                                                  max_batch_tokens=args.max_batch_tokens), args.min_seconds * 2,
                                        padding_steps=PADDING_STEPS)
            speeds[s].append(speed)
            pads[s] = report.get("pad_fraction", float("nan"))
            rows[s] = report["rows_per_step"]
    results = {}
    for s in strategies:
        ratio, ratios = median_ratio(list(zip(speeds[s], speeds["none"])))
        goal = "   goal >= 1.8x, pad <= 0.05" if s in ("full", "buckets") else ""
        say(f"{s:>9}: {statistics.median(speeds[s]):>8,.0f}/s  ratio vs none {ratio:.2f}x  pad fraction "
            f"{pads[s]:.3f}  rows/step {rows[s]:.1f}  ({fmt_rounds(ratios)}){goal}")
        results[f"dynamic_{s}_ratio"] = ratio
        results[f"dynamic_{s}_pad"] = pads[s]
    return results


PADDING_STEPS = 50  # the baseline's padding sample: 1,600 rows at bs 32


# --------------------------------------------------------------------------------------------------
# hogwild
# --------------------------------------------------------------------------------------------------

def hogwild_speed(opts: Opts, min_seconds: float, warmup_exs: int = 200) -> float:
    """Examples/s of a HogwildWorld: parley (non-blocking) and read the shared example counter."""
    world = create_world(opts)
    try:
        while world.get_total_exs() < warmup_exs:  # children started, first steps done
            world.parley()
        start, before = time.perf_counter(), world.get_total_exs()
        while time.perf_counter() - start < min_seconds:
            world.parley()
        return (world.get_total_exs() - before) / (time.perf_counter() - start)
    finally:
        world.shutdown()


def part_hogwild(args: argparse.Namespace) -> dict[str, float]:
    say("== hogwild: conv bs 32, --numthreads 2 vs 1 ==")
    pairs = []
    for _ in range(args.repeats):
        two = hogwild_speed(base_opts(args, model=CONV, numthreads=2), args.min_seconds * 3)
        one = world_speed(base_opts(args, model=CONV, numthreads=1), args.min_seconds * 3)[0]
        pairs.append((two, one))
    ratio, ratios = median_ratio(pairs)
    say(f"2 processes {statistics.median(p[0] for p in pairs):>8,.0f}/s  1 process "
        f"{statistics.median(p[1] for p in pairs):>8,.0f}/s  ratio 2 processes / 1 {ratio:.2f}x  "
        f"({fmt_rounds(ratios)})   goal >= 1.8x")
    return {"hogwild_ratio": ratio}


PARTS = {"overhead": part_overhead, "metrics": part_metrics, "async": part_async, "dynamic": part_dynamic,
         "hogwild": part_hogwild}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma separated, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: 2,000 training episodes, 2 repeats, short timings (< 2 min)")
    parser.add_argument("--task", default=None,
                        help="any task instead of the synthetic dialogues (e.g. jsonl:PATH); its examples need "
                             "label_candidates for the bag and conv models")
    parser.add_argument("--episodes", type=int, default=None,
                        help="training episodes of the dialogues task (default: the spec's 10,000, --quick 2,000; "
                             "not with --task)")
    parser.add_argument("--eval-episodes", type=int, default=None,
                        help="episodes scored by the metrics part (of --task's valid split, or of the generated "
                             "dialogues'; default 3,000, --quick 600)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds per comparison (default 5, --quick 2)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="seconds per measurement (default 1.5, --quick 0.4)")
    parser.add_argument("--batchsizes", default="1,32,128", help="batch sizes of the overhead part")
    parser.add_argument("--max-batch-tokens", type=int, default=-1,
                        help="dynamic part: token budget of 'full' and 'buckets' (-1: the loader's default, "
                             "ParlAI's (text truncation + label truncation) x bs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="overhead and metrics parts: wall time, or this process's CPU time (steadier when "
                             "other processes share the cores); multi-process parts always use wall time")
    args = parser.parse_args(argv)
    # explicit sizes are checked (0 is not "the default") before the defaults fill the ones not given
    for option, value in (("--repeats", args.repeats), ("--episodes", args.episodes),
                          ("--eval-episodes", args.eval_episodes)):
        if value is not None and value < 1:
            parser.error(f"{option} {value}: give 1 or more")
    if args.min_seconds is not None and not 0 < args.min_seconds < math.inf:
        parser.error(f"--min-seconds {args.min_seconds:g}: give a finite number of seconds above 0")
    if args.episodes is not None and args.task is not None:
        parser.error("--episodes: sizes the generated dialogues, not --task's data")
    if args.quick:  # smaller defaults; explicit options win
        args.episodes = 2000 if args.episodes is None and args.task is None else args.episodes
    if args.eval_episodes is None:
        args.eval_episodes = 600 if args.quick else 3000
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (0.4 if args.quick else 1.5)
    try:
        sizes = [int(b) for b in args.batchsizes.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        parser.error(f"--batchsizes {args.batchsizes}: give batch sizes of 1 or more, comma separated")
    args.batchsizes = sizes
    torch.set_num_threads(1)
    args.now = CLOCKS[args.clock]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    say(f"workload: -t {task_name(args)} seed {args.seed}, torch threads 1, {os.cpu_count()} cpus, "
        f"repeats {args.repeats}, {args.min_seconds}s per measurement, {args.clock} clock")
    results: dict[str, float] = {}
    start = time.perf_counter()
    for name in parts:
        t = time.perf_counter()
        results.update(PARTS[name](args))
        say(f"   ({name}: {time.perf_counter() - t:.1f}s)")
        say()
    say(f"total {time.perf_counter() - start:.1f}s")
    if results.get("metrics_identical") == 0.0:  # said once everything is printed: the exit status tells
        print(f"{os.path.basename(sys.argv[0])}: the metrics part's one-pass values are not the per-reply "
              "reference's (DIFFERENT above)", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    from accelbatch.cli import run_script

    sys.exit(run_script(main))  # bad input (a task's file, an option): accelbatch's one line, exit 2
