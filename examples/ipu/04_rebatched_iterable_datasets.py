"""Tutorial 4: rebatching iterable datasets, so that no worker drops its tail.

    python examples/ipu/04_rebatched_iterable_datasets.py [--items 100 --workers 7 --batch-size 4]

An ``IterableDataset`` read by W workers is split among them (here: ceil(items / W) items each, the last
worker gets the rest). Each worker batches its own items, and with ``drop_last=True`` (needed for the
IPU's static shapes) each worker drops its own partial last batch:

    100 items, 7 workers, batch 4: six workers with 15 items use 12 each, the last has 10 and uses 8:
    6 x 12 + 8 = 80 items used, 20% of the data never seen.

``mode=poptorch.DataLoaderMode.AsyncRebatched`` makes the workers emit small batches (``rebatched_worker_size``
rows, default the combined batch) without dropping anything, and the background accessor re-forms full
combined batches: floor(100 / 4) x 4 = 100 items used. The shapes the model sees are the same.
The script counts the distinct items each mode delivers and checks them against these formulas.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from poptorch_or_emulator import import_poptorch  # examples/ipu/poptorch_or_emulator.py

# 7 workers on a small machine is the point of the example: silence torch's advice about it (module level,
# so the loading processes, which import this file, silence it too)
warnings.filterwarnings("ignore", message="This DataLoader will create")


class Numbers(torch.utils.data.IterableDataset):
    """The integers [start, end); ``split_among_workers`` gives each data worker its own contiguous part."""

    def __init__(self, items: int):
        super().__init__()
        self.start, self.end = 0, items

    def __iter__(self):
        for i in range(self.start, self.end):
            yield torch.tensor([i])


def split_among_workers(worker_id: int) -> None:
    """``worker_init_fn``: worker k of W reads items [k * ceil(N/W), (k+1) * ceil(N/W))."""
    info = torch.utils.data.get_worker_info()
    dataset = info.dataset
    per_worker = math.ceil((dataset.end - dataset.start) / info.num_workers)
    start = dataset.start + worker_id * per_worker
    dataset.start, dataset.end = start, min(start + per_worker, dataset.end)


def expected_without_rebatching(items: int, workers: int, batch: int) -> int:
    per_worker = math.ceil(items / workers)
    sizes = [max(0, min(per_worker, items - k * per_worker)) for k in range(workers)]
    return sum(batch * (n // batch) for n in sizes)


def count(loader) -> tuple[int, int, set[int]]:
    """(batches, rows, distinct items) delivered by one pass."""
    batches, rows, seen = 0, 0, set()
    try:
        for x in loader:
            batches += 1
            rows += x.shape[0]
            seen.update(x.reshape(-1).tolist())
    finally:
        if hasattr(loader, "terminate"):
            loader.terminate()
    return batches, rows, seen


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--workers", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--skip-async", action="store_true", help="only Sync and AsyncRebatched")
    parser.add_argument("--emulator", action="store_true", help="use the CPU emulator even if poptorch exists")
    args = parser.parse_args(argv)
    n, w, b = args.items, args.workers, args.batch_size
    for name in ("items", "workers", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if b == 1:  # PopTorch's accessor asserts a rebatched size (here the batch) of at least 2
        parser.error("--batch-size 1: AsyncRebatched re-forms batches of at least 2 rows (PopTorch's accessor "
                     "refuses a rebatched_size of 1); use --batch-size 2 or more")
    if n < b:  # drop_last: not one batch in any mode (the rebatching accessor fails to start on no batch)
        parser.error(f"--items {n} is fewer than one batch (--batch-size {b}): no mode has a batch to deliver")
    if not args.skip_async and expected_without_rebatching(n, w, b) == 0:
        parser.error(f"--items {n} split among --workers {w} gives each worker at most {math.ceil(n / w)} items, "
                     f"fewer than --batch-size {b}: every worker drops all its items and the Async mode has no "
                     "batch to deliver; use fewer --workers, more --items, or --skip-async")
    poptorch = import_poptorch(args.emulator)
    opts = poptorch.Options()  # deviceIterations etc. multiply the batch the same way in every mode

    def loader(mode, **kwargs):
        return poptorch.DataLoader(opts, Numbers(n), batch_size=b, num_workers=w, drop_last=True, mode=mode,
                                   worker_init_fn=split_among_workers, **kwargs)

    dropped = expected_without_rebatching(n, w, b)
    kept = (n // b) * b
    print(f"{n} items, {w} workers, batch {b}: ceil({n}/{w}) = {math.ceil(n / w)} items per worker")
    modes = [("Sync", poptorch.DataLoaderMode.Sync, dropped)]
    if not args.skip_async:
        modes.append(("Async", poptorch.DataLoaderMode.Async, dropped))
    modes.append(("AsyncRebatched", poptorch.DataLoaderMode.AsyncRebatched, kept))
    for label, mode, expected in modes:
        batches, rows, seen = count(loader(mode))
        assert rows == len(seen) == expected, (label, rows, len(seen), expected)
        print(f"  {label:<15} {batches:>3} batches of {b}: {len(seen):>4} distinct items used "
              f"(expected {expected})")
    print(f"\nwithout rebatching each worker drops its partial batch: {n - dropped} items lost; "
          f"AsyncRebatched loses only the {n - kept} that do not fill a last batch")


if __name__ == "__main__":
    main()
