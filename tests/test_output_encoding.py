"""Text the data holds, printed where the output cannot encode it, shows as escapes instead of failing."""

from __future__ import annotations

import io
import json
import sys

import pytest

from accelbatch import cli
from accelbatch.opts import Opts
from accelbatch.verbs import display_data


@pytest.mark.timeout(120)
def test_non_ascii_text_prints_as_escapes_to_an_ascii_output(tmp_path, monkeypatch):
    """stdout as a redirected Windows console's code page (or PYTHONIOENCODING=ascii) gives it: strict
    ascii. Every verb starts by making it escape (display-data, --display-examples and the multitask
    report's task names failed after the run)."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    data = tmp_path / "caf\u00e9.jsonl"
    data.write_text(json.dumps({"text": "caf\u00e9 \u65e5\u672c", "labels": ["\u00e9t\u00e9"]}) + "\n",
                    encoding="utf-8")
    assert cli.main(["tasks"]) == 0
    assert out.errors == "backslashreplace"
    display_data(Opts(task=f"jsonl:{data}", datatype="train:ordered"), 1)
    out.flush()
    assert b"caf\\xe9 \\u65e5\\u672c" in raw.getvalue() and b"\\xe9t\\xe9" in raw.getvalue()
