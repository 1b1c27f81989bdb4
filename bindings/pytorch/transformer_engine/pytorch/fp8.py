"""FP8 autocast state and per-module delayed-scaling metadata.

Recipes: DelayedScaling (below) and Float8CurrentScaling, whose casts each take their scale from
the tensor being cast (nvte_compute_amax + nvte_compute_scale_from_amax, see custom_ops.quantize)
and keep no state here.

Timing (as in TE for DelayedScaling): during a step, every FP8 cast max-accumulates its
amax into row 0 of its module's amax history. Forward scales are updated (history rolled,
scale recomputed by nvte_delayed_scaling_recipe_amax_and_scale_update) when the OUTERMOST
fp8_autocast exits with grad enabled, for every module that ran an FP8 forward inside it.
Backward scales are updated in each module's backward, right before its gradients are cast
(a simplification of TE, which does it once per backward pass).

Amax reduction (recipe.reduce_amax, default True, with an fp8_group given): at the outermost
region's exit, one MAX all-reduce per (group, device) carries the current amaxes (row 0) of every
module that ran there, forward and backward histories together (TE aggregates them per region
too). The forward rows hold this step's amaxes; the backward rows hold those of the last backward
pass (a module's backward rolls its history before casting), so the next backward's scales come
from the group's amaxes too and every rank casts with the same scales. Without an fp8_group there
is no reduction (TE would reduce over the default group when torch.distributed is initialised; a
module run on one rank only, as in tests, would then hang).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
from typing import Optional, Tuple, Union

import torch

from transformer_engine import _nvte
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

from . import _ops, custom_ops

__all__ = ["fp8_autocast", "autocast", "is_fp8_available", "fp8_model_init", "quantized_model_init",
           "FP8GlobalState", "FP8Meta", "FP8ModelInitState", "get_default_recipe"]


def get_default_recipe() -> DelayedScaling:
    return DelayedScaling()


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether FP8 runs here (TE's signature: a bool, or (available, reason) with return_reason).
    CUDA: the library's CUDA backend and a device of compute capability >= 8.9. Without CUDA, FP8
    is emulated by the library's CPU backend (always available)."""
    ok, reason = _fp8_support()
    return (ok, reason) if return_reason else ok


def _fp8_support() -> Tuple[bool, str]:
    if torch.cuda.is_available():
        if not _nvte.cuda_backend_available():
            return False, "this build of libtransformer_engine has no CUDA backend"
        cc = torch.cuda.get_device_capability()
        if cc < (8, 9):
            return False, f"FP8 needs a GPU of compute capability 8.9 or newer (found {cc[0]}.{cc[1]})"
        return True, ""
    return True, "no CUDA device: FP8 is emulated by the CPU backend of libtransformer_engine"


_E4M3, _E5M2 = int(_ops.DType.kFloat8E4M3), int(_ops.DType.kFloat8E5M2)
# (forward, backward) FP8 DType values per format, as plain ints: torch.compile traces int
# lookups, not conversions of the binding's enum
FORMAT_DTYPES = {Format.E4M3: (_E4M3, _E4M3), Format.E5M2: (_E5M2, _E5M2), Format.HYBRID: (_E4M3, _E5M2)}


def _fwd_bwd_dtypes(recipe: Recipe):
    return FORMAT_DTYPES[recipe.fp8_format]


def check_recipe_supported(recipe: Recipe) -> None:
    """Raise for recipes (or recipe options) the modules cannot run."""
    if isinstance(recipe, DelayedScaling):
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            raise NotImplementedError("DelayedScaling with callable amax_compute_algo / "
                                      "scaling_factor_compute_algo is not supported by this adapter")
        return
    if isinstance(recipe, Float8CurrentScaling):
        return
    raise NotImplementedError(f"only the DelayedScaling and Float8CurrentScaling recipes are implemented, "
                              f"got {type(recipe).__name__}")


