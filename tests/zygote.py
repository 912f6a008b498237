"""Faster subprocesses for the suite: ``python -m accelbatch ...`` and ``python script.py ...`` forked from a
process that has already imported torch and accelbatch's command line, in place of a fresh interpreter.

About half of the suite's CPU time went to importing torch (2 s per process on CI's cores), and the suite
starts about 190 such runs. A forked run is still a real process: its own pid, session (when asked), standard
streams, working folder, environment and sys.path, a child of the preloading process; tests signal, kill, wait
for and read it through ``subprocess.Popen`` as before. It differs from a fresh interpreter in what was
imported before the fork (torch, torch._dynamo, ``accelbatch.cli`` and what they import), the hash seed,
and a script's ``sys.argv[0]`` (its absolute path).

Anything that depends on more of a fresh interpreter starts one as before: other interpreter flags (``-c``,
``-X``, ...), a preexec_fn, pass_fds, close_fds=False, a user or group change, ``PYTHON*`` or locale variables
other than this process's (but a PYTHONPATH with no sitecustomize, where this process has none). So do tests
marked ``fresh_processes``, and every test when ``ACCELBATCH_TEST_FRESH_PROCESSES=1``.

The preloading process starts before a pytest process's first test (tests/conftest.py; else at its first forked
run) and ends with it."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF_ENV = "ACCELBATCH_TEST_FRESH_PROCESSES"
_MESSAGE_BYTES = 1 << 20


class _Client:
    """This pytest process's side: the preloading process's socket, and the pids of the runs it forked (with
    their environment: /proc/PID/environ of a forked process shows the preloader's)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.path = ""
        self.enabled = hasattr(socket, "send_fds") and os.environ.get(OFF_ENV) != "1"
        self.paused = False
        self.forked_env: dict[int, dict[str, str]] = {}
        self.forks = 0  # runs forked so far

    def start(self) -> None:
        folder = tempfile.mkdtemp(prefix="accelbatch-zygote-")
        self.path = os.path.join(folder, "socket")
        log = open(os.path.join(folder, "log"), "wb")  # noqa: SIM115 - the preloader's, closed with it
        # not through the recording Popen: the preloader is the suite's own; its stdout is no terminal, so its
        # forked runs buffer their stdout as a fresh interpreter writing to a pipe or file does
        self.process = _OriginalPopen([sys.executable, os.path.abspath(__file__), self.path], cwd=ROOT,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        ready, deadline = os.path.join(folder, "ready"), time.monotonic() + 120
        while not os.path.exists(ready):
            if self.process.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(folder, "log"), encoding="utf-8", errors="replace") as handle:
                    said = handle.read()[-2000:]
                raise RuntimeError(f"the preloading process did not start ({self.process.returncode}): {said}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        if self.path:
            folder = os.path.dirname(self.path)
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)
        self.process, self.path = None, ""


_ORIGINAL_EXECUTE_CHILD = subprocess.Popen._execute_child  # type: ignore[attr-defined]
_ORIGINAL_POPEN_INIT = subprocess.Popen.__init__


class _OriginalPopen(subprocess.Popen):
    """Popen as the standard library has it, whatever a test has patched."""

    __init__ = _ORIGINAL_POPEN_INIT  # type: ignore[assignment]
    _execute_child = _ORIGINAL_EXECUTE_CHILD  # type: ignore[assignment]


CLIENT = _Client()


def _python_vars(env: Any) -> dict[str, str]:
    """What a fresh interpreter reads at its start: PYTHON* variables and the locale."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LC_")) or k == "LANG"}


def _entry(args: Any, cwd: Any) -> dict[str, str] | None:
    """What the command runs: the accelbatch module, or a script file (its absolute path); None for others."""
    if [str(a) for a in args[1:3]] == ["-m", "accelbatch"]:
        return {"module": "accelbatch"}
    script = os.path.join(os.fspath(cwd or os.getcwd()), os.fspath(args[1]))
    if str(args[1]).endswith(".py") and os.path.isfile(script):
        return {"script": os.path.abspath(script)}
    return None


def _customizes_startup(pythonpath: str, cwd: Any) -> bool:
    """Whether a folder of ``pythonpath`` holds a sitecustomize or usercustomize module, which a fresh
    interpreter runs as it starts."""
    for folder in pythonpath.split(os.pathsep) if pythonpath else []:
        path = os.path.join(os.fspath(cwd or os.getcwd()), folder)
        if any(os.path.exists(os.path.join(path, name)) for name in
               ("sitecustomize.py", "sitecustomize", "usercustomize.py", "usercustomize")):
            return True
    return False


def _forkable(args: Any, call: dict[str, Any]) -> dict[str, str] | None:
    """What the preloader would run (:func:`_entry`) for a command it can fork (see the module docstring);
    None for one that needs a fresh interpreter."""
    if not (CLIENT.enabled and not CLIENT.paused and isinstance(args, (list, tuple)) and len(args) >= 2):
        return None
    if str(args[0]) != sys.executable or call["shell"]:
        return None
    if call["preexec_fn"] is not None or call["pass_fds"] or not call["close_fds"]:
        return None
    if call["executable"] not in (None, sys.executable) or not call.get("restore_signals", True):
        return None
    if call["cwd"] is not None and not os.path.isdir(call["cwd"]):  # Popen's own error for a missing folder
        return None
    if any(call.get(k) not in (None, -1) for k in ("gid", "gids", "uid", "umask", "process_group")):
        return None
    env = os.environ if call["env"] is None else call["env"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    ours, theirs = _python_vars(dict(os.environ)), _python_vars(dict(env))
    if "PYTHONPATH" not in ours and not _customizes_startup(theirs.get("PYTHONPATH", ""), call["cwd"]):
        theirs.pop("PYTHONPATH", None)  # the forked run puts its folders where a fresh interpreter would
    if theirs != ours:
        return None
    return _entry(args, call["cwd"])


def _execute_child(self: subprocess.Popen, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                   startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                   restore_signals, *rest, **kw) -> None:
    names = ("gid", "gids", "uid", "umask", "start_new_session", "process_group")
    extra = dict(zip(names, rest), **kw)
    call = dict(executable=executable, preexec_fn=preexec_fn, close_fds=close_fds, pass_fds=pass_fds, env=env,
                cwd=cwd, shell=shell, restore_signals=restore_signals, **extra)
    entry = _forkable(args, call)
    if entry is None:
        return _ORIGINAL_EXECUTE_CHILD(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                                       errread, errwrite, restore_signals, *rest, **kw)
    if CLIENT.process is None:
        CLIENT.start()
    env = dict(os.environ if env is None else env)
    request = {**entry, "argv": [str(a) for a in args[3 if "module" in entry else 2:]],
               "cwd": os.path.abspath(os.fspath(cwd or os.getcwd())),
               "env": env, "new_session": bool(extra.get("start_new_session"))}
    streams = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(CLIENT.path)
        socket.send_fds(conn, [json.dumps(request).encode()], streams)
        reply = json.loads(conn.recv(_MESSAGE_BYTES) or b"{}")
    except BaseException:
        conn.close()
        raise
    finally:
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
    if "pid" not in reply:
        conn.close()
        raise OSError(f"the preloading process ended before forking {args!r} "
                      f"(its log: {os.path.join(os.path.dirname(CLIENT.path), 'log')})")
    self.pid = reply["pid"]
    self._child_created = True  # type: ignore[attr-defined]
    CLIENT.forked_env[self.pid] = env
    CLIENT.forks += 1
    status_of = _Status(self, conn)
    self._internal_poll = status_of.poll  # type: ignore[method-assign]
    self._wait = status_of.wait  # type: ignore[method-assign]


class _Status:
    """A forked run's exit status, which its parent (the preloader) sends when it has reaped it."""

    def __init__(self, popen: subprocess.Popen, conn: socket.socket) -> None:
        self.popen, self.conn = popen, conn

    def _read(self, timeout: float | None) -> bool:
        if self.popen.returncode is not None:
            return True
        with selectors.DefaultSelector() as selector:
            selector.register(self.conn, selectors.EVENT_READ)
            if not selector.select(timeout):
                return False
        message = self.conn.recv(_MESSAGE_BYTES)
        self.conn.close()
        status = json.loads(message)["status"] if message else 255 << 8
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        CLIENT.forked_env.pop(self.popen.pid, None)
        return True

    def poll(self, *args: Any, **kwargs: Any) -> int | None:
        self._read(0)
        return self.popen.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read(timeout):
            raise subprocess.TimeoutExpired(self.popen.args, timeout)
        return self.popen.returncode  # type: ignore[return-value]


def install() -> None:
    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]


