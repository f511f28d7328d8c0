"""One row of benchmarks/bench_gpu.py: a spec (a dict, JSON-able so that it can cross into a fresh
process) in, the spec plus its measurements and a status out.

A ``"project"`` row trains the project's own stack (load_config + overrides, build_run,
train_step) at one precision level, eager (``training.compile=false``) or with every
transformer layer compiled (``"compile": true``: ``training.compile=true``, so build_run
compiles the layers as a training run does); a ``"plain"`` row trains transformers'
GPT2LMHeadModel of the same shape in bf16 with torch AdamW, optionally with torchao's float8
training applied, eager or under ``torch.compile``. ``"compile_backend"`` (default inductor)
picks another dynamo backend: the CPU smoke test takes aot_eager, which costs seconds.
Tokens are synthetic (uniform random ids, one batch repeated): throughput only.

After the timed steps, ``"profile_steps"`` more run under ``torch.profiler`` (``profile_steps``
below): device kernels, dispatched ATen operators and host time per step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from families import register_family
from families.gpt import GPTFamily, GPTModelSection
from fp8train import device as devices
from fp8train import gemm
from fp8train.precision import split_level
from training.compile import compile_layers
from training.config import load_config
from training.setup import build_run
from training.step import train_step

__all__ = [
    "FAMILY",
    "NOT_INSTALLED",
    "ROW_PREFIX",
    "SHAPES",
    "Shape",
    "SyntheticGPTFamily",
    "device_info",
    "fp8_backend",
    "measure_row",
    "profile_steps",
    "model_config",
    "run_config",
    "run_row",
    "time_steps",
    "torchao_float8",
]

REPO = Path(__file__).resolve().parent.parent
# A row's subprocess runs the command line's hidden ``_row`` subcommand, which lives in the
# script, not in this module.
SCRIPT = Path(__file__).resolve().with_name("bench_gpu.py")
CONFIG = "configs/gpt_1.3b.yaml"  # GPT-3 XL; the other shapes override its model keys
ROW_PREFIX = "BENCH_GPU_ROW "  # the line a row's subprocess reports on
NOT_INSTALLED = "torchao not installed"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int  # before the project pads it to a multiple of 128 (50257 -> 50304)
    micro_batch: int


SHAPES = {
    "tiny": Shape(2, 64, 2, 64, 512, 2),  # CPU smoke test: seconds
    "350m": Shape(24, 1024, 16, 2048, 50257, 8),  # GPT-3 Medium
    "1.3b": Shape(24, 2048, 16, 2048, 50257, 4),  # GPT-3 XL, as configs/gpt_1.3b.yaml
}

# --------------------------------------------------------------------------- synthetic data


@dataclass(frozen=True)
class SyntheticSection(GPTModelSection):
    """GPT's model section under the synthetic family's name (a section names its family)."""

    FAMILY: ClassVar[str] = "gpt_synthetic"


class SyntheticGPTFamily(GPTFamily):
    """The GPT family with nothing read from disk: a vocabulary of ``data.vocab_size`` ids and
    no datasets (the benchmark hands train_step its own batches). Building the stdlib corpus
    and its tokenizer would cost minutes of a 30-minute GPU lease and measure nothing."""

    name = "gpt_synthetic"
    model_section = SyntheticSection
    hf_model_types = ()  # imports nothing from Hugging Face: "gpt2" stays the GPT family's

    def preflight(self, cfg):
        return None

    def prepare_data(self, cfg, rank: int):
        vocab = types.SimpleNamespace(vocab_size=cfg.data.vocab_size)
        return types.SimpleNamespace(tokenizer=vocab, data_prefix=None)

    def build_datasets(self, cfg, data, train_samples: int, valid_samples: int):
        return None, None


FAMILY = register_family(SyntheticGPTFamily())


def synthetic_batch(batch: int, seq: int, vocab: int, device: torch.device) -> dict:
    """One micro-batch in the GPT dataset's format, already on ``device`` (no copy per step)."""
    gen = torch.Generator().manual_seed(0)  # private: the model's RNG stream stays untouched
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    out = {
        "tokens": ids[:, :-1],
        "labels": ids[:, 1:],
        "loss_mask": torch.ones(batch, seq),
        "position_ids": torch.arange(seq).expand(batch, seq),
    }
    return {k: v.contiguous().to(device) for k, v in out.items()}


