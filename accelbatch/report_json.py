"""--report-json: the run's report written as JSON, a file replaced whole or not at all."""

from __future__ import annotations

import json
import os
from typing import Any

from accelbatch.opts import OptionError
from accelbatch.report_table import json_ready, standard_stream


class ReportNotWritten(OptionError):
    """--report-json could not be written once the run had finished; ``report`` is its report, to print."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report  # pickled with it: a replica's reaches the parent


def write_report_json(report: dict[str, Any], path: str) -> None:
    """Write ``report`` to ``path`` as JSON: a file whole or not at all (a temporary file beside it, synced, renamed
    over it: a failed write leaves an earlier report intact); what is not a file (a pipe) in place, and the file
    stdout or stderr writes to (/dev/stdout redirected to a file) through that stream. A failure
    is a :class:`ReportNotWritten` carrying the report, for the caller to print."""
    stream = standard_stream(path)
    if stream is not None:  # /dev/stdout redirected to a file: written in its place in the output, as printed
        stream.write(json.dumps(json_ready(report), indent=2, sort_keys=True, allow_nan=False) + "\n")
        stream.flush()
        return
    replaced = not os.path.exists(path) or os.path.isfile(path)  # else a device, a pipe
    target = os.path.realpath(path) if replaced else path  # a link's target is replaced
    tmp = f"{target}.tmp-{os.getpid()}" if replaced else target
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(json_ready(report), indent=2, sort_keys=True, allow_nan=False) + "\n")
            if replaced:  # on disk before it replaces an earlier report
                handle.flush()
                os.fsync(handle.fileno())
        if replaced:
            os.replace(tmp, target)
    except OSError as exc:  # the run itself is done (and its -mf saved): only this file is missing
        if replaced and os.path.lexists(tmp):
            os.remove(tmp)
        raise ReportNotWritten(f"--report-json {path}: cannot be written ({exc.strerror or exc}); the "
                               "run finished (its -mf, if given, is saved): choose another path", report) from None
