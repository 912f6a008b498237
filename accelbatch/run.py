"""run(world, opts): train and/or evaluate a world on the chosen backend and return a report.

Training runs world steps until the epoch or step limit, validating every N epochs (keeping the best
model in --model-file), then evaluates the final splits. Evaluation runs a world until its epoch is
done. The report is a dict with one entry per split (ParlAI's metric names exs, accuracy, f1, loss),
printed as a table and written to --report-json.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

from accelbatch.agent_files import loads_itself, saves_itself
from accelbatch.agents import Agent, TorchAgent
from accelbatch.best_valid import BestValid, continued_best, judge, metric_mode, validation_ends, write_best
from accelbatch.build import Runtime, as_opts, attach_runtime, create_world
from accelbatch.checkpoint import checkpoint_dir, has_saved_position
from accelbatch.eval_splits import eval_opts, eval_teachers
from accelbatch.metric_names import metric_names_problem, select_metrics, unvalidated_metric_note
from accelbatch.metrics import combine_reports
from accelbatch.model_opts import agent_name, with_agent_shape, write_model_opts
from accelbatch.optimizers import learning_rates, set_learning_rates
from accelbatch.opts import OptionError, Opts
from accelbatch.progress_bar import postfix, progress_bar
from accelbatch.report_json import write_report_json
from accelbatch.report_merge import reduce_report, renamed_tasks
from accelbatch.report_table import MetricsLog
from accelbatch.run_control import (
    ModelFileLock,
    PeriodicSaver,
    SpentData,
    StopSignals,
    check_output_paths,
    lock_model_file,
    refuse_no_examples,
    steps_together,
)
from accelbatch.start_method import keeps_default_start_method
from accelbatch.state import Checkpointer, restore_rng
from accelbatch.teachers import eval_datatype, is_training, portable_task, split_of, task_names
from accelbatch.tensorboard_log import TensorBoardLog
from accelbatch.train_state import TrainState
from accelbatch.worlds import World


def evaluate(world: World, log: MetricsLog | None = None, split: str = "valid",
             backend: Any = None, max_exs: int = -1, at: dict[str, Any] | None = None,
             stop: StopSignals | None = None) -> dict[str, float]:
    """Run ``world`` until its epoch is done, or until it served ``max_exs`` examples (all replicas together;
    -1: no limit); return its report (merged across replicas) and log it, with ``at`` (the training
    position: step, epoch; final) in the logged record.

    A stop signal (``stop``) ends it at the next step with KeyboardInterrupt saying how many examples it saw."""
    if log is not None and not callable(getattr(log, "write", None)):
        raise TypeError(f"evaluate(world, log=...): log is a MetricsLog or None, not {type(log).__name__}; the "
                        "world evaluates with the opts it was built with: evaluate(world)")
    datatype = (getattr(world, "opts", None) or {}).get("datatype", "valid")
    if is_training(datatype):  # its epoch never ends: the train datatype repeats its data (and trains on it)
        raise OptionError(f"evaluate(world): the world serves -dt {datatype}, which repeats its data and trains; "
                          f"build it with datatype={eval_datatype(datatype)!r} to score the training data once")
    world.reset()
    world.reset_metrics()
    start = time.monotonic()
    replicas = 1 if backend is None else backend.world_size  # each serves an equal share of every step
    served, spent = world.get_total_exs(), SpentData(split)  # a count over the world's life
    refuse_no_examples(world, split)

    def scored() -> int:  # ParlAI's -vme counts the report's exs (turns with labels); each replica its share
        return int(world.report().get("exs", world.get_total_exs() - served)) * replicas

    cut = False  # by a stop signal; replicas decide together after their loops (one collective each)
    with steps_together(world.get_model_agent(), False):  # each replica evaluates its own rows
        while not world.epoch_done() and (max_exs < 0 or scored() < max_exs):
            if stop is not None and stop.requested is not None:
                cut = True
                break
            world.parley()
            spent.parleyed(world, world.get_total_exs())
    if backend.decide(cut)[0] if replicas > 1 else cut:
        if stop is not None:
            stop.agree()  # a replica stopped by another's signal saves and ends as that one does
            stop.at_safe_point()
        done, total = world.get_total_exs() - served, world.num_examples()
        raise KeyboardInterrupt(f"{getattr(stop, 'name', None) or 'a stop on another replica'}: the {split} evaluation "
                                "stopped after " + (f"{done} of {total} examples" if replicas == 1 else
                                                    f"{done} examples (this replica's; {total} in the split)")
                                + "; no report")
    report = reduce_report(world.report(), backend)
    report["time_s"] = round(time.monotonic() - start, 3)
    if log is not None:
        log.write({"split": split, **(at or {}), **report})
    return report


@keeps_default_start_method
def run(world: World, opts: Opts) -> dict[str, Any]:
    """Train (datatype train) or evaluate (valid/test) ``world`` on ``opts.device``; return the report.

    A world from :func:`accelbatch.create_world` already has its model compiled for the device; one built by
    hand is compiled here. The backend is torn down at the end. ``opts`` may be a dict of Opts' fields.

    ``opts`` must be those the world was built with in what shapes it (task, datatype, model, device, seed,
    -bs, the plan, the feed, -lr, -opt: another value is refused, naming it; a -bs create_world lowered to the
    data is taken). A world trains once: a second training run of it is refused; to train its model further,
    build a new world on it, ``create_world(opts, agent=world.get_model_agent())``."""
    given = as_opts(opts, "run(world, opts)")
    opts = with_agent_shape(given, world)  # the agent's own options too: given ones must be the built agent's
    other = next((k for k, v in given.agent_args.items() if opts.agent_args.get(k) != v), None)
    problem = _world_problem(world, opts) if other is None else (
        f"run(world, opts): the agent's option {other}={given.agent_args[other]!r}, but the world's agent was built "
        f"with {opts.agent_args.get(other)!r}; build the world with these opts (create_world(opts))")
    if problem is None and not is_training(opts.datatype) and opts.gradient_accumulation > 1:
        problem = (f"-ga/--gradient-accumulation {opts.gradient_accumulation}: gradient accumulation is a training "
                   f"option and -dt {opts.datatype} trains nothing; evaluate with -ga 1")
    problem = problem or metric_names_problem(world, opts)
    if problem is not None:  # the world stays as it was (its processes too): run it with its own opts
        raise OptionError(problem)
    check_output_paths(opts)
    if world.opts.batchsize < opts.batchsize:  # create_world fitted the batch to the data (and said so)
        opts = opts.replace(batchsize=world.opts.batchsize)
    restore_rng(getattr(world, "torch_rng", None))  # the stream it was built with, whatever was built since
    runtime = attach_runtime(world, opts)
    backend = runtime.backend
    backend.begin_run()
    main = backend.is_main_process()
    board = TensorBoardLog(opts.tensorboard_logdir) if main and opts.tensorboard_logdir else None
    log = MetricsLog(opts.metrics_log if main else None, tensorboard=board)
    lock: ModelFileLock | None = None
    worlds_made = ExitStack()  # the worlds a training run builds (validation): shut down however it ends
    try:
        if is_training(opts.datatype):
            lock = lock_model_file(opts.model_file, main, backend.decide) if opts.model_file else None
            then = "saving a checkpoint after this step, then stopping" if opts.model_file else \
                "stopping after this step; nothing is saved (no --model-file)"
            with StopSignals(announce=main, then=then) as stop:
                report = _train(world, opts, log, runtime, stop, worlds_made)
        else:
            split = split_of(opts.datatype)
            with StopSignals(announce=main, then="stopping the evaluation after this step") as stop:
                report = {split: evaluate(world, log, split, backend, stop=stop)}
        report["device"] = backend.name
        report.update(backend.report_extras())
        if backend.world_size > 1:
            report["replicas"] = backend.world_size
        report = select_metrics(report, opts.metrics)
        if main and opts.report_json:
            write_report_json(report, opts.report_json)
    finally:
        worlds_made.close()
        log.close()
        world.shutdown()
        backend.teardown()
        if lock is not None:
            lock.release()
    return report


UNCOUNTED_PARLEYS = 1000  # a world of yours that counted no example in as many training parleys is told so

# what a world is built with and run() cannot change: its data, model, feed, seed and every option of its plan
# (-bs may be lowered to the data when the world is built, an agent may shape its model itself: -esz; -lr and
# -opt are the optimizer's, checked apart)
WORLD_SHAPING = ("task", "datatype", "model", "numthreads", "seed", "context_length", "include_labels", "batchsize",
                 "dynamic_batching", "num_workers", "dataloader_mode",
                 *(f.name for f in dataclasses.fields(Opts) if f.metadata["group"] == "plan"))


def _world_problem(world: World, opts: Opts) -> str | None:
    """Why ``run(world, opts)`` cannot run: ``opts`` differ from the world's in what built it
    (:data:`WORLD_SHAPING`; another datatype than the world serves would never end an evaluation), train
    with another -lr or -opt than the world's optimizer has, or train a world that has trained already."""
    built = getattr(world, "opts", None) or {}  # Opts, or a world built by hand with a dict
    for name in WORLD_SHAPING:
        own, flag = built.get(name, getattr(opts, name)), "/".join(Opts.__dataclass_fields__[name].metadata["flags"])
        fitted = name == "batchsize" and own < opts.batchsize and getattr(world, "batch_fitted", False)
        if own != getattr(opts, name) and not fitted:
            return (f"run(world, opts): {flag} {getattr(opts, name)!r}, but the world was built with {own!r}; "
                    f"build the world with these opts (create_world(opts)), or run it with its own, "
                    f"opts.replace({name}={own!r})")
    for name, flag in (("learning_rate", "-lr/--learning-rate"), ("optimizer", "-opt/--optimizer")):
        own = built.get(name, getattr(opts, name))
        if is_training(opts.datatype) and own != getattr(opts, name):
            return (f"run(world, opts): {flag} {getattr(opts, name)!r}, but the world's optimizer was built with "
                    f"{own!r}; build the world with these opts, create_world(opts) (or create_world(opts, "
                    "agent=world.get_model_agent()) to go on training its model)")
    if is_training(opts.datatype) and world.get_total_exs() > 0:
        return (f"run(world, opts): this world has trained {world.get_total_exs()} examples already (an earlier "
                "run() or parley()); a world trains once: to train its model further, build a new world on it, "
                "create_world(opts, agent=world.get_model_agent())")
    return None


