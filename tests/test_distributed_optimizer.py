"""Data parallelism with and without the distributed optimizer (ZeRO-1), end to end on gloo.

Runs: the tiny GPT with 4 layers, a global batch of 8 in micro-batches of 2 (4 per step in one
process, 2 per replica at DP=2, 1 at DP=4, on the same samples), 3 steps, in forked ranks, one
fork per world size: DP=2 and DP=4, TP2 x DP2 and PP2 x DP2 (the tied embedding in its
held-back bucket), each with and without ``optimizer.distributed``, at fp32 and O2, DP=4 also
at O3. Every copy of a weight (replicas after the all-gather, TP ranks after the gather, the
embedding on both stages) must be bitwise the same. Clipping is off here (its own runs below):
a norm summed in another order moves the clip coefficient by an FP32 ulp.

Against the run with one data-parallel rank (the single process; TP2 for TP2 x DP2):

fp32: losses within 1e-6 relative, and every weight tensor after step 3 within 1e-6 relative
L2. Measured: losses bitwise equal; weights <= 4.4e-7 (two replicas add two partial sums where
one process accumulates four micro-batches; gloo's ring all-reduce at DP=4 adds in another
order). DP=4 with the distributed optimizer is bitwise the single process: its reduce-scatter
adds the replicas in rank order, the single process's accumulation order, and the 1/n_micro
loss scaling is a power of two. One exclusion: the key entries of ``qkv.bias``. Their gradient
is zero in exact arithmetic (softmax ignores the q.b_k added to every score of a query); autograd
returns FP32 rounding noise, 6e-12..1e-11 (the value bias's: 1e-2), which Adam (eps 1e-8) turns
into steps of ~lr |g| / eps ~ 1e-6. So these entries are noise in every run (|value| <= 6.7e-7
against ~1e-3 for the other bias entries) and so are their differences (2.6e-7..7.5e-7,
6e-5..1.7e-4 of the qkv.bias norm): they are checked to stay noise-sized in both runs (< 1e-5,
1% of one full Adam step) instead of relative to each other.

FP8 levels: no bitwise agreement is possible. One process rounds each weight gradient to E4M3
after every micro-batch with one delayed-scaling history; replicas round their own gradient and
then the average once more. The bar is in units of that FP8 noise: per tensor,
||w - w_ref|| < 2.5 ||w_ref - w_ref_fp32||, the reference's distance from its own fp32 run. Two
runs carrying FP8 noise of one size are at most ~2x it apart (triangle inequality); 2.5 lets one
run's noise be the larger in a tensor. Measured max 1.44 (O2), 1.5 (O3), medians 0.65-0.97. The
FP8 noise is ~10% of the 3-step update (model-wide, O2 against fp32), so a wrong gradient (a
replica's own instead of the average, a stale one) would stand out. Losses: 1e-3 relative
(measured <= 6.6e-5 over 3 steps; tests/test_entry_point.py allows 2e-3 over 6).

Against the same layout without the distributed optimizer the arithmetic is the same: the
reduce-scatter sums the replicas' FP8 bytes in FP32 in rank order and rounds once, as the
all-reduce's first half does; Adam is elementwise; the all-gather copies bytes. So the first
step's gradients of every owned parameter are bitwise equal (FP8 at any DP size, FP32 with two
replicas), and with two replicas (DP=2, TP2 x DP2, PP2 x DP2) so is every weight after 3 steps
(measured: all, at fp32 and O2). At DP=4 gloo's ring all-reduce adds the FP32 gradients in
another order (first step 8e-8 apart), so after 3 steps the bars above apply (measured fp32
3.1e-7; ratio 1e-4 at O2 and 0.13 at O3, where FP32 ulps flip a few E4M3 weights). Each model
slice's parameters are owned by exactly one of its data-parallel ranks.

Grad norm at fp32, step by step, on every rank: equal to the single-process (TP2) norm within
1e-6 (measured <= 7.2e-8, one ulp) for DP=2, DP=4, TP2 x DP2 (norms, row biases and position
embedding replicated on both TP ranks) and PP2 x DP2 (tied embedding on both stages): each
parameter counted once. Clipping at O2 (clip_grad 0.05 against a norm of ~1.9, DP=2 and
TP2 x DP2): norms equal the plain run's within 1e-6 (measured: equal, or one ulp); every owned
gradient, FP8 slots included, is its unclipped value times clip / (norm + 1e-6) (measured
1.4e-7) and the plain run's clipped gradient; weights after 3 steps within the FP8-noise bar
of the plain run (not bitwise: an ulp of the clip coefficient can flip an FP8 rounding; seen
on an AVX-512 Xeon).

O3, DP=4, distributed optimizer, every rank: FP8 linear weights cost 3.2502 bytes per parameter
(weight 1, gradient 1, master 0.5001, moments 0.7502; theory 2 + 5/4 = 3.25; 7.001 without the
distributed optimizer), bar 3.3; on the wire reduce_scatter_fp8 1.0026 and all_gather_params_fp8
1.0003 bytes per element (per-tensor scales included), bar 1.05.

Overlap (O2, DP=2, 2 micro-batches per replica, ddp_bucket_size 20000: 9 buckets): when the
last micro-batch's forward starts nothing has been launched or metered; during its backward the
buckets launch in order, the first with 47 of 52 parameters still pending; with
overlap_grad_reduce=false every launch happens inside ``finish``.

Resume, through torchrun (2 ranks, O2, distributed optimizer): 6 straight iterations equal 3 +
resume, each rank's optimizer_dp{d} file written and read; resuming without the distributed
optimizer exits 2 with one line. Each replica's FP8 delayed-scaling state is saved and restored
too (the replicas' amax histories differ, since they see different data).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import (
    RunsByWorld,
    full_tensors,
    grad_value,
    pretrain_ranks,
    rank_env,
    torchrun,
    weight_value,
)

from fp8train.param_state import set_initial_master, take_initial_master
from parallel.distributed_optimizer import assign_owners, ownership_balance

STEPS = 3
# 4 layers (16 linear weights to balance over the owners), a global batch of 8 in micro-batches
# of 2: 4 per step on one process, 2 per replica at DP=2, 1 at DP=4, on the same samples.
# Clipping off (its own runs below): a norm summed in another order moves the clip coefficient
# by an FP32 ulp, which is not what these runs compare.
COMMON = {
    "model.num_layers": 4,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 8,
    "training.clip_grad": 0,
}
DIST = {"optimizer.distributed": "true"}
TP2, PP2 = {"parallel.tensor": 2}, {"parallel.pipeline": 2}
CLIP = {"training.clip_grad": 0.05}  # the gradient norm is ~1.9: every step clips, by ~1/38
BUCKETS = {"parallel.ddp_bucket_size": 20000}  # 9 buckets at O2 (4 layers of hidden 64)
NO_OVERLAP = {**BUCKETS, **DIST, "parallel.overlap_grad_reduce": "false"}

# name -> (world size, overrides, levels, probes); the runs of one world size share a fork.
RUNS = {
    "single": (1, {}, ("fp32", "O2", "O3"), ()),
    "dp2": (2, {}, ("fp32", "O2"), ()),
    "dp2_dist": (2, DIST, ("fp32", "O2"), ()),
    # BF16 parameters with FP32 masters beside O3's FP8 weights and FP16 masters.
    "dp2_bf16": (2, {}, ("O3:bf16",), ()),
    "dp2_dist_bf16": (2, DIST, ("O3:bf16",), ()),
    "tp2": (2, TP2, ("fp32", "O2"), ()),  # the DP=1 run of the TP2 x DP2 layouts
    "dp4": (4, {}, ("fp32", "O2", "O3"), ()),
    "dp4_dist": (4, DIST, ("fp32", "O2", "O3"), ()),
    "tp2_dp2": (4, TP2, ("fp32", "O2"), ()),
    "tp2_dp2_dist": (4, {**TP2, **DIST}, ("fp32", "O2"), ()),
    "pp2_dp2": (4, PP2, ("fp32", "O2"), ()),
    "pp2_dp2_dist": (4, {**PP2, **DIST}, ("fp32", "O2"), ()),
    # Clipping active: gradients captured before and after it.
    "dp2_clip": (2, CLIP, ("fp32", "O2"), ("clip",)),  # fp32: the unit of FP8 noise
    "dp2_dist_clip": (2, {**CLIP, **DIST}, ("O2",), ("clip",)),
    "tp2_dp2_clip": (4, {**TP2, **CLIP}, ("fp32", "O2"), ("clip",)),
    "tp2_dp2_dist_clip": (4, {**TP2, **CLIP, **DIST}, ("O2",), ("clip",)),
    # Overlap: small buckets, 2 micro-batches per replica, every launch recorded.
    "overlap_dist": (2, {**BUCKETS, **DIST}, ("O2",), ("launch",)),
    "overlap_plain": (2, BUCKETS, ("O2",), ("launch",)),
    "no_overlap": (2, NO_OVERLAP, ("O2",), ("launch",)),
}
# layout -> the data-parallel-size-1 run it must reproduce
REFERENCE = {
    "dp2": "single",
    "dp2_dist": "single",
    "dp4": "single",
    "dp4_dist": "single",
    "tp2_dp2": "tp2",
    "tp2_dp2_dist": "tp2",
    "pp2_dp2": "single",
    "pp2_dp2_dist": "single",
}
PLAIN = {"dp2_dist": "dp2", "dp4_dist": "dp4", "tp2_dp2_dist": "tp2_dp2", "pp2_dp2_dist": "pp2_dp2",
         "dp2_dist_bf16": "dp2_bf16"}  # fmt: skip


def _instrument_launches(state, events: list) -> None:
    """Record at every micro-batch's forward how many buckets were launched and how many bytes
    the meter had counted so far, and at every launch whether ``finish`` had begun."""
    buffers, model = state.optimizer.buffers, state.model
    in_finish = [False]
    forward, launch, finish = model.forward_chunk, buffers._launch, buffers.finish

    def counted_forward(*args, **kwargs):
        events.append(["forward", len(buffers.launch_log), state.meter.step_bytes])
        return forward(*args, **kwargs)

    def logged_launch(bucket):
        launch(bucket)
        events.append(["launch", bucket.index, buffers.launch_log[-1][1], in_finish[0]])

    def flagged_finish(*args, **kwargs):
        in_finish[0] = True
        try:
            return finish(*args, **kwargs)
        finally:
            in_finish[0] = False

    model.forward_chunk, buffers._launch, buffers.finish = (
        counted_forward,
        logged_launch,
        flagged_finish,
    )


def _train(state, probes: tuple, tensors: dict) -> dict:
    """3 steps of ``state``'s run; fills ``tensors`` with the gradients (see ``_worker``) and
    returns the run's record."""
    from data.sampler import micro_batches
    from training.step import train_step

    cfg, topo, opt = state.cfg, state.groups.topology, state.optimizer
    n_micro = state.plan.micro_batches
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, topo.dp_rank, topo.data)
    names = {id(p): n for n, p in state.model.named_parameters()}
    rec = {"losses": [], "norms": [], "per_element": [], "launch_log": [], "events": []}
    rec.update(
        n_micro=n_micro,
        buckets=len(opt.buffers.buckets),
        held=[b.index for b in opt.buffers.buckets if b.held],
        params=[names[id(p)] for p in opt.model_params],
        owned=[names[id(p)] for p in opt.step_params],
        fp8=[names[id(p)] for p in opt.model_params if opt._is_slot(p)],
        # O3: the weights whose FP16 rounding of the initial value is still on them
        # (param_state.take_initial_master), before the first step and after the last.
        initial_masters=[_with_initial_master(opt.model_params, names)],
    )
    if "launch" in probes:
        _instrument_launches(state, rec["events"])
    step_fn = opt.step
    for step in range(STEPS):

        def hook(s, step=step):  # final gradients, before clipping
            if step == 0 or "clip" in probes:
                for p in s.optimizer.step_params:
                    tensors[f"grad{step}/{names[id(p)]}"] = grad_value(p).detach().float().clone()

        def clipped_step(step=step):  # the optimizer's step, after clipping
            for p in opt.step_params:
                tensors[f"clipped{step}/{names[id(p)]}"] = grad_value(p).detach().float().clone()
            step_fn()

        if "clip" in probes:
            opt.step = clipped_step
        stats = train_step(state, data, n_micro, grad_hook=hook)
        rec["losses"].append(stats.loss)
        rec["norms"].append(stats.grad_norm)
        rec["per_element"].append(stats.comm_per_element)
        rec["launch_log"].append(list(opt.buffers.launch_log))
        rec["events"].append(["step", step])
    rec["bytes_per_param"] = state.bytes_per_param
    rec["initial_masters"].append(_with_initial_master(opt.model_params, names))
    return rec


