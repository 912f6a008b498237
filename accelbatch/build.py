"""The build: one assembly line from options to a world whose model is compiled for its device.

In the order things exist at run time::

    backend.setup(opts) -> Topology (rank, replicas)          setup_runtime: the backend owns the topology
      -> ExecutionPlan built once                             Runtime(backend, topology, plan)
      -> the teacher (one store of every task) and its feed   build_world: this replica's or process's shard
      -> the world: BatchWorld of clones, or LoaderWorld      (the batched front end: workers, async,
      -> backend.compile(model, optimizer, plan)              dynamic batching), HogwildWorld with -nt N
      -> the engine set on the agent                          compile_agent

This is the one module of the core that imports the backends; worlds, agents, teachers and the data side
know none. Which front end serves a task never depends on a performance option: ``--num-workers`` and
``--dataloader-mode`` move the collation of the very same steps into data workers (for agents whose
``vectorize``/``batchify`` can run there), and ``--dynamic-batching`` chooses batches by length, which
the batched front end alone does.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from accelbatch.agent_files import construct, unread_model_file
from accelbatch.agents import Agent, TorchAgent
from accelbatch.checkpoint import has_saved_position
from accelbatch.cores import check_processes, usable_cores
from accelbatch.datatypes import is_training, split_of
from accelbatch.held_sigint import start_forkserver
from accelbatch.hogwild import HogwildWorld
from accelbatch.host_memory import apply_host_allocator
from accelbatch.loader_world import LoaderWorld, awaits_replies, check_replies_returned
from accelbatch.main_guard import check_main_guard, refuse_script_rerun
from accelbatch.multi_world import MultiWorld
from accelbatch.names import resolve_agent_class, say_unused_model
from accelbatch.optimizers import learning_rates, set_learning_rates
from accelbatch.opts import OptionError, Opts
from accelbatch.ordered_pass import check_ordered_pass
from accelbatch.plan import ExecutionPlan
from accelbatch.start_method import default_start_method, keeps_default_start_method
from accelbatch.state import torch_rng
from accelbatch.teachers import FixedTeacher, Teacher, create_teacher, create_teachers, task_names
from accelbatch.worlds import BatchWorld, DialogPartnerWorld, World


@dataclasses.dataclass
class Runtime:
    """What the build made for a device: the backend (set up), where this process stands, and the plan the
    model was compiled with. ``run()`` reads it from the world; worlds never do."""

    backend: Any
    topology: Any
    plan: ExecutionPlan

    @property
    def shard(self) -> tuple[int, int]:
        """This replica's share of the data: (rank, replicas)."""
        return self.topology.rank, self.topology.world_size


def setup_runtime(opts: Opts) -> Runtime:
    """Set up the --device backend (it joins the replicas' process group when there is one) and build the
    training plan the model is compiled with; before the agent is built, so that a refused option costs no model."""
    from accelbatch.backends.base import get_backend

    if opts.numthreads > 1 and opts.device != "cpu":  # hogwild processes share one model in host memory
        raise OptionError(f"--numthreads {opts.numthreads} (hogwild) runs on --device cpu only, not --device "
                          f"{opts.device}; use --numthreads 1, or --replication-factor for data parallelism")
    plan = ExecutionPlan.from_opts(opts, training=True)  # a bad plan fails before any process or device work
    backend_class = get_backend(opts.device, opts)
    if (not opts.drop_last and opts.dynamic_batching != "none" and is_training(opts.datatype)
            and not backend_class.runs_partial_tails):  # without dynamic batching no training batch is partial
        raise OptionError(f"--no-drop-last: --device {opts.device} runs graphs of static shapes, which cannot train "
                          f"a pass's partial batches of --dynamic-batching {opts.dynamic_batching}; train with "
                          "--drop-last (the default), which drops them and says so")
    apply_host_allocator(opts.host_allocator)  # before any data worker or hogwild process starts: they inherit it
    backend = backend_class()
    backend.setup(opts)  # joins the replicas' group when launched as one of them; the topology says where
    return Runtime(backend, backend.topology, plan)


