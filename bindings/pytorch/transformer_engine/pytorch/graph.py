"""make_graphed_callables: CUDA-graph capture of TE modules with their FP8 state (TE's signature).

CUDA graphs exist only on CUDA devices; on a machine without one (or with CPU sample
arguments) this raises a RuntimeError that says so. On CUDA, capture is delegated to
torch.cuda.make_graphed_callables, run inside fp8_autocast(fp8_enabled, fp8_calibrating,
fp8_recipe, fp8_group), so the captured casts read the modules' scale buffers (the library
kernels take them by pointer: scale updates between replays take effect) and the captured
backward contains the backward recipe step. A replay runs no module Python code, so each call
of a graphed callable registers the modules' FP8 metadata with the enclosing fp8_autocast; its
exit then runs the forward recipe step as for an eager forward. Call graphed callables inside
fp8_autocast with the recipe they were captured with.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple, Union

import torch

from .fp8 import FP8GlobalState, fp8_autocast, get_default_recipe

__all__ = ["make_graphed_callables"]

CUDA_GRAPHS_NEED_CUDA = ("make_graphed_callables: CUDA graphs need a CUDA device; "
                         "{what}. Run the modules eagerly (or with torch.compile) on the CPU instead.")


def _fp8_metas(module):
    if not isinstance(module, torch.nn.Module):
        return []
    return [m.fp8_meta for m in module.modules() if getattr(m, "fp8_meta", None) is not None
            and (m.fp8_meta.num["fwd"] or m.fp8_meta.num["bwd"])]


def _register_on_call(fn: Callable, metas, fp8_enabled: bool) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if fp8_enabled and FP8GlobalState.depth > 0 and FP8GlobalState.enabled:
            for meta in metas:
                FP8GlobalState.register_forward(meta)
        return fn(*args, **kwargs)
    return call


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           sample_kwargs=None, fp8_enabled: bool = False, fp8_calibrating: bool = False,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching: bool = False, _order=None,
                           pool: Optional[Tuple[int, ...]] = None, retain_graph_in_backward: bool = False,
                           enabled: Optional[bool] = None, calibrating: Optional[bool] = None, recipe=None,
                           amax_reduction_group=None, cache_quantized_params: Optional[bool] = None
                           ) -> Union[Callable, Tuple[Callable, ...]]:
    """Graphed versions of `modules` (a callable / nn.Module or a tuple of them), as
    torch.cuda.make_graphed_callables, with the FP8 autocast state (fp8_*, or TE 2.8+'s enabled /
    calibrating / recipe / amax_reduction_group / cache_quantized_params) applied during warm-up
    and capture. Not implemented here: sample_kwargs, fp8_weight_caching, _order (pipeline
    schedules), retain_graph_in_backward."""
    # (TE 2.8+'s names, where given, stand for the older fp8_* ones)
    fp8_enabled = fp8_enabled if enabled is None else enabled
    fp8_calibrating = fp8_calibrating if calibrating is None else calibrating
    fp8_recipe = fp8_recipe if recipe is None else recipe
    fp8_group = fp8_group if amax_reduction_group is None else amax_reduction_group
    fp8_weight_caching = fp8_weight_caching if cache_quantized_params is None else cache_quantized_params
    if not torch.cuda.is_available():
        raise RuntimeError(CUDA_GRAPHS_NEED_CUDA.format(what="torch.cuda.is_available() is False"))
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    for a in args:
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                raise RuntimeError(CUDA_GRAPHS_NEED_CUDA.format(what=f"a sample argument is on {t.device}"))
    unsupported = {"sample_kwargs": bool(sample_kwargs), "fp8_weight_caching": fp8_weight_caching,
                   "_order": _order is not None, "retain_graph_in_backward": retain_graph_in_backward}
    on = [k for k, v in unsupported.items() if v]
    if on:
        raise NotImplementedError(f"make_graphed_callables: options not implemented in this adapter: {on}")
    recipe = fp8_recipe if fp8_recipe is not None else get_default_recipe()
    metas = [_fp8_metas(m) for m in mods]
    with fp8_autocast(enabled=fp8_enabled, calibrating=fp8_calibrating, fp8_recipe=recipe, fp8_group=fp8_group):
        graphed = torch.cuda.make_graphed_callables(tuple(mods), tuple(args), num_warmup_iters=num_warmup_iters,
                                                    allow_unused_input=allow_unused_input, pool=pool)
    out = []
    for g, ms in zip(graphed, metas):
        if isinstance(g, torch.nn.Module):
            g.forward = _register_on_call(g.forward, ms, fp8_enabled)
            out.append(g)
        else:
            out.append(_register_on_call(g, ms, fp8_enabled))
    return out[0] if single else tuple(out)
