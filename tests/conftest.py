"""Shared test helpers: small worlds and data files built in the test, never read from the package."""

from __future__ import annotations

import json
import os
import signal

import pytest
import zygote

os.environ.setdefault("OMP_NUM_THREADS", "1")
zygote.install()

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


def pytest_sessionfinish(session, exitstatus):
    zygote.CLIENT.stop()


@pytest.fixture(autouse=True, scope="session")
def _preloader_started_first():
    """The preloader of subprocesses (tests/zygote.py) starts before this process's first test, so that tests
    that compare this process's children before and after see it in both."""
    if zygote.CLIENT.enabled:
        zygote.CLIENT.start()
    yield


@pytest.fixture(autouse=True)
def _fresh_processes_when_marked(request):
    """Tests marked ``fresh_processes`` start their command-line runs in a fresh interpreter (tests/zygote.py)."""
    zygote.CLIENT.paused = request.node.get_closest_marker("fresh_processes") is not None
    yield
    zygote.CLIENT.paused = False


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    """A test that starts a child process (multiprocessing, torch's workers and spawns, a subprocess) must be
    marked ``multiprocess``: the marker is how the fast subset and CI know what a test costs."""
    import multiprocessing.process
    import subprocess

    started: list[str] = []
    start, popen = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def recording_start(self, *args, **kwargs):
        started.append(f"process {self.name}")
        return start(self, *args, **kwargs)

    def recording_popen(self, args, *rest, **kwargs):
        # matplotlib probes fontconfig once per fresh install (building its font cache): not the test's process
        if not (isinstance(args, (list, tuple)) and args and args[0] == "fc-list"):
            started.append(f"subprocess {args!r:.80}")
        return popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen)
    yield
    if started and request.node.get_closest_marker("multiprocess") is None:
        pytest.fail(f"{request.node.nodeid} starts processes ({started[0]}, ...) but is not marked "
                    "@pytest.mark.multiprocess", pytrace=False)

