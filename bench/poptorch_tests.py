"""Run PopTorch's own test files against the emulator through a module alias.

PopTorch's ``tests/batching_test.py``, ``outputs_test.py``, ``options_test.py``, ``dataloader_test.py``,
``buffers_test.py``, ``inputs_test.py`` and the forward ops' ``slice_test.py``, ``loop_test.py``, ``if_test.py``,
``ipu_print_tensor_test.py`` (with their ``conftest.py`` and ``helpers.py``) are copied, unmodified, from a
graphcore/poptorch checkout or exported from a git dir into a temporary directory, next to a ``poptorch.py``
that makes ``import poptorch`` (and ``poptorch.enums``, ``poptorch.optim``, ``poptorch.options``,
``poptorch.poptorch_core``) resolve to ``accelbatch.backends.poptorch_emulator``, in pytest and in the data
workers it starts. It also gives ``torch.utils.data.Sampler`` back the ``__init__(data_source)`` of torch 2.0.1
(the SDK's torch), which the tests' batch samplers call. Pytest runs there; the script prints the passed /
failed / skipped counts and each failure under a category (needs custom batch types, the SDK's torch, features
the emulator leaves out, PopTorch's internals, or a real emulator defect). Nothing is fetched and nothing is
written to the tree.

    .venv/bin/python bench/poptorch_tests.py --git-dir /work/.mirror/graphcore+poptorch/repo --ref sdk-release-3.3
    .venv/bin/python bench/poptorch_tests.py --poptorch-src ~/src/poptorch [--keep DIR] [-- -k rebatch]

Exit status: 0 when every failure falls in an expected category, 1 when any is a real defect, 2 on bad input
or when the run passed ``--timeout``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_FILES = ("batching_test.py", "outputs_test.py", "options_test.py", "dataloader_test.py", "slice_test.py",
              "loop_test.py", "if_test.py", "ipu_print_tensor_test.py", "buffers_test.py", "inputs_test.py")
SUPPORT_FILES = ("conftest.py", "helpers.py")
PLUGIN = "_poptorch_emulator_alias"

# ``poptorch.py`` in the run directory: importing it puts the emulator (and its submodules) in its place. A
# module file rather than a conftest, so that data workers started with spawn or forkserver, which import
# the test modules again, resolve ``import poptorch`` the same way.
ALIAS_SOURCE = '''"""``import poptorch`` gives accelbatch's emulator (written by bench/poptorch_tests.py)."""
import importlib
import sys

_EMU = "accelbatch.backends.poptorch_emulator"
sys.modules[__name__] = importlib.import_module(_EMU)
for _name in ("enums", "optim", "options", "poptorch_core"):
    sys.modules[__name__ + "." + _name] = importlib.import_module(_EMU + "." + _name)

# PopTorch 3.3's tests subclass torch 2.0.1's Sampler, whose __init__ took the data source; later torch
# dropped it (the subclasses' super().__init__(None) then fails): give it back, doing nothing, as it did.
import torch.utils.data as _data
if _data.Sampler.__init__ is object.__init__:
    def _sampler_init(self, data_source=None):
        pass
    _data.Sampler.__init__ = _sampler_init
