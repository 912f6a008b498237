"""A model too large for memory is a usage error naming the size option, not torch's allocator traceback."""

from __future__ import annotations

import pytest
import torch

from accelbatch.agents import TorchAgent
from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts


class _Failing(TorchAgent):
    """build_model raises what it is given."""

    error: BaseException = RuntimeError()

    def build_model(self) -> torch.nn.Module:
        raise self.error


def test_an_embedding_too_large_for_host_memory_is_one_line_naming_esz(capsys):
    # 100,000,000 x 32,768 float32 = 13 TB: torch's CPU allocator refuses it at once
    code = main(["train", "-t", "dialogues:20", "-m", "bag", "-esz", "100000000", "-tstep", "1", "--no-progress",
                 "--eval-splits", ""])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]  # one line, no traceback
    assert "-m bag: its model does not fit in memory" in err and err.strip().endswith(
        "make it smaller (-esz/--embedding-size 100000000)")  # the truncations do not size a bag of words


def test_a_device_out_of_memory_names_what_torch_asked_for():
    _Failing.error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB "
                                            "total capacity)")
    with pytest.raises(OptionError, match=r"does not fit in memory \(torch tried to allocate 20.00 GiB\)"):
        _Failing(Opts(model="mine", embedding_size=8))


def test_other_errors_of_build_model_keep_their_type():
    _Failing.error = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _Failing(Opts(model="mine"))


def test_a_model_too_large_for_its_label_truncate_names_it(capsys):
    # a generator embeds every position a reply may have: --label-truncate 10**12 asked for 256 TB
    code = main(["train", "-t", "dialogues:20", "-m", "transformer/generator", "--label-truncate", str(10**12),
                 "-tstep", "1", "--no-progress", "--eval-splits", ""])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert "does not fit in memory" in err and f"--label-truncate {10**12}" in err, err