def _with_initial_master(params, names) -> list[str]:
    out = []
    for p in params:
        master = take_initial_master(p)
        if master is not None:
            set_initial_master(p, *master)
            out.append(names[id(p)])
    return out


def _worker(rank: int, world: int, port: int, runs: dict, out_dir: str) -> None:
    """One rank of every run in ``runs`` ((name, level) -> (overrides, probes)): 3 steps each.
    Writes the weights before and after (global names, dequantized, TP gathered), the first
    step's final gradients of the parameters this rank steps (local names; with the "clip"
    probe every step's, before and after clipping) as safetensors, and per step the loss, grad
    norm, wire bytes per element and launch log as JSON."""
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.setup import build_run

    for (name, level), (overrides, probes) in runs.items():
        state = build_run(load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides))
        tensors = {f"init/{k}": v for k, v in full_tensors(state.model, weight_value).items()}
        rec = _train(state, probes, tensors)
        final = full_tensors(state.model, weight_value)
        tensors.update({f"final/{k}": v for k, v in final.items()})
        stem = Path(out_dir, f"{name}_{level}_rank{rank}")
        save_file(tensors, f"{stem}.safetensors")
        Path(f"{stem}.json").write_text(json.dumps(rec))
        del state  # later runs reuse the process group and add their own groups
    destroy_distributed()


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    """``results(name, level)`` -> per rank ``(tensors, record)``; forks each world size's runs
    once, on first use."""
    # Imported here so that forked ranks inherit them instead of each importing megatron.
    import training.loop  # noqa: F401

    def make_runs(world, tmp):
        return {
            (n, lv): (tiny_overrides(tiny_data, tmp / n / lv, lv, **{**COMMON, **extra}), probes)
            for n, (w, extra, levels, probes) in RUNS.items()
            if w == world
            for lv in levels
        }

    runs = RunsByWorld(_worker, make_runs, tmp_path_factory, "dp", timeout=300,
                       start_method="fork")  # fmt: skip
    return lambda name, level: runs(RUNS[name][0], name, level)