def _train(world: World, opts: Opts, log: MetricsLog, runtime: Runtime, stop: StopSignals,
           worlds_made: ExitStack) -> dict[str, Any]:
    backend = runtime.backend
    state, spent = TrainState(judged_by=f"{opts.validation_metric} {metric_mode(opts)}"), SpentData()
    model = world.get_model_agent()
    worlds_made.enter_context(steps_together(model, True))  # replicas train or evaluate a call together
    main = backend.is_main_process()
    replicas = backend.world_size  # each replica's world holds its share; epochs count all of them
    refuse_no_examples(world, "train")
    per_epoch = world.num_examples()
    target_exs = opts.num_epochs * per_epoch if opts.num_epochs > 0 else math.inf
    next_validation = opts.validation_every_n_epochs * per_epoch if opts.validation_every_n_epochs > 0 else math.inf
    checkpoints = Checkpointer(opts, backend, runtime.plan, log) if opts.model_file and \
        isinstance(model, TorchAgent) else None
    if checkpoints is not None and not opts.resume and main and has_saved_position(opts.model_file):
        print(f"accelbatch: {checkpoint_dir(opts.model_file)} holds an earlier run's position; this run starts "
              "afresh and its checkpoints replace it (--resume continues that run instead)", file=sys.stderr)
    optimizer = model.engine.host_optimizer() if checkpoints is not None and opts.resume else None
    fresh = learning_rates(optimizer) if optimizer is not None else []  # this run's -lr (and the agent's own)
    resumed = checkpoints.resume(world, model.engine) if checkpoints is not None and opts.resume else None
    if optimizer is not None:
        had = set_learning_rates(model.engine.host_optimizer(), fresh)  # a new -lr applies
        if had and main:
            print(f"accelbatch: --resume: continuing with -lr {', '.join(f'{v:g}' for v in sorted(set(fresh)))} "
                  f"(the checkpoint's optimizer had {had})", file=sys.stderr)
    # the train row: every example trained, before a resume (the checkpoint's, task rows by portable name) and since
    portable = {task: portable_task(task, opts.datapath) for task in task_names(opts)}
    before_resume: dict[str, float] = {}
    judged_afresh: str | None = None
    if resumed is None and opts.model_file and os.path.isfile(opts.model_file) and saves_itself(model):
        state.best = continued_best(opts, main)
    if resumed is not None:
        judged_afresh = state.load_json(resumed["train"])
        next_validation = resumed.get("next_validation", next_validation)
        before_resume = renamed_tasks(resumed.get("train_metrics", {}), {v: k for k, v in portable.items()})
    saver = PeriodicSaver(opts.save_every_n_secs)
    bar = log.progress = progress_bar(opts, target_exs) if main else None
    if bar is not None and state.exs:
        bar.update(state.exs)
    logged: dict[str, float] = {}  # the world's metrics (cumulative: never reset in training) at the last log

    def valid_world_made() -> World:
        made = create_world(eval_opts(opts, "valid"), agent=model, runtime=runtime)
        worlds_made.callback(made.shutdown)
        return made

    valid_world: World | None = None
    reading = time.monotonic()
    if next_validation < math.inf or opts.validation_every_n_secs > 0:  # bad valid data fails now, not an epoch on
        valid_world = valid_world_made()
    teachers = eval_teachers(opts, {"valid"} if valid_world is not None else set())  # their data fails now too
    state.started += time.monotonic() - reading  # reading the evaluation data is not training time (-ttim)
    last_log, window_exs, window_start, log_next = time.monotonic(), 0, time.monotonic(), False
    every_step = opts.log_every_n_secs == 0  # -ltim 0: every replica knows a window is due, with no decision
    window_data = getattr(world, "data_time_s", 0.0)
    last_validation = time.monotonic()
    stop_reason = "num_epochs"

    def passed() -> float:
        """The examples of the training data passed over (all replicas): the passes of a batch plan (each
        pass's dropped examples passed over with it), else the examples trained."""
        passes = world.passes()
        return state.exs if passes is None else passes * per_epoch
    # a checkpoint taken after the last step (the save at the end of training) leaves nothing to train, unless
    # the resume moves a limit (-ne, -tstep, -ttim) past where that training ended
    ended = {"num_epochs": passed() >= target_exs,
             "validation": state.ended_by == "validation" and validation_ends(opts, state) is not None,
             "max_train_steps": 0 < opts.max_train_steps <= state.steps,
             "max_train_time": state.ended_by == "max_train_time" and 0 < opts.max_train_time <= state.elapsed()}
    finished = resumed is not None and any(ended.values())
    if finished:
        stop_reason = next(reason for reason, now in ended.items() if now)
    if resumed is not None and main and (finished or judged_afresh):
        why = validation_ends(opts, state) if stop_reason == "validation" else "-ne, -tstep and -ttim move its end"
        print(f"accelbatch: --resume: the training ended ({stop_reason}; {why}): only evaluating" if finished
              else f"accelbatch: {judged_afresh}", file=sys.stderr)

    def position() -> dict[str, Any]:
        return {"step": state.steps, "epoch": round(passed() / per_epoch, 4)}

    def log_window(now: float) -> None:
        """One train record: the metrics of the examples since the last one."""
        nonlocal logged, last_log, window_exs, window_start, window_data
        cumulative = reduce_report(world.report(), backend)  # every replica's rows (a collective: all call it)
        window, logged = combine_reports(cumulative, logged, sign=-1), cumulative
        speed = window_exs / max(now - window_start, 1e-9)
        data_time = getattr(world, "data_time_s", 0.0)
        wait_share = (data_time - window_data) / max(now - window_start, 1e-9)
        log.write({"split": "train", **position(), "exs_per_s": round(speed, 1),
                   "data_wait_share": round(wait_share, 4), **window})
        if bar is not None:
            bar.set_postfix(postfix(window, speed, wait_share))
        last_log, window_exs, window_start, window_data = now, 0, now, data_time

    def log_due(now: float) -> bool:
        return opts.log_every_n_secs != -1 and now - last_log >= opts.log_every_n_secs

    def trained() -> dict[str, float]:
        return combine_reports(before_resume, reduce_report(world.report(), backend))

    def validate() -> bool:
        """Evaluate on valid now (the world built once); True when training should stop."""
        nonlocal valid_world, last_validation, window_start
        world.finish_parleys()  # the model validated (and saved when best) is the one its number describes
        began = time.monotonic()
        valid_world = valid_world or valid_world_made()
        stops = _validate(valid_world, opts, log, state, model, backend, position(), stop)
        last_validation = time.monotonic()  # -vtim is training time since a validation ended (ParlAI's)
        window_start += last_validation - began  # a train record's exs_per_s: training time only
        state.validating_s += last_validation - began  # and the report's
        return stops

    def save(validation_cut: bool = False) -> None:
        if backend.decide(window_exs > 0)[0]:  # the log then holds what the checkpoint holds (a resume cuts it
            log_window(time.monotonic())        # back there: a record after it is of steps trained again)
        checkpoints.save(world, model.engine, {"train": state.to_json(), "next_validation": next_validation,
                                               "train_metrics": renamed_tasks(trained(), portable),
                                               "validation_cut": validation_cut})

    def stop_run(cut_short: str = "") -> None:
        """A stop signal: save the checkpoint (a resume goes on from this step), say where, end the run."""
        if checkpoints is not None:
            save(validation_cut=bool(cut_short))
        if backend.decide(window_exs > 0)[0]:
            log_window(time.monotonic())  # the log holds every example trained, as after a resume it will
        where = _saved_where(opts.model_file) if checkpoints else \
            "nothing was saved (" + ("no --model-file)" if not opts.model_file else
                                     f"{type(model).__name__} is not a TorchAgent)")
        raise KeyboardInterrupt(f"{stop.name or 'a stop signal to another replica'}: {cut_short}{where}")

    def validation_stops(due: float | None = None) -> bool:
        """Validate; True when training should stop. A stop signal during it ends the run (stop_run), the
        checkpoint set to validate again at ``due`` (the -veps point this validation was for)."""
        nonlocal next_validation
        try:
            return validate()
        except KeyboardInterrupt:
            if stop.requested is None:
                raise
            if due is not None:
                next_validation = due
            stop_run("the validation was cut short (a resume runs it again); ")
            raise  # not reached: stop_run raises

    if resumed is not None and (resumed.get("validation_cut") or passed() >= next_validation and not finished):
        # a stop cut this validation (-veps or -vtim) short when the checkpoint was taken: run it before the
        # next step (or, at the end of training, before the final evaluation), as the run never stopped did
        due = next_validation if passed() >= next_validation else None
        if due is not None:
            next_validation += opts.validation_every_n_epochs * per_epoch
        if validation_stops(due):
            stop_reason, finished = "validation", True
    while not finished:
        world.parley()
        state.steps += 1
        total = world.get_total_exs() * replicas
        if total == 0 and state.steps == UNCOUNTED_PARLEYS and not type(world).__module__.startswith("accelbatch."):
            print(f"accelbatch: {type(world).__name__}.parley(): {state.steps} parleys counted no example "
                  "(get_total_exs() stays 0), and only counted examples reach -ne/--num-epochs: call "
                  "self.update_counters() at the end of parley(), as ParlAI's worlds do", file=sys.stderr)
        new_exs, state.exs = total - state.exs, total
        spent.parleyed(world, total)
        window_exs += new_exs
        if bar is not None:
            bar.update(new_exs)
        now = time.monotonic()
        if log_next or (replicas == 1 or every_step) and log_due(now):
            log_window(now)
            log_next = False
        if passed() >= next_validation:  # due at the last step too: -ne and -tstep end alike
            due, next_validation = next_validation, next_validation + opts.validation_every_n_epochs * per_epoch
            if validation_stops(due):
                stop_reason = "validation"
                break
        if opts.max_train_steps > 0 and state.steps >= opts.max_train_steps:
            stop_reason = "max_train_steps"
            break
        if passed() >= target_exs:
            break
        # between world steps: every call's D updates (and their G-micro-batch windows) are complete. The
        # replicas decide together: one whose stop signal came a step later than another's must still stop
        # at the same step, or it would wait alone in the next step's collectives (a -vtim clock too)
        stop.at_safe_point()
        stopping = stop.requested is not None
        timed = 0 < opts.validation_every_n_secs <= time.monotonic() - last_validation
        out_of_time = 0 < opts.max_train_time <= state.elapsed()
        # replicas log a window together (it merges their rows), at the step after the one that found it due
        log_together = replicas > 1 and not every_step and log_due(time.monotonic())
        want_save, stopping, timed, out_of_time, log_next = backend.decide(
            saver.due() or stopping, stopping, timed, out_of_time, log_together)
        if out_of_time:  # before a timed validation, as ParlAI's: the time is up, and the end evaluates
            stop_reason = "max_train_time"
            break
        if timed and validation_stops():
            stop_reason = "validation"
            break
        if stopping:
            stop_run()
        if want_save and checkpoints is not None:
            save()
    world.finish_parleys()  # what is saved and evaluated below holds every update trained
    if bar is not None:  # the examples of parleys still in flight at the last step (hogwild) are counted now
        bar.update(max(0, world.get_total_exs() * replicas - state.exs))
    if backend.decide(window_exs > 0)[0]:
        log_window(time.monotonic())  # the examples since the last train record
    stop.at_safe_point()  # the final save is not cut short; the evaluations below stop at their next step
    state.ended_by = stop_reason
    if checkpoints is not None:
        save()  # training is done: a resume (after a stop in the evaluations below) only evaluates
    if bar is not None:
        bar.total = bar.n  # the bar ends full: at -ne's end (the last step's rows pass it) or at -tstep's, -ttim's
        bar.close()
    if opts.model_file and state.validations == 0 and state.best > -math.inf:
        validation_stops()  # -mf holds a validated model: this run's replaces it only when it validates better
        if state.stale and main:
            held = -state.best if metric_mode(opts) == "min" else state.best
            print(f"accelbatch: -mf {opts.model_file} kept: this run's model validated {opts.validation_metric} "
                  f"{state.last_valid:.4g}, not better than the file's {held:.4g}", file=sys.stderr)
    elif opts.model_file and state.validations == 0 and main:
        _save(model, opts, best=None)
    if opts.model_file and main and not saves_itself(model):
        print(f"accelbatch: -mf/--model-file {opts.model_file}: {type(model).__name__} is not a TorchAgent and has "
              "no save(path); nothing was written there", file=sys.stderr)
    elif opts.model_file and main and not os.path.isfile(opts.model_file):  # its best, removed since it was saved
        why = "removed after the validation that wrote it?" if state.best > -math.inf else \
            f"no validation scored -vmt {opts.validation_metric} as a number"
        print(f"accelbatch: -mf {opts.model_file} is missing ({why}): this run's last model is written there and "
              "evaluated", file=sys.stderr)
        _save(model, opts, best=None)
    backend.barrier()
    if opts.model_file and os.path.isfile(opts.model_file) and isinstance(model, TorchAgent):
        model.load(opts.model_file, optimizer=False)  # evaluate the best weights (the evaluations train nothing)
    elif opts.model_file and os.path.isfile(opts.model_file) and loads_itself(type(model)):
        model.load(opts.model_file)
    train_report = trained()
    # after the report: steps still in flight (hogwild) are done; replicas' shares of a tail may differ
    state.exs = int(backend.reduce_metrics({"exs": world.get_total_exs()})["exs"]) if replicas > 1 \
        else world.get_total_exs()
    report: dict[str, Any] = {"train": {**train_report, "exs": state.exs, "steps": state.steps,
                                        "epochs": round(passed() / per_epoch, 4),
                                        "exs_per_s": round(state.exs_per_s(), 1),
                                        "time_s": round(state.elapsed(), 3), "stopped_by": stop_reason}}
    if main and replicas > 1 and not opts.drop_last and train_report.get("dropped_exs"):
        print(f"accelbatch: --no-drop-last: {train_report['dropped_exs']:g} examples left out (dropped_exs): batches "
              f"of fewer rows than the -rf {replicas} replica processes, one of which would have no row of its own; "
              "train with -rf 1 to keep every example", file=sys.stderr)
    for split, teacher in teachers.items():
        eval_world = create_world(eval_opts(opts, split), agent=model, runtime=runtime, teacher=teacher)
        try:
            report[split] = evaluate(eval_world, log, split, backend, at={**position(), "final": True},
                                     stop=stop)
        except KeyboardInterrupt as exc:
            if stop.requested is None or checkpoints is None:
                raise
            raise KeyboardInterrupt(f"{exc}; the training is saved: --resume -mf {opts.model_file} runs the "
                                    "final evaluations") from None
        finally:
            eval_world.shutdown()
    if main and state.validations == 0 and (note := unvalidated_metric_note(opts, report.get("valid"))):
        print(note, file=sys.stderr)
    return report


