"""The data position of a world, as JSON data: where every part of it continues after a resume.

:func:`world_position` / :func:`restore_world_position` cover ParlAI's worlds of FixedTeacher clones (the
shared episode cursor, each clone's place in its episode, each model clone's conversation history, a
MultiWorld's task choice and RNG); a LoaderWorld and a HogwildWorld give their own through
``data_position`` / ``restore_data_position``. Taken between world steps; stored by :mod:`accelbatch.run`
in the checkpoint's ``state["data"]``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Mapping, Sequence

from accelbatch.checkpoint import CheckpointError
from accelbatch.rng_state import random_state, set_random_state

POSITION_VERSION = 1


def _order_digest(order: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, order)).encode("ascii")).hexdigest()[:16]


def cursor_state(cursor: Any) -> dict[str, Any]:
    """An EpisodeCursor's (or SharedEpisodeCursor's) position as JSON data.

    The order of an epoch is not stored (it is a function of seed and epoch); its digest is, so a
    restore into data of another order (other file, shard or seed) is refused instead of silently
    serving other examples.
    """
    return {"num_episodes": int(cursor.num_episodes), "shuffle": bool(cursor.shuffle),
            "seed": int(cursor.seed), "epoch": int(cursor.epoch), "next_index": int(cursor.next_index),
            "order_sha256": _order_digest(cursor.order)}


def restore_cursor(cursor: Any, state: Mapping[str, Any]) -> None:
    """Put a cursor at a position from :func:`cursor_state` (after checking it is the same data)."""
    for key in ("num_episodes", "shuffle", "seed"):
        if getattr(cursor, key) != state[key]:
            raise CheckpointError(
                f"data position: the checkpoint's episode cursor has {key}={state[key]!r}, this run's has "
                f"{getattr(cursor, key)!r}; resume with the same task data, --seed and "
                "--replication-factor, or start afresh without --resume")
    epoch, next_index = int(state["epoch"]), int(state["next_index"])
    if not 0 <= next_index <= cursor.num_episodes or epoch < 0:
        raise CheckpointError(f"data position: bad cursor position (epoch {epoch}, index {next_index} of "
                              f"{cursor.num_episodes})")
    if hasattr(cursor, "seek"):  # the method proposed in /tmp/ckpt_patches/teachers.diff
        cursor.seek(epoch, next_index)
    elif hasattr(cursor, "_new_order"):  # EpisodeCursor
        with cursor.lock:
            cursor.epoch = epoch
            cursor._new_order()
            cursor.next_index = next_index
    else:  # hogwild's SharedEpisodeCursor (values in shared memory)
        with cursor.lock:
            cursor._epoch.value = epoch
            cursor._next.value = next_index
    if _order_digest(cursor.order) != state["order_sha256"]:
        raise CheckpointError("data position: this run shuffles the episodes in another order than the "
                              "checkpointed run (other data or code version); start afresh without --resume")


def teacher_position(teacher: Any) -> list[int] | None:
    """``[episode index, next entry]`` of the episode a FixedTeacher clone is in the middle of, or None."""
    if hasattr(teacher, "position"):
        pos = teacher.position()
        return None if pos is None else [int(pos[0]), int(pos[1])]
    episode, entry = getattr(teacher, "_episode", None), int(getattr(teacher, "_entry", 0))
    if episode is None or entry >= len(episode):
        return None
    index = getattr(teacher, "_episode_index", None)
    if index is None:  # before the teachers.diff patch: find the episode by identity
        index = next((i for i, ep in enumerate(teacher.episodes) if ep is episode), None)
        if index is None:
            raise CheckpointError(f"data position: {type(teacher).__name__}'s current episode is not in its "
                                  "episode list")
    return [int(index), entry]


def restore_teacher(teacher: Any, position: Sequence[int] | None) -> None:
    """Put a FixedTeacher clone back in the middle of an episode (or between episodes when None)."""
    if position is not None:
        index, entry = int(position[0]), int(position[1])
        if not (0 <= index < len(teacher.episodes) and 0 <= entry < len(teacher.episodes[index])):
            raise CheckpointError(f"data position: episode {index}, entry {entry} does not exist in "
                                  f"{type(teacher).__name__}'s data ({len(teacher.episodes)} episodes); "
                                  "resume with the same data, or start afresh without --resume")
        position = (index, entry)
    if hasattr(teacher, "restore"):
        teacher.restore(position)
        return
    if position is None:
        teacher._episode, teacher._entry = None, 0
    else:
        teacher._episode, teacher._entry = teacher.episodes[position[0]], position[1]
        if hasattr(teacher, "_episode_index"):
            teacher._episode_index = position[0]
    teacher._last, teacher._done = None, False


def agent_conversation(agent: Any) -> dict[str, Any] | None:
    """A model agent clone's conversation state (TorchAgent's history of the episode in progress)."""
    if hasattr(agent, "conversation_state"):
        return agent.conversation_state()
    history = getattr(agent, "history", None)
    if history is None or not hasattr(history, "turns"):
        return None
    return {"turns": list(history.turns), "last_label": getattr(agent, "_last_label", None),
            "previous_done": bool(getattr(agent, "_previous_done", True))}


def restore_agent_conversation(agent: Any, state: Mapping[str, Any] | None) -> None:
    if state is None:
        return
    if hasattr(agent, "restore_conversation"):
        agent.restore_conversation(state)
        return
    agent.history.turns = list(state["turns"])
    agent._last_label = state["last_label"]
    agent._previous_done = bool(state["previous_done"])


def _walk(world: Any) -> Iterator[tuple[str, Any]]:
    """The parts of a world that hold a data position, in a deterministic order.

    Yields ("teacher", FixedTeacher), ("agent", model agent clone), ("multi", MultiWorld),
    ("loader", a world with its own ``data_position`` / ``restore_data_position``, e.g. a LoaderWorld task
    of a MultiWorld), ("unsupported", reason).
    """
    from accelbatch.teachers import FixedTeacher
    from accelbatch.worlds import BatchWorld, DialogPartnerWorld, MultiWorld

    if isinstance(world, BatchWorld):
        yield from _walk(world.world)  # the original (its teacher does not act, but shares the cursor)
        for row in world.worlds:
            yield from _walk(row)
    elif isinstance(world, MultiWorld):
        yield ("multi", world)
        for sub in world.worlds:
            yield from _walk(sub)
    elif isinstance(world, DialogPartnerWorld):
        teacher = world.get_task_agent()
        if isinstance(teacher, FixedTeacher):
            yield ("teacher", teacher)
        else:
            yield ("unsupported", f"{type(teacher).__name__} is not a FixedTeacher")
        yield ("agent", world.get_model_agent())
    elif hasattr(world, "data_position") and hasattr(world, "restore_data_position"):
        yield ("loader", world)
    else:
        yield ("unsupported", f"{type(world).__name__} has no data position yet")


def world_position(world: Any) -> dict[str, Any]:
    """The data position of a training world as JSON data, taken between world steps.

    Holds each shared episode cursor (epoch and next index), each teacher clone's episode in progress
    (``[episode index, next entry]`` or None), each model agent clone's conversation history, each
    MultiWorld's task choice and RNG, and ``total_exs``. A LoaderWorld gives its own
    (``LoaderWorld.data_position``), and so does a HogwildWorld (``HogwildWorld.data_position``: it drains
    the queued parleys, then holds the shared cursors and each process's world position). A MultiWorld
    whose tasks are LoaderWorlds (``-t A,B`` through the data loader) holds their positions under
    ``"loaders"``, in task order, next to its own task choice and RNG under ``"multi"``. Worlds with no
    position are listed under ``"unsupported"``: :func:`restore_world_position` refuses them.
    """
    if hasattr(world, "data_position"):  # a LoaderWorld: its loader's position (accelbatch.loader_world)
        return {"version": POSITION_VERSION, "world": type(world).__name__, **world.data_position()}
    cursors: list[Any] = []
    teachers, agents, multi, loaders, unsupported = [], [], [], [], []
    seen_agents: set[int] = set()
    for kind, part in _walk(world):
        if kind == "teacher":
            index = next((i for i, c in enumerate(cursors) if c is part.cursor), None)
            if index is None:
                cursors.append(part.cursor)
                index = len(cursors) - 1
            teachers.append({"cursor": index, "episode": teacher_position(part)})
        elif kind == "agent":
            if id(part) not in seen_agents:
                seen_agents.add(id(part))
                agents.append(agent_conversation(part))
        elif kind == "multi":
            last = part.worlds[part.current].get_acts()[0]
            multi.append({"current": part.current, "rng": random_state(part.rng),
                          "in_episode": bool(last and not last.get("episode_done", True))})
        elif kind == "loader":
            loaders.append({"world": type(part).__name__, **part.data_position()})
            unsupported.extend(loaders[-1].get("unsupported") or [])
        else:
            unsupported.append(part)
    return {"version": POSITION_VERSION, "world": type(world).__name__,
            "total_exs": int(world.get_total_exs()), "cursors": [cursor_state(c) for c in cursors],
            "teachers": teachers, "agents": agents, "multi": multi, "loaders": loaders,
            "unsupported": unsupported}


def restore_world_position(world: Any, position: Mapping[str, Any]) -> None:
    """Put a freshly built world (same options) at a position from :func:`world_position`."""
    if position.get("version") != POSITION_VERSION:
        raise CheckpointError(f"data position: version {position.get('version')!r} is not "
                              f"{POSITION_VERSION}; start afresh without --resume")
    if position.get("unsupported"):
        raise CheckpointError("data position: the checkpointed world cannot be resumed exactly ("
                              + "; ".join(position["unsupported"]) + "); start afresh without --resume")
    if hasattr(world, "restore_data_position"):  # a LoaderWorld or a HogwildWorld
        return world.restore_data_position(dict(position))
    if position.get("hogwild") is not None:
        raise CheckpointError(f"data position: the checkpoint was taken with --numthreads "
                              f"{position['hogwild'].get('numthreads')} (hogwild), this run builds a "
                              f"{type(world).__name__}; resume with the same --numthreads, or start afresh "
                              "without --resume")
    parts = list(_walk(world))
    reasons = [p for k, p in parts if k == "unsupported"]
    if reasons:
        raise CheckpointError("data position: this world cannot be resumed exactly (" + "; ".join(reasons)
                              + ")")
    teachers = [p for k, p in parts if k == "teacher"]
    agents: list[Any] = []
    for kind, part in parts:
        if kind == "agent" and all(part is not a for a in agents):
            agents.append(part)
    multis = [p for k, p in parts if k == "multi"]
    loaders = [p for k, p in parts if k == "loader"]
    saved_loaders = position.get("loaders") or []
    counts = {"teacher clones": (len(teachers), len(position["teachers"])),
              "model agent clones": (len(agents), len(position["agents"])),
              "multi-task worlds": (len(multis), len(position["multi"])),
              "data-loader task worlds": (len(loaders), len(saved_loaders))}
    for what, (now, saved) in counts.items():
        if now != saved:
            raise CheckpointError(f"data position: the checkpoint has {saved} {what}, this world {now}; "
                                  "resume with the same --batchsize, -di, -ga, -rf and -t, or start afresh "
                                  "without --resume")
    cursors: list[Any] = []
    for teacher, saved in zip(teachers, position["teachers"]):
        index = saved["cursor"]
        if index == len(cursors):
            cursors.append(teacher.cursor)
            restore_cursor(teacher.cursor, position["cursors"][index])
        elif index > len(cursors) or cursors[index] is not teacher.cursor:
            raise CheckpointError("data position: the teachers share their cursors differently than in the "
                                  "checkpointed run; resume with the same options")
        restore_teacher(teacher, saved["episode"])
    for agent, saved in zip(agents, position["agents"]):
        restore_agent_conversation(agent, saved)
    for loader, saved in zip(loaders, saved_loaders):
        loader.restore_data_position(dict(saved))
    for multi, saved in zip(multis, position["multi"]):
        multi.current = int(saved["current"])
        set_random_state(multi.rng, saved["rng"])
        if saved["in_episode"]:
            # MultiWorld.parley_init keeps the task while the last teacher act has episode_done False
            from accelbatch.messages import Message

            multi.worlds[multi.current].get_acts()[0] = Message(episode_done=False)
    if hasattr(world, "total_exs"):
        world.total_exs = int(position["total_exs"])
