"""An exception from the user's agent during training ends ``ab.run`` with no process left behind, even while
the caller keeps the exception's traceback (as a REPL or Jupyter does): the validation world's data process
(``--dataloader-mode async``) is shut down however training ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
ROOT = str(Path(__file__).resolve().parent.parent)

AGENTS = '''
from accelbatch.models.bag import BagAgent

class FailsOnStep2(BagAgent):
    steps = 0
    def replies(self, outputs, observations):
        type(self).steps += 1
        if type(self).steps == 2:
            raise ValueError("my bug on step 2")
        return super().replies(outputs, observations)
'''

SCRIPT = '''
import multiprocessing as mp, time
import accelbatch as ab

def main():
    opts = ab.Opts(task="babi:1", batchsize=4, dataloader_mode="async", model="cleanup_agents:FailsOnStep2",
                   progress=False)
    try:
        ab.run(ab.create_world(opts), opts)
    except ValueError as error:
        kept = error.__traceback__  # held, as the REPL keeps sys.last_traceback
        print("raised:", error)
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("children left:", [p.name for p in mp.active_children()])

if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_error_in_training_leaves_no_data_process_while_its_traceback_is_kept(tmp_path):
    (tmp_path / "cleanup_agents.py").write_text(AGENTS, encoding="utf-8")
    (tmp_path / "script.py").write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert "raised: my bug on step 2" in done.stdout, (done.stdout, done.stderr)
    assert "children left: []" in done.stdout, (done.stdout, done.stderr)
