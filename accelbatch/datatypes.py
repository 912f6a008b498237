"""The datatypes (-dt): which split a run reads and how (ParlAI's train, valid, test with their modes)."""

from __future__ import annotations

DATATYPES = ("train", "train:ordered", "train:stream", "train:stream:ordered", "valid", "test",
             "valid:stream", "test:stream", "train:evalmode", "train:evalmode:stream")


def split_of(datatype: str) -> str:
    """'train', 'valid' or 'test' from a datatype such as 'train:stream'."""
    return datatype.split(":")[0]


def is_training(datatype: str) -> bool:
    return split_of(datatype) == "train" and "evalmode" not in datatype


def eval_datatype(datatype: str) -> str:
    """The datatype that evaluates ``datatype``'s split: a train datatype in eval mode (each example once,
    in data order, nothing trained), valid and test as they are."""
    if not is_training(datatype):
        return datatype
    return "train:evalmode:stream" if "stream" in datatype else "train:evalmode"