def compile_agent(agent: Agent, runtime: Runtime) -> None:
    """Compile a TorchAgent's model and optimizer for the runtime's device and plan (once per agent)."""
    if isinstance(agent, TorchAgent) and agent.slot.engine is None:
        agent.attach_engine(runtime.backend.compile(agent.model, agent.optimizer, runtime.plan), runtime.backend.name)
        agent.slot.runtime = runtime


def make_agent(opts: Opts, agent: Agent | type[Agent] | None) -> Agent:
    """The model agent: built from -m, from a class, or a fork of an existing agent (same model)."""
    if agent is None:
        found = resolve_agent_class(opts.model)
        if not (isinstance(found, type) and issubclass(found, Agent)):
            raise OptionError(_not_an_agent(f"-m {opts.model}", found))
        return construct(found, opts)
    if isinstance(agent, type):
        return construct(agent, opts)
    forked = agent.fork()
    if is_training(opts.datatype) and isinstance(forked, TorchAgent):
        _continue_training(forked, opts)
    return forked


def _continue_training(agent: TorchAgent, opts: Opts) -> None:
    """A training world on an agent built already trains with this world's -lr: its shared optimizer's rates
    are scaled by the ratio (said in one line). Another -opt is refused: the engine holds the optimizer."""
    built = agent.opts
    if opts.optimizer != built.optimizer:
        raise OptionError(f"create_world(opts, agent=...): -opt/--optimizer {opts.optimizer}, but the agent's "
                          f"optimizer is {built.optimizer}, compiled into its engine; save the model (-mf PATH) and "
                          f"continue from the file with -opt {opts.optimizer} (a fresh optimizer), or keep "
                          f"-opt {built.optimizer}")
    running = built.learning_rate if agent.slot.learning_rate is None else agent.slot.learning_rate
    agent.opts = built.replace(learning_rate=opts.learning_rate)
    if opts.learning_rate == running:
        return
    optimizer = agent.engine.host_optimizer() if agent.slot.engine is not None else agent.optimizer
    scale = opts.learning_rate / running
    had = set_learning_rates(optimizer, [lr * scale for lr in learning_rates(optimizer)])
    agent.slot.learning_rate = opts.learning_rate  # every clone shares the optimizer: the next world scales from here
    if had:
        print(f"accelbatch: continuing with -lr {opts.learning_rate:g} (the agent's optimizer had {had})",
              file=sys.stderr)


def _not_an_agent(where: str, found: Any) -> str:
    name = getattr(found, "__name__", type(found).__name__)
    return (f"{where}: {name} is not an accelbatch Agent; derive it from accelbatch.Agent (class {name}(ab.Agent)), "
            "which gives what worlds call besides observe and act (self_observe, share, clone, reset, report, "
            "reset_metrics, shutdown); your own methods override its")


def collates_anywhere(agent: Agent | type[Agent]) -> bool:
    """Whether data workers can build this agent's (or agent class's) batches: a TorchAgent whose observations
    are what the base ``observe`` makes (its ``vectorize`` and ``batchify`` then give the same tensors anywhere)."""
    cls = agent if isinstance(agent, type) else type(agent)
    return issubclass(cls, TorchAgent) and cls.observe is TorchAgent.observe


def served_as_stored(teacher: Teacher | None) -> bool:
    """Whether the loader may read a teacher's examples from its store: a FixedTeacher whose ``act`` and
    ``observe`` are the base ones (a teacher that overrides them changes what the agent sees or scores)."""
    return isinstance(teacher, FixedTeacher) and all(
        getattr(type(teacher), name) is getattr(FixedTeacher, name) for name in ("act", "observe"))


def uses_loader(opts: Opts, agent: Agent, teacher: Teacher | None = None) -> bool:
    """The batched front end (LoaderWorld) rather than teacher and agent clones (BatchWorld): asked for by
    an option, for an agent and a teacher whose messages the loader reproduces (the base observe/act)."""
    if opts.dynamic_batching != "none":
        return True
    return (opts.num_workers > 0 or opts.dataloader_mode != "sync") and collates_anywhere(agent) \
        and (teacher is None or served_as_stored(teacher))


