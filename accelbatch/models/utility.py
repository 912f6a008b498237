"""ParlAI's utility agents: they need no model, which makes data-path checks easy."""

from __future__ import annotations

import random
from typing import Any

from accelbatch.agents import Agent
from accelbatch.messages import LABEL_CANDIDATES, Message, is_padding
from accelbatch.opts import Opts

NO_CANDIDATES_REPLY = "I don't know."  # ParlAI's RandomCandidateAgent's reply to an example without candidates


class RepeatLabelAgent(Agent):
    """Replies with the first label of the example (labels or eval_labels); 'I don't know' without one.

    Accuracy is 1.0 on any data with labels, so it checks that every example reaches the model once.
    """

    reported_metrics: frozenset[str] | None = frozenset()

    def act(self) -> Message:
        obs = self.observation or {}
        targets = Message.targets(obs)  # a str label is one answer, not its characters
        if not obs or ("text" not in obs and not targets):
            return Message(id=self.id)
        return Message(id=self.id, text=targets[0] if targets else "I don't know")


class RandomCandidateAgent(Agent):
    """Replies with a random label candidate (one seeded stream for all its clones, so runs are repeatable);
    without candidates "I don't know.", as ParlAI's RandomCandidateAgent: never the labels, so its accuracy is
    chance level."""

    reported_metrics: frozenset[str] | None = frozenset()

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        # one stream for every clone: the rows of a batch draw one after another, independently (a stream per
        # clone, each seeded alike, drew the same candidate in every row)
        self.rng: random.Random = shared["rng"] if shared and "rng" in shared else random.Random(opts.seed)

    def share(self) -> dict[str, Any]:
        return {**super().share(), "rng": self.rng}

    def act(self) -> Message:
        obs = self.observation
        if is_padding(obs):  # no example in this row: nothing to answer
            return Message(id=self.id)
        cands = obs.get(LABEL_CANDIDATES)  # type: ignore[union-attr]
        if not cands:
            return Message(id=self.id, text=NO_CANDIDATES_REPLY)
        return Message(id=self.id, text=self.rng.choice(list(cands)))