def _merged(ranks, prefix: str = "final/") -> dict[str, torch.Tensor]:
    """One tensor per global name over all ranks, checking that every copy (data-parallel
    replicas after the weights' all-gather, TP ranks after the gather, the tied embedding on
    both pipeline stages) holds bitwise the same."""
    out = {}
    for tensors, _ in ranks:
        for key, value in tensors.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                if name in out:
                    assert torch.equal(out[name], value), f"copies of {name} differ"
                else:
                    out[name] = value
    return out


def _key_bias(name: str, value: torch.Tensor) -> torch.Tensor:
    """Mask of the key entries of a ``qkv.bias`` (layout [groups, heads/groups + 2, head_dim]
    with the key at index heads/groups; the tiny model: 2 groups of 1 head of 32), else none."""
    mask = torch.zeros(value.shape, dtype=torch.bool)
    if name.endswith("qkv.bias"):
        mask.view(2, 3, -1)[:, 1] = True
    return mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _loss_error(ranks, ref_ranks) -> float:
    losses = ranks[-1][1]["losses"]
    assert all(r[1]["losses"] == losses for r in ranks)  # every rank reports the step's loss
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref_ranks[0][1]["losses"]))


def _fp32_errors(weights, ref) -> tuple[dict[str, float], float]:
    """(relative L2 error per tensor without the key biases, largest key-bias magnitude)."""
    errors, key_bias = {}, 0.0
    for name, r in ref.items():
        mask = _key_bias(name, r)
        w = weights[name]
        errors[name] = _rel(w[~mask], r[~mask])
        if mask.any():
            key_bias = max(key_bias, w[mask].abs().max().item(), r[mask].abs().max().item())
    return errors, key_bias


