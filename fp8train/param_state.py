"""The state the precision machinery keeps on a parameter, behind typed accessors.

Three slots ride on a parameter object, so whoever holds the parameter (an optimizer, a
gradient buffer, a clipping pass) finds them without a side table:

- the gradient slot (attribute ``main_grad``): where a step reads the weight's gradient instead
  of ``.grad``. Either an FP32 tensor of the parameter's shape (a view into the flat gradient
  buffer of ``parallel/grad_buffer.py``: BF16 gradients accumulate there in FP32), or an
  ``Fp8GradSlot`` (O1-O3 FP8 weight gradients, given by ``Linear.lower_weight_precision``).
  None when there is neither: the gradient is ``.grad``.
- the scale (attribute ``scale_inv``): the FP32 dequantisation scale of a weight stored as
  tensor-scaled FP16 (O1/O2) or FP8 (O3), whose value is ``p.float() * scale_inv``; or, for an
  FP8 weight with block scales (O3 at ``fp8_granularity=block``), one scale per block of
  ``scale_block`` (attribute ``scale_block``), the grid ``[ceil(R/br), ceil(C/bc)]``.
  ``fp8train.Linear`` points it at its ``weight_scale_inv`` buffer, so updating one in place
  updates the other. None for a weight stored at its own precision.

- the initial master (attribute ``initial_master``): at O3, the tensor-scaled FP16 rounding of
  the weight's initial high-precision value, made where the weight is lowered to FP8
  (``Linear.lower_weight_precision``) and taken by the optimizer that steps the weight when it
  creates its FP16 master (``optim_states.init_state``). Without it the master would start as
  the FP8 weight itself: on E4M3's grid, where every element must travel half an E4M3 step
  (~6% of its magnitude) before the weight it rounds to moves, so the first hundred steps'
  small updates barely reach the forward. Dropped when the weight is overwritten (a load) and
  on the ranks that do not step the weight (the distributed optimizer's other owners).

The attribute names are Megatron's (``main_grad``) and MS-AMP's (``scale_inv``), so outside
code that reads them keeps working; inside this project only these functions touch them.
"""

from __future__ import annotations

import torch

from .blockwise import block_grid
from .low_precision import Fp8GradSlot

__all__ = [
    "GradSlot",
    "drop_initial_master",
    "fp8_grad_slot",
    "grad_slot",
    "grad_value",
    "scale_block_of",
    "scale_inv_of",
    "set_grad_slot",
    "set_initial_master",
    "set_scale_inv",
    "take_initial_master",
]

GradSlot = torch.Tensor | Fp8GradSlot

_GRAD_SLOT = "main_grad"
_SCALE_INV = "scale_inv"
_SCALE_BLOCK = "scale_block"
_INITIAL_MASTER = "initial_master"


def grad_slot(p: torch.Tensor) -> GradSlot | None:
    """``p``'s gradient slot: its FP32 buffer view, its ``Fp8GradSlot``, or None (use ``.grad``)."""
    return getattr(p, _GRAD_SLOT, None)


def grad_value(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a step uses: an FP8 slot dequantized, the FP32 buffer view, or ``.grad``."""
    slot = getattr(p, _GRAD_SLOT, None)
    if slot is None:
        return p.grad
    return slot if isinstance(slot, torch.Tensor) else slot.dequantize()


def fp8_grad_slot(p: torch.Tensor) -> Fp8GradSlot | None:
    """``p``'s gradient slot when it is an ``Fp8GradSlot`` (an FP8 weight gradient), else None."""
    slot = getattr(p, _GRAD_SLOT, None)
    return slot if isinstance(slot, Fp8GradSlot) else None


def set_grad_slot(p: torch.Tensor, slot: GradSlot | None) -> None:
    """Give ``p`` a gradient slot of its own shape (None removes it)."""
    if slot is None:
        if hasattr(p, _GRAD_SLOT):
            delattr(p, _GRAD_SLOT)
        return
    if not isinstance(slot, (torch.Tensor, Fp8GradSlot)):
        raise TypeError(f"a gradient slot is a tensor or an Fp8GradSlot, not {type(slot)}")
    # A slot of another shape would be read as this parameter's gradient all the same.
    if tuple(slot.data.shape) != tuple(p.shape):
        raise ValueError(
            f"gradient slot of shape {tuple(slot.data.shape)} for a parameter of shape "
            f"{tuple(p.shape)}"
        )
    setattr(p, _GRAD_SLOT, slot)


def scale_inv_of(p: torch.Tensor) -> torch.Tensor | None:
    """The FP32 scale of a scaled FP16/FP8 parameter (one value, or its block grid); None for
    others."""
    return getattr(p, _SCALE_INV, None)


def scale_block_of(p: torch.Tensor) -> tuple[int, int] | None:
    """The block of a block-scaled parameter's ``scale_inv`` grid; None for one scale."""
    return getattr(p, _SCALE_BLOCK, None)


def set_scale_inv(
    p: torch.Tensor, scale_inv: torch.Tensor | None, block: tuple[int, int] | None = None
) -> None:
    """Attach the scale, kept by reference (in-place updates of either are seen by both): one
    element, or with ``block`` one per block of the 2-D ``p``. None removes it."""
    for attr in (_SCALE_INV, _SCALE_BLOCK):
        if hasattr(p, attr):
            delattr(p, attr)
    if scale_inv is None:
        return
    if not isinstance(scale_inv, torch.Tensor):
        raise TypeError("scale_inv: a tensor (the parameter's scale)")
    if block is None:
        if scale_inv.numel() != 1:
            raise TypeError("scale_inv: a one-element tensor (the per-tensor scale), or a block")
    else:
        grid = block_grid(tuple(p.shape), block) if p.dim() == 2 else None
        if grid is None or tuple(scale_inv.shape) != grid:
            raise ValueError(
                f"scale_inv of shape {tuple(scale_inv.shape)} for a parameter of shape "
                f"{tuple(p.shape)} in blocks {tuple(block)}: want {grid}"
            )
        setattr(p, _SCALE_BLOCK, tuple(block))
    setattr(p, _SCALE_INV, scale_inv)


def set_initial_master(p: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Attach the FP16 ``data`` (``p``'s shape) and its 0-d FP32 ``scale_inv``: the value ``p``'s
    master starts from, where it is finer than ``p`` itself."""
    if data.dtype != torch.float16 or tuple(data.shape) != tuple(p.shape):
        raise ValueError(
            f"initial master: FP16 of shape {tuple(p.shape)}, not {data.dtype} {tuple(data.shape)}"
        )
    if scale_inv.numel() != 1:
        raise ValueError("initial master: one per-tensor scale")
    setattr(p, _INITIAL_MASTER, (data, scale_inv))


def take_initial_master(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``p``'s initial master ``(data, scale_inv)``, removed from ``p``; None when it has none."""
    master = getattr(p, _INITIAL_MASTER, None)
    drop_initial_master(p)
    return master


def drop_initial_master(p: torch.Tensor) -> None:
    """Forget ``p``'s initial master (its weight was overwritten, or another rank steps it)."""
    if hasattr(p, _INITIAL_MASTER):
        delattr(p, _INITIAL_MASTER)
