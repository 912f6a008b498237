"""Tutorial 1: efficient data loading for the IPU.

    python examples/ipu/01_efficient_data_loading.py [--items 2048 --batch-size 8 --device-iterations 16 ...]

What it shows:

1. The *combined batch*: one call of a PopTorch model consumes batch_size x deviceIterations x
   replicationFactor x gradientAccumulation rows. ``poptorch.DataLoader`` builds exactly that;
   ``torch.utils.data.DataLoader(batch_size=b)`` gives b rows, which the model refuses ("Invalid batch
   dimension") once D, R or G > 1 unless b is a multiple of D x R x G (then it runs D x R x G micro-batches
   of b / (D x R x G) rows): either way enlarging it by hand changes the micro batch.
2. Loader modes: ``Sync`` (in this process, or ``num_workers`` torch workers) and ``Async`` (an
   ``AsynchronousDataAccessor`` fills a ring buffer in a background process while the device computes).
3. Finding the bottleneck: time the loader alone (no model), the model alone (one batch reused, and with
   ``Options.enableSyntheticData(True)``: no host I/O at all, over an epoch), then both together. If the
   loader alone is slower than the model alone, the IPU waits for data: add workers, use Async, or make
   ``__getitem__`` cheaper. If the model is slower, data loading is not the problem.
4. ``async_options`` of an Async loader (they go to its ``AsynchronousDataAccessor``): ``buffer_size``
   (batches read ahead, default 3), ``early_preload`` (fill the ring at construction instead of waiting
   for the first ``iter()``; the worker reads only the first batch before that otherwise), and
   ``miss_sleep_time_in_ms`` (how long the worker sleeps between checks for a free slot when the ring is
   full, default 0.1: small keeps the ring topped up, larger polls less). And ``persistent_workers``
   (poptorch.DataLoader's default: True whenever ``num_workers > 0``): torch's worker processes live across
   epochs instead of starting again at every ``iter()``; the script sets it False to show what it saves.
5. Device iterations against batch size: the same rows per call as ``b x D`` with a larger ``D`` and a
   smaller ``b``, or the reverse. A call costs one host round trip whatever ``D``; the micro batch ``b``
   sets the activations' memory on the IPU and the rows per weight update, ``D`` the updates per call.

Runs on a real IPU with the Poplar SDK's ``poptorch`` and torch alone (accelbatch need not be installed);
without poptorch, on accelbatch's CPU emulator of poptorch
(``--emulator`` forces the emulator). Timings on the emulator are CPU timings, not IPU ones; the method is
the same.
"""

from __future__ import annotations

import argparse
import time

import torch
from poptorch_or_emulator import import_poptorch  # examples/ipu/poptorch_or_emulator.py


class SyntheticImages(torch.utils.data.Dataset):
    """``items`` random "images" and labels; ``cost_ms`` of busy work per item imitates decoding/augmenting."""

    def __init__(self, items: int, features: int, classes: int, cost_ms: float):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(items, features, generator=g)
        self.y = torch.randint(0, classes, (items,), generator=g)
        self.cost_s = cost_ms / 1000.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:  # stand-in for JPEG decoding, augmentation...
            pass
        return self.x[i], self.y[i]


class Classifier(torch.nn.Module):
    """Returns (logits, loss): PopTorch trains on the loss it finds in the graph (here the torch loss), whichever
    output holds it; a hand-written loss must be wrapped in poptorch.identity_loss."""

    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, classes))
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        logits = self.net(x)
        return logits, self.loss(logits, y)


def items_per_second(items: int, seconds: float) -> float:
    return items / max(seconds, 1e-9)


def time_loader(loader, max_batches: int) -> tuple[int, float]:
    """Iterate the loader alone: (items read, seconds), timed from the first batch on (worker start-up left
    out). An Async loader's background process has filled its buffer before that: time enough batches
    (--max-batches well above the buffer size, 3) to see its steady rate."""
    it = iter(loader)
    next(it)
    start, items = time.perf_counter(), 0
    for i, (x, _) in enumerate(it):
        items += x.shape[0]
        if i + 2 >= max_batches:
            break
    return items, time.perf_counter() - start


def time_model(model, batch, steps: int) -> tuple[int, float]:
    """Run the model on one batch over and over (no loading at all): (items, seconds)."""
    x, y = batch
    model(x, y)  # the first call compiles: keep it out of the timing
    start = time.perf_counter()
    for _ in range(steps):
        model(x, y)
    return steps * x.shape[0], time.perf_counter() - start


def time_both(model, loader, max_batches: int) -> tuple[int, float]:
    start, items = time.perf_counter(), 0
    for i, (x, y) in enumerate(loader):
        model(x, y)
        items += x.shape[0]
        if i + 1 >= max_batches:
            break
    return items, time.perf_counter() - start