def check_dynamic_batching(opts: Opts, teacher: Teacher | None, agent: Agent) -> None:
    """--dynamic-batching plans batches from the teacher's stored episodes, collated by the agent's
    vectorize()/batchify() (as ParlAI's, for TorchAgents): an agent without them, or one whose observe() keeps
    state, and a teacher whose act()/observe() change its messages cannot be batched that way."""
    if not collates_anywhere(agent):
        why = "overrides observe()" if isinstance(agent, TorchAgent) else "is not a TorchAgent"
        raise OptionError(f"--dynamic-batching {opts.dynamic_batching}: agent {type(agent).__name__} {why}; dynamic "
                          "batches mix rows of different episodes, collated by a TorchAgent's vectorize() and "
                          "batchify() without observe(): run it without --dynamic-batching")
    if not served_as_stored(teacher):
        what = "a task whose teacher is not a FixedTeacher" if not isinstance(teacher, FixedTeacher) else \
            f"teacher {type(teacher).__name__}, which overrides act() or observe()"
        raise OptionError(f"--dynamic-batching {opts.dynamic_batching}: -t {opts.task} has {what}; dynamic "
                          "batches are planned from stored episodes: run it without --dynamic-batching")


def stages_batches(agent: Agent) -> bool:
    """Whether the agent's engine copies batches to a device ahead of their step (``Engine.stage``: the
    CUDA engine's side-stream prefetch), which the loader front end does one batch ahead."""
    slot = getattr(agent, "slot", None)
    engine = getattr(slot, "engine", None)
    return collates_anywhere(agent) and engine is not None and bool(engine.stages)


def data_processes_compete(opts: Opts) -> str | None:
    """The line that says so when a cpu run's data processes (--num-workers, the async accessor's) can only
    take cores from the model: torch's threads in this process already cover every usable core. Its
    parallel regions then wait for a preempted thread, which costs more than building batches here saves."""
    background = opts.dataloader_mode != "sync"  # the async accessor's process
    if opts.device != "cpu" or not (opts.num_workers or background):
        return None
    import torch

    cores, threads = usable_cores(), torch.get_num_threads()
    if cores > threads:
        return None
    asked = [(f"--num-workers {opts.num_workers}", "--num-workers 0")] if opts.num_workers else []
    if background:
        asked.append((f"--dataloader-mode {opts.dataloader_mode}", "--dataloader-mode sync"))
    return (f"accelbatch: {' '.join(a for a, _ in asked)}: torch runs {threads} threads on the {cores} cores "
            "this process may use, so the data processes can only take cores from the model, which may slow "
            f"training; {' '.join(b for _, b in asked)} builds the same batches in the main process (same "
            "results)" + (f", or OMP_NUM_THREADS={cores - 1} leaves them a core" if cores > 1 else ""))


