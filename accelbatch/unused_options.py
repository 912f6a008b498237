"""Options given on the command line that this run's other options leave unread: one note each, so a user
who tunes ``--num-buckets`` without ``--dynamic-batching buckets`` learns that nothing changed. A note, not a
refusal: scripts keep one set of options and switch a strategy on and off."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Collection

from accelbatch.opts import Opts


@dataclass(frozen=True)
class Reader:
    """When an option is read (``reads(opts)``), and what reads it, in words."""

    reads: Callable[[Opts], bool]
    what: str


def _periodic_validation(opts: Opts) -> bool:
    return opts.validation_every_n_epochs > 0 or opts.validation_every_n_secs > 0


def _replicated(opts: Opts) -> bool:
    return opts.replication_factor > 1 or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _loads_elsewhere(opts: Opts) -> bool:
    return opts.num_workers > 0 or opts.dataloader_mode != "sync"


def _generates(opts: Opts) -> bool:
    """Whether -m may read the generation options: a generator, or an agent from outside accelbatch."""
    from accelbatch.models.generator import GeneratorAgent
    from accelbatch.names import resolve_agent_class

    try:
        found = resolve_agent_class(opts.model)
    except Exception:  # noqa: BLE001 - an -m that does not resolve is refused later, saying why
        return True
    return not isinstance(found, type) or issubclass(found, GeneratorAgent) \
        or not found.__module__.startswith("accelbatch.")


GENERATOR = "a generator (-m transformer/generator, or a GeneratorAgent of yours)"


READERS: dict[str, Reader] = {
    "num_buckets": Reader(lambda o: o.dynamic_batching == "buckets", "--dynamic-batching buckets"),
    "max_batch_tokens": Reader(lambda o: o.dynamic_batching in ("full", "buckets"),
                               "--dynamic-batching full or buckets"),
    "batch_sort_cache_size": Reader(lambda o: o.dynamic_batching != "none", "--dynamic-batching"),
    "buffer_size": Reader(lambda o: o.dataloader_mode != "sync", "--dataloader-mode async or async-rebatched"),
    "data_timeout_s": Reader(_loads_elsewhere, "data workers (--num-workers) or --dataloader-mode async"),
    "beam_size": Reader(lambda o: o.inference == "beam" and _generates(o), f"--inference beam of {GENERATOR}"),
    **{name: Reader(_generates, GENERATOR)
       for name in ("inference", "beam_min_length", "beam_block_ngram", "skip_generation")},
    "replica_timeout_s": Reader(_replicated, "replicas (-rf/--replication-factor above 1, or torchrun)"),
    "validation_patience": Reader(_periodic_validation, "validations during training (-veps or -vtim)"),
    "validation_cutoff": Reader(_periodic_validation, "validations during training (-veps or -vtim)"),
}


def unused_option_notes(opts: Opts, given: Collection[str]) -> list[str]:
    """A line for each option of ``given`` (field names) that ``opts`` never reads, naming what would."""
    flags = {f.name: "/".join(f.metadata["flags"]) for f in fields(Opts)}
    return [f"accelbatch: {flags[name]}: not used by this run: it is read only with {reader.what}"
            for name, reader in READERS.items() if name in given and not reader.reads(opts)]