def time_after_pause(loader, batches: int, pause_s: float) -> float:
    """Seconds to read ``batches`` batches of a new Async loader after ``pause_s`` of other host work (the
    model compiling, say): what ``early_preload`` buys."""
    time.sleep(pause_s)
    start = time.perf_counter()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return time.perf_counter() - start


def time_epoch_start(loader) -> float:
    """Seconds to the first batch of a second epoch (a first one is read before)."""
    for _ in loader:
        pass
    start = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - start


def async_options_section(poptorch, opts, dataset, args, training) -> None:
    """4. What each of async_options and persistent_workers changes, measured."""
    pause = args.pause_s
    print(f"\n4. async_options (first {args.buffer_size} batches read after {pause:g} s of other work; then "
          f"loader + model over {args.max_batches} calls)")
    choices = [("defaults", {}),
               ("early_preload=True", {"early_preload": True}),
               ("buffer_size=1, miss_sleep_time_in_ms=50", {"buffer_size": 1, "miss_sleep_time_in_ms": 50})]
    for label, extra in choices:
        async_options = {"buffer_size": args.buffer_size, **extra}
        times = []
        for measure in ("pause", "both"):
            loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, drop_last=True,
                                         mode=poptorch.DataLoaderMode.Async, async_options=async_options)
            try:
                if measure == "pause":
                    times.append(time_after_pause(loader, min(args.buffer_size, len(loader)), pause))
                else:
                    items, seconds = time_both(training, loader, args.max_batches)
                    times.append(items_per_second(items, seconds))
            finally:
                loader.terminate()
        print(f"   {label:<42}{times[0] * 1000:>8.1f} ms{times[1]:>12,.0f} it/s")
    print("   early_preload=True: the ring is full when the loop starts. A large miss_sleep_time_in_ms with a "
          "small buffer\n   lets the worker notice late that a slot is free: the model may wait for data.")
    if args.workers:
        starts = []
        for persistent in (False, True):
            loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, drop_last=True,
                                         num_workers=args.workers, persistent_workers=persistent)
            starts.append(time_epoch_start(loader))
        print(f"   start of a 2nd epoch with {args.workers} workers: {starts[0] * 1000:.1f} ms, with "
              f"persistent_workers=True {starts[1] * 1000:.1f} ms (the workers are not started again)")


