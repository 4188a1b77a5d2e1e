"""Hidden states kept per rank: each rank's file holds its batches, and a resumed run on any number
of processes (or one) takes back exactly its own batches, in order, from whatever wrote them."""
from __future__ import annotations

import torch

from panther_lite.conversion.saving.stream_shards import remove_shards, save_shard, shard_streams


def _streams(indices, sequential):
    original = [torch.full((1, 2), float(i)) for i in indices]
    return original, [t + 100 for t in original] if sequential else original


def _ids(streams):
    original, current = streams
    return [int(t[0, 0]) for t in original], [int(t[0, 0]) for t in current], original is current


def test_files_of_two_processes_are_read_back_on_one_two_and_three(tmp_path):
    (tmp_path / "streams").mkdir()
    for rank in range(2):  # six batches: rank 0 holds 0, 2, 4; rank 1 holds 1, 3, 5
        save_shard(tmp_path, 3, rank, 2, _streams(range(rank, 6, 2), sequential=True))
    progress = dict(finished=3, shards=2, streams=None)
    assert _ids(shard_streams(tmp_path, progress)) == ([0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105], False)
    assert _ids(shard_streams(tmp_path, progress, 1, 2))[0] == [1, 3, 5]
    assert [_ids(shard_streams(tmp_path, progress, rank, 3))[0] for rank in range(3)] == [[0, 3], [1, 4], [2, 5]]


def test_one_process_streams_are_split_and_a_shared_list_stays_shared(tmp_path):
    progress = dict(finished=1, streams=_streams(range(5), sequential=False))  # an older commit: no "shards"
    assert _ids(shard_streams(tmp_path, progress, 1, 2)) == ([1, 3], [1, 3], True)
    assert shard_streams(tmp_path, dict(finished=1, streams=None)) is None


def test_only_the_committed_files_are_kept(tmp_path):
    (tmp_path / "streams").mkdir()
    for finished in (1, 2):
        save_shard(tmp_path, finished, 0, 2, _streams([0], sequential=False))
    remove_shards(tmp_path, 2)
    assert [p.name for p in (tmp_path / "streams").iterdir()] == ["00002-0-of-2.pt"]
    remove_shards(tmp_path)
    assert not list((tmp_path / "streams").iterdir())
