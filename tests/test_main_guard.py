"""A script that starts accelbatch's processes (async data accessor, hogwild, replicas: forkserver) must keep
its top-level code under ``if __name__ == "__main__":``, as Python's start methods re-run the script in each
child: refused in the parent naming the script and line, before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from accelbatch.main_guard import unguarded_line
from accelbatch.proc_errors import SCRIPT_RAN_AGAIN, describe_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
BODY = """\
import sys
import accelbatch as ab
kind = {"async": {"dataloader_mode": "async"}, "hogwild": {"numthreads": 2}, "workers": {"num_workers": 2}}[sys.argv[1]]
_ = sys.argv[1] == "workers" and __import__("multiprocessing").set_start_method("spawn")  # workers: not forked
opts = ab.Opts(task="babi:1", batchsize=8, max_train_steps=2, progress=False, eval_splits="",
               validation_every_n_epochs=-1, **kind)
world = ab.create_world(opts)
ab.run(world, opts)
print("trained", flush=True)
"""


def _script(tmp_path, guarded: bool):
    text = BODY if not guarded else "def main():\n" + textwrap.indent(BODY, "    ") + \
        "\n\nif __name__ == \"__main__\":\n    main()\n"
    path = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    path.write_text(text)
    return path


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, option", [("async", "--dataloader-mode async"), ("hogwild", "-nt/--numthreads 2"),
                                          ("workers", "--num-workers 2 (started by spawn)")])
def test_an_unguarded_script_is_refused_before_any_process_starts_and_a_guarded_one_trains(tmp_path, kind, option):
    ran = subprocess.run([sys.executable, str(_script(tmp_path, False)), kind], capture_output=True, text=True,
                         timeout=100, env=ENV, cwd=tmp_path)
    assert ran.returncode != 0 and "trained" not in ran.stdout
    last = ran.stderr.strip().splitlines()[-1]
    assert f"{option} starts processes that import unguarded.py" in last and "line 7" in last, ran.stderr[-2000:]
    assert "if __name__ ==" in last and "child process" not in ran.stderr  # no child started to find out
    ran = subprocess.run([sys.executable, str(_script(tmp_path, True)), kind], capture_output=True, text=True,
                         timeout=100, env=ENV, cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.count("trained") == 1, ran.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_calling_the_command_line_with_replicas_is_refused_before_any_process_starts(tmp_path):
    """``accelbatch.cli.main([... -rf 2])`` at a script's top level: each replica would run the script again to
    start (it ended with "replica 1 of 2 exited with code 1 without a Python traceback" after Python's
    bootstrapping error in the replica)."""
    script = tmp_path / "unguarded.py"
    script.write_text("import sys\nfrom accelbatch.cli import main\n\n"
                      "sys.exit(main(['train', '-t', 'babi:1', '-m', 'bag', '-tstep', '2', '-rf', '2', "
                      "'--no-progress', '--eval-splits', '', '-veps', '-1']))\n")
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=ENV,
                         cwd=tmp_path)
    assert ran.returncode == 2, ran.stderr[-2000:]
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "-rf/--replication-factor 2 starts processes that import unguarded.py" in lines[0] \
        and "line 4" in lines[0] and "if __name__ ==" in lines[0], ran.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_that_finds_itself_running_the_script_ends_with_a_code_the_parent_names():
    code = ("import multiprocessing; multiprocessing.current_process()._inheriting = True\n"
            "from accelbatch.main_guard import refuse_script_rerun; refuse_script_rerun(); print('went on')")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=ENV)
    assert ran.returncode == SCRIPT_RAN_AGAIN and "went on" not in ran.stdout
    assert "if __name__ ==" in ran.stderr
    assert "if __name__ ==" in describe_exit(SCRIPT_RAN_AGAIN) and "code 3" in describe_exit(3)


def test_a_call_outside_a_script_s_top_level_is_never_refused():
    assert unguarded_line() is None  # pytest's own __main__ runs under its guard, or is not a script


def test_the_line_found_is_the_top_level_line_outside_the_guard(tmp_path, monkeypatch):
    """A script's code run as a main module: the call on its line 3 is found, the one under the guard not."""
    import types

    path = tmp_path / "script.py"
    path.write_text("import sys\nfrom accelbatch.main_guard import unguarded_line\n"
                    "top = unguarded_line(sys.modules['fake_main'])\n"
                    "if __name__ == '__main__':\n    guarded = unguarded_line(sys.modules['fake_main'])\n")
    module = types.ModuleType("__main__")
    module.__file__, module.__spec__ = str(path), None
    monkeypatch.setitem(sys.modules, "fake_main", module)
    exec(compile(path.read_text(), str(path), "exec"), vars(module))
    assert module.top == (str(path), 3) and module.guarded is None
