"""Host allocator settings for training loops (``--host-allocator``): glibc's malloc only.

A training step allocates and frees the same few megabytes of tensors every step (activations, and the
gradients ``zero_grad`` sets to None). glibc's dynamic thresholds give the freed top of the heap back to the
operating system once it exceeds twice the largest block freed so far, so the next step takes those pages back
one page fault at a time. On the bag model (bs 32) that was about 1,000 minor faults per step, and the same
step ran at 25 or at 85 us per example depending on where the heap's top happened to lie.

``reuse`` serves blocks up to :data:`MMAP_THRESHOLD` from the heap (glibc's own dynamic ceiling on 64-bit
systems) and keeps up to :data:`TRIM_THRESHOLD` of freed heap for the next step, so a steady loop takes no
page fault. The cost is resident memory: a process keeps what it freed, up to that much. Results do not
change. The settings go to this process (``mallopt``) and, through the environment glibc reads at start-up,
to the processes it starts afterwards (data workers, hogwild processes, replicas); a value the user already
set in the environment is left as it is. Both last as long as the process: glibc cannot return to its dynamic
thresholds, so a later ``system`` world in the same process runs with them too.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import MutableMapping

from accelbatch.opts import OptionError

MMAP_THRESHOLD = 32 << 20  # blocks larger than this are mapped alone and unmapped when freed
TRIM_THRESHOLD = 256 << 20  # freed memory at the top of the heap kept for reuse

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_SETTINGS = (("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
             ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, TRIM_THRESHOLD))
ALLOCATOR_CHOICES = ("reuse", "system")


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)  # this process's own symbols, glibc's among them (no library search)


def reuse_freed_memory(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Apply ``--host-allocator reuse`` (see the module docstring); returns the environment variables it set
    (none off glibc, or where the user set them all)."""
    environ = os.environ if environ is None else environ
    libc = _glibc()
    if libc is None:
        return []
    applied = []
    for variable, parameter, value in _SETTINGS:
        if variable in environ:  # the user's own value, which glibc read at start-up
            continue
        if libc.mallopt(parameter, value) != 1:
            continue
        environ[variable] = str(value)
        applied.append(variable)
    return applied


def apply_host_allocator(choice: str) -> list[str]:
    """``--host-allocator``: ``reuse`` applies :func:`reuse_freed_memory`, ``system`` changes nothing."""
    if choice not in ALLOCATOR_CHOICES:
        raise OptionError(f"--host-allocator {choice!r}: choose one of {', '.join(ALLOCATOR_CHOICES)}")
    return reuse_freed_memory() if choice == "reuse" else []