def _fp8_ratios(weights, ref, ref_fp32) -> dict[str, float]:
    """Per tensor: distance to the reference over the reference's own distance from fp32."""
    return {
        k: (weights[k] - r).norm().item() / (r - ref_fp32[k]).norm().item() for k, r in ref.items()
    }


# ---------------------------------------------------------------------------------------------
# Ownership (units)


def test_assign_owners_whole_tensors_deterministic_and_balanced():
    gen = torch.Generator().manual_seed(0)
    numels = torch.randint(1, 100_000, (300,), generator=gen).tolist()
    for world in (2, 3, 4, 8):
        owners = assign_owners(numels, world)
        assert owners == assign_owners(list(numels), world)  # every rank computes the same
        assert len(owners) == len(numels) and set(owners) == set(range(world))
        # Largest first to the least loaded: no rank exceeds the even share by more than the
        # largest tensor; with 300 tensors that is within 1%.
        load = [sum(n for n, r in zip(numels, owners) if r == k) for k in range(world)]
        assert max(load) - min(load) <= max(numels)
        assert ownership_balance(numels, owners, world) < 1.01
    # The tiny model's 16 linear weights (4 layers of qkv 3h^2, proj h^2, fc1 and fc2 4h^2)
    # split exactly evenly over 4 ranks: 12 h^2 each.
    h2 = 64 * 64
    linear = [3 * h2, h2, 4 * h2, 4 * h2] * 4
    assert ownership_balance(linear, assign_owners(linear, 4), 4) == 1.0