class FP8Meta:
    """Delayed-scaling state of one module: for forward and backward, an amax history
    float32 [len, n] and scales float32 [n] on the module's device.

    The buffers are allocated when the module is built (with the default recipe's history
    length), not at the first FP8 forward: torch.compile cannot trace a first allocation whose
    buffers the backward graph then updates in place. `initialized` says whether FP8 (or
    calibration) has run, i.e. whether the buffers hold state worth saving."""

    DEFAULT_HISTORY_LEN = DelayedScaling().amax_history_len

    def __init__(self, num_fwd: int, num_bwd: int):
        self.num = {"fwd": num_fwd, "bwd": num_bwd}
        self.amax_history = {}
        self.scale = {}
        self.recipe: Optional[Recipe] = None
        self.initialized = False
        # bit i: backward slot i's amax history has been seeded by a current-scaled first gradient
        # cast (see LinearCfg.seed_bwd); a fresh history clears the bits
        self.bwd_seeded = 0

    def allocate(self, device: torch.device, history_len: Optional[int] = None) -> None:
        """Fresh buffers: zero histories, unit scales."""
        n_len = self.DEFAULT_HISTORY_LEN if history_len is None else history_len
        for key, n in self.num.items():
            self.amax_history[key] = torch.zeros((n_len, n), dtype=torch.float32, device=device)
            self.scale[key] = torch.ones(n, dtype=torch.float32, device=device)
        self.bwd_seeded = 0

    def reset_tensors(self) -> None:
        """Zero amax histories and unit scales, in place (the module keeps its buffers)."""
        for key in self.amax_history:
            self.amax_history[key].zero_()
            self.scale[key].fill_(1.0)
        self.bwd_seeded = 0

    def take_bwd_seed(self, bit: int) -> bool:
        """Whether the backward of this forward seeds the (empty) backward amax histories behind
        `bit` with current-scaled first gradients; marks the bit, so only the first forward run
        with gradients enabled does (should its backward never run, the history stays empty and
        the next backward uses the initial scales, as TE does). A plain int attribute: torch.compile
        guards on its value and replays the update, so a compiled first step seeds too.
        NVTE_FP8_SEED_FIRST_BACKWARD=0 turns the seeding off (TE's first step: initial scales)."""
        if self.bwd_seeded & bit or os.environ.get("NVTE_FP8_SEED_FIRST_BACKWARD", "1") == "0":
            return False
        self.bwd_seeded = self.bwd_seeded | bit
        return True

    def _needs_realloc(self, n_len: int, device: torch.device) -> bool:
        h = self.amax_history.get("fwd")
        return h is None or h.device != device or h.shape[0] != n_len

    def prepare(self, recipe: Recipe, device: torch.device) -> None:
        """Adopt the recipe; adapt the buffers to its history length / the module's device."""
        check_recipe_supported(recipe)
        if self.recipe is not recipe:
            self.recipe = recipe
        if not isinstance(recipe, DelayedScaling):
            return  # current scaling keeps no state
        if not self.initialized:
            self.initialized = True
        n_len = recipe.amax_history_len
        if not self._needs_realloc(n_len, device):
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"FP8 metadata must be resized to amax_history_len={n_len} on {device} outside torch.compile "
                "(the buffers are updated in place by the compiled backward): run one eager forward under "
                "this recipe first, or call fp8_meta.prepare(recipe, device) before compiling")
        for key, n in self.num.items():
            h = self.amax_history.get(key)
            if h is None:
                self.allocate(device, n_len)
                return
            h, s = h.to(device), self.scale[key].to(device)
            if h.shape[0] != n_len:  # keep the most recent rows (row 0 = current step)
                new = torch.zeros((n_len, n), dtype=torch.float32, device=device)
                k = min(n_len, h.shape[0])
                new[:k] = h[:k]
                h = new
            self.amax_history[key], self.scale[key] = h, s

    def amax(self, key: str, i: int) -> torch.Tensor:
        """View of the current-step amax slot (history row 0, column i)."""
        return self.amax_history[key][0, i:i + 1]

    def scale_of(self, key: str, i: int) -> torch.Tensor:
        return self.scale[key][i:i + 1]

    def fp8_dtype(self, key: str) -> int:
        """The DType value (int) of this recipe's forward or backward casts."""
        fwd, bwd = _fwd_bwd_dtypes(self.recipe)
        return fwd if key == "fwd" else bwd

    def delayed(self) -> bool:
        """Whether this module holds delayed-scaling state worth updating."""
        return self.initialized and isinstance(self.recipe, DelayedScaling)

    def update(self, key: str) -> None:
        """One delayed-scaling step of the forward or backward state."""
        if not self.delayed():
            return
        h = self.amax_history[key]
        custom_ops.delayed_scaling_update(h, self.scale[key], self.recipe.amax_compute_algo,
                                          self.fp8_dtype(key), float(self.recipe.margin))

    # state_dict support
    def state(self):
        if not self.initialized:
            return None
        return {
            "amax_history_fwd": self.amax_history["fwd"].detach().cpu().clone(),
            "scale_fwd": self.scale["fwd"].detach().cpu().clone(),
            "amax_history_bwd": self.amax_history["bwd"].detach().cpu().clone(),
            "scale_bwd": self.scale["bwd"].detach().cpu().clone(),
        }

    def load(self, state, device: torch.device) -> None:
        """Adopt a saved state: the dict state() writes, None (no FP8 ran: fresh buffers), or TE's
        own `_extra_state` (a uint8 tensor: empty for no FP8, else a pickled dict with the same
        amax_history_* / scale_* entries), so TE checkpoints load."""
        if isinstance(state, torch.Tensor):
            state = _te_extra_state(state)
        elif isinstance(state, io.BytesIO):
            state = _te_bytesio_extra_state(state)
        if state is None:
            self.allocate(device)
            self.initialized = False
            return
        if not isinstance(state, dict) or "amax_history_fwd" not in state:
            raise ValueError("unrecognised FP8 extra state (expected the dict written by get_extra_state)")
        for key in ("fwd", "bwd"):
            h = state[f"amax_history_{key}"]
            s = state[f"scale_{key}"]
            if h.dim() != 2 or h.shape[1] != self.num[key] or s.shape != (self.num[key],):
                raise ValueError(f"FP8 extra state for {key} has shapes {tuple(h.shape)}/{tuple(s.shape)}; "
                                 f"this module needs [len, {self.num[key]}]/[{self.num[key]}]")
        for key in ("fwd", "bwd"):
            h, s = state[f"amax_history_{key}"], state[f"scale_{key}"]
            self.amax_history[key] = h.to(device=device, dtype=torch.float32).contiguous().clone()
            self.scale[key] = s.to(device=device, dtype=torch.float32).contiguous().clone()
        self.initialized = True
        self.bwd_seeded = (1 << self.num["bwd"]) - 1  # a saved history carries on as it is


