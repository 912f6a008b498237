"""Imported first by accelbatch's forkserver as it starts (:data:`accelbatch.forkserver.PRELOAD`), and
imported for this alone: the server ends with the process that started it (PDEATHSIG on Linux), so that a
run killed by SIGKILL takes the server and, with it, every child forked from there at once. Elsewhere, or
where the variable is not set (a server started from a thread other than the main one), nothing."""

from __future__ import annotations

import os

from accelbatch.forkserver import SERVER_PARENT
from accelbatch.orphans import end_with_parent

_parent = os.environ.pop(SERVER_PARENT, "")
if _parent.isdigit():
    end_with_parent(int(_parent))
