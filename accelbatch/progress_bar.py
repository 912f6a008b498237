"""The train progress bar (tqdm): when it is drawn, and the fields it shows."""

from __future__ import annotations

import math
import sys
from typing import Any

from accelbatch.opts import Opts


def shows_bar(opts: Opts) -> bool:
    """Whether a run shows its train bar: --progress, or by default where stderr is a terminal (a log file
    would collect every redraw)."""
    return bool(opts.progress or (opts.progress is None and sys.stderr.isatty()))


def progress_bar(opts: Opts, total: float) -> Any:
    """The train bar (tqdm), or None where :func:`shows_bar` says none is shown."""
    if not shows_bar(opts):
        return None
    from tqdm import tqdm

    return tqdm(total=None if math.isinf(total) else int(total), unit="ex", dynamic_ncols=True,
                file=sys.stderr, desc="train")


def postfix(report: dict[str, float], speed: float, wait_share: float) -> dict[str, str]:
    """Progress-bar fields; 'data' is the share of time the model waited for its inputs."""
    out = {"ex/s": f"{speed:,.0f}", "data": f"{wait_share:.0%}"}
    for key in ("loss", "accuracy"):
        if key in report:
            out[key] = f"{report[key]:.4f}"
    return out
