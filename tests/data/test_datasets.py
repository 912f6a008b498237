"""Datasets: map-style examples, lazy byte-range reading of JSONL / ParlAI files, streaming batch sorting."""

import json
import random

import pytest

from accelbatch.data.batching import BatchingConfig, MessageLength
from accelbatch.data.datasets import ExampleDataset, StreamDataset, StreamSource, read_episodes
from accelbatch.data.sharding import ShardSpec, byte_ranges
from accelbatch.tasks.files import DataFileError, iter_episodes, iter_examples


def write_dialogues(path, episodes=60, seed=0, fmt="jsonl", noise=True):
    rng = random.Random(seed)
    k = 0
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(episodes):
            turns = rng.randint(1, 5)
            for t in range(turns):
                if noise and rng.random() < 0.1:
                    f.write("\n")
                if noise and fmt == "parlai" and rng.random() < 0.1:
                    f.write("# a comment\n")
                k += 1
                text = f"x{k} " + "w " * rng.randint(0, 25) + "é"
                if fmt == "jsonl":
                    f.write(json.dumps({"text": text, "labels": [f"y{k}"], "episode_done": t == turns - 1}) + "\n")
                else:
                    done = "\tepisode_done:True" if t == turns - 1 else ""
                    f.write(f"text:{text}\tlabels:y{k}{done}\n")
    return k


@pytest.mark.parametrize("fmt", ["jsonl", "parlai"])
def test_byte_ranges_partition_the_episodes_with_exact_line_numbers(tmp_path, fmt):
    path = str(tmp_path / ("d.jsonl" if fmt == "jsonl" else "d.txt"))
    write_dialogues(path, fmt=fmt)
    reference = [[m["text"] for m in ep] for ep in iter_episodes(path)]
    first_lines = []
    line_of = {msg["text"]: n for n, msg in iter_examples(path)}
    for shards in (1, 2, 3, 8, 61, 5000):
        got = []
        for start, stop in byte_ranges(len(open(path, "rb").read()), shards):
            for line, ep in read_episodes(path, None, start, stop):
                got.append([m["text"] for m in ep])
                assert line == line_of[ep[0]["text"]]
                first_lines.append(line)
        assert got == reference, shards


def test_crlf_files_read_like_text_mode(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(b"text:a\tlabels:b\r\ntext:c\tlabels:d\tepisode_done:True\r\n")
    (_, ep), = read_episodes(str(path))
    assert [m["labels"] for m in ep] == [["b"], ["d"]] and ep[-1]["episode_done"] is True


def test_errors_name_file_and_line_in_any_shard(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"t{i}", "labels": ["l"]}) for i in range(50)]
    lines[40] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    with pytest.raises(DataFileError, match=r"bad.jsonl:41: not valid JSON"):
        for start, stop in byte_ranges(size, 4)[2:]:
            list(read_episodes(str(path), None, start, stop))


def test_unfinished_last_episode_is_closed_not_dropped(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("text:a\tlabels:b\ntext:c\tlabels:d\n")
    (line, ep), = read_episodes(str(path))
    assert line == 1 and len(ep) == 2 and ep[-1]["episode_done"] is True


def test_stream_source_squashes_and_ids_are_file_and_line(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("text:x1\tlabels:y1\ntext:x2\tlabels:y2\tepisode_done:True\n")
    b.write_text("# header\ntext:z\tlabels:w\tepisode_done:True\n")
    source = StreamSource([str(a), str(b)], context_length=-1, include_labels=True)
    got = list(source.examples())
    assert [i for i, _ in got] == [(0, 1), (0, 2), (1, 2)]
    assert got[1][1]["text"] == "x1\ny1\nx2"
    with pytest.raises(DataFileError, match="no such file"):
        StreamSource(str(tmp_path / "missing.jsonl"))


def test_example_dataset_from_episodes_and_files(tmp_path):
    path = str(tmp_path / "d.jsonl")
    n = write_dialogues(path)
    ds = ExampleDataset.from_files(path, context_length=2, include_labels=False)
    assert len(ds) == n and ds[0]["episode_done"] is True
    assert ds.lengths == [MessageLength()(m) for m in ds.examples]
    ds2 = ExampleDataset.from_episodes(iter_episodes(path), context_length=2, include_labels=False)
    assert [m["text"] for m in ds2] == [m["text"] for m in ds]


def test_stream_dataset_batchsorts_on_the_fly_within_a_length_range(tmp_path):
    path = str(tmp_path / "d.jsonl")
    n = write_dialogues(path, episodes=200, noise=False)
    config = BatchingConfig("batchsort", 4, cache_size=40, length_range=5)
    stream = StreamDataset(StreamSource(path, context_length=1), config)
    batches = list(stream)
    assert sorted(i for b in batches for i, _ in b.items) == sorted(i for i, _ in
                                                                       StreamSource(path).examples())
    assert sum(b.num_real for b in batches) == n
    full = [b for b in batches if b.num_real == 4]
    assert len(full) > len(batches) / 2
    assert all(max(b.lengths) // 5 == min(b.lengths) // 5 for b in full)


def test_stream_dataset_reads_only_its_shard(tmp_path):
    path = str(tmp_path / "d.jsonl")
    write_dialogues(path, episodes=100)
    seen = []
    for spec in ShardSpec.all(num_processes=2, num_replicas=3):
        stream = StreamDataset(StreamSource(path), BatchingConfig("none", 5), shard=spec)
        seen += [i for b in stream for i, _ in b.items]
    assert sorted(seen) == sorted(i for i, _ in StreamSource(path).examples())