# --------------------------------------------------------------------------- one row


def fp8_backend(device: torch.device, choice: str | None = None) -> str:
    """The FP8 GEMM backend, pinned: "auto" would time both inside the first row."""
    if choice:
        return choice
    if device.type == "cuda" and gemm.scaled_mm_available(device):
        return "scaled_mm"  # FP8 tensor cores
    return "emulated"


def run_config(spec: dict):
    """The run's Config: configs/gpt_1.3b.yaml with the shape, level and batch of ``spec``."""
    shape = SHAPES[spec["size"]]
    micro = spec.get("micro_batch") or shape.micro_batch
    # "te:bf16": the level with precision.param_dtype=bf16 (BF16 parameters, FP32 masters);
    # "te:bf16@block": with row- or block-wise FP8 scales too (current scaling).
    spec_level, _, granularity = (spec.get("level") or "bf16").partition("@")
    level, param_dtype = split_level(spec_level)
    values = {
        "model.num_layers": spec.get("layers") or shape.layers,
        "model.hidden_size": shape.hidden,
        "model.num_attention_heads": shape.heads,
        "model.seq_length": shape.seq,
        "model.recompute": spec.get("recompute", "none"),
        "data.vocab_size": shape.vocab,
        "training.micro_batch_size": micro,
        "training.global_batch_size": micro,  # one micro-batch per step: no accumulation
        "training.train_iters": spec["warmup"] + spec["steps"],
        "optimizer.lr_warmup_iters": 0,
        "precision.level": level,
        "precision.param_dtype": param_dtype,
        "precision.fp8_gemm_backend": spec.get("fp8_backend") or "emulated",
        # Explicit both ways: null would compile on CUDA (training/compile.py), so an eager
        # row there would silently be a compiled one.
        "training.compile": "true" if spec.get("compile") else "false",
    }
    if granularity:
        values.update({"precision.fp8_granularity": granularity, "precision.fp8_recipe": "current"})
    overrides = [f"{k}={v}" for k, v in values.items()]
    return load_config(str(REPO / CONFIG), overrides, family=FAMILY.name)


def model_config(cfg):
    """The GPTConfig every row of a shape shares (vocabulary padded as the project pads it)."""
    return FAMILY.model_config(cfg, FAMILY.prepare_data(cfg, 0), 1)


def device_info(device: torch.device) -> dict:
    """What the report says about the device; rows carry it, so that the parent process of
    subprocess rows never touches the GPU (a CUDA context there would hold memory the rows
    then lack)."""
    cap = devices.cuda_capability(device)
    return {
        "device": devices.device_name(device),
        "device_type": device.type,
        "capability": f"sm_{cap[0]}{cap[1]}" if cap else None,
    }


def peak_bytes(device: torch.device) -> int:
    stats = devices.memory_stats(device)
    return stats.get("max_allocated", stats.get("max_rss", 0))


STEP_MARK = "bench_gpu.step"  # the profiler's range around each profiled step


def _is_wait(name: str) -> bool:
    """A runtime call in which the host blocks on the device: a synchronisation, or a copy
    (a device-to-host copy returns only once the stream has reached it; host-to-device ones
    of a step are a few bytes and microseconds)."""
    return "Synchronize" in name or name.startswith(("cudaMemcpy", "hipMemcpy"))