def test_assign_owners_balances_each_class_on_its_own():
    """One huge embedding must not push every FP8 weight onto the other ranks."""
    numels = [1_000_000] + [1000] * 8 + [10] * 4
    classes = ["emb"] + ["fp8"] * 8 + ["norm"] * 4
    owners = assign_owners(numels, 4, classes)
    for cls in set(classes):
        members = [i for i, c in enumerate(classes) if c == cls]
        sub_numels = [numels[i] for i in members]
        sub_owners = [owners[i] for i in members]
        assert sub_owners == assign_owners(sub_numels, 4)  # each class on its own
    fp8_ranks = [owners[i] for i, c in enumerate(classes) if c == "fp8"]
    assert sorted(fp8_ranks) == [0, 0, 1, 1, 2, 2, 3, 3]
    # Without classes the embedding's rank gets none of them.
    plain = assign_owners(numels, 4)
    assert plain[0] not in plain[1:9]
    assert ownership_balance([1, 1], [0, 0], 2) == 2.0 and ownership_balance([], [], 3) == 1.0


# ---------------------------------------------------------------------------------------------
# Every layout against the single process


def _check_fp32(weights, ref, what: str) -> None:
    errors, key_bias = _fp32_errors(weights, ref)
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] < 1e-6, (what, worst)
    assert key_bias < 1e-5, (what, key_bias)  # noise-sized in both runs (module docstring)


def _check_fp8(weights, ref, ref_fp32, what: str) -> None:
    ratios = _fp8_ratios(weights, ref, ref_fp32)
    worst = sorted(ratios.items(), key=lambda kv: -kv[1])[:3]
    assert worst[0][1] < 2.5, (what, worst)


LAYOUT_CASES = [(n, lv) for n in REFERENCE for lv in RUNS[n][2]]


@pytest.mark.parametrize(("layout", "level"), LAYOUT_CASES)
def test_layout_matches_data_parallel_size_one(results, layout, level):
    ranks, ref_ranks = results(layout, level), results(REFERENCE[layout], level)
    weights, ref = _merged(ranks), _merged(ref_ranks)
    assert sorted(weights) == sorted(ref)  # every parameter, nothing extra
    loss = _loss_error(ranks, ref_ranks)
    if level == "fp32":
        assert loss < 1e-6, loss
        _check_fp32(weights, ref, layout)
    else:
        assert loss < 1e-3, loss
        _check_fp8(weights, ref, _merged(results(REFERENCE[layout], "fp32")), layout)


