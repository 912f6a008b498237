"""ParlAI's utility agents: they need no model, which makes data-path checks easy."""

from __future__ import annotations

import random
from typing import Any

from accelbatch.agents import Agent
from accelbatch.messages import EVAL_LABELS, LABEL_CANDIDATES, LABELS, Message
from accelbatch.opts import Opts


class RepeatLabelAgent(Agent):
    """Replies with the first label of the example (labels or eval_labels); 'I don't know' without one.

    Accuracy is 1.0 on any data with labels, so it checks that every example reaches the model once.
    """

    def act(self) -> Message:
        obs = self.observation or {}
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
        if not obs or ("text" not in obs and not targets):
            return Message(id=self.id)
        return Message(id=self.id, text=targets[0] if targets else "I don't know")


class RandomCandidateAgent(Agent):
    """Replies with a random label candidate (seeded per clone, so runs are repeatable)."""

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        self.rng = random.Random(opts.seed)

    def act(self) -> Message:
        obs = self.observation or {}
        cands = obs.get(LABEL_CANDIDATES)
        if not cands:
            targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
            cands = list(targets) if targets else []
        if not cands:
            return Message(id=self.id)
        return Message(id=self.id, text=self.rng.choice(list(cands)))
