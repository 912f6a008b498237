"""The main-module guard in the forms scripts write it (``and``, ``elif``, ``!=`` with the code in ``else``,
either operand order, nested in ``if True:`` or ``try``), judged against running the script as a spawn child
would (``__name__ == "__mp_main__"``); and an agent class defined in a ``__main__`` without a file (``python
-c``, a REPL, a notebook), which the child processes cannot import, refused in one line before any starts."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from accelbatch.main_guard import check_main_guard, unguarded_line
from accelbatch.opts import OptionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}

# each form calls hit() on its one line that runs in the parent (where __name__ == "__main__")
FORMS = {
    "and": 'if __name__ == "__main__" and len(sys.argv) > 0:\n    hit()\n',
    "and, guard second": 'if len(sys.argv) > 0 and __name__ == "__main__":\n    hit()\n',
    "reversed": 'if "__main__" == __name__:\n    hit()\n',
    "one line": 'if __name__ == "__main__": hit()\n',
    "elif": 'if len(sys.argv) < 0:\n    pass\nelif __name__ == "__main__":\n    hit()\n',
    "!= with else": 'if __name__ != "__main__":\n    pass\nelse:\n    hit()\n',
    "elif != with else": 'if len(sys.argv) < 0:\n    pass\nelif __name__ != "__main__":\n    pass\nelse:\n    hit()\n',
    "not !=": 'if not __name__ != "__main__":\n    hit()\n',
    "or of guards": 'if __name__ == "__main__" or "__main__" == __name__:\n    hit()\n',
    "in if True": 'if True:\n    if __name__ == "__main__":\n        hit()\n',
    "in try": 'try:\n    if __name__ == "__main__":\n        hit()\nexcept ImportError:\n    pass\n',
    "in with": 'with open(__file__):\n    if __name__ == "__main__":\n        hit()\n',
    "bare": "hit()\n",
    "or": 'if __name__ == "__main__" or len(sys.argv) > 0:\n    hit()\n',
    "not of a guard": 'if not (__name__ == "__main__" and len(sys.argv) < 0):\n    hit()\n',
    "else of a guard": 'if __name__ == "__main__" and len(sys.argv) < 0:\n    pass\nelse:\n    hit()\n',
    "body of !=": 'if __name__ != "__main__" or len(sys.argv) > 0:\n    hit()\n',
    "other name": 'if __name__ == "__mp_main__" or len(sys.argv) > 0:\n    hit()\n',
    "in if True, unguarded": 'if True:\n    hit()\n',
    "in try, unguarded": 'try:\n    hit()\nexcept ImportError:\n    pass\n',
    "in except": 'try:\n    import no_such_module_here\nexcept ImportError:\n    hit()\n',
}


def _runs(text: str, name: str, path: str) -> list[int]:
    """The lines hit() was called from when ``text`` runs with ``__name__ == name`` (a hand-made namespace)."""
    lines: list[int] = []
    scope = {"__name__": name, "__file__": path, "sys": sys, "hit": lambda: lines.append(sys._getframe(1).f_lineno)}
    exec(compile(text, path, "exec"), scope)
    return lines


@pytest.mark.parametrize("form", list(FORMS))
def test_a_line_is_refused_exactly_when_a_spawn_child_would_run_it(tmp_path, monkeypatch, form):
    path = tmp_path / "script.py"
    text = "import sys\n" + FORMS[form]
    path.write_text(text)
    in_parent = _runs(text, "__main__", str(path))
    in_child = _runs(text, "__mp_main__", str(path))  # the reference: what a spawn child runs
    assert len(in_parent) == 1
    module = types.ModuleType("__main__")
    module.__file__, module.__spec__ = str(path), None
    monkeypatch.setitem(sys.modules, "fake_main", module)
    found: list[tuple[str, int] | None] = []
    vars(module).update(sys=sys, hit=lambda: found.append(unguarded_line(module)))
    exec(compile(text, str(path), "exec"), vars(module))
    assert found == [(str(path), in_parent[0]) if in_child else None]


def _file_less_main(monkeypatch) -> None:
    """``__main__`` as ``python -c`` and a REPL have it: no file, no spec."""
    module = types.ModuleType("__main__")
    module.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", module)


def test_what_children_must_import_from_a_file_less_main_is_refused_naming_it(monkeypatch):
    mine = type("Mine", (), {"__module__": "__main__"})
    imported = type("Fine", (), {"__module__": "some_module"})
    _file_less_main(monkeypatch)
    for thing in (mine, mine(), "__main__:Mine", "torch:__main__:Mine"):
        with pytest.raises(OptionError, match=r"^-nt/--numthreads 2 starts processes that must import Mine, .*"
                                              r"define Mine in a module file \(e\.g\. mine\.py\)"):
            check_main_guard("-nt/--numthreads 2", [imported, thing])
    check_main_guard("-nt/--numthreads 2", [imported, imported(), "bag", "torch:pkg.mod:Net", "tests:Mine"])
    check_main_guard("-nt/--numthreads 2")  # nothing named: nothing to refuse


def test_a_main_children_import_is_not_refused(monkeypatch, tmp_path):
    mine = type("Mine", (), {"__module__": "__main__"})
    script = types.ModuleType("__main__")
    script.__file__, script.__spec__ = str(tmp_path / "run.py"), None  # a script file: children run it too
    monkeypatch.setitem(sys.modules, "__main__", script)
    check_main_guard("--dataloader-mode async", [mine])


INLINE = """\
import accelbatch as ab
from accelbatch.models.bag import BagAgent
class Mine(BagAgent):
    pass