DIST_CASES = [(n, lv) for n in PLAIN for lv in RUNS[n][2]]


@pytest.mark.parametrize(("layout", "level"), DIST_CASES)
def test_distributed_optimizer_matches_plain_data_parallel(results, layout, level):
    """Same layout without the distributed optimizer (module docstring): the first step's
    gradients of the owned parameters bitwise (FP8) or to FP32 rounding; with two replicas
    every weight after 3 steps bitwise; ownership covers each parameter exactly once."""
    dist_ranks, plain_ranks = results(layout, level), results(PLAIN[layout], level)
    replicas = 4 if layout == "dp4_dist" else 2
    for (grads, rec), (plain_grads, plain_rec) in zip(dist_ranks, plain_ranks):
        assert rec["params"] == plain_rec["params"]
        assert len(rec["owned"]) < len(rec["params"])  # sharded, not replicated
        for name in rec["owned"]:
            mine, theirs = grads[f"grad0/{name}"], plain_grads[f"grad0/{name}"]
            if name in rec["fp8"] or replicas == 2:
                assert torch.equal(mine, theirs), name
            else:  # gloo's ring all-reduce adds 4 replicas in another order
                assert _rel(mine, theirs) < 1e-6, name
        assert rec["norms"][0] == pytest.approx(plain_rec["norms"][0], rel=1e-6)
    # Each model slice's parameters are owned by exactly one of its data-parallel ranks.
    tp = 2 if layout.startswith("tp2") else 1
    for first in range(tp):
        slices = {}
        for rank in range(first, len(dist_ranks), tp):  # tp fastest, then dp, then pp
            _, rec = dist_ranks[rank]
            key = tuple(rec["params"])
            slices.setdefault(key, []).append(set(rec["owned"]))
        for params, owned in slices.items():
            assert len(owned) == replicas
            assert sorted(n for o in owned for n in o) == sorted(params)
    weights, plain = _merged(dist_ranks), _merged(plain_ranks)
    if replicas == 2:  # sums of two are commutative: the same arithmetic everywhere
        assert all(torch.equal(weights[k], plain[k]) for k in plain)
        assert _loss_error(dist_ranks, plain_ranks) == 0.0
    elif level == "fp32":
        _check_fp32(weights, plain, layout)
    else:
        _check_fp8(weights, plain, _merged(results(PLAIN[layout], "fp32")), layout)


def test_pipeline_tied_embedding_bucket_is_reduced_last(results):
    """PP2 x DP2: both stages hold the tied embedding in a held-back bucket of its own, reduced
    over the replicas after the two stages' copies are summed (its weights already matched)."""
    for level in ("fp32", "O2"):
        for _, rec in results("pp2_dp2_dist", level):
            assert len(rec["held"]) == 1 and rec["held"][0] == rec["buckets"] - 1
            for log in rec["launch_log"]:
                assert [b for b, _ in log] == list(range(rec["buckets"]))  # held one last


def test_grad_norm_counts_replicated_parameters_once(results):
    """fp32, identical weights at step 1: TP2 x DP2 (replicated norms and row biases on both
    TP ranks, owned by one DP rank each), PP2 x DP2 (tied embedding on two stages) and DP=4
    give the single-process (or TP2) norm to FP32 rounding, on every rank."""
    for layout in ("dp2_dist", "dp4_dist", "tp2_dp2_dist", "pp2_dp2_dist"):
        ref = results(REFERENCE[layout], "fp32")[0][1]["norms"]
        for _, rec in results(layout, "fp32"):
            assert rec["norms"] == pytest.approx(ref, rel=1e-6), layout


# ---------------------------------------------------------------------------------------------
# O3 at DP=4: bytes per parameter and on the wire


