"""Shared test helpers: small worlds and data files built in the test, never read from the package."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def write_jsonl(tmp_path):
    """Write rows (dicts) to a JSONL file and return its path."""

    def _write(rows, name="data.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    return _write
