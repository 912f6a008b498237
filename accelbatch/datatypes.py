"""The datatypes (-dt): which split a run reads and how (ParlAI's train, valid, test with their modes)."""

from __future__ import annotations

DATATYPES = ("train", "train:ordered", "train:stream", "train:stream:ordered", "valid", "test",
             "valid:stream", "test:stream", "train:evalmode", "train:evalmode:stream")


def canonical_datatype(text: str) -> str:
    """ParlAI's spellings of a train datatype, its modes in any order (``train:ordered:stream``,
    ``train:evalmode:stream:ordered``), as the one of :data:`DATATYPES`; ``ordered`` in eval mode adds nothing
    (an evaluation is in data order). Anything else is given back, for the choices to refuse."""
    split, *modes = text.split(":")
    known = ("evalmode", "stream") if "evalmode" in modes else ("stream", "ordered")
    given = [m for m in modes if not (m == "ordered" and "evalmode" in modes)]
    if split != "train" or len(set(modes)) != len(modes) or not set(given) <= set(known):
        return text
    return ":".join(["train", *(m for m in known if m in given)])


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
