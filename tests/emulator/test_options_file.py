"""Options.loadFromFile and the options the emulator records without effect (maxRepeatLogs, setPatterns,
disableModuleNamescope, syncPattern)."""

from __future__ import annotations

import pytest
from accelbatch.backends import poptorch_emulator as poptorch


def _write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines))
    return str(path)


def test_load_from_file_runs_one_call_a_line(tmp_path):
    path = _write(tmp_path, "a.conf", [
        "deviceIterations(3)",
        "  replicationFactor(2)",
        "",
        "# a comment",
        "Training.gradientAccumulation(4)  # inline comment",
        "outputMode(poptorch.OutputMode.Sum)",
    ])
    opts = poptorch.Options().loadFromFile(path)
    assert (opts.device_iterations, opts.replication_factor) == (3, 2)
    assert opts.Training.gradient_accumulation == 4
    assert opts.output_mode == poptorch.OutputMode.Sum


def test_a_second_file_overrides_only_what_it_sets(tmp_path):
    opts = poptorch.Options()
    opts.loadFromFile(_write(tmp_path, "a.conf", ["deviceIterations(2)", "replicationFactor(2)"]))
    opts.loadFromFile(_write(tmp_path, "b.conf", ["deviceIterations(5)"]))
    assert (opts.device_iterations, opts.replication_factor) == (5, 2)


def test_a_malformed_line_names_file_line_and_call(tmp_path):
    path = _write(tmp_path, "bad.conf", ["deviceIterations(1)", "# skipped", "", "outputMode(poptorch.OutputMode.All"])
    with pytest.raises(poptorch.ConfigFileError) as err:
        poptorch.Options().loadFromFile(path)
    assert str(err.value) == ("SyntaxError at line 2 of bad.conf: unexpected EOF while parsing\n"
                              "> options.outputMode(poptorch.OutputMode.All")
    assert poptorch.options.ConfigFileError is poptorch.ConfigFileError


def test_recorded_settings():
    opts = poptorch.Options()
    assert opts.max_repeat_logs == 4
    assert opts.maxRepeatLogs(None).max_repeat_logs == 2 ** 64 - 1
    assert opts.maxRepeatLogs(10).max_repeat_logs == 10
    opts._Popart.setPatterns({"PadSum": True}, 0)
    assert opts._Popart.options["patterns"] == {"PadSum": True} and opts._Popart.options["patterns_level"] == 0
    assert opts._module_namescope_enabled
    assert not opts.disableModuleNamescope()._module_namescope_enabled
    assert opts.sync_pattern == poptorch.SyncPattern.Full
    assert opts.syncPattern(poptorch.SyncPattern.SinglePipeline).sync_pattern == poptorch.SyncPattern.SinglePipeline
    assert opts.available_memory_proportion == {}
    opts.Training.setAutomaticLossScaling(True)
    assert opts._Popart.options["automaticLossScalingSettings.enabled"] is True
    opts._freeze()
    for setter in (lambda: opts.disableModuleNamescope(), lambda: opts.Training.setAutomaticLossScaling(False),
                   lambda: opts.anchorTensor("a", "b"), lambda: opts.maxRepeatLogs(1)):
        with pytest.raises(AttributeError, match="Can't modify frozen Options"):
            setter()
