"""``-m trivial``: the throughput benchmark's do-nothing agent.

``batch_act`` returns the same reply for every row; the reply carries text, so the teacher still scores it
(accuracy and F1), which makes the world loop, message handling and metrics the whole cost of a step.
Padding rows get an empty reply, as a model's would.
"""

from __future__ import annotations

from typing import Sequence

from accelbatch.agents import Agent
from accelbatch.messages import Message, is_padding

REPLY_TEXT = "i do not know the answer"


class TrivialAgent(Agent):
    """Replies :data:`REPLY_TEXT` to every observation, in one ``batch_act`` for a whole batch."""

    reported_metrics: frozenset[str] | None = frozenset()

    def act(self) -> Message:
        return self.batch_act([self.observation])[0]

    def batch_act(self, observations: Sequence[Message | None]) -> list[Message]:
        return [Message(id=self.id) if is_padding(obs) else Message(id=self.id, text=REPLY_TEXT)
                for obs in observations]