'''
# The pytest plugin (``-p``): imports the alias before PopTorch's conftest does.
PLUGIN_SOURCE = "import poptorch  # noqa: F401\n"

NEEDS_BATCH_TYPES = "needs custom batch types"
NEEDS_SDK_TORCH = "needs the SDK's torch 2.0.1 (run the script with .ci/sdk_stack's .venv-sdk python)"
NEEDS_FEATURES = ("needs PopTorch features the emulator leaves out (pipelining, PopART profiles / proto files, "
                  "copyNamedBuffersToDevice)")
NEEDS_INTERNALS = "needs PopTorch internals (private attributes, poptorch_core functions, log output)"
REAL_DEFECT = "real defect"

# (category, pattern searched in "<test id>\n<failure message>"); the first match wins.
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    (NEEDS_BATCH_TYPES, r"registerCustomArgParser|ICustomArgParser|CustomArgParser"),
    # torch.utils.data.Sampler.__init__ took a data_source argument until torch 2.2
    (NEEDS_SDK_TORCH, r"object\.__init__\(\) takes exactly one argument"),
    # PopTorch's C++ option validator, the PopART IR, and its DEBUG log (what the options file set)
    (NEEDS_INTERNALS, r"_validateOptions|_debugGetPopartIR|test_set_options_from_file|test_override_options_from_file"),
    (NEEDS_FEATURES, r"\b(Block|BeginBlock|Stage|AutoStage|ShardedExecution|PipelinedExecution|SerialPhasedExecution"
                     r"|ParallelPhasedExecution|setExecutionStrategy|_execution_strategy)\b"),
    (NEEDS_FEATURES, r"test_export_proto_file|test_profile_report|copyNamedBuffersToDevice|updatableNamedBuffers"),
    (NEEDS_INTERNALS, r"poptorch\._logging|poptorch\._impl|_validateOptions|propagateInputShapes"
                      r"|has no attribute '_worker'|PID could not be captured"),
    (NEEDS_INTERNALS, r"test_popart_partials|test_running_statistics"),  # they read PopTorch's TRACE log
)
@dataclass
class Outcome:
    """One test's result: ``passed``, ``failed`` (errors included) or ``skipped``, and the failure text."""

    test_id: str
    status: str
    message: str = ""


@dataclass
class Summary:
    """Counts and categorised failures of one run."""

    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def failures_by_category(self) -> dict[str, list[Outcome]]:
        groups: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            if o.status == "failed":
                groups.setdefault(categorise(o), []).append(o)
        return groups


def categorise(outcome: Outcome) -> str:
    """The category of a failed test, from its id and failure message."""
    text = f"{outcome.test_id}\n{outcome.message}"
    for category, pattern in CATEGORY_RULES:
        if re.search(pattern, text):
            return category
    return REAL_DEFECT


def export_tests(dest: Path, src: Path | None, git_dir: Path | None, ref: str) -> None:
    """Copy (or ``git show``) PopTorch's test files into ``dest``; raises ValueError naming what is missing."""
    names = TEST_FILES + SUPPORT_FILES
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if src is not None:
            path = src / "tests" / name
            if not path.is_file():
                raise ValueError(f"--poptorch-src: {path} not found; give the root of a graphcore/poptorch checkout")
            shutil.copyfile(path, dest / name)
        else:
            proc = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{ref}:tests/{name}"],
                                  capture_output=True)
            if proc.returncode != 0:
                raise ValueError(f"--git-dir/--ref: tests/{name} not found at {ref} in {git_dir}; "
                                 "give a graphcore/poptorch git dir and one of its branches")
            (dest / name).write_bytes(proc.stdout)


def parse_junit(path: Path) -> Summary:
    """The outcomes recorded in a pytest JUnit XML file."""
    summary = Summary()
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
                break
            if child.tag == "skipped":
                status, message = "skipped", child.get("message", "")
        summary.outcomes.append(Outcome(test_id, status, message))
    return summary


def run_pytest(workdir: Path, extra: list[str], timeout: float) -> Summary:
    """Run PopTorch's test files in ``workdir`` with the alias plugin; the parsed outcomes."""
    (workdir / "poptorch.py").write_text(ALIAS_SOURCE)
    (workdir / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    (workdir / "pytest.ini").write_text("[pytest]\n")
    tests = workdir / "tests"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), str(tests), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    # some tests start ``python3 -m pytest ...``: let that be this interpreter, with the alias on its path
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    junit = workdir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={junit}", *[f"tests/{name}" for name in TEST_FILES], *extra]
    subprocess.run(cmd, cwd=workdir, env=env, timeout=timeout, check=False)
    if not junit.is_file():
        raise RuntimeError("pytest wrote no results: see its output above")
    return parse_junit(junit)


def first_line(message: str) -> str:
    """The first non-empty line of a failure message, shortened."""
    for line in message.splitlines():
        if line.strip():
            return line.strip()[:160]
    return ""


def report(summary: Summary) -> str:
    """Counts and the categorised failure list as text."""
    total = len(summary.outcomes)
    lines = [f"PopTorch tests against the emulator: {summary.count('passed')} passed, "
             f"{summary.count('failed')} failed, {summary.count('skipped')} skipped, {total} in all"]
    for category, outcomes in sorted(summary.failures_by_category().items()):
        lines.append(f"\n{category} ({len(outcomes)}):")
        lines.extend(f"  {o.test_id}: {first_line(o.message)}" for o in outcomes)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--poptorch-src", type=Path, help="root of a graphcore/poptorch checkout (holds tests/)")
    src.add_argument("--git-dir", type=Path, help="a graphcore/poptorch git dir (bare or .git); see --ref")
    p.add_argument("--ref", default="sdk-release-3.3", help="branch or commit read from --git-dir")
    p.add_argument("--keep", type=Path, help="run in this directory (created) and keep it")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole pytest run")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds for one test (pytest-timeout)")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest after --, e.g. -- -k rebatch")
    return p.parse_args(argv)


def _ended_by(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: subprocess.run kills pytest, the temporary folder is removed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (timeout, a job's end) leaves no copy of PopTorch's files; the caller's handler comes back after
    previous = signal.signal(signal.SIGTERM, _ended_by)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    """Export the tests, run them, print the report; the exit status."""
    if args.git_dir is not None and not args.git_dir.is_dir():
        print(f"--git-dir: {args.git_dir} is not a directory", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="poptorch_tests_") as tmp:
        workdir = args.keep if args.keep is not None else Path(tmp)
        try:
            export_tests(workdir / "tests", args.poptorch_src, args.git_dir, args.ref)
        except ValueError as err:
            print(err, file=sys.stderr)
            return 2
        extra = [f"--timeout={args.test_timeout}", *args.pytest_args]
        try:
            summary = run_pytest(workdir, extra, args.timeout)
        except subprocess.TimeoutExpired:  # run() killed pytest; leaving the block removes the folder
            print(f"--timeout: the pytest run passed {args.timeout:g} s and was stopped; give a larger --timeout "
                  "or fewer tests (-- -k ...)", file=sys.stderr)
            return 2
    print(report(summary))
    return 1 if REAL_DEFECT in summary.failures_by_category() else 0


if __name__ == "__main__":
    sys.exit(main())
