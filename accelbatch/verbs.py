"""ParlAI's everyday verbs: ``display-data`` (a task's examples), ``display-model`` (examples with a model's
replies) and ``interactive`` (type a message, read the model's reply; a terminal or piped stdin)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from accelbatch.messages import Message, lone_surrogate
from accelbatch.metric_names import metric_names_problem, select_metrics
from accelbatch.model_opts import check_task_files
from accelbatch.opts import OptionError, Opts
from accelbatch.teachers import create_teacher, create_teachers
from accelbatch.world_display import EPISODE_END, display

if TYPE_CHECKING:
    from accelbatch.agents import Agent
    from accelbatch.build import Runtime

RESET, EXIT = "[DONE]", "[EXIT]"


def add_verb_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """The options a verb adds to the usual ones."""
    if verb in ("display-data", "display-model"):
        parser.add_argument("-n", "--num-examples", dest="num_examples", type=int, default=10,
                            help="examples to show (default 10; display-model shows whole batches of -bs)")
    if verb == "interactive":
        parser.add_argument("-st", "--single-turn", action="store_true",
                            help="every message is a conversation of its own (as ParlAI's --single-turn)")
        parser.add_argument("--candidates", default=None,
                            help="replies a ranking model chooses from, separated by '|' (default: the "
                                 "label candidates of -t's first 1000 examples)")


def display_data(opts: Opts, num_examples: int, out: TextIO | None = None) -> int:
    """Print the first ``num_examples`` examples of ``opts``'s tasks as training or evaluation serves them (their
    label candidates under them; several tasks in turn, as one MultiTaskTeacher serves them), a line between
    episodes, then how many the split holds. Returns how many were shown; it stops early once ``out`` is lost
    (its reader left: ``| head -1``)."""
    _check_count(num_examples)
    out = out or sys.stdout
    shown = 0
    each = create_teachers(opts)
    one = create_teacher(opts, each)  # None: a task's teacher serves alone; each is shown after the one before
    teachers = [one] if one is not None else each
    for teacher in teachers:
        last = shown + teacher.num_examples()  # once each: training data would go round again
        while shown < min(num_examples, last) and not teacher.epoch_done() and not _lost(out):
            act = teacher.act()
            if act is None or act.get("text") is None and not act.get("labels") and not act.get("eval_labels"):
                break  # padding: the pass is over
            print(display([act]), file=out)
            teacher.observe(Message())
            shown += 1
            if act.get("episode_done"):
                print(EPISODE_END, file=out)
        if shown >= num_examples or _lost(out):
            break
    if not _lost(out):
        examples, episodes = (sum(getattr(t, name)() for t in teachers) for name in ("num_examples", "num_episodes"))
        print(f"[shown {shown} example{'s' * (shown != 1)} of -t {opts.task} ({opts.datatype}), which holds "
              f"{examples} example{'s' * (examples != 1)} in {episodes} episode{'s' * (episodes != 1)}]", file=out)
    return shown


def _lost(out: TextIO | None) -> bool:
    """Whether ``out`` can no longer be written (the command line's guarded stdout, once its reader left or
    its disk is full): what is still to be shown would go nowhere."""
    return bool(getattr(out, "lost", False))


def display_model(opts: Opts, num_examples: int, out: TextIO | None = None) -> dict[str, float]:
    """Evaluate ``opts``'s model (-mf, or a fresh -m) on the first ``num_examples`` examples of ``opts.datatype``,
    printing each example with the model's reply; returns the report of those examples (those run before
    ``out`` was lost, when its reader left)."""
    from contextlib import redirect_stdout

    from accelbatch.build import create_world

    _check_count(num_examples)
    if opts.datatype.split(":")[0] == "train":
        opts = opts.replace(datatype="train:evalmode")
    world = create_world(opts.replace(display_examples=True, numthreads=1))
    try:
        problem = metric_names_problem(world, opts)
        if problem is not None:
            raise OptionError(problem)
        target = out or sys.stdout
        with redirect_stdout(target):
            while world.get_total_exs() < num_examples and not world.epoch_done() and not _lost(target):
                world.parley()
        return select_metrics({"shown": dict(world.report())}, opts.metrics)["shown"]
    finally:
        world.shutdown()


def interactive(opts: Opts, candidates: str | None = None, stdin: TextIO | None = None,
                out: TextIO | None = None, single_turn: bool = False) -> int:
    """Read messages (a prompt when stdin is a terminal), print the model's reply to each. As ParlAI's local
    human agent reads them: ``\\n`` typed is a new line of the message, and a message holding ``[DONE]`` (taken
    out) is answered and ends its conversation, as every message does with ``single_turn`` (ParlAI before 1.0;
    1.x ends it without an answer); ``[DONE]`` alone starts a new conversation, a line holding ``[EXIT]`` or
    the end of input stops. Returns the number of replies."""
    if opts.model.startswith("torch:"):  # its batchify reads a dataset item's tensors, not typed text
        raise OptionError(f"-m {opts.model}: interactive types text to the model, and a torch: model reads its "
                          "dataset's tensors; see its replies with accelbatch display-model or eval -t TASK")
    if stdin is None and hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become U+FFFD
        sys.stdin.reconfigure(errors="replace")
    stdin, out = stdin or sys.stdin, out or sys.stdout
    if stdin is None:
        raise OptionError("interactive reads the messages from standard input, which is closed; give it a "
                          "terminal or a file (accelbatch interactive ... < messages.txt)")
    given = _given_candidates(candidates)  # a bad --candidates fails before the model loads
    opts = opts.replace(datatype="valid", batchsize=1, numthreads=1, num_workers=0, dataloader_mode="sync",
                        dynamic_batching="none")
    agent, runtime = _model_agent(opts)
    prompt = stdin.isatty()
    replies = 0
    try:
        fixed = _candidates(opts, agent, given)
        while True:
            if prompt:
                print("Enter Your Message: ", end="", file=out, flush=True)
            line = stdin.readline()
            if not line or EXIT in line:
                break
            text = line.rstrip("\n").replace("\\n", "\n")
            last = single_turn or RESET in text
            if RESET in text:
                text = text.replace(RESET, "").strip()
                if not text:  # nothing but the marker: a new conversation, nothing to answer
                    agent.reset()
                    print(EPISODE_END, file=out)
                    continue
            message = Message(text=text, episode_done=last)
            if fixed:
                message["label_candidates"] = list(fixed)
            agent.observe(message)
            reply = agent.act() or {}
            print(f"[{reply.get('id', type(agent).__name__)}]: {reply.get('text', '')}", file=out, flush=True)
            replies += 1
            if last:
                agent.reset()
                print(EPISODE_END, file=out)
    finally:
        agent.shutdown()
        runtime.backend.teardown()
    return replies


def _model_agent(opts: Opts) -> tuple[Agent, Runtime]:
    """The model agent alone, compiled for --device (its runtime with it): interactive talks to it directly,
    so no world is built and -t is read only for its candidates (and only when --candidates is not given)."""
    from accelbatch.build import compile_agent, make_agent, setup_runtime

    agent = make_agent(opts, None)
    runtime = setup_runtime(opts)
    compile_agent(agent, runtime)
    for note in getattr(agent, "load_notes", ()):
        print(f"accelbatch: {note}", file=sys.stderr)
    return agent, runtime


def _given_candidates(given: str | None) -> list[str] | None:
    """``--candidates`` split on '|' (None when not given); one that names no candidate is refused."""
    if given is None:
        return None
    found = [c.strip() for c in given.split("|") if c.strip()]
    for candidate in found:  # Python reads the command line's bytes that are not UTF-8 as lone surrogates
        bad = lone_surrogate(candidate)
        if bad is not None:
            raise OptionError(f"--candidates: {candidate!r} is not valid UTF-8 (the byte {ord(bad[2]) & 0xff:#x} "
                              f"at character {bad[1]}); give the candidates in UTF-8")
    if not found:
        raise OptionError(f"--candidates {given!r}: names no candidate; give the replies to choose from, "
                          "separated by '|' (e.g. --candidates 'kitchen|garden'), or leave it out to use -t's")
    return found


def _candidates(opts: Opts, agent: Agent, given: list[str] | None) -> list[str] | None:
    """The candidates offered with each message: those given, else the task's; none to a generator, which
    writes its replies (given ones are said to be unused)."""
    from accelbatch.models.generator import GeneratorAgent

    if isinstance(agent, GeneratorAgent):
        if given is not None:
            print(f"accelbatch: --candidates: not used by this run: -m {opts.model} generates its replies "
                  "(a ranker such as -m bag chooses among candidates)", file=sys.stderr)
        return None
    if given is not None:
        return given
    check_task_files(opts, "interactive offers the candidates of the task:",
                     "give --candidates 'reply one|reply two|...', or -t naming the data")
    return _task_candidates(opts, agent)


def _task_candidates(opts: Opts, agent: Agent) -> list[str]:
    """The label candidates of the task's first 1000 examples, in order; a model that ranks them (it requires
    ``label_candidates``) is refused a task that has none, as it would reply nothing."""
    seen: dict[str, None] = {}
    read = 0
    for teacher in create_teachers(opts.replace(datatype="valid")):
        for _ in range(1000):
            if teacher.epoch_done():
                break
            act = teacher.act()
            teacher.observe(Message())
            seen.update(dict.fromkeys(act.get("label_candidates") or ()))
            read += 1
    if not seen and "label_candidates" in getattr(agent, "required_fields", ()):
        raise OptionError(f"-m {opts.model}: none of the {read} examples read of -t {opts.task} (valid) has "
                          f"'label_candidates', and {type(agent).__name__} replies with one of them: give "
                          "--candidates 'reply one|reply two|...'")
    return list(seen)


def _check_count(num_examples: int) -> None:
    if num_examples < 1:
        raise OptionError(f"-n/--num-examples: {num_examples} shows nothing; give 1 or more")


__all__ = ["add_verb_arguments", "display_data", "display_model", "interactive"]
