"""Generated bAbI-style question answering: no download, deterministic by seed.

``babi:1`` (single supporting fact): actors move between places; every few statements a question
"Where is Mary?" asks for an actor's latest place. ``babi:2`` (two supporting facts): actors also pick
up and drop objects; the question asks where an object is. Each episode is one story of five questions;
the text of a turn holds the statements since the last question, then the question, so answering needs
the episode's history (the agent's, or squashing's).

Splits are generated from fixed seeds (train 1000 stories, valid and test 200 each), so every run
and every machine sees the same data.
"""

from __future__ import annotations

import random

from accelbatch.messages import Message
from accelbatch.names import UnknownNameError
from accelbatch.teachers import FixedTeacher, split_of

ACTORS = ("Mary", "John", "Daniel", "Sandra")
PLACES = ("bathroom", "hallway", "garden", "office", "bedroom", "kitchen")
OBJECTS = ("football", "apple", "milk")
MOVES = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
SPLIT_SIZES = {"train": 1000, "valid": 200, "test": 200}
SPLIT_SEEDS = {"train": 101, "valid": 202, "test": 303}
QUESTIONS_PER_STORY = 5


def _story_single_fact(rng: random.Random) -> list[Message]:
    where: dict[str, str] = {}
    turns: list[Message] = []
    for _ in range(QUESTIONS_PER_STORY):
        lines = []
        for _ in range(2):
            actor, place = rng.choice(ACTORS), rng.choice(PLACES)
            where[actor] = place
            lines.append(f"{actor} {rng.choice(MOVES)} the {place}.")
        actor = rng.choice(sorted(where))
        lines.append(f"Where is {actor}?")
        turns.append(_turn(lines, where[actor]))
    return _close(turns)


def _story_two_facts(rng: random.Random) -> list[Message]:
    where: dict[str, str] = {}
    holder: dict[str, str | None] = {}
    turns: list[Message] = []
    for _ in range(QUESTIONS_PER_STORY):
        lines = []
        for _ in range(3):
            actor = rng.choice(ACTORS)
            held = [o for o, h in holder.items() if h == actor]
            free = [o for o, h in holder.items() if h is None] + [o for o in OBJECTS if o not in holder]
            if actor in where and free and rng.random() < 0.35:
                obj = rng.choice(free)
                holder[obj] = actor
                lines.append(f"{actor} picked up the {obj}.")
            elif held and rng.random() < 0.2:
                obj = rng.choice(held)
                holder[obj] = None
                where[obj] = where[actor]
                lines.append(f"{actor} dropped the {obj}.")
            else:
                place = rng.choice(PLACES)
                where[actor] = place
                lines.append(f"{actor} {rng.choice(MOVES)} the {place}.")
        known = sorted(o for o in OBJECTS if (holder.get(o) and holder[o] in where) or
                       (o in holder and holder[o] is None and o in where))
        if not known:
            actor = rng.choice(sorted(where))
            lines.append(f"Where is {actor}?")
            turns.append(_turn(lines, where[actor]))
            continue
        obj = rng.choice(known)
        answer = where[holder[obj]] if holder[obj] else where[obj]
        lines.append(f"Where is the {obj}?")
        turns.append(_turn(lines, answer))
    return _close(turns)


def _turn(lines: list[str], answer: str) -> Message:
    return Message(text="\n".join(lines), labels=[answer], label_candidates=list(PLACES), episode_done=False)


def _close(turns: list[Message]) -> list[Message]:
    turns[-1]["episode_done"] = True
    return turns


STORY_MAKERS = {"1": _story_single_fact, "2": _story_two_facts}


def generate(task_id: str, split: str, num_stories: int | None = None) -> list[list[Message]]:
    """The episodes of one split of one generated task; the same every time."""
    if task_id not in STORY_MAKERS:
        raise UnknownNameError(f"-t babi:{task_id}: not generated here; choose one of "
                               f"{', '.join('babi:' + k for k in STORY_MAKERS)}")
    rng = random.Random(SPLIT_SEEDS[split] * 10 + int(task_id))
    count = SPLIT_SIZES[split] if num_stories is None else num_stories
    return [STORY_MAKERS[task_id](rng) for _ in range(count)]


class BabiTeacher(FixedTeacher):
    """``-t babi:1`` or ``-t babi:2``."""

    def setup_data(self) -> list[list[Message]]:
        task_id = self.opts.task.partition(":")[2]
        if not task_id:  # ParlAI's plain "babi" is every task; name one
            raise UnknownNameError(f"-t {self.opts.task}: name a task, one of "
                                   f"{', '.join('babi:' + k for k in STORY_MAKERS)}")
        return generate(task_id, split_of(self.opts.datatype))