def _load_storage_bytes(b: bytes):
    """torch.storage._load_from_bytes (how pickle.dumps writes a tensor's storage), through torch's
    weights-only loader instead of a full unpickler."""
    return torch.load(io.BytesIO(b), weights_only=True)


class _LenientUnpickler(pickle.Unpickler):
    """Unpickles TE's extra state (pickled bytes inside a uint8 tensor, which torch.load's
    weights-only mode lets through). Only the tensors are read, so only what rebuilds a tensor
    resolves (its storage through the weights-only loader); every other global (TE's recipe and
    private helpers, or anything a crafted checkpoint names, os.system included) becomes an inert
    placeholder: loading a state_dict runs no code from it."""

    _ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
                ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        return type(name, (), {"__init__": lambda self, *a, **k: None, "__setstate__": lambda self, st: None,
                               "__call__": lambda self, *a, **k: None})


def _te_extra_state(t: torch.Tensor):
    """The dict inside TE's serialized `_extra_state` (None when empty: no FP8 ran)."""
    if t.numel() == 0:
        return None
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"unrecognised FP8 extra state: a {t.dtype} tensor of shape {tuple(t.shape)} (TE's "
                         "is 1D uint8 bytes)")
    state = _LenientUnpickler(io.BytesIO(t.detach().cpu().numpy().tobytes())).load()
    if not isinstance(state, dict):
        raise ValueError(f"unrecognised FP8 extra state: TE's bytes hold a {type(state).__name__}, not a dict")
    keys = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")
    if not any(k in state for k in keys):
        return None  # (a recipe without delayed-scaling state, e.g. current scaling: nothing to restore)
    return {k: state[k] for k in keys if k in state}