def forked_pids_with(variable: str) -> set[int]:
    """Live runs forked for this process whose environment holds ``variable`` (``NAME=value``)."""
    name, _, value = variable.partition("=")
    return {pid for pid, env in list(CLIENT.forked_env.items()) if env.get(name) == value}


# --- the preloading process --------------------------------------------------------------------------------


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _fresh_stdio() -> None:
    """sys.stdin/stdout/stderr built over the new fds 0-2 as the interpreter builds them at its start (the
    preloader's were built over other files: a /dev/null stdout is seekable, a pipe is not)."""
    import io

    streams = []
    for fd, old in enumerate((sys.stdin, sys.stdout, sys.stderr)):
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        streams.append(io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors, newline="\n",
                                        line_buffering=fd > 0 and (fd == 2 or raw.isatty())))
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]


def _run_forked(request: dict[str, Any], streams: list[int], started: int) -> None:
    """In the forked child: become ``python -m accelbatch ARGV`` (or ``python SCRIPT ARGV``) started with the
    request's streams, folder, environment and session, run it, and exit as the interpreter would."""
    import atexit
    import runpy
    import threading

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in set(streams):
        if fd > 2:
            os.close(fd)
    _fresh_stdio()
    os.chdir(request["cwd"])
    # PYTHONPATH's folders follow the script's folder, made absolute as the interpreter makes them (an empty
    # entry is the working folder, an empty PYTHONPATH none); a preloader started with a PYTHONPATH forks only
    # runs with that one, in _FRESH_PATH
    given = "" if "PYTHONPATH" in os.environ else request["env"].get("PYTHONPATH", "")
    added = [os.path.abspath(p) for p in given.split(os.pathsep)] if given else []
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    sys.argv = [script or "-m", *request["argv"]]
    # as the interpreter has it: a script's folder first, or (`python -m`) the working folder
    sys.path[:] = [os.path.dirname(script) if script else request["cwd"], *added, *_FRESH_PATH]
    os.close(started)
    code, interrupted = 0, False
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 130, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # the interpreter's own exit: wait for non-daemon threads, run atexit, flush the streams
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # an uncaught Ctrl-C ends a Python process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


