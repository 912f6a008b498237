"""A run that starts processes leaves multiprocessing's default start method as the script had it: unset,
so that the script can still choose one with multiprocessing.set_start_method."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent("""
    import multiprocessing
    import accelbatch as ab

    if __name__ == "__main__":
        for extra in (dict(num_workers=2), dict(dataloader_mode="async"), dict(numthreads=2)):
            opts = dict(task="dialogues:20", model="bag", batchsize=4, num_epochs=1, eval_splits="valid",
                        progress=True, **extra)
            ab.run(ab.create_world(opts), opts)
            print("after:", multiprocessing.get_start_method(allow_none=True))
        multiprocessing.set_start_method("spawn")  # what failed: "context has already been set"
        print("chosen:", multiprocessing.get_start_method())
""")

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runs_with_workers_async_and_hogwild_leave_the_default_start_method_unset(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("after: None") == 3 and "chosen: spawn" in done.stdout, done.stdout
