"""``accelbatch report RUN_DIR``: plot a run's metrics log (loss and throughput per step) to a PNG.

The log is the JSONL file ``--metrics-log`` writes (one record per line: ``split``, ``step``, ``epoch``,
``exs_per_s``, ``loss``, ``accuracy``, ...). ``RUN_DIR`` may be that file, or a directory holding
``metrics.jsonl`` or exactly one ``*.jsonl``. The PNG goes next to the log (``metrics.jsonl`` ->
``metrics.png``) unless ``out`` is given.

* Records without a ``step`` (validation and test reports) are placed at the step of the last train
  record before them; a missing ``exs_per_s`` is ``exs / time_s`` when both are there. The evaluations
  after training (``"final": true``: the model ``-mf`` kept, which may be an earlier step's) are points of
  their own (``valid (final)``), not the end of the split's line.
* A log appended to by several runs (MetricsLog appends) or a resumed run whose last records went past
  its checkpoint has steps that go back; each such restart starts a new line of the same colour.
* A file none of whose lines is a record is not a metrics log (one line says so). In a log, a malformed line
  (not JSON, not an object, no ``split``) is an error naming ``file:line``, unless
  ``skip_bad`` (``--skip-bad``): then it is reported on stderr and skipped. A last line without a
  newline that does not parse (a write cut short by a kill) is always skipped with a notice.
* Needs matplotlib (an optional extra): without it :class:`MissingDependency` says
  ``pip install matplotlib`` and the command exits with code 2. Nothing here uses pyplot's global state.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any, Callable, Sequence

__all__ = ["MetricsLogError", "MissingDependency", "find_metrics_log", "read_metrics", "plot_run",
           "add_report_arguments", "report_command", "main"]

SPLIT_STYLE = {"train": ("tab:blue", "-", None), "valid": ("tab:orange", "-", "o"),
               "test": ("tab:green", "", "s")}
FINAL = "(final)"  # a split's evaluations after training (the model -mf kept), marked apart from its line
PANELS = (("loss", "loss"), ("exs_per_s", "examples / s"), ("accuracy", "accuracy"))


class MetricsLogError(ValueError):
    """The metrics log cannot be found or read; the text names the file (and line) and what to do."""


class MissingDependency(RuntimeError):
    """An optional dependency is not installed; the text says what to install."""


def find_metrics_log(path: str | os.PathLike) -> str:
    """The JSONL file of ``path``: the file itself, or ``metrics.jsonl`` / the only ``*.jsonl`` in it."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):  # a file, or a pipe the run writes its log to
        return path
    if not os.path.isdir(path):
        raise MetricsLogError(f"{path}: no such file or directory; give a run directory or its metrics "
                              "log (the --metrics-log file)")
    preferred = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(preferred):
        return preferred
    found = [f for f in sorted(glob.glob(os.path.join(glob.escape(path), "*.jsonl"))) if os.path.isfile(f)]
    if len(found) == 1:
        return found[0]
    if not found:
        what = "metrics.jsonl there is a directory, and no other *.jsonl file is" if os.path.isdir(preferred) \
            else "no metrics.jsonl or other *.jsonl file here"
        raise MetricsLogError(f"{path}: {what}; give the --metrics-log file of the run")
    names = ", ".join(os.path.basename(f) for f in found)
    raise MetricsLogError(f"{path}: several JSONL files ({names}); give one of them, e.g. "
                          f"accelbatch report {found[0]}")


def _notice(text: str) -> None:
    print(f"accelbatch report: {text}", file=sys.stderr)


def read_metrics(path: str | os.PathLike, *, skip_bad: bool = False,
                 warn: Callable[[str], None] = _notice) -> list[dict[str, Any]]:
    """The records of a metrics log, in file order (see the module docstring for malformed lines)."""
    file = find_metrics_log(path)
    with open(file, "rb") as handle:
        raw = handle.read()
    lines = raw.split(b"\n")
    records: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    notices: list[str] = []  # said once the file is known to be a metrics log
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last_unterminated = number == len(lines)  # split leaves b"" after a final newline
        problem = None
        try:
            record = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
            problem = f"not valid JSON ({str(exc).splitlines()[0]})"
            if last_unterminated:
                notices.append(f"{file}:{number}: skipped an unfinished last line ({problem}); the run was "
                               "probably stopped while writing it")
                continue
        else:
            if not isinstance(record, dict):
                problem = f"expected a JSON object, got {type(record).__name__}"
            elif not isinstance(record.get("split"), str):
                problem = "the record has no 'split'" if "split" not in record else \
                    f"the record's 'split' is {record['split']!r}, not a split's name such as \"train\""
        if problem is None:
            records.append(record)
        else:
            bad.append((number, problem))
    if bad and not records:  # another kind of file (a report JSON, TensorBoard events, a data file)
        raise MetricsLogError(f"{file}: not a metrics log: none of its lines is a JSON record with a 'split' "
                              f"(line {bad[0][0]}: {bad[0][1]}); give the --metrics-log file of a run")
    for notice in notices:
        warn(notice)
    if bad and skip_bad:
        for number, problem in bad:
            warn(f"{file}:{number}: skipped: {problem}")
    elif bad:
        more = f"\n... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise MetricsLogError("\n".join(f"{file}:{n}: {p}" for n, p in bad[:5]) + more +
                              "\nFix or delete these lines, or plot the others "
                              "with accelbatch report --skip-bad")
    if not records:
        raise MetricsLogError(f"{file}: no metric records; is it the --metrics-log file of a run that "
                              "logged (see --log-every-n-secs)?")
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer beyond a float's range: as inf, not plotted
        return None
    return value if math.isfinite(value) else None


