"""bench/poptorch_tests.py: its failure categories, JUnit parsing and bad-input errors (no PopTorch run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "poptorch_tests.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("poptorch_tests_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("test_id, message, category", [
    ("t::test_x", "AttributeError: module 'poptorch' has no attribute 'Block'", "NEEDS_FEATURES"),
    ("t::test_x", "AttributeError: module 'poptorch.poptorch_core' has no attribute '_validateOptions'",
     "NEEDS_INTERNALS"),
    ("t::test_custom_batch_sampler[a]", "TypeError: object.__init__() takes exactly one argument",
     "NEEDS_SDK_TORCH"),
    ("t::test_rebatch[a]", "AssertionError: assert 3 == 4", "REAL_DEFECT"),
    # the options test that also sets PipelinedExecution fails on the validator, an internal
    ("t::test_set_options", "setExecutionStrategy(poptorch.PipelinedExecution())\nAttributeError: module "
     "'poptorch.poptorch_core' has no attribute '_validateOptions'", "NEEDS_INTERNALS"),
    # automatic loss scaling and anchors are emulated: their failures are defects
    ("t::test_automatic_loss_scaling[a]", "opts.anchorTensor('ls_final', 'finalLossScale')\nAssertionError",
     "REAL_DEFECT"),
])
def test_failures_are_categorised(script, test_id, message, category):
    outcome = script.Outcome(test_id, "failed", message)
    assert script.categorise(outcome) == getattr(script, category)


def test_junit_outcomes_are_counted(script, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.a" name="ok"/>'
                   '<testcase classname="tests.a" name="bad"><failure message="boom">trace</failure></testcase>'
                   '<testcase classname="tests.a" name="err"><error message="setup"/></testcase>'
                   '<testcase classname="tests.b" name="skip"><skipped message="hw"/></testcase>'
                   '</testsuite></testsuites>')
    summary = script.parse_junit(xml)
    assert (summary.count("passed"), summary.count("failed"), summary.count("skipped")) == (1, 2, 1)
    assert "1 passed, 2 failed, 1 skipped, 4 in all" in script.report(summary)


def test_missing_test_files_are_one_line_errors(script, tmp_path, capsys):
    assert script.main(["--poptorch-src", str(tmp_path)]) == 2
    assert "batching_test.py not found" in capsys.readouterr().err
    assert script.main(["--git-dir", str(tmp_path / "nope")]) == 2
    assert "--git-dir" in capsys.readouterr().err


MIRROR = Path("/work/.mirror/graphcore+poptorch/repo")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not MIRROR.is_dir(), reason="no local graphcore/poptorch mirror")
def test_poptorch_outputs_tests_pass_on_the_emulator():
    import subprocess

    proc = subprocess.run([sys.executable, str(SCRIPT), "--git-dir", str(MIRROR), "--ref", "sdk-release-3.3",
                           "--", "-k", "outputs_test"], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "6 passed, 0 failed, 0 skipped, 6 in all" in proc.stdout
