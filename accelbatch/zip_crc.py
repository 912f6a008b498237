"""The CRC-32 check of a torch save: ``torch.save`` writes a zip archive whose entries each carry a CRC-32, which
``torch.load`` does not verify, so a file damaged after it was saved (a flipped bit in a tensor's bytes) loads
as other weights. Reading it once more to check costs about what loading it does."""

from __future__ import annotations

import zipfile

__all__ = ["damaged_entry"]


def damaged_entry(path: str) -> str | None:
    """The name of the first entry of the zip archive at ``path`` whose bytes fail their CRC-32; None when all
    pass, or when ``path`` is no zip archive to check (``torch.load`` then says what it is)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None
