"""The suite's forked runs (tests/zygote.py) behave as fresh ``python -m accelbatch`` and ``python script.py``:
the same output, exit status, working folder, environment and sys.path, and signals end them the same way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import zygote
from helpers import wait_for_first_checkpoint

PROBE = """
import json, os, sys
from accelbatch.cli import main as _main  # noqa: F401 - the module the runs import
print(json.dumps({"cwd": os.getcwd(), "path0": sys.path[0], "tag": os.environ.get("ZYGOTE_PROBE"),
                  "argv0": os.path.basename(sys.argv[0]), "stdout_tty": sys.stdout.isatty(),
                  "buffering": sys.stdout.line_buffering, "in_path": "probe_agent" in sys.modules}))
"""


def _both(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The command run forked and in a fresh interpreter."""
    forks = zygote.CLIENT.forks
    forked = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    assert zygote.CLIENT.forks == forks + 1
    zygote.CLIENT.paused = True
    try:
        fresh = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    finally:
        zygote.CLIENT.paused = False
    return forked, fresh


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_forked_run_prints_and_exits_as_a_fresh_one(tmp_path):
    if not zygote.CLIENT.enabled:
        pytest.skip("forked runs are off (ACCELBATCH_TEST_FRESH_PROCESSES=1 or no socket.send_fds)")
    (tmp_path / "data.jsonl").write_text('{"text": "a b", "labels": ["c"]}\n', encoding="utf-8")
    for argv in (["display-data", "-t", "jsonl:data.jsonl", "-n", "1"], ["train", "-t", "jsonl:missing.jsonl"],
                 ["train", "--no-such-option"]):
        forked, fresh = _both([sys.executable, "-m", "accelbatch", *argv], cwd=tmp_path,
                              env={**os.environ, "ZYGOTE_PROBE": "1"})
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and "--no-such-option" in forked.stderr
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "script.py").write_text(
        "import os, sys\nprint(__name__, __file__, sys.path[0], os.getcwd(), sys.argv[1:])\nraise SystemExit(3)\n",
        encoding="utf-8")
    forked, fresh = _both([sys.executable, "sub/script.py", "x"], cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 3 and forked.stdout.split()[:4] == ["__main__", str(tmp_path / "sub" / "script.py"),
                                                                    str(tmp_path / "sub"), str(tmp_path)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_forked_run_has_the_fresh_runs_folder_environment_and_path(tmp_path, monkeypatch):
    """Checked from inside: a probe module imported by `-m` from the working folder, as a user's agent is."""
    if not zygote.CLIENT.enabled:
        pytest.skip("forked runs are off")
    (tmp_path / "probe_agent.py").write_text(PROBE + "import accelbatch\nclass Probe(accelbatch.Agent):\n    pass\n",
                                             encoding="utf-8")
    command = [sys.executable, "-m", "accelbatch", "display-model", "-m", "probe_agent:Probe", "-t", "reverse"]
    forked, fresh = _both(command, cwd=tmp_path, env={**os.environ, "ZYGOTE_PROBE": "seen"})
    said = [json.loads(r.stdout.splitlines()[0]) for r in (forked, fresh)]
    assert said[0] == said[1], said
    assert said[0]["cwd"] == str(tmp_path) and said[0]["path0"] == str(tmp_path) and said[0]["tag"] == "seen"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_forked_run_with_a_pythonpath_has_the_fresh_runs_path(tmp_path):
    """PYTHONPATH's folders (relative, absolute, empty) follow the script's folder as in a fresh interpreter,
    and a module there is found (the tests' agents and tasks are found that way)."""
    if not zygote.CLIENT.enabled or "PYTHONPATH" in os.environ:
        pytest.skip("forked runs are off, or this process has a PYTHONPATH (such runs are not forked)")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_mod.py").write_text("WHERE = 'lib'\n", encoding="utf-8")
    (tmp_path / "script.py").write_text("import sys\nimport helper_mod\nprint(helper_mod.WHERE, sys.path[:4])\n",
                                        encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["lib", "/no/such/folder", ""])}
    forked, fresh = _both([sys.executable, "script.py"], cwd=tmp_path, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.stdout.strip() == f"lib {[str(tmp_path), str(tmp_path / 'lib'), '/no/such/folder', str(tmp_path)]}"
    (tmp_path / "script.py").write_text("import sys\nprint(sys.path[:2])\n", encoding="utf-8")
    forked, fresh = _both([sys.executable, "script.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert forked.stdout == fresh.stdout and str(tmp_path) not in forked.stdout.split(",")[1]  # no entry


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_signalled_forked_run_ends_as_a_fresh_one(tmp_path, sig):
    if not zygote.CLIENT.enabled:
        pytest.skip("forked runs are off")
    command = [sys.executable, "-m", "accelbatch", "train", "-t", "babi:1", "-ne", "1000", "--no-progress",
               "-mf", "model.pt", "--save-every-n-secs", "0.01"]
    codes = []
    for paused in (False, True):
        zygote.CLIENT.paused = paused
        try:
            proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
        finally:
            zygote.CLIENT.paused = False
        assert (proc.pid in zygote.CLIENT.forked_env) != paused
        assert os.getsid(proc.pid) == proc.pid  # start_new_session: a session of its own
        wait_for_first_checkpoint(proc, tmp_path / "model.pt", max_delay_s=0.2)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        codes.append(proc.returncode)
        for path in tmp_path.glob("model.pt*"):
            subprocess.run(["rm", "-rf", str(path)], check=True)
    assert codes[0] == codes[1] and codes[0] in ((130, -signal.SIGINT) if sig == signal.SIGINT else (-sig,))