def test_o3_dp4_model_state_bytes_and_wire_bytes(results):
    """Theory per FP8 linear weight: FP8 weight 1 + FP8 gradient 1 on every rank, FP16 master 2
    and FP8 + FP16 moments 3 on the owner only: 2 + 5/4 = 3.25 bytes per parameter per rank.
    On the wire: 1 byte per element plus the per-tensor scales."""
    for rank, (_, rec) in enumerate(results("dp4_dist", "O3")):
        linear = rec["bytes_per_param"]["linear"]
        assert linear["total"] <= 3.3, (rank, linear)
        # The weight's 4-byte per-tensor scale counts with it (parts per thousand here).
        assert linear["weights"] == pytest.approx(1.0, abs=1e-3), (rank, linear)
        assert linear["grads"] == pytest.approx(1.0, abs=1e-3), (rank, linear)  # + scales
        for step, per_element in enumerate(rec["per_element"]):
            for name in ("reduce_scatter_fp8", "all_gather_params_fp8"):
                assert 1.0 <= per_element[name] <= 1.05, (rank, step, name, per_element)
    for _, rec in results("dp4", "O3"):  # the same level without the distributed optimizer
        assert rec["bytes_per_param"]["linear"]["total"] > 6.9


@pytest.mark.parametrize("layout", ["dp4_dist", "dp4"])
def test_o3_initial_masters_stay_with_the_ranks_that_step_them(results, layout):
    """Each FP8 weight's FP16 initial value (what its master starts from) is kept on the rank
    whose optimizer steps it, dropped on the others when the optimizer is built (no 2 bytes
    per parameter held for the owner's sake), and gone after the first step everywhere."""
    for rank, (_, rec) in enumerate(results(layout, "O3")):
        before, after = rec["initial_masters"]
        assert before and sorted(before) == sorted(set(rec["fp8"]) & set(rec["owned"])), rank
        assert after == [], rank


# ---------------------------------------------------------------------------------------------
# Overlap of the reduction with backward


@pytest.mark.parametrize("layout", ["overlap_dist", "overlap_plain"])
def test_buckets_launch_during_the_last_backward(results, layout):
    """2 micro-batches per replica, small buckets: nothing is launched and nothing is sent
    before the last micro-batch's backward (checked at its forward); during it, buckets are
    launched in their fixed order while other parameters still wait for their gradients."""
    for _, rec in results(layout, "O2"):
        assert rec["n_micro"] == 2 and rec["buckets"] >= 4
        steps = _split_steps(rec["events"])
        assert len(steps) == STEPS
        for events, log in zip(steps, rec["launch_log"]):
            kinds = [e[0] for e in events]
            forwards = [e for e in events if e[0] == "forward"]
            launches = [e for e in events if e[0] == "launch"]
            assert [e[1:] for e in forwards] == [[0, 0], [0, 0]]  # no launch, no bytes yet
            assert kinds == ["forward", "forward"] + ["launch"] * rec["buckets"]
            assert [e[1] for e in launches] == list(range(rec["buckets"]))
            assert [tuple(x) for x in log] == [tuple(e[1:3]) for e in launches]
            during_backward = [e for e in launches if not e[3]]
            assert during_backward and during_backward[0][2] > 0  # params still pending


def test_without_overlap_buckets_launch_in_finish(results):
    for _, rec in results("no_overlap", "O2"):
        for events, log in zip(_split_steps(rec["events"]), rec["launch_log"]):
            launches = [e for e in events if e[0] == "launch"]
            assert launches and all(e[3] for e in launches)  # inside finish
            assert [x[1] for x in log] == [0] * rec["buckets"]  # backward was over


def _split_steps(events: list) -> list[list]:
    steps, current = [], []
    for event in events:
        if event[0] == "step":
            steps.append(current)
            current = []
        else:
            current.append(event)
    return steps


# ---------------------------------------------------------------------------------------------
# Clipping over sharded and FP8 gradients