def _te_bytesio_extra_state(b: io.BytesIO):
    """Old TE checkpoints' `_extra_state`: an io.BytesIO holding torch.save of None (no FP8 ran) or
    of the state dict; read in weights-only mode (tensors and plain containers only)."""
    b.seek(0)
    if not b.getbuffer().nbytes:
        return None
    try:
        state = torch.load(b, weights_only=True)
    except Exception as e:  # (e.g. pickled recipe objects, which weights-only loading refuses)
        raise ValueError(f"unrecognised FP8 extra state: TE's io.BytesIO form could not be read in weights-only "
                         f"mode ({type(e).__name__}: {e})") from None
    if state is None:
        return None
    if not isinstance(state, dict):
        raise ValueError(f"unrecognised FP8 extra state: TE's io.BytesIO holds a {type(state).__name__}, not a dict")
    keys = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")
    return {k: state[k] for k in keys if k in state} or None


class FP8GlobalState:
    """Process-wide autocast state (a stack of nested fp8_autocast regions)."""

    enabled = False
    calibrating = False
    recipe: Optional[Recipe] = None
    group = None
    depth = 0
    pending = {}  # meta -> group: delayed-scaling metas that ran an FP8 forward in this region
    # activation recomputation (distributed.checkpoint): while a checkpointed forward runs (under
    # no_grad), checkpoint_stash collects meta -> copy of its forward scales; while its recompute
    # runs in backward, recompute_stash is that dict (the recompute casts with those scales and
    # records amaxes into scratch buffers, so the recipe state is touched once, as without checkpoint)
    checkpoint_stash: Optional[dict] = None
    recompute_stash: Optional[dict] = None
    # whether grad was enabled where the checkpoint was called: its forward (run without grad in
    # the reentrant form) is then a training forward, whose fp8_autocast exit updates the scales
    checkpoint_training = False

    @classmethod
    def register_forward(cls, meta: FP8Meta) -> None:
        if cls.recompute_stash is not None:
            return
        if cls.checkpoint_stash is not None:
            if meta not in cls.checkpoint_stash:
                cls.checkpoint_stash[meta] = meta.scale["fwd"].clone()
            cls.pending[meta] = cls.group  # the checkpointed forward counts as the step's forward
        elif torch.is_grad_enabled():
            cls.pending[meta] = cls.group

    @classmethod
    def reset(cls) -> None:
        cls.enabled, cls.calibrating, cls.recipe, cls.group, cls.depth = False, False, None, None, 0
        cls.pending = {}
        cls.checkpoint_stash = cls.recompute_stash = None
        cls.checkpoint_training = False
        FP8ModelInitState.reset()

    @classmethod
    def autocast_state(cls):
        return cls.enabled, cls.calibrating, cls.recipe, cls.group

    @classmethod
    def set_autocast_state(cls, state) -> None:
        cls.enabled, cls.calibrating, cls.recipe, cls.group = state