opts = ab.Opts(task="babi:1", batchsize=8, max_train_steps=2, progress=False, eval_splits="",
               validation_every_n_epochs=-1, **{kind})
ab.run(ab.create_world(opts, {agent}), opts)
print("trained", flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, agent, option", [
    ('{"numthreads": 2}', "Mine", "-nt/--numthreads 2"),
    ('{"numthreads": 2, "model": "__main__:Mine"}', "None", "-nt/--numthreads 2"),
    ('{"dataloader_mode": "async"}', "Mine", "--dataloader-mode async")])
def test_an_agent_class_defined_in_python_c_is_refused_in_one_line_before_any_process_starts(kind, agent, option):
    ran = subprocess.run([sys.executable, "-c", INLINE.format(kind=kind, agent=agent)], capture_output=True,
                         text=True, timeout=100, env=ENV)
    assert ran.returncode != 0 and "trained" not in ran.stdout
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith(f"accelbatch.opts.OptionError: {option} starts processes that must import Mine"), \
        ran.stderr[-3000:]
    assert "mine.py" in last
    assert ran.stderr.count("Traceback") == 1 and "Can't get attribute" not in ran.stderr  # none from a child


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, option", [('{"numthreads": 2}', "-nt/--numthreads 2"),
                                          ('{"dataloader_mode": "async"}', "--dataloader-mode async")])
def test_a_script_read_from_stdin_is_refused_in_one_line_before_any_process_starts(kind, option):
    """`python - < script.py` with a built-in agent: each child looked for a file named '<stdin>' and the run
    ended with 'hogwild process 0 ... exited with code 1 without reporting an error'."""
    ran = subprocess.run([sys.executable, "-"], input=INLINE.format(kind=kind, agent="None"), capture_output=True,
                         text=True, timeout=100, env=ENV)
    assert ran.returncode != 0 and "trained" not in ran.stdout
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith(f"accelbatch.opts.OptionError: {option} starts processes that run the calling "
                           "script's file to start"), ran.stderr[-3000:]
    assert "read from <stdin> (python -)" in last and "save the script to a file" in last
    assert ran.stderr.count("Traceback") == 1 and "FileNotFoundError" not in ran.stderr  # none from a child


GUARDED_FILE = """\
import sys
import accelbatch as ab
from accelbatch.models.bag import BagAgent


class Mine(BagAgent):
    pass


def main():
    opts = ab.Opts(task="babi:1", batchsize=8, max_train_steps=2, progress=False, eval_splits="",
                   validation_every_n_epochs=-1, numthreads=2)
    ab.run(ab.create_world(opts, Mine), opts)
    print("trained", flush=True)


if __name__ == "__main__" and len(sys.argv) > 0:
    main()
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_guarded_with_and_defining_its_agent_trains_with_hogwild_processes(tmp_path):
    path = tmp_path / "guarded_and.py"
    path.write_text(GUARDED_FILE)
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=100, env=ENV,
                         cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.count("trained") == 1, ran.stderr[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_python_c_with_an_agent_the_async_worker_never_gets_still_trains():
    """An agent that overrides observe() has its batches built in the main process: nothing to refuse."""
    code = INLINE.replace("    pass\n", "    def observe(self, obs):\n        return super().observe(obs)\n")
    ran = subprocess.run([sys.executable, "-c", code.format(kind='{"dataloader_mode": "async"}', agent="Mine")],
                         capture_output=True, text=True, timeout=100, env=ENV)
    assert ran.returncode == 0 and ran.stdout.count("trained") == 1, ran.stderr[-3000:]

