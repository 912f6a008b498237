"""The CRC-32 check of a torch save: ``torch.save`` writes a zip archive whose entries each carry a CRC-32, which
``torch.load`` does not verify, so a file damaged after it was saved (a flipped bit in a tensor's bytes) loads
as other weights. Reading it once more to check costs about what loading it does."""

from __future__ import annotations

import zipfile

__all__ = ["damaged_entry"]


def damaged_entry(path: str) -> str | None:
    """The name of the first entry of the zip archive at ``path`` whose bytes fail their CRC-32; None when all
    pass, or when ``path`` is no zip archive to check (``torch.load`` then says what it is). An entry whose
    CRC-32 is 0 is not checked: torch writes 0 when told not to compute them
    (``torch.serialization.set_crc32_options(False)``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if entry.CRC == 0:
                    continue
                try:
                    with archive.open(entry) as data:
                        while data.read(1 << 20):
                            pass
                except zipfile.BadZipFile:  # the CRC-32 of what was read is not the one the entry holds
                    return entry.filename
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None
    return None