def build_world(opts: Opts, model: Agent, shard: tuple[int, int] = (0, 1), rows: int | None = None,
                replicas: int = 1, teacher: Teacher | None = None) -> World:
    """The world of this process: ``shard`` (index, count) of the episodes, ``rows`` per step (default: the
    plan's combined batch over ``replicas``, the replica processes sharing a step); ``teacher``: one made for
    ``opts`` already (else it is made here)."""
    plan = ExecutionPlan.from_opts(opts, training=is_training(opts.datatype))
    rows = plan.combined_batch // replicas if rows is None else rows
    # replicas read their rows of the one schedule a single process lays out for the combined batch (same
    # plan, same numbers); hogwild processes (replicas == 1) and dynamic batches take shares of the episodes
    serve = replica_rows(plan, shard[0], replicas) if replicas > 1 and rows * replicas == plan.combined_batch \
        else None
    teacher = teacher or create_teacher(opts)
    check_required_fields(opts, model, teacher)
    check_collate(opts, model)
    if serve is None:  # this process's rows over its share of the episodes (a hogwild process's)
        _check_ordered_tail(opts, plan, model, teacher, shard, rows)
    else:  # the combined batch's rows over all of them, each replica process holding its own
        _check_ordered_tail(opts, plan, model, teacher, (0, 1), plan.combined_batch,
                            [replica_rows(plan, r, replicas) for r in range(replicas)])
    # an engine that stages batches (CUDA) gets the loader front end even without workers: it builds the
    # same schedule's steps and fetches one ahead, whose copy then overlaps the current step (not for stored
    # episodes whose histories hold the model's replies, which the loader cannot squash ahead)
    staged = served_as_stored(teacher) and stages_batches(model) and not awaits_replies(opts, teacher)
    if uses_loader(opts, model, teacher) or staged:
        if opts.dynamic_batching != "none":
            check_dynamic_batching(opts, teacher, model)
        if serve is None or opts.dynamic_batching != "none":
            teacher.keep_shard(*shard)
            return LoaderWorld(opts, model, teacher, rows, shard, max(1, plan.factor // replicas))
        return LoaderWorld(opts, model, teacher, plan.combined_batch, row_multiple=max(1, plan.factor // replicas),
                           serve=serve)
    check_replies_returned(opts, plan, model, teacher)  # (the loader front end refuses such data itself)
    if teacher is None:  # several tasks, not all FixedTeachers: one world per task
        teachers = create_teachers(opts)
        for t in teachers:
            if isinstance(t, FixedTeacher):
                _share_data(t, shard, serve, plan.combined_batch)
        world: World = MultiWorld(opts, [DialogPartnerWorld(opts, [t, model]) for t in teachers], task_names(opts))
    else:
        if isinstance(teacher, FixedTeacher):
            _share_data(teacher, shard, serve, plan.combined_batch)
        world = DialogPartnerWorld(opts, [teacher, model])
    return BatchWorld(opts, world, rows) if rows > 1 else world


def _check_ordered_tail(opts: Opts, plan: ExecutionPlan, model: Agent, teacher: Any, shard: tuple[int, int],
                        rows: int, replica_rows_: list[list[int]] | None = None) -> None:
    """An ordered training pass's partial last steps, checked before any step (accelbatch/ordered_pass.py)."""
    if isinstance(teacher, FixedTeacher) and teacher.training and not teacher.cycles \
            and opts.dynamic_batching == "none":
        runtime = getattr(getattr(model, "slot", None), "runtime", None)
        check_ordered_pass(opts, plan, teacher.store.table.shard(*shard), rows,
                           runtime is None or runtime.backend.runs_partial_tails, replica_rows_)


def check_required_fields(opts: Opts, model: Agent, teacher: Any, scan: int = 1000) -> None:
    """Refuse data the agent cannot learn from: an agent naming ``required_fields`` (e.g. rankers need
    ``label_candidates``) whose task has none of them in its first ``scan`` episodes (per task) would train
    on a zero loss and reply nothing."""
    from accelbatch.tasks.torch_data import check_pairing  # items are read by -m torch:... alone, and only it

    check_pairing(opts, model, task_names(opts))
    fields = getattr(model, "required_fields", ())
    store = getattr(teacher, "store", None) if isinstance(teacher, FixedTeacher) else None
    if not fields or store is None:
        return
    for sub, name in zip(getattr(store, "stores", [store]), task_names(opts)):
        episodes = min(scan, sub.table.num_episodes)
        turns = [turn for e in range(episodes) for turn in sub.episode(e)]
        for field in fields:
            if not any(turn.get(field) for turn in turns):
                raise OptionError(
                    f"-m {opts.model}: no example of -t {name} ({opts.datatype}) has '{field}' (read the first "
                    f"{episodes} episodes); {type(model).__name__} needs it and learns nothing without it: add "
                    f"'{field}' to the examples or choose a model that does not need it")


def check_collate(opts: Opts, model: Agent) -> None:
    """--collate batches a torch Dataset's items for -m torch:...'s model; any other model builds its own
    batches, so the option is refused rather than ignored."""
    if not opts.collate:
        return
    from accelbatch.tasks.torch_data import TorchModelAgent  # torch's Dataset path: imported only when asked

    if not isinstance(model, TorchModelAgent):
        raise OptionError(f"--collate {opts.collate}: only -m torch:pkg.mod:Model batches with a collate function "
                          f"(a -t torch:... Dataset's items); -m {opts.model} builds its own batches: leave "
                          "--collate out")


def replica_rows(plan: ExecutionPlan, rank: int, replicas: int) -> list[int]:
    """The rows of the combined batch replica ``rank`` runs (``plan.shard`` of the row numbers); contiguous
    blocks when the plan's replication factor is not the number of replicas."""
    rows = plan.combined_batch
    if plan.replication_factor != replicas:
        per = rows // replicas
        return list(range(rank * per, (rank + 1) * per))
    import torch

    return plan.shard({"row": torch.arange(rows)}, rank)["row"].tolist()


def _share_data(teacher: FixedTeacher, shard: tuple[int, int], serve: list[int] | None, layout_rows: int) -> None:
    """A replica's rows of the combined schedule, else a share of the episodes (hogwild)."""
    if serve is None:
        teacher.keep_shard(*shard)
    else:
        teacher.serve_replica(layout_rows, serve)


def fit_batch_to_data(opts: Opts, teacher: Teacher | None) -> tuple[Opts, str | None]:
    """``opts`` with ``--batchsize`` lowered to the fewest rows that serve every episode in one step (each
    row serves whole episodes: more rows would only repeat them in training, or be padding in evaluation,
    at the cost of a teacher and agent clone each; rows come in multiples of D x R x G), and the line that
    says so; ``(opts, None)`` when -bs is already that small, with --dynamic-batching (its batches are cut
    from the data) or when the task's size is unknown."""
    if opts.dynamic_batching != "none" or not isinstance(teacher, FixedTeacher):
        return opts, None
    plan = ExecutionPlan.from_opts(opts, training=is_training(opts.datatype))
    episodes = -(-teacher.num_episodes() // opts.numthreads)  # hogwild: each process serves its share
    per_micro_row = plan.combined_batch // opts.batchsize  # rows per step for each row of -bs (D x R x G)
    if plan.combined_batch <= max(episodes, per_micro_row):
        return opts, None
    fitted = max(1, -(-episodes // per_micro_row))
    if fitted >= opts.batchsize:
        return opts, None
    whose = " per hogwild process" if opts.numthreads > 1 else ""
    note = (f"accelbatch: -bs {opts.batchsize}: a step of {plan.combined_batch} rows is more than the {episodes} "
            f"episodes of -t {opts.task} ({split_of(opts.datatype)}){whose} can fill; using -bs {fitted} "
            f"({fitted * per_micro_row} rows)" + (f": the fewest, in multiples of D x R x G = {per_micro_row}, that "
                                                  "serve every episode in one step" if per_micro_row > 1 else ""))
    return opts.replace(batchsize=fitted), note


def as_opts(opts: Any, where: str) -> Opts:
    """``opts`` as Opts: a mapping (a ParlAI-style opt dict) becomes ``Opts(**opts)``, its keys checked."""
    if isinstance(opts, Opts):
        return opts
    if not isinstance(opts, Mapping):
        raise TypeError(f"{where} takes accelbatch.Opts (or a dict of its fields), not {type(opts).__name__}")
    unknown = sorted(set(opts) - {f.name for f in dataclasses.fields(Opts)})
    if unknown:
        raise OptionError(f"{where}: {unknown[0]!r} is not an option of accelbatch.Opts; give Opts' field names "
                          "(e.g. 'task', 'batchsize'; `accelbatch train --help` lists them)")
    return Opts(**opts)


@keeps_default_start_method
def create_world(opts: Opts | Mapping[str, Any], agent: Agent | type[Agent] | str | None = None,
                 rows: int | None = None, *, runtime: Runtime | None = None,
                 teacher: Teacher | None = None) -> World:
    """The world for ``opts``, its model compiled for ``opts.device``: one task or several, batched when
    rows > 1, fed by the data loader with its options, HogwildWorld with ``--numthreads N`` > 1.

    ``agent`` may be None (use ``opts.model``), a model name as ``-m`` takes it, an Agent class, or an agent
    instance whose model (and engine) the new world shares, e.g. the training agent for a validation world.
    Under replication each process's world holds its replica's share of the rows and of the data. The first
    world of a run (no runtime yet) fits ``--batchsize`` to its data (:func:`fit_batch_to_data`);
    ``world.opts`` holds the options it was built with. ``opts`` may be a dict of Opts' fields. ``teacher``:
    one made for ``opts`` already (else it is made here). Building a model seeds torch's global generator with
    ``opts.seed``, and run() starts from the state it had when the world was built: the same seed builds and
    trains the same weights, whatever other worlds were built in between."""
    refuse_script_rerun()  # a child process running this script's unguarded top-level code ends here
    opts = as_opts(opts, "create_world(opts)")
    if isinstance(agent, str):  # a name as -m takes it: the run's opts say which model it is
        opts, agent = opts.replace(model=agent), None
    elif agent is not None and not isinstance(agent, (type, Agent)):
        raise TypeError(f"create_world(agent=...) takes None (opts.model), a model name, an Agent class or an "
                        f"agent instance, not {type(agent).__name__}")
    elif isinstance(agent, type) and not issubclass(agent, Agent):
        raise TypeError(_not_an_agent(f"create_world(agent={agent.__name__})", agent))
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise TypeError(f"create_world(rows={rows!r}): rows is a number of batch rows, 1 or more (None: -bs)")
    if runtime is None:
        check_processes(opts)
        say_unused_model(opts.model, agent, Opts.__dataclass_fields__["model"].default)
    if runtime is None and opts.numthreads > 1:
        check_main_guard(f"-nt/--numthreads {opts.numthreads}", _sent_agent(opts, agent, teacher))
    elif runtime is None and opts.dataloader_mode != "sync":
        check_main_guard(f"--dataloader-mode {opts.dataloader_mode}", _sent_agent(opts, agent, teacher))
    elif runtime is None and opts.num_workers > 0 and default_start_method() != "fork":  # a script's choice
        check_main_guard(f"--num-workers {opts.num_workers} (started by {default_start_method()})",
                         _sent_agent(opts, agent, teacher))
    fitted = None
    if runtime is None and opts.dataloader_mode != "sync" and opts.numthreads <= 1:
        # the forkserver the async accessor's worker forks from imports torch while this process builds the
        # agent; the allocator first, whose settings it inherits
        apply_host_allocator(opts.host_allocator)
        start_forkserver()
    if runtime is None and rows is None and getattr(getattr(agent, "slot", None), "runtime", None) is None:
        teacher = teacher or create_teacher(opts)
        opts, fitted = fit_batch_to_data(opts, teacher)
    shared = getattr(getattr(agent, "slot", None), "runtime", None)  # an agent instance's, which its fork keeps
    first = runtime is None and shared is None
    runtime = runtime or shared or setup_runtime(opts)
    model = make_agent(opts, agent)
    compile_agent(model, runtime)
    # a checkpoint to resume replaces what loading -mf did (and the resume says itself what it changes)
    resuming = opts.resume and opts.model_file and has_saved_position(opts.model_file)
    if first and runtime.topology.rank == 0 and not resuming:
        for note in [*getattr(model, "load_notes", ()), unread_model_file(model, opts)]:
            if note:
                print(f"accelbatch: {note}", file=sys.stderr)
    if opts.numthreads > 1:
        world: World = create_hogwild_world(opts, agent, rows, runtime=runtime, model=model, teacher=teacher)
    else:
        replicas = runtime.topology.world_size
        world = build_world(opts, model, runtime.shard, rows, replicas, teacher)
    if first and runtime.topology.rank == 0 and opts.dynamic_batching == "none" and opts.numthreads <= 1 \
            and (opts.num_workers > 0 or opts.dataloader_mode != "sync") and not isinstance(world, LoaderWorld):
        who = f"agent {type(model).__name__} overrides observe() or is not a TorchAgent" \
            if not collates_anywhere(model) else "the task's teacher overrides act() or observe()"
        print(f"accelbatch: --num-workers / --dataloader-mode: {who}, so its batches are built in the main "
              "process (same results)", file=sys.stderr)
    if first and runtime.topology.rank == 0 and isinstance(world, LoaderWorld):
        contention = data_processes_compete(opts)
        if contention:
            print(contention, file=sys.stderr)
    world.runtime, world.torch_rng = runtime, torch_rng()  # run() starts from it (see state.torch_rng)
    world.batch_fitted = bool(fitted)  # -bs lowered to the data: run() takes the larger -bs it was built from
    if fitted and runtime.topology.rank == 0:  # said once the world is built: after any error in the options
        print(fitted, file=sys.stderr, flush=True)
    return world


def _sent_agent(opts: Opts, agent: Agent | type[Agent] | None, teacher: Teacher | None) -> list[Any]:
    """The agent (an instance, a class, or -m's path) whose class child processes import: each hogwild
    process builds its own; the async data process batches with a copy of one whose batches the loader builds."""
    given = opts.model if agent is None else agent
    if opts.numthreads > 1:
        return [given]
    loaded = isinstance(given, str) or collates_anywhere(given)  # -m's path: its class is not imported here
    return [given] if loaded and (teacher is None or served_as_stored(teacher)) else []


def create_hogwild_world(opts: Opts, agent: Agent | type[Agent] | None = None, rows: int | None = None, *,
                         processes: int | None = None, runtime: Runtime | None = None,
                         model: Agent | None = None, teacher: Teacher | None = None) -> HogwildWorld:
    """A HogwildWorld of ``processes`` (default ``--numthreads``) processes; cpu only. ``teacher``: the main
    process's, made for ``opts`` already (else it is made here)."""
    if model is None:
        runtime = runtime or setup_runtime(opts)
        model = make_agent(opts, agent)
        compile_agent(model, runtime)
    main = build_world(opts.replace(numthreads=1), model, rows=1, teacher=teacher)
    served = main.get_task_agent() if hasattr(main, "get_task_agent") else None
    if isinstance(served, FixedTeacher):  # before any process starts (each would refuse its share)
        count, one = processes or opts.numthreads, hogwild_process_opts(opts)
        plan = ExecutionPlan.from_opts(one, training=True)
        served.check_shareable(count)
        for rank in range(count):
            _check_ordered_tail(one, plan, model, served, (rank, count), rows or plan.combined_batch)
    agent_class = agent if isinstance(agent, type) else (None if agent is None else type(agent))
    # a training parley of a static-row world trains its rows: known before it runs
    per_parley = None if opts.dynamic_batching != "none" else \
        (rows or ExecutionPlan.from_opts(opts, training=True).combined_batch)
    world = HogwildWorld(opts.replace(numthreads=processes or opts.numthreads), main, build_hogwild_child,
                         agent_class, rows, exs_per_parley=per_parley, timeout=opts.replica_timeout_s)
    world.runtime = runtime
    return world


def hogwild_process_opts(opts: Opts) -> Opts:
    """A hogwild process's options: one process, and without dynamic batching (its shard served in passes
    whose last steps are padded) a partial step trained as a tail, as ``--no-drop-last`` trains it."""
    passes = is_training(opts.datatype) and opts.dynamic_batching == "none"
    return opts.replace(numthreads=1, **({"drop_last": False} if passes else {}))


def build_hogwild_child(opts: Opts, agent_class: type[Agent] | None, rank: int, processes: int,
                        rows: int | None) -> World:
    """Hogwild process ``rank``'s world (in that process): its own model agent and engine on the CPU (the
    caller points the parameters at the shared ones), its shard of the episodes, the whole combined batch,
    with :func:`hogwild_process_opts` (its shard's passes: accelbatch/hogwild_passes.py)."""
    single = hogwild_process_opts(opts)
    runtime = setup_runtime(single)
    model = make_agent(single, agent_class)
    compile_agent(model, runtime)
    world = build_world(single, model, (rank, processes), rows)
    world.runtime = runtime
    return world


def attach_runtime(world: World, opts: Opts) -> Runtime:
    """The runtime of a world built by hand (not by :func:`create_world`): set up and compile its model."""
    if world.runtime is None:
        model = world.get_model_agent()
        world.runtime = getattr(getattr(model, "slot", None), "runtime", None) or setup_runtime(opts)
        compile_agent(model, world.runtime)
    return world.runtime


__all__ = ["Runtime", "as_opts", "attach_runtime", "build_hogwild_child", "build_world", "check_collate",
           "check_required_fields", "collates_anywhere", "compile_agent", "create_hogwild_world", "create_world",
           "fit_batch_to_data", "make_agent", "setup_runtime", "uses_loader"]