_FRESH_PATH: list[str] = []  # the preloader's sys.path after its own script folder


def serve(path: str) -> None:
    """Preload, then fork one run per request on ``path``; send each requester its run's pid, then its exit
    status once reaped."""
    # torch's optimizers import torch._dynamo when the first one is made (torch._disable_dynamo): about 2 s of
    # CPU, as much as importing torch, in every run that trains
    import torch._dynamo  # noqa: F401

    import accelbatch.cli  # noqa: F401 - the preload: torch and the command line

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    open(os.path.join(os.path.dirname(path), "ready"), "w").close()
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.fileobj is server:
                conn, _ = server.accept()
                message, streams, _, _ = socket.recv_fds(conn, _MESSAGE_BYTES, 3)
                sys.stdout.flush()
                sys.stderr.flush()
                started_r, started_w = os.pipe()  # the child closes it once set up, as exec's success does
                pid = os.fork()
                if pid == 0:
                    os.close(started_r)
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(sig, signal.SIG_DFL)
                    selector.close()
                    server.close()
                    conn.close()
                    for other in waiting.values():
                        other.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    try:
                        _run_forked(json.loads(message), streams, started_w)
                    finally:  # never back into this loop
                        os._exit(1)
                os.close(started_w)
                os.read(started_r, 1)
                os.close(started_r)
                for fd in streams:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                waiting[pid] = conn
            else:
                os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"status": status}).encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    _FRESH_PATH[:] = sys.path[1:]
    serve(sys.argv[1])
