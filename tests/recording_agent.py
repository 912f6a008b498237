"""A bag-of-words agent that reports which examples each training step held (tests import it by name, and
data workers unpickle it): every example's text starts with ``q<index>``."""

from __future__ import annotations

import os

import torch

from accelbatch.agents import Agent
from accelbatch.models.bag import BagAgent


class RecordingBag(BagAgent):
    """Appends the example indices of every training batch to the file named by $RECORD_TRAINED."""

    def vectorize(self, obs):
        obs = super().vectorize(obs)
        obs["example_index"] = int(obs["text"].split()[0][1:])
        return obs

    def batchify(self, observations):
        batch = super().batchify(observations)
        batch["example_index"] = torch.tensor([o.get("example_index", -1) for o in observations])
        return batch

    def step(self, observations, batch):
        if any("labels" in obs for obs in observations):
            with open(os.environ["RECORD_TRAINED"], "a") as out:
                out.write(" ".join(str(i) for i in batch["example_index"].tolist()) + "\n")
        return super().step(observations, batch)


class ShapeRecordingBag(BagAgent):
    """Appends "train|eval rows width real_tokens" of every text tensor it is fed to the file named by
    $RECORD_SHAPES (one line per step, from whichever process runs it)."""

    def step(self, observations, batch):
        text = batch["text_vec"]
        mode = "train" if any("labels" in obs for obs in observations) else "eval"
        with open(os.environ["RECORD_SHAPES"], "a") as out:
            out.write(f"{mode} {text.shape[0]} {text.shape[1]} {int((text != 0).sum())}\n")
        return super().step(observations, batch)


class ConversationRecorder(Agent):
    """Keeps every message it observes (class-wide, for the test to read) and replies with the number of
    messages of the conversation so far; reset() starts a new conversation."""

    seen: list = []

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.turns = 0

    def observe(self, observation):
        ConversationRecorder.seen.append((observation["text"], observation["episode_done"]))
        self.turns += 1
        return super().observe(observation)

    def act(self):
        return {"id": "recorder", "text": str(self.turns)}

    def reset(self):
        super().reset()
        self.turns = 0


class WiderBag(BagAgent):
    """A ParlAI-style agent whose add_cmdline_args sets defaults of accelbatch's own options (as ParlAI's BART sets
    embedding_size) and of one of its own; it says what it was built with on stderr."""

    @classmethod
    def add_cmdline_args(cls, parser, partial_opt=None):
        parser.add_argument("--width", type=int, default=3)
        parser.set_defaults(embedding_size=24, optimizer="sgd", width=7)
        return parser

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        if shared is None:
            import sys
            print(f"built: esz {opts.embedding_size} opt {opts.optimizer} width {opts['width']}", file=sys.stderr)
