"""A lower bound on a planned step's time on H100s: an estimate, with the peaks it assumes.

Each planned rank's step is priced at the hardware's limits and nothing else:

- GEMMs at the dense tensor-core peak of their operand dtype (FP8, BF16/FP16; FP32 GEMMs at
  the FP32 peak, as PyTorch runs them without TF32);
- every other op's bytes (``RankPlan.traffic``: an unfused eager step) at HBM bandwidth;
  GEMMs and those ops share one stream, so their times add;
- the bytes this rank sends per process group at the link the group spans: NVLink inside an
  8-GPU node, InfiniBand (one 400 Gb/s NIC per GPU) across nodes. Collectives can overlap
  compute, so they bound the step on their own (the maximum, not the sum);
- the pipeline's bubble: 1F1B idles ``pipeline - 1`` micro-batch slots per step (interleaved:
  ``(pipeline - 1) / virtual``), so the slowest stage's work is stretched by
  ``(n + bubble) / n``.

Real steps are slower (kernel efficiency, launch overhead, exposed communication); this says
how fast the step cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.topology import Topology
from training.flops import PEAK_TFLOPS
from training.run_plan import RunPlan

__all__ = ["H100", "Hardware", "StepBound", "step_bound"]


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: dict[str, float]  # dense peaks by GEMM dtype class
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_gbps: float  # per GPU, one direction, GB/s
    network_gbps: float  # per GPU across nodes, one direction, GB/s
    gpus_per_node: int


H100 = Hardware(
    name="H100 SXM (dense peaks; HBM3 3.35 TB/s; NVLink 4 450 GB/s per direction; "
    "InfiniBand NDR 400 Gb/s per GPU; 8 GPUs per node)",
    tflops=PEAK_TFLOPS["H100"],
    hbm_gbps=3350.0,
    nvlink_gbps=450.0,
    network_gbps=50.0,
    gpus_per_node=8,
)


def _peak_class(dtype: str) -> str:
    if dtype.startswith("float8"):
        return "fp8"
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")


@dataclass
class StepBound:
    """Seconds per step of one rank: ``gemm`` + ``memory`` on its stream, ``links``
    (group -> (link, seconds)), and ``step``, the bound with the bubble applied."""

    gemm: float
    memory: float
    links: dict[str, tuple[str, float]]
    bubble: float  # the factor (n + idle slots) / n
    step: float


def group_link(topo: Topology, group: str, hw: Hardware) -> str:
    """ "nvlink" when every rank of this rank's ``group`` shares its node, else "network"."""
    members = {
        "tensor": topo.tensor_parallel_ranks,
        "data": topo.data_parallel_ranks,
        "pipeline": topo.pipeline_ranks,
        "embedding": topo.embedding_ranks,
    }[group]()
    mine = next((g for g in members if topo.rank in g), [topo.rank])
    return "nvlink" if len({r // hw.gpus_per_node for r in mine}) == 1 else "network"


def step_bound(plan: RunPlan, results, hw: Hardware = H100) -> dict[int, StepBound]:
    """The bound for each planned rank (``RankPlan``s), keyed by rank; every rank's ``step``
    is the run's: its stage's work can be no faster than the slowest stage's."""
    pp, vp, n = plan.pipeline, plan.virtual_stages, plan.micro_batches
    bubble = (n + (pp - 1) / vp) / n if pp > 1 else 1.0
    rows = {}
    for r in results:
        gemm = sum(f / (hw.tflops.get(_peak_class(d), hw.tflops["fp32"]) * 1e12)
                   for d, f in r.flops.items())  # fmt: skip
        topo = Topology(plan.world_size, r.rank, plan.tensor, plan.pipeline)
        links = {}
        for group, nbytes in r.comm_groups.items():
            link = group_link(topo, group, hw)
            gbps = hw.nvlink_gbps if link == "nvlink" else hw.network_gbps
            links[group] = (link, nbytes / (gbps * 1e9))
        rows[r.rank] = StepBound(gemm, r.traffic / (hw.hbm_gbps * 1e9), links, bubble, 0.0)
    slowest = max((b.gemm + b.memory for b in rows.values()), default=0.0) * bubble
    for b in rows.values():
        b.step = max([slowest, *(t for _, t in b.links.values())])
    return rows