def series(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[list[tuple[float, float]]]]:
    """``{(split, metric): [segment, ...]}``, each segment a list of ``(step, value)`` of one run: the records
    of one ``run`` name (however runs sharing a log interleave), else those until a restart."""
    out: dict[tuple[str, str], dict[Any, list[tuple[float, float]]]] = {}
    steps: dict[Any, float] = {}  # each run's last step: a record without one is placed there
    restarts, last_train_step = 0, None
    for record in records:
        split = record["split"]
        if record.get("final") is True and split != "test":  # the best model's evaluation after training: a
            split = f"{split} {FINAL}"                         # point of its own, not the end of the line
        record_step = _number(record.get("step"))
        if split == "train" and record_step is not None and not isinstance(record.get("run"), str):
            if last_train_step is not None and record_step < last_train_step:
                restarts += 1  # a restart of a log without run names: a new run appended to it, or a resume
            last_train_step = record_step
        run = record["run"] if isinstance(record.get("run"), str) else restarts
        if record_step is not None:
            steps[run] = record_step
        step = steps.get(run, 0.0)
        values = dict(record)
        if _number(values.get("exs_per_s")) is None:
            exs, secs = _number(values.get("exs")), _number(values.get("time_s"))
            if exs is not None and secs:
                values["exs_per_s"] = exs / secs
        for metric, _ in PANELS:
            value = _number(values.get(metric))
            if value is None:
                continue
            out.setdefault((split, metric), {}).setdefault(run, []).append((step, value))
    return {key: list(segments.values()) for key, segments in out.items()}


def _default_out(log_file: str) -> str:
    stem, _ = os.path.splitext(log_file)
    return stem + ".png"


def plot_run(path: str | os.PathLike, out: str | os.PathLike | None = None, *, skip_bad: bool = False) -> str:
    """Plot loss, examples/s (and accuracy when logged) against step for each split; return the PNG path."""
    log_file = find_metrics_log(path)
    data = series(read_metrics(log_file, skip_bad=skip_bad))
    panels = [(metric, label) for metric, label in PANELS if any(m == metric for _, m in data)]
    if not any(metric in ("loss", "exs_per_s") for metric, _ in panels):
        raise MetricsLogError(f"{log_file}: no loss or exs_per_s values to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency("accelbatch report needs matplotlib to draw the PNG: "
                                "pip install matplotlib") from None
    out = os.fspath(out) if out is not None else _default_out(log_file)
    if not out.lower().endswith(".png") or os.path.isdir(out):
        raise MetricsLogError(f"-o/--out {out!r}: the report is a PNG image; give a file path ending in .png")

    fig = Figure(figsize=(7.5, 2.6 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    splits = sorted({split for split, _ in data}, key=lambda s: (list(SPLIT_STYLE).index(s)
                                                                 if s in SPLIT_STYLE else 99, s))
    for ax, (metric, label) in zip(axes, panels):
        for index, split in enumerate(splits):
            segments = data.get((split, metric), [])
            color, line, marker = SPLIT_STYLE.get(split.replace(f" {FINAL}", ""), (f"C{3 + index}", "-", "^"))
            line, marker = ("", "D") if split.endswith(FINAL) else (line, marker)
            for n, segment in enumerate(segments):
                xs, ys = zip(*segment)
                ax.plot(xs, ys, color=color, linestyle=line or "none", marker=marker, markersize=4,
                        linewidth=1.4, label=split if n == 0 else None)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    axes[0].set_title(os.path.join(*os.path.abspath(log_file).split(os.sep)[-2:]), fontsize="medium")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, format="png")
    except OSError as exc:  # makedirs under a file raises "File exists": said as what it is
        why = "a part of its directory is a file" if isinstance(exc, FileExistsError) else exc.strerror or exc
        raise MetricsLogError(f"-o/--out {out}: cannot write it ({why}); give a writable path") from None
    return out


# --- command line: accelbatch report RUN_DIR [-o OUT] [--skip-bad] ---------------------------------------
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run's directory (with metrics.jsonl or one *.jsonl) or its metrics log")
    parser.add_argument("-o", "--out", default=None, help="PNG to write (default: next to the log, .png)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip malformed log lines (reported on stderr) instead of stopping")


def report_command(args: argparse.Namespace) -> int:
    """Run ``accelbatch report`` for parsed arguments: 0 with the PNG path printed, 2 on any error."""
    try:
        png = plot_run(args.run_dir, args.out, skip_bad=args.skip_bad)
    except (MetricsLogError, MissingDependency, OSError) as exc:
        print(f"accelbatch: error: {exc}", file=sys.stderr)
        return 2
    print(png)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelbatch report",
                                     description="Plot a run's loss and throughput curves to a PNG.")
    add_report_arguments(parser)
    return report_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
