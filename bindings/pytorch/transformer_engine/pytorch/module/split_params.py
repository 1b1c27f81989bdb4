"""parameters_split (TE's Linear / LayerNormLinear argument): the weight and bias as several
Parameters along dim 0, `<name>_weight` / `<name>_bias`, which the forward concatenates; and the
weights whose `main_grad` receives the weight gradient under fuse_wgrad_accumulation."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..attn_packing import cat_rows


def parse_parameters_split(parameters_split, out_features: int, who: str) -> List[Tuple[str, int]]:
    """[(name, rows)] of parameters_split: a tuple/list of names (equal splits of out_features) or
    a dict name -> rows summing to out_features; trailing underscores of names are dropped (TE).
    None / empty -> [] (no split)."""
    if parameters_split is None or len(parameters_split) == 0:
        return []
    if isinstance(parameters_split, dict):
        items = [(str(k), v) for k, v in parameters_split.items()]
        for k, v in items:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{who}: parameters_split sizes must be positive ints, got {k!r}: {v!r}")
        if sum(v for _, v in items) != out_features:
            raise ValueError(f"{who}: parameters_split sizes {[v for _, v in items]} must sum to out_features "
                             f"({out_features})")
    elif isinstance(parameters_split, (tuple, list)):
        n = len(parameters_split)
        if out_features % n:
            raise ValueError(f"{who}: out_features ({out_features}) does not split into {n} equal parameters "
                             f"{tuple(parameters_split)}")
        items = [(str(k), out_features // n) for k in parameters_split]
    else:
        raise TypeError(f"{who}: parameters_split must be a tuple/list of names or a dict name -> size, got "
                        f"{type(parameters_split).__name__}")
    names = [k.rstrip("_") for k, _ in items]
    if any(not k for k in names) or len(set(names)) != len(names):
        raise ValueError(f"{who}: parameters_split names must be distinct and non-empty (after dropping "
                         f"trailing underscores), got {[k for k, _ in items]}")
    return list(zip(names, [v for _, v in items]))


class SplitParams:
    """Mixin of Linear and LayerNormLinear. Without a split the module holds `weight` / `bias`;
    with one (_split), one Parameter per named split, made as consecutive rows of one buffer so that
    the forward's concatenation is a view while they stay there (attn_packing.cat_rows; moved or
    replaced parameters are concatenated by copy). `_splits` is [] (no split), None (a split is
    pending: the fused weight is not cast to FP8 yet) or [(name, rows)]."""

    _splits: Optional[List[Tuple[str, int]]] = []

    def _split(self, splits: Sequence[Tuple[str, int]]) -> None:
        """Replaces weight / bias (not initialised yet: reset_parameters follows, initialising each
        split on its own and casting the split weights under quantized_model_init) by the splits,
        registered in TE's order: every weight, then every bias (optimizer states index
        parameters by position)."""
        w, b = self.weight, self.bias
        del self._parameters["weight"]
        del self._parameters["bias"]
        w_all = w.detach().clone()
        b_all = None if b is None else b.detach().clone()
        starts = [sum(n for _, n in splits[:i]) for i in range(len(splits))]
        for (name, n), start in zip(splits, starts):
            self.register_parameter(f"{name}_weight", torch.nn.Parameter(w_all[start:start + n],
                                                                         requires_grad=w.requires_grad))
        for (name, n), start in zip(splits, starts):
            self.register_parameter(f"{name}_bias", None if b is None else
                                    torch.nn.Parameter(b_all[start:start + n], requires_grad=b.requires_grad))
        self._splits = list(splits)

    def _weight_names(self) -> List[str]:
        return [f"{n}_weight" for n, _ in self._splits] if self._splits else ["weight"]

    def _fp8_weight_slots(self):
        if self._splits is None:
            return {}  # still building: the fused weight is split (and cast) in _split
        return {name: 1 for name in self._weight_names()}

    def _init_parameters(self) -> None:
        if getattr(self, "layer_norm_weight", None) is not None:
            self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.zero_()
        names = [n for n, _ in self._splits] if self._splits else [None]
        for n in names:
            w = getattr(self, "weight" if n is None else f"{n}_weight")
            b = getattr(self, "bias" if n is None else f"{n}_bias")
            self.init_method(w)
            if b is not None:
                b.zero_()

    def _weight_and_bias(self):
        """The weight and bias this forward uses (the split Parameters concatenated)."""
        if not self._splits:
            return self.weight, self.bias
        ws = [getattr(self, f"{n}_weight") for n, _ in self._splits]
        bs = [getattr(self, f"{n}_bias") for n, _ in self._splits]
        return cat_rows(ws), (None if bs[0] is None else cat_rows(bs))

    def _wgrad_params(self) -> tuple:
        """fuse_wgrad_accumulation: the weight Parameters whose main_grad the weight gradient is
        accumulated into, in row order; () when it is off."""
        if not self.fuse_wgrad_accumulation:
            return ()
        return tuple(getattr(self, n) for n in self._weight_names())