@pytest.mark.parametrize("layout", ["dp2_dist_clip", "tp2_dp2_dist_clip"])
def test_clipping_sharded_and_fp8_gradients(results, layout):
    """O2, clip_grad 0.05 (the norm is ~1.9, so every step clips): the distributed optimizer's
    norm equals the plain run's at every step (FP32 rounding of the sum's order), every owned
    gradient, FP8 slots included, leaves clipping multiplied by clip / (norm + 1e-6), the
    clipped gradients equal the plain run's, and the weights after 3 steps agree to FP8 noise.

    Not bitwise: the distributed optimizer sums its own shard's squares before the
    all-reduce, the plain run all of them in parameter order, so the norm and with it the clip
    coefficient may differ in the last bit (equal on one CPU, an ulp apart on an AVX-512
    Xeon). An E4M3 moment or FP16 weight whose value lands within that ulp of a rounding
    boundary then rounds the other way, and the steps after carry it on: the weights get the
    module's FP8-noise bar against the plain run's fp32 twin."""
    plain_layout = layout.replace("_dist", "")
    dist_ranks, plain_ranks = results(layout, "O2"), results(plain_layout, "O2")
    for (grads, rec), (plain_grads, plain_rec) in zip(dist_ranks, plain_ranks):
        assert rec["norms"] == pytest.approx(plain_rec["norms"], rel=1e-6)
        assert any(name in rec["fp8"] for name in rec["owned"])
        for step, norm in enumerate(rec["norms"]):
            coef = 0.05 / (norm + 1e-6)
            assert coef < 0.1  # clipping active
            for name in rec["owned"]:
                clipped = grads[f"clipped{step}/{name}"]
                assert _rel(clipped, grads[f"grad{step}/{name}"] * coef) < 1e-6, (step, name)
                assert _rel(clipped, plain_grads[f"clipped{step}/{name}"]) < 1e-6, (step, name)
    weights, plain = _merged(dist_ranks), _merged(plain_ranks)
    _check_fp8(weights, plain, _merged(results(plain_layout, "fp32")), layout)


# ---------------------------------------------------------------------------------------------
# Through the real entry point


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_distributed_optimizer(tiny_data, tmp_path, capfd):
    """2 ranks, O2, delayed scaling: 6 straight iterations against 3 + resume: the same losses,
    every rank's own optimizer shard and own FP8 scaling state (replicas see different data, so
    their amax histories differ) written and read back. Resuming without the distributed
    optimizer reshards the state."""
    extra = {**DIST, "training.global_batch_size": 4, "precision.fp8_recipe": "delayed"}
    config = ["--config", str(REPO / "configs/gpt_tiny.yaml")]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    stop = {**extra, "training.exit_interval": 3}
    # The straight run and the stopped one in forked ranks; the resume through torchrun.
    pretrain_ranks(2, [(config[1], tiny_overrides(tiny_data, run, "O2", **kw))
                       for run, kw in ((straight, extra), (resumed, stop))])  # fmt: skip
    assert [r["iteration"] for r in _records(resumed)] == [1, 2, 3]
    files = {p.name for p in (resumed / "checkpoints" / "iter_0000003").iterdir()}
    assert {"optimizer_dp0.safetensors", "optimizer_dp1.safetensors"} <= files
    assert {"fp8_scaling_dp0.safetensors", "fp8_scaling_dp1.safetensors"} <= files
    assert "optimizer.safetensors" not in files and "model.safetensors" in files
    proc = torchrun(2, config + tiny_overrides(tiny_data, resumed, "O2", **extra))
    assert "resumed from" in proc.stdout
    assert [r["lm loss"] for r in _records(resumed)] == [r["lm loss"] for r in _records(straight)]
    # A complete run says so and builds nothing: no records, no new TensorBoard file. (This
    # and the next run in forked ranks, whose output capfd reads: the entry point ran above.)
    events = sorted((resumed / "tensorboard").iterdir())
    capfd.readouterr()
    pretrain_ranks(2, [(config[1], tiny_overrides(tiny_data, resumed, "O2", **extra))])
    out = capfd.readouterr().out
    assert "training already complete" in out and "fp8train: level" not in out, out[-2000:]
    assert sorted((resumed / "tensorboard").iterdir()) == events
    assert len(_records(resumed)) == 6
    # Without the distributed optimizer the same checkpoint loads too: its shards are
    # gathered into each replica's full optimizer state (checkpoint/reshard.py); one more step.
    replicated = {**extra, "optimizer.distributed": "false", "training.train_iters": 7}
    pretrain_ranks(2, [(config[1], tiny_overrides(tiny_data, resumed, "O2", **replicated))])
    assert "resharded" in capfd.readouterr().out
    assert [r["iteration"] for r in _records(resumed)] == [1, 2, 3, 4, 5, 6, 7]
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "iter_0000007"
