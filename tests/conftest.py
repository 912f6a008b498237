"""Shared test helpers: small worlds and data files built in the test, never read from the package."""

from __future__ import annotations

import json
import os
import signal

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# A run started with Ctrl-C ignored (a background job of a non-interactive shell: `.ci/run &` in a script,
# some CI runners) would pass that on to every process it starts, and the tests that press Ctrl-C on a child
# would wait in vain. Give this process Python's usual Ctrl-C: its children then start with it too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def write_jsonl(tmp_path):
    """Write rows (dicts) to a JSONL file and return its path."""

    def _write(rows, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    return _write
