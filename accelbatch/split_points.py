"""--pipeline's split points: the submodules where the IPU pipeline's stages start."""

from __future__ import annotations


def parse_split_points(spec: str | None) -> tuple[str, ...]:
    """``"a.b,c"`` -> ``("a.b", "c")``; ValueError (naming what is wrong) for an empty or malformed name."""
    if spec is None or not spec.strip():
        return ()
    names = tuple(n.strip() for n in spec.split(","))
    for name in names:
        parts = name.split(".")
        if not name or not all(p.isidentifier() or p.isdigit() for p in parts):
            raise ValueError(f"{name!r} is not a submodule name: give dotted paths such as encoder.layers.2, "
                             "comma separated, as model.named_modules() lists them")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{', '.join(dupes)} named twice: each split point starts one stage")
    return names
