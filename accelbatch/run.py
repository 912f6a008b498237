"""run(world, opts): train and/or evaluate a world on the chosen backend and return a report.

Training runs world steps until the epoch or step limit, validating every N epochs (keeping the best
model in --model-file), then evaluates the final splits. Evaluation runs a world until its epoch is
done. The report is a dict with one entry per split (ParlAI's metric names exs, accuracy, f1, loss),
printed as a table and written to --report-json.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from accelbatch.agents import Agent, TorchAgent
from accelbatch.build import Runtime, attach_runtime, create_world
from accelbatch.opts import Opts
from accelbatch.run_control import PeriodicSaver, StopSignals, check_output_paths
from accelbatch.state import Checkpointer
from accelbatch.teachers import is_training, split_of
from accelbatch.tensorboard_log import TensorBoardLog
from accelbatch.worlds import World


@dataclass
class MetricsLog:
    """Appends one JSON object per line to --metrics-log (nothing when no path is given)."""

    path: str | None
    handle: TextIO | None = None
    tensorboard: TensorBoardLog | None = None  # the same records as TensorBoard scalars (optional)

    def write(self, record: dict[str, Any]) -> None:
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if not self.path:
            return
        if self.handle is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.handle = open(self.path, "a", encoding="utf-8")
        self.handle.write(json.dumps(record, sort_keys=True) + "\n")
        self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.tensorboard is not None:
            self.tensorboard.close()


@dataclass
class TrainState:
    """Counters of a training run."""

    steps: int = 0
    exs: int = 0
    validations: int = 0
    best: float = -math.inf
    stale: int = 0
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "exs": self.exs, "validations": self.validations, "best": self.best,
                "stale": self.stale, "elapsed_s": self.elapsed()}

    def load_json(self, data: dict[str, Any]) -> None:
        self.steps, self.exs, self.validations = data["steps"], data["exs"], data["validations"]
        self.best, self.stale = data["best"], data["stale"]
        self.started = time.monotonic() - data["elapsed_s"]


def evaluate(world: World, log: MetricsLog | None = None, split: str = "valid",
             backend: Any = None, stop: StopSignals | None = None) -> dict[str, float]:
    """Run ``world`` until its epoch is done; return its report (merged across replicas) and log it.

    A stop signal (``stop``) ends it at the next step with KeyboardInterrupt saying how many examples it saw."""
    world.reset()
    world.reset_metrics()
    start = time.monotonic()
    seen = world.get_total_exs()
    while not world.epoch_done():
        if stop is not None and stop.requested is not None:
            stop.at_safe_point()
            share = " (this replica's share)" if backend is not None and backend.world_size > 1 else ""
            raise KeyboardInterrupt(f"{stop.name}: the {split} evaluation stopped after {world.get_total_exs() - seen}"
                                    f" of {world.num_examples()} examples{share}; no report")
        world.parley()
    report = reduce_report(world.report(), backend)
    report["time_s"] = round(time.monotonic() - start, 3)
    if log is not None:
        log.write({"split": split, **report})
    return report


def reduce_report(report: dict[str, float], backend: Any) -> dict[str, float]:
    """Merge one replica's report with the others' (averages weighted by examples); identity alone."""
    if backend is None or backend.world_size == 1:
        return report
    exs = float(report.get("exs", 0))
    sums = {"exs": exs}
    for key, value in report.items():
        if key != "exs" and isinstance(value, (int, float)):
            sums[key] = value * exs
            sums[f"{key}/present"] = exs
    keys = sorted(sums)
    total = backend.reduce_metrics({k: sums[k] for k in keys})
    merged: dict[str, float] = {"exs": int(total["exs"])}
    for key in keys:
        if key != "exs" and not key.endswith("/present") and total[f"{key}/present"]:
            merged[key] = float(total[key]) / float(total[f"{key}/present"])
    return merged


def run(world: World, opts: Opts) -> dict[str, Any]:
    """Train (datatype train) or evaluate (valid/test) ``world`` on ``opts.device``; return the report.

    A world from :func:`accelbatch.create_world` already has its model compiled for the device; one built by
    hand is compiled here. The backend is torn down at the end."""
    check_output_paths(opts)
    if world.opts.batchsize < opts.batchsize:  # create_world fitted the batch to the data (and said so)
        opts = opts.replace(batchsize=world.opts.batchsize)
    runtime = attach_runtime(world, opts)
    backend = runtime.backend
    main = backend.is_main_process()
    tb_dir = opts.tensorboard_logdir
    log = MetricsLog(opts.metrics_log if main else None,
                     tensorboard=TensorBoardLog(tb_dir) if main and tb_dir else None)
    try:
        if is_training(opts.datatype):
            then = "saving a checkpoint after this step, then stopping" if opts.model_file else \
                "stopping after this step; nothing is saved (no --model-file)"
            with StopSignals(announce=main, then=then) as stop:
                report = _train(world, opts, log, runtime, stop)
        else:
            split = split_of(opts.datatype)
            with StopSignals(announce=main, then="stopping the evaluation after this step") as stop:
                report = {split: evaluate(world, log, split, backend, stop)}
        report["device"] = backend.name
        if backend.name == "ipu":
            report["ipu"] = {"poptorch": backend.implementation, "compilations": backend.compilations}
        if backend.world_size > 1:
            report["replicas"] = backend.world_size
        report = _finish(report, opts if main else opts.replace(report_json=None))
    finally:
        log.close()
        world.shutdown()
        backend.teardown()
    return report


def _train(world: World, opts: Opts, log: MetricsLog, runtime: Runtime, stop: StopSignals) -> dict[str, Any]:
    backend = runtime.backend
    state = TrainState()
    model = world.get_model_agent()
    main = backend.is_main_process()
    replicas = backend.world_size  # each replica's world holds its share; epochs count all of them
    per_epoch = world.num_examples()
    target_exs = opts.num_epochs * per_epoch if opts.num_epochs > 0 else math.inf
    next_validation = opts.validation_every_n_epochs * per_epoch if opts.validation_every_n_epochs > 0 else math.inf
    checkpoints = Checkpointer(opts, backend, runtime.plan) if opts.model_file and isinstance(model, TorchAgent) \
        else None
    resumed = checkpoints.resume(world, model.engine) if checkpoints is not None and opts.resume else None
    if resumed is not None:
        state.load_json(resumed["train"])
        next_validation = resumed.get("next_validation", next_validation)
    saver = PeriodicSaver(opts.save_every_n_secs)
    bar = _progress(opts, target_exs) if main else None
    if bar is not None and state.exs:
        bar.update(state.exs)
    last_log, window_exs, window_start = time.monotonic(), 0, time.monotonic()
    window_data = getattr(world, "data_time_s", 0.0)
    train_report: dict[str, float] = {}
    valid_world: World | None = None
    stop_reason = "num_epochs"
    # a checkpoint taken after the last step (the save at the end of training) leaves nothing to train
    finished = resumed is not None and (state.exs >= target_exs or (
        opts.max_train_steps > 0 and state.steps >= opts.max_train_steps))
    if finished and opts.max_train_steps > 0 and state.steps >= opts.max_train_steps:
        stop_reason = "max_train_steps"

    def save() -> None:
        checkpoints.save(world, model.engine, {"train": state.to_json(), "next_validation": next_validation})

    while not finished:
        world.parley()
        state.steps += 1
        total = world.get_total_exs() * replicas
        new_exs, state.exs = total - state.exs, total
        window_exs += new_exs
        if bar is not None:
            bar.update(new_exs)
        now = time.monotonic()
        if now - last_log >= opts.log_every_n_secs:
            train_report = world.report()
            world.reset_metrics()
            speed = window_exs / max(now - window_start, 1e-9)
            data_time = getattr(world, "data_time_s", 0.0)
            wait_share = (data_time - window_data) / max(now - window_start, 1e-9)
            log.write({"split": "train", "step": state.steps, "epoch": round(state.exs / per_epoch, 4),
                       "exs_per_s": round(speed, 1), "data_wait_share": round(wait_share, 4), **train_report})
            if bar is not None:
                bar.set_postfix(_postfix(train_report, speed, wait_share))
            last_log, window_exs, window_start, window_data = now, 0, now, data_time
        if opts.max_train_steps > 0 and state.steps >= opts.max_train_steps:
            stop_reason = "max_train_steps"
            break
        if state.exs >= next_validation:
            next_validation += opts.validation_every_n_epochs * per_epoch
            valid_world = valid_world or create_world(_eval_opts(opts, "valid"), agent=model, runtime=runtime)
            if _validate(valid_world, opts, log, state, model, backend):
                stop_reason = "validation"
                break
        if state.exs >= target_exs:
            break
        # between world steps: every call's D updates (and their G-micro-batch windows) are complete. The
        # replicas decide together: one whose stop signal came a step later than another's must still stop
        # at the same step, or it would wait alone in the next step's collectives
        stop.at_safe_point()
        stopping = stop.requested is not None
        want_save, stopping = backend.decide(saver.due() or stopping, stopping)
        if want_save and checkpoints is not None:
            save()
        if stopping:
            if bar is not None:
                bar.close()
            where = f"checkpoint saved to {opts.model_file}; continue with --resume" if checkpoints else \
                "nothing was saved (" + ("no --model-file)" if not opts.model_file else
                                         f"{type(model).__name__} is not a TorchAgent)")
            raise KeyboardInterrupt(f"{stop.name or 'a stop signal to another replica'}: {where}")
    stop.at_safe_point()  # the final save is not cut short; the evaluations below stop at their next step
    if checkpoints is not None and opts.save_every_n_secs > 0:
        save()  # a resume goes on from here
    if bar is not None:
        bar.close()
    if opts.model_file and state.validations == 0 and main:
        _save(model, opts.model_file)
    backend.barrier()
    if opts.model_file and os.path.isfile(opts.model_file) and isinstance(model, TorchAgent):
        model.load(opts.model_file)  # evaluate the best model
    final_window = reduce_report(world.report(), backend)
    state.exs = world.get_total_exs() * replicas  # after the report: steps still in flight (hogwild) are done
    if final_window.get("exs"):
        train_report = final_window
    report: dict[str, Any] = {"train": {**train_report, "exs": state.exs, "steps": state.steps,
                                        "epochs": round(state.exs / per_epoch, 4),
                                        "exs_per_s": round(state.exs / max(state.elapsed(), 1e-9), 1),
                                        "time_s": round(state.elapsed(), 3), "stopped_by": stop_reason}}
    for split in [s.strip() for s in opts.eval_splits.split(",") if s.strip()]:
        eval_world = create_world(_eval_opts(opts, split), agent=model, runtime=runtime)
        try:
            report[split] = evaluate(eval_world, log, split, backend, stop)
        finally:
            eval_world.shutdown()
    if valid_world is not None:
        valid_world.shutdown()
    return report


def _eval_opts(opts: Opts, split: str) -> Opts:
    """Options of an evaluation inside training: in this process even when training is hogwild (the
    model is shared, so this sees the latest weights without starting processes)."""
    return opts.replace(datatype=split, numthreads=1)


def _validate(world: World, opts: Opts, log: MetricsLog, state: TrainState, model: Agent,
              backend: Any) -> bool:
    """Evaluate on valid; save the best model (rank 0); True when training should stop."""
    report = evaluate(world, log, "valid", backend)
    state.validations += 1
    metric = report.get(opts.validation_metric)
    if metric is None:
        return False
    value = -metric if opts.validation_metric == "loss" else metric
    if value > state.best:
        state.best, state.stale = value, 0
        if opts.model_file and backend.is_main_process():
            _save(model, opts.model_file)
    else:
        state.stale += 1
    if opts.validation_patience > 0 and state.stale >= opts.validation_patience:
        return True
    return opts.validation_cutoff > 0 and metric >= opts.validation_cutoff


def _save(model: Agent, path: str) -> None:
    if isinstance(model, TorchAgent):
        model.save(path)


def _progress(opts: Opts, total: float) -> Any:
    if not opts.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=None if math.isinf(total) else int(total), unit="ex", dynamic_ncols=True,
                file=sys.stderr, desc="train")


def _postfix(report: dict[str, float], speed: float, wait_share: float) -> dict[str, str]:
    """Progress-bar fields; 'data' is the share of time the model waited for its inputs."""
    out = {"ex/s": f"{speed:,.0f}", "data": f"{wait_share:.0%}"}
    for key in ("loss", "accuracy"):
        if key in report:
            out[key] = f"{report[key]:.4f}"
    return out


def _finish(report: dict[str, Any], opts: Opts) -> dict[str, Any]:
    if opts.report_json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.report_json)), exist_ok=True)
        with open(opts.report_json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2, sort_keys=True)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain table: one row per split, ParlAI's metric names as columns."""
    splits = [(name, rep) for name, rep in report.items() if isinstance(rep, dict) and "exs" in rep]
    columns = ["exs", "accuracy", "f1", "loss", "exs_per_s", "time_s"]
    columns = [c for c in columns if any(c in rep for _, rep in splits)]
    header = f"{'split':<8}" + "".join(f"{c:>12}" for c in columns)
    lines = [header, "-" * len(header)]
    for name, rep in splits:
        cells = []
        for c in columns:
            value = rep.get(c, "")
            cells.append(f"{value:>12.4f}" if isinstance(value, float) and c not in ("exs_per_s", "time_s")
                         else f"{value:>12}")
        lines.append(f"{name:<8}" + "".join(cells))
    extras = [f"{k}: " + (", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v))
              for k, v in report.items() if not (isinstance(v, dict) and "exs" in v)]
    return "\n".join(lines + extras)