def _validate(world: World, opts: Opts, log: MetricsLog, state: TrainState, model: Agent,
              backend: Any, at: dict[str, Any] | None = None, stop: StopSignals | None = None) -> bool:
    """Evaluate on valid; save the best model (rank 0); True when training should stop. A stop signal
    (``stop``) ends the evaluation at its next step (KeyboardInterrupt)."""
    report = evaluate(world, log, "valid", backend, opts.validation_max_exs, at, stop=stop)
    state.validations += 1
    metric = report.get(opts.validation_metric)
    if metric is None:
        known = ", ".join(k for k, v in report.items() if isinstance(v, (int, float)) and k != "time_s")
        capped = (f" (-vme/--validation-max-exs {opts.validation_max_exs} may have left it unscored: raise "
                  "it)") if opts.validation_max_exs > 0 else ""
        raise OptionError(f"-vmt/--validation-metric {opts.validation_metric}: the valid report has no such "
                          f"metric{capped}; " + (f"choose one of {known}" if known else "it is empty: a teacher of "
                                                 "yours reports its counts and scores in report(), as ParlAI's do"))
    improved, stops = judge(metric, opts, state)
    if improved and opts.model_file and backend.is_main_process():
        _save(model, opts, BestValid(opts.validation_metric, metric_mode(opts), float(metric)))
    if not improved and not math.isfinite(metric) and backend.is_main_process():
        print(f"accelbatch: the validation at step {(at or {}).get('step')} scored -vmt {opts.validation_metric} "
              f"{metric}: its model cannot be the best", file=sys.stderr)
    return stops


def _saved_where(model_file: str) -> str:
    """What a stopped run left: the checkpoint (PATH.ckpt) to resume, and what PATH itself holds."""
    held = "the best validated weights so far" if os.path.isfile(model_file) else \
        "not written yet: it is written at a validation or when training ends"
    return (f"checkpoint saved to {checkpoint_dir(model_file)}; continue with --resume -mf {model_file} "
            f"({model_file} itself: {held})")


def _save(model: Agent, opts: Opts, best: BestValid | None) -> None:
    """The model to -mf (the agent's save), and beside it the options that make the model (PATH.opt) and its
    validation (``best``; None: not validated, so a later run's first validation replaces it)."""
    if saves_itself(model):
        model.save(opts.model_file)  # type: ignore[attr-defined]
        write_model_opts(opts.model_file, opts, agent_name(model, opts))
        write_best(opts.model_file, best)
