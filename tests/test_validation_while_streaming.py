"""Validation inside a training run: streamed from its file when training streams (as ParlAI's eval worlds
are), with the same metrics as loading it; and reading the evaluation data is not training time (-ttim)."""

from __future__ import annotations

import importlib
import json
import time
import types

import pytest

import accelbatch as ab

run_module = importlib.import_module("accelbatch.run")  # the package's `run` is the function


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for n in range(40):
            label = f"w{n % 4}"
            f.write(json.dumps({"text": f"say {label} {n}", "labels": [label],
                                "label_candidates": ["w0", "w1", "w2", "w3"]}) + "\n")
    return str(path)


def _opts(data, **kw):
    return {**dict(task=f"jsonl:{data}", model="bag", batchsize=4, max_train_steps=3, eval_splits="valid,test",
                   progress=False, seed=3), **kw}


def _datatypes_of_worlds(monkeypatch) -> list[str]:
    made: list[str] = []
    real = run_module.create_world

    def recording(opts, **kw):
        made.append(opts.datatype)
        return real(opts, **kw)

    monkeypatch.setattr(run_module, "create_world", recording)
    return made


def test_a_streamed_training_validates_and_tests_streamed_with_the_same_metrics(data, monkeypatch):
    loaded = ab.run(ab.create_world(_opts(data)), _opts(data))
    made = _datatypes_of_worlds(monkeypatch)
    opts = _opts(data, datatype="train:stream")
    streamed = ab.run(ab.create_world(opts), opts)
    assert sorted(set(made)) == ["test:stream", "valid:stream"]  # read as training read the file, not loaded
    for split in ("valid", "test"):
        assert {k: v for k, v in streamed[split].items() if k != "time_s"} == \
            {k: v for k, v in loaded[split].items() if k != "time_s"}


def test_reading_the_evaluation_data_is_not_training_time(data, monkeypatch):
    """A big file took the whole -ttim budget to read for validation: one step trained."""
    offset = [0.0]
    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.monotonic = lambda: time.monotonic() + offset[0]
    monkeypatch.setattr(run_module, "time", clock)
    real = run_module.create_world

    def slow_to_read(opts, **kw):
        offset[0] += 100.0  # as if reading the valid file took 100 s
        return real(opts, **kw)

    monkeypatch.setattr(run_module, "create_world", slow_to_read)
    opts = _opts(data, max_train_time=50.0, eval_splits="")
    report = ab.run(ab.create_world(opts), opts)
    assert report["train"]["stopped_by"] == "max_train_steps" and report["train"]["exs"] == 12
    assert report["train"]["time_s"] < 50