def _top(prof, device: torch.device, steps: int, top: int) -> list[dict]:
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    return [
        {
            "name": e.key[:120],
            "ms_per_step": getattr(e, key) / 1e3 / steps,
            "share": getattr(e, key) / total,
            "calls_per_step": e.count / steps,
        }
        for e in events[:top]
    ]


def profile_steps(step, device: torch.device, steps: int = 2, top: int = 0) -> dict:
    """``steps`` more steps under ``torch.profiler`` (after the timed ones, so that its own
    overhead never enters a timing), per step:

    - ``kernels_per_step``: the profiler's device events that are kernels (not memcpy or
      memset, counted apart as ``copies_per_step``); None on a device without them (the CPU);
    - ``aten_ops_per_step``: ATen operators dispatched from outside another ATen operator
      (by Python, the autograd engine or compiled code), on every thread;
    - ``host_s``: the step's wall time on the host less the time its threads spent blocked
      on the device (``_is_wait``): what the host needs to issue the step, whatever the
      device's speed. It includes the profiler's own cost (about a microsecond per recorded
      operator or launch); on the CPU, where nothing waits, it is the step's wall time.

    With ``top``, also the ``top`` operators by device time (``top_kernels``): where a level's
    time goes, read from one call instead of a second lease."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
            devices.synchronize(device)  # outside the mark: the next step starts idle
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    marks = [e.time_range for e in host if e.name == STEP_MARK]
    waits = [e.time_range for e in host if _is_wait(e.name)]
    busy_us = 0.0
    for mark in marks:
        inside = (w for w in waits if w.start >= mark.start and w.end <= mark.end)
        busy_us += mark.elapsed_us() - sum(w.elapsed_us() for w in inside)
    # Device events are kernels, copies, and the device-side spans of record_function ranges
    # (user annotations: this step's mark, dynamo's regions), which launch nothing.
    on_device = [
        e.name
        for e in events
        if e.device_type != DeviceType.CPU
        and not getattr(e, "is_user_annotation", False)
        and e.name != STEP_MARK
    ]
    copies = sum(n.startswith(("Memcpy", "Memset")) for n in on_device)

    def dispatched(e) -> bool:
        parent = e.cpu_parent
        return e.name.startswith("aten::") and not (parent and parent.name.startswith("aten::"))

    out = {
        "profiled_steps": len(marks),
        "host_s": busy_us / 1e6 / max(len(marks), 1),
        "aten_ops_per_step": sum(map(dispatched, host)) / steps,
        "kernels_per_step": (len(on_device) - copies) / steps if device.type != "cpu" else None,
        "copies_per_step": copies / steps if device.type != "cpu" else None,
        # A cross-check of the kernel count from the host side: runtime and driver calls
        # that launch (cudaLaunchKernel, cuLaunchKernel, ...).
        "launches_per_step": sum("LaunchKernel" in e.name for e in host) / steps,
    }
    if top:
        out["top_kernels"] = _top(prof, device, steps, top)
    return out


def time_steps(
    step, device: torch.device, warmup: int, steps: int, profile: bool = False, profiled: int = 0
) -> dict:
    """Median seconds per step after ``warmup`` untimed steps (each one's time kept in
    ``warmup_s``: the first holds a compiled row's compilation, a later one any
    recompilation), and the peak memory of the timed ones (reset after warm-up: the
    optimizer's lazily made states exist by then); then ``profiled`` more steps under the
    profiler (``profile_steps``; with ``profile``, at least 2, with the top operators)."""
    warm = []
    for _ in range(warmup):
        start = time.perf_counter()
        step()
        devices.synchronize(device)
        warm.append(time.perf_counter() - start)
    devices.reset_peak_memory(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        devices.synchronize(device)  # the kernels this step queued are part of its time
        times.append(time.perf_counter() - start)
    out = {
        "step_s": statistics.median(times),
        "peak_bytes": peak_bytes(device),
        "warmup_s": warm,
    }
    if profile or profiled:
        count = max(profiled, 2 if profile else 1)
        out.update(profile_steps(step, device, count, top=25 if profile else 0))
    return out


def _dynamo_reset() -> None:
    """A compiled row starts from an empty dynamo cache and counters (in-process rows share a
    process): its graph count is its own, and no earlier row's entries count against the
    recompile limit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _dynamo_stats(compiled_modules: int) -> dict:
    """What dynamo did for a compiled row: the modules it wraps (each layer, or the whole
    model), the graphs compiled (for the layers one, plus one per recompilation, e.g. for the
    first layer, whose input needs no gradient), and the graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "compiled_modules": compiled_modules,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _compiled_modules(model: nn.Module) -> int:
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def project_row(spec: dict) -> dict:
    """The project's own stack at ``spec["level"]``: build_run, then train_step."""
    device = devices.get_device()
    cfg = run_config({**spec, "fp8_backend": fp8_backend(device, spec.get("fp8_backend"))})
    # --build-on-device: build and initialise under the device as default device. build_run
    # otherwise initialises on the host, at about 100-200 M values/s (one thread's RNG):
    # minutes for the largest max-size attempts, for values nobody reads.
    where = torch.device(device) if spec.get("build_on_device") else contextlib.nullcontext()
    compiled = bool(spec.get("compile"))
    if compiled:
        _dynamo_reset()
    start = time.perf_counter()
    with where:
        state = build_run(cfg)  # training.compile=true: build_run compiles the layers
    backend = spec.get("compile_backend") or "inductor"
    if compiled and backend != "inductor":
        # Re-wraps each layer (compilation is lazy: nothing was compiled yet).
        compile_layers(state.model, tensor_parallel=False, backend=backend)
    build_s = time.perf_counter() - start
    micro, seq = cfg.training.micro_batch_size, cfg.model.seq_length
    data = itertools.repeat(synthetic_batch(micro, seq, state.model_config.vocab_size, device))
    last = []  # the last step's StepStats: its loss is read after the timing, not inside it

    def step():
        last[:] = [train_step(state, data, 1)]

    timing = time_steps(
        step, device, spec["warmup"], spec["steps"], spec.get("profile", False),
        spec.get("profile_steps", 0),
    )  # fmt: skip
    bpp = (state.bytes_per_param or {}).get("all", {}).get("total")
    return {
        **timing,
        **(_dynamo_stats(_compiled_modules(state.model)) if compiled else {}),
        **device_info(device),
        "build_s": build_s,
        "tokens": micro * seq,
        "flops": state.family.flops_per_step(state.model_config, micro),
        "params": sum(p.numel() for p in state.model.parameters()),
        "bytes_per_param": bpp,
        "loss": last[0].loss if last else None,  # a host read of the device-side mean
        "fp8_backend": state.gemm_backend,
        "gemm": state.recipe.gemm,
    }


def linearise_conv1d(model: nn.Module) -> nn.Module:
    """GPT-2's ``Conv1D`` (``x @ W + b``, W stored [in, out]) as the equal ``nn.Linear``: the
    same GEMMs, and torchao's float8 conversion only swaps ``nn.Linear`` modules."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                fan_in, fan_out = child.weight.shape
                linear = nn.Linear(fan_in, fan_out, device=child.weight.device)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def torchao_float8():
    """torchao's float8 training API, or None when torchao is not importable."""
    if importlib.util.find_spec("torchao") is None:
        return None
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return Float8LinearConfig, convert_to_float8_training


def _fp8_filter(module: nn.Module, fqn: str) -> bool:
    # The head stays in bf16, as the project keeps its output head out of FP8; FP8 GEMMs need
    # both dimensions divisible by 16.
    return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def plain_model(config, device: torch.device, recipe: str | None) -> nn.Module:
    """transformers' GPT2LMHeadModel of the project's shape (random weights, SDPA, no
    dropout) in bf16; with ``recipe`` its linears converted to torchao float8 training."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.seq_length,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        activation_function="gelu_new",  # tanh GELU, the project's GPT-2 GELU
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: no host copy of the model
        model = GPT2LMHeadModel(hf)
    model = linearise_conv1d(model).to(torch.bfloat16)
    if recipe is not None:
        config_cls, convert = torchao_float8()
        convert(model, config=config_cls.from_recipe_name(recipe), module_filter_fn=_fp8_filter)
    return model


def plain_row(spec: dict) -> dict:
    """Plain PyTorch (optionally torchao float8): forward, backward, clip, AdamW step."""
    device = devices.get_device()
    cfg = run_config(spec)
    config = model_config(cfg)
    start = time.perf_counter()
    model = plain_model(config, device, spec.get("recipe"))
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay, **fused
    )
    compiled = bool(spec.get("compile"))
    if compiled:
        _dynamo_reset()
        run = torch.compile(model, backend=spec.get("compile_backend") or "inductor")
    else:
        run = model
    build_s = time.perf_counter() - start
    micro, seq = cfg.training.micro_batch_size, config.seq_length
    tokens = synthetic_batch(micro, seq, config.vocab_size, device)["tokens"]
    stats = {}

    def step():
        loss = run(input_ids=tokens, labels=tokens).loss  # HF shifts the labels itself
        loss.backward()
        nn.utils.clip_grad_norm_(params, cfg.training.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats["loss"] = loss.detach()

    timing = time_steps(
        step, device, spec["warmup"], spec["steps"], spec.get("profile", False),
        spec.get("profile_steps", 0),
    )  # fmt: skip
    return {
        **timing,
        **(_dynamo_stats(1) if compiled else {}),
        **device_info(device),
        "build_s": build_s,
        "tokens": micro * seq,
        "flops": FAMILY.flops_per_step(config, micro),  # the same formula as the levels
        "params": sum(p.numel() for p in params),
        "bytes_per_param": None,
        "loss": float(stats["loss"]),
        "gemm": "fp8" if spec.get("recipe") else "bf16",
    }


ROW_KINDS = {"project": project_row, "plain": plain_row}


def _out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return (
        isinstance(err, torch.OutOfMemoryError)
        or "out of memory" in text.lower()
        or ("can't allocate memory" in text)
    )


def measure_row(spec: dict) -> dict:
    """``spec`` plus its measurements and a status: "ok", "OOM", or "failed: ..." (with the
    traceback on stderr), so that one row that does not run leaves the table standing."""
    if spec.get("recipe") and torchao_float8() is None:
        return {**spec, "status": NOT_INSTALLED}
    try:
        return {**spec, "status": "ok", **ROW_KINDS[spec["kind"]](spec)}
    except Exception as err:  # noqa: BLE001  (reported in the row; the traceback goes to stderr)
        if _out_of_memory(err):
            return {**spec, "status": "OOM"}
        traceback.print_exc()
        why = " ".join(str(err).split())[:160]  # one line: it is a table cell
        return {**spec, "status": f"failed: {type(err).__name__}: {why}"}


def run_row(spec: dict, in_process: bool, timeout: float) -> dict:
    """One row in this process or in a fresh one (whose last ``ROW_PREFIX`` line is it)."""
    if in_process or (spec.get("recipe") and torchao_float8() is None):
        return measure_row(spec)
    cmd = [sys.executable, str(SCRIPT), "_row", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "status": f"failed: timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(ROW_PREFIX):
            row = json.loads(line[len(ROW_PREFIX) :])
            if row["status"] != "ok":
                sys.stderr.write(proc.stderr[-4000:])  # the traceback, for the call's log
            return row
    sys.stderr.write(proc.stderr[-4000:])
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    why = "killed (host out of memory?)" if proc.returncode == -9 else last[:160]
    return {**spec, "status": f"failed: exit {proc.returncode}: {why}"}