def trade_off_section(poptorch, dataset, args) -> None:
    """5. The same rows per call as batch_size x deviceIterations, split differently."""
    rows = args.batch_size * args.device_iterations
    splits = sorted({d for d in (1, 2, 4, args.device_iterations) if rows % d == 0}, reverse=True)
    print(f"\n5. {rows} rows per call (x replicas x accumulation) as batch_size x deviceIterations:")
    header = [("batch_size", 10), ("deviceIterations", 17), ("updates/call", 13), ("rows/update", 12),
              ("model alone", 14)]
    print("   " + " ".join(f"{name:>{width}}" for name, width in header))
    for d in splits:
        b = rows // d
        opts = poptorch.Options().deviceIterations(d).replicationFactor(args.replication_factor)
        opts.Training.gradientAccumulation(args.gradient_accumulation)
        loader = poptorch.DataLoader(opts, dataset, batch_size=b, drop_last=True)
        model = Classifier(args.features, args.hidden, args.classes)
        training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        batch = next(iter(loader))
        items, seconds = time_model(training, batch, max(2, args.max_batches))
        training.destroy()
        per_update = b * args.replication_factor * args.gradient_accumulation
        print(f"   {b:>10} {d:>17} {d:>13} {per_update:>12} {items_per_second(items, seconds):>9,.0f} it/s")
    print("   Larger deviceIterations: more weight updates per host round trip, smaller micro-batches (less IPU "
          "memory\n   for activations, more and noisier steps). Larger batch_size: fewer, larger updates, one "
          "round trip each;\n   pick batch_size for memory and convergence, then raise deviceIterations until "
          "the host is hidden.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="micro batch")
    parser.add_argument("--device-iterations", type=int, default=16)
    parser.add_argument("--replication-factor", type=int, default=1)
    parser.add_argument("--gradient-accumulation", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="torch DataLoader worker processes")
    parser.add_argument("--item-cost-ms", type=float, default=0.2, help="busy work per item (decoding)")
    parser.add_argument("--max-batches", type=int, default=8, help="combined batches timed per measurement")
    parser.add_argument("--buffer-size", type=int, default=3, help="async_options buffer_size")
    parser.add_argument("--pause-s", type=float, default=0.5, help="host work before reading (early_preload)")
    parser.add_argument("--emulator", action="store_true", help="use the CPU emulator even if poptorch exists")
    args = parser.parse_args(argv)
    counts = ("batch_size", "device_iterations", "replication_factor", "gradient_accumulation", "items", "features",
              "hidden", "classes", "max_batches", "buffer_size")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("workers", "item_cost_ms", "pause_s"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more")
    combined = args.batch_size * args.device_iterations * args.replication_factor * args.gradient_accumulation
    if args.items < combined:  # drop_last: not one combined batch to load
        parser.error(f"--items {args.items} is fewer than one combined batch ({combined} = --batch-size x "
                     "--device-iterations x --replication-factor x --gradient-accumulation)")
    poptorch = import_poptorch(args.emulator)

    dataset = SyntheticImages(args.items, args.features, args.classes, args.item_cost_ms)
    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replication_factor)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    opts.randomSeed(0)

    # --- 1. the combined batch -------------------------------------------------------------------
    loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    combined = loader.combinedBatchSize
    print(f"\n1. combined batch = batch_size({args.batch_size}) x deviceIterations({args.device_iterations}) x "
          f"replicationFactor({args.replication_factor}) x gradientAccumulation({args.gradient_accumulation}) "
          f"= {combined} rows per call; {len(loader)} calls per epoch of {len(dataset)} items")
    x, y = next(iter(loader))
    print(f"   poptorch.DataLoader batch: x{list(x.shape)} y{list(y.shape)}")
    model = Classifier(args.features, args.hidden, args.classes)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    plain = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size)
    px, py = next(iter(plain))
    print(f"   torch DataLoader batch:    x{list(px.shape)}  (the micro batch only)")
    if combined != args.batch_size:
        # a training model, as the one above: an inference model refuses these options once G > 1
        probe_model = Classifier(args.features, args.hidden, args.classes)
        probe = poptorch.trainingModel(probe_model, opts.clone(),
                                       optimizer=torch.optim.SGD(probe_model.parameters(), lr=0.01))
        try:
            probe(px, py)
        except Exception as exc:  # noqa: BLE001 - show PopTorch's own message
            print(f"   feeding it to the model: {type(exc).__name__}: {str(exc).split(' because')[0]}")
        else:  # the rows divide by D x R x G: accepted, but cut into smaller micro-batches
            split = combined // args.batch_size
            print(f"   feeding it to the model works, but as {split} micro-batches of "
                  f"{args.batch_size // split} rows: the micro batch silently became {args.batch_size // split}, "
                  f"not {args.batch_size}")
        finally:
            probe.destroy()

    # --- 2 and 3. modes and the bottleneck --------------------------------------------------------
    max_batches = max(2, min(args.max_batches, len(loader)))
    training(x, y)  # compile once, outside the timings
    m_items, m_s = time_model(training, (x, y), max_batches)
    model_rate = items_per_second(m_items, m_s)
    print(f"\n2. model alone (one batch reused): {model_rate:,.0f} items/s")
    # Graphcore's way: synthetic data (no host I/O at all, the device makes its inputs) over a whole epoch
    synthetic_model = Classifier(args.features, args.hidden, args.classes)
    synthetic = poptorch.trainingModel(synthetic_model, opts.clone().enableSyntheticData(True),
                                       optimizer=torch.optim.SGD(synthetic_model.parameters(), lr=0.01))
    s_items, s_s = time_model(synthetic, (x, y), len(loader))
    synthetic.destroy()
    print(f"   model alone (Options.enableSyntheticData, {len(loader)} calls = one epoch): "
          f"{items_per_second(s_items, s_s):,.0f} items/s")
    print(f"\n3. {'mode':<28}{'loader alone':>16}{'loader + model':>18}   bottleneck")
    modes = [("Sync, 0 workers", poptorch.DataLoaderMode.Sync, 0)]
    if args.workers:
        modes.append((f"Sync, {args.workers} workers", poptorch.DataLoaderMode.Sync, args.workers))
    modes.append((f"Async, {args.workers} workers", poptorch.DataLoaderMode.Async, args.workers))
    for label, mode, workers in modes:
        loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                     num_workers=workers, mode=mode)
        try:
            l_items, l_s = time_loader(loader, max_batches)
            b_items, b_s = time_both(training, loader, max_batches)
        finally:
            if hasattr(loader, "terminate"):
                loader.terminate()  # stops an Async loader's background process
        loader_rate, both_rate = items_per_second(l_items, l_s), items_per_second(b_items, b_s)
        verdict = "data loading" if loader_rate < model_rate else "the model"
        print(f"   {label:<28}{loader_rate:>12,.0f} it/s{both_rate:>14,.0f} it/s   {verdict}")
    print("\nIf the bottleneck is data loading: more workers, Async mode, cheaper __getitem__, or a larger "
          "deviceIterations (fewer host round trips). Otherwise the loader keeps up: look at the model.")
    async_options_section(poptorch, opts, dataset, args, training)
    trade_off_section(poptorch, dataset, args)


if __name__ == "__main__":
    main()
