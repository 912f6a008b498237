"""Sharding across processes x replicas x data workers: nothing lost, nothing repeated (properties)."""

import json
import os
import tempfile
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.data.batching import BatchingConfig
from accelbatch.data.datasets import StreamDataset, StreamSource
from accelbatch.data.sharding import ShardSpec, byte_ranges, even_shards, shard_bounds, shard_indices, shard_stream

from . import no_leaks  # noqa: F401  (pytest fixture)

layouts = dict(n=st.integers(0, 300), processes=st.integers(1, 3), replicas=st.integers(1, 4),
               workers=st.integers(1, 4))


@settings(max_examples=200, deadline=None)
@given(**layouts, contiguous=st.booleans())
def test_map_style_shards_partition_the_indices(n, processes, replicas, workers, contiguous):
    specs = ShardSpec.all(processes, replicas, workers)
    assert [s.index for s in specs] == list(range(processes * replicas * workers))
    parts = [shard_indices(n, s.num_shards, s.index, contiguous) for s in specs]
    assert Counter(i for p in parts for i in p) == Counter(range(n))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=200, deadline=None)
@given(**layouts)
def test_stream_shards_partition_the_stream(n, processes, replicas, workers):
    specs = ShardSpec.all(processes, replicas, workers)
    seen = [x for s in specs for x in shard_stream(iter(range(n)), s.num_shards, s.index)]
    assert Counter(seen) == Counter(range(n))


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 10_000), shards=st.integers(1, 50))
def test_byte_ranges_tile_the_file(size, shards):
    ranges = byte_ranges(size, shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@settings(max_examples=40, deadline=None)
@given(episodes=st.lists(st.integers(1, 4), min_size=0, max_size=40), processes=st.integers(1, 2),
       replicas=st.integers(1, 3), workers=st.integers(1, 3), text=st.integers(0, 30),
       fmt=st.sampled_from(["jsonl", "parlai"]))
def test_file_streams_shard_without_loss_or_repeat(episodes, processes, replicas, workers, text, fmt):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.jsonl" if fmt == "jsonl" else "d.txt")
        k = 0
        with open(path, "w") as f:
            for turns in episodes:
                for t in range(turns):
                    k += 1
                    body = f"x{k} " + "w " * ((k * 7 + text) % 23)
                    if fmt == "jsonl":
                        f.write(json.dumps({"text": body, "labels": ["y"], "episode_done": t == turns - 1}) + "\n")
                    else:
                        f.write(f"text:{body}\tlabels:y" + ("\tepisode_done:True" if t == turns - 1 else "") + "\n")
        source = StreamSource(path, context_length=1)
        seen = []
        for spec in ShardSpec.all(processes, replicas, workers):
            seen += [m["text"].split()[0] for _, m in source.examples(spec.num_shards, spec.index)]
        assert Counter(seen) == Counter(f"x{i}" for i in range(1, k + 1))


def test_shard_spec_validates_and_flattens():
    spec = ShardSpec(num_processes=2, process_index=1, num_replicas=3, replica_index=2, num_workers=4, worker_id=1)
    assert spec.num_shards == 24 and spec.index == (1 * 3 + 2) * 4 + 1
    assert spec.rank == 5 and spec.world_size == 6
    assert spec.in_worker().num_workers == 1          # outside a DataLoader worker
    with pytest.raises(ValueError, match="replica_index=3"):
        ShardSpec(num_replicas=3, replica_index=3)
    with pytest.raises(ValueError, match="num_workers"):
        ShardSpec(num_workers=0)


def test_shard_bounds_and_even_shards():
    assert [shard_bounds(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert even_shards([4, 3, 3]) == (3, 1)


@pytest.mark.timeout(60)
def test_stream_dataset_in_torch_workers_takes_worker_shards(tmp_path, no_leaks):
    import torch

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}", "labels": ["l"]}) + "\n" for i in range(97)))
    seen = []
    for replica in range(2):
        ds = StreamDataset(StreamSource(str(path)), BatchingConfig("none", 4),
                           shard=ShardSpec(num_replicas=2, replica_index=replica))
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda b: b)
        seen += [i for b in loader for i, _ in b.items]
    assert sorted(seen) == [(0, i) for i in range(1, 98)]