def reduce_amaxes(pending: dict) -> None:
    """MAX all-reduce of the current amaxes (history row 0, forward and backward) of the metas in
    `pending` (meta -> fp8_group) whose recipe has reduce_amax, one collective per (group, device)
    over one flat buffer. Metas without a group, and groups of one rank, are left alone."""
    dist = torch.distributed
    if not pending or not dist.is_available() or not dist.is_initialized():
        return
    buckets = {}
    for meta, group in pending.items():
        if group is None or not meta.delayed() or not meta.recipe.reduce_amax:
            continue
        rows = (meta.amax_history["fwd"][0], meta.amax_history["bwd"][0])
        buckets.setdefault((group, rows[0].device), []).extend(rows)
    for (group, _), rows in buckets.items():
        if dist.get_world_size(group) <= 1:
            continue
        flat = torch.cat(rows)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        torch._foreach_copy_(rows, list(flat.split([r.numel() for r in rows])))


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False):
    """Run TE modules in FP8 inside the region (DelayedScaling or Float8CurrentScaling; default
    recipe DelayedScaling()).

    calibrating: modules run in high precision but record amaxes (so scales are ready when FP8
    is switched on). Forward scales are updated when the outermost region exits."""
    if enabled:
        ok, reason = _fp8_support()
        if not ok:
            raise RuntimeError(f"FP8 is not available: {reason}")
    if fp8_recipe is None:
        fp8_recipe = get_default_recipe()
    if not isinstance(fp8_recipe, Recipe):
        raise TypeError(f"fp8_recipe must be a transformer_engine.common.recipe.Recipe, got {type(fp8_recipe).__name__}")
    st = FP8GlobalState
    saved = (st.enabled, st.calibrating, st.recipe, st.group)
    st.enabled, st.calibrating, st.recipe, st.group = enabled, calibrating, fp8_recipe, fp8_group
    st.depth += 1
    try:
        yield
    finally:
        st.enabled, st.calibrating, st.recipe, st.group = saved
        st.depth -= 1
        if st.depth == 0:
            pending, st.pending = st.pending, {}
            # (an fp8_autocast inside a reentrant checkpoint's function exits without grad; the
            # checkpointed forward is the step's training forward all the same)
            if torch.is_grad_enabled() or (st.checkpoint_stash is not None and st.checkpoint_training):
                reduce_amaxes(pending)
                for meta in pending:
                    meta.update("fwd")


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False, **deprecated):
    """TE 2.8+'s name of fp8_autocast, with its argument names (recipe, amax_reduction_group); the
    older fp8_recipe / fp8_group are taken too."""
    bad = set(deprecated) - {"fp8_recipe", "fp8_group"}
    if bad:
        raise TypeError(f"autocast() got unexpected keyword arguments {sorted(bad)}")
    if "fp8_recipe" in deprecated:
        if recipe is not None:
            raise TypeError("autocast(): give recipe or fp8_recipe, not both")
        recipe = deprecated["fp8_recipe"]
    if "fp8_group" in deprecated:
        if amax_reduction_group is not None:
            raise TypeError("autocast(): give amax_reduction_group or fp8_group, not both")
        amax_reduction_group = deprecated["fp8_group"]
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)


class FP8ModelInitState:
    """The quantized_model_init region in force while modules are built (read by their __init__)."""

    enabled = False
    recipe: Optional[Recipe] = None
    preserve_high_precision_init_val = False

    @classmethod
    def reset(cls) -> None:
        cls.enabled, cls.recipe, cls.preserve_high_precision_init_val = False, None, False


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """TE modules built inside the region keep their GEMM weights only in FP8 (a Float8Tensor
    parameter: FP8 bytes, their transpose when built with grad enabled, scale_inv); norm weights and
    biases stay in high precision. There is no high-precision copy of those weights: the master
    weights, if any, belong to the optimizer (or the caller), who writes updates into the
    parameter with `param.copy_(hp)` / in-place ops, which cast to FP8 again.

    recipe (default DelayedScaling()): DelayedScaling casts a weight with its module's forward
    weight scale (and records the weight's amax in the module's amax history, so the recipe step
    adapts that scale); Float8CurrentScaling takes each cast's scale from the value itself
    (fp8_quant_fwd_weight). The FP8 format is the recipe's forward format.

    preserve_high_precision_init_val: keep the initial high-precision value of each FP8 weight
    on the CPU, for param.get_high_precision_init_val() (e.g. to seed optimizer master weights);
    param.clear_high_precision_init_val() frees it.

    Under fp8_autocast the modules' FP8 GEMMs read the FP8 weights directly; outside it the
    weights are dequantized and the module runs in high precision."""
    if enabled:
        ok, reason = _fp8_support()
        if not ok:
            raise RuntimeError(f"FP8 is not available: {reason}")
        recipe = get_default_recipe() if recipe is None else recipe
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a transformer_engine.common.recipe.Recipe, got {type(recipe).__name__}")
        check_recipe_supported(recipe)
    st = FP8ModelInitState
    saved = (st.enabled, st.recipe, st.preserve_high_precision_init_val)
    st.enabled, st.recipe = bool(enabled), (recipe if enabled else None)
    st.preserve_high_precision_init_val = bool(preserve_high_precision_init_val) and bool(enabled)
    try:
        yield
    finally:
        st.enabled, st.recipe, st.preserve_high_precision_init_val = saved


# TE 1.x name of the same context manager
fp8_model_init = quantized_model_init


# TE's names that callers import from this module (Megatron-LM: FP8GlobalStateManager)
from .fp8_state_manager import FP8GlobalStateManager, check_fp8_support, get_default_fp8_recipe  # noqa: E402,F401
