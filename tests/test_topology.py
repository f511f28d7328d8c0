"""Topology validation and rank coordinates (tensor fastest, then data, then pipeline)."""

import pytest

from parallel.topology import Topology, TopologyError


def test_sizes_multiply_to_world():
    t = Topology(world_size=8, rank=5, tensor=2, pipeline=2)
    assert t.data == 2
    assert (t.tp_rank, t.dp_rank, t.pp_rank) == (1, 0, 1)
    assert t.is_last_stage


@pytest.mark.parametrize(
    ("world", "tp", "pp", "match"),
    [(6, 4, 1, "parallel.tensor=4"), (4, 1, 3, "parallel.pipeline=3"), (4, 0, 1, "tensor=0")],
)
def test_impossible_layouts_name_the_keys(world, tp, pp, match):
    with pytest.raises(TopologyError, match=match):
        Topology(world_size=world, rank=0, tensor=tp, pipeline=pp)


def test_data_parallel_groups_cover_every_rank_once():
    t = Topology(world_size=8, rank=0, tensor=2, pipeline=2)
    groups = t.data_parallel_ranks()
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(8))
    assert [0, 2] in groups and [5, 7] in groups


def test_tensor_groups_are_adjacent_ranks():
    t = Topology(world_size=8, rank=0, tensor=2, pipeline=1)
    assert t.tensor_parallel_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_pipeline_groups_are_strided_and_in_stage_order():
    # tp fastest, then dp, then pp: rank = tp + 2 * (dp + 2 * pp)
    t = Topology(world_size=8, rank=5, tensor=2, pipeline=2)
    assert t.pipeline_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (t.tp_rank, t.dp_rank, t.pp_rank, t.is_last_stage) == (1, 0, 1, True)
    assert Topology(world_size=4, rank=0, pipeline=4).pipeline_ranks() == [[0, 1, 2, 3]]
    assert Topology(world_size=4, rank=0, pipeline=4).embedding_ranks() == [[0, 3]]


def test_more_local_ranks_than_gpus_is_one_line(monkeypatch):
    """A node with 1 GPU and a second process on it (LOCAL_RANK=1): a TopologyError naming
    the local rank and the count, before any CUDA call or process group. The GPU count is
    faked (no GPU here); everything after the check is never reached."""
    from fp8train import device as devices
    from parallel.topology import TopologyError, init_distributed

    monkeypatch.setattr(devices, "is_cuda", lambda: True)
    monkeypatch.setattr(devices, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(TopologyError, match=r"LOCAL_RANK=1 \(rank 1\) but this node has 1 CUDA"):
        init_distributed()
