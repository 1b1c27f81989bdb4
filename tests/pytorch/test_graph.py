"""te.make_graphed_callables: CUDA graphs need CUDA, which this test checks for on the CPU; the
capture itself (with FP8 state) runs on a GPU only."""
import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe


def test_make_graphed_callables_needs_cuda():
    m = te.Linear(8, 8, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        te.make_graphed_callables(m, (torch.randn(4, 8, requires_grad=True),), fp8_enabled=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_make_graphed_callables_fp8_matches_eager():
    """Replays of the captured forward/backward equal eager steps, FP8 recipe state included
    (the forward step at the fp8_autocast exit, the backward step inside the captured backward)."""
    torch.manual_seed(0)
    eager = te.LayerNormMLP(64, 128, device="cuda")
    src = copy.deepcopy(eager)
    r = recipe.DelayedScaling(amax_history_len=4)
    sample = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = te.make_graphed_callables(src, (sample,), fp8_enabled=True, fp8_recipe=r)
    # same warm-up on the eager twin: make_graphed_callables ran num_warmup_iters (3) forwards + backwards
    # and one capture inside one fp8_autocast region
    src_state = {k: (v.clone(), src.fp8_meta.scale[k].clone()) for k, v in src.fp8_meta.amax_history.items()}
    eager.fp8_meta.prepare(r, torch.device("cuda"))
    for k, (h, s) in src_state.items():
        eager.fp8_meta.amax_history[k].copy_(h)
        eager.fp8_meta.scale[k].copy_(s)
    # the warm-up's first backward seeded the gradient histories (LinearCfg.seed_bwd): the twin's too
    assert src.fp8_meta.bwd_seeded != 0
    eager.fp8_meta.bwd_seeded = src.fp8_meta.bwd_seeded
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(32, 64, device="cuda", generator=g)
        dy = torch.randn(32, 64, device="cuda", generator=g)
        outs = []
        for m in (eager, graphed):
            xi = x.clone().requires_grad_()
            with te.fp8_autocast(fp8_recipe=r):
                y = m(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1])
        for k in ("fwd", "bwd"):
            torch.testing.assert_close(src.fp8_meta.scale[k], eager.fp8_meta.scale[k])
            torch.testing.assert_close(src.fp8_meta.amax_history[k], eager.fp8_meta.amax_history[k])


def test_make_graphed_callables_signature_defaults():
    import inspect
    p = inspect.signature(te.make_graphed_callables).parameters
    assert list(p)[:2] == ["modules", "sample_args"]
    assert p["num_warmup_iters"].default == 3 and p["fp8_enabled"].default is False
    assert p["fp8_recipe"].default is None and p["fp8_weight_caching"].default is False


def _sync_fp8_state(dst, src):
    """Copy every FP8Meta state (histories, scales, first-backward seeding flags) of src's modules
    into dst's (a deepcopy twin) after prepare()."""
    for a, b in zip(dst.modules(), src.modules()):
        ma, mb = getattr(a, "fp8_meta", None), getattr(b, "fp8_meta", None)
        if ma is None or mb is None or not mb.amax_history:
            continue
        for k in mb.amax_history:
            ma.amax_history[k] = mb.amax_history[k].clone()
            ma.scale[k] = mb.scale[k].clone()
        ma.recipe, ma.bwd_seeded = mb.recipe, mb.bwd_seeded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_dpa"])
def test_make_graphed_callables_transformer_layer_matches_eager(mode):
    """A TransformerLayer (fused attention, causal, packed Q/K/V) captured in a CUDA graph: its
    replays give the eager twin's outputs and input gradients, FP8 recipe state included (fp8_dpa:
    cuDNN's FP8 attention and its casts inside the graph)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 512, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, device="cuda")
    eager = copy.deepcopy(layer)
    fp8 = mode != "bf16"
    r = recipe.DelayedScaling(amax_history_len=4, fp8_dpa=mode == "fp8_dpa")
    sample = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(layer, (sample,), fp8_enabled=fp8, fp8_recipe=r)
    if fp8:
        with te.fp8_autocast(fp8_recipe=r):  # prepares the twin's FP8 state, then copied over
            eager(sample).sum().backward()
        _sync_fp8_state(eager, layer)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        for m in (eager, graphed):
            xi = x.clone().requires_grad_()
            with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
                y = m(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad))
        # the forward is deterministic; the attention backward accumulates dQ with atomics
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[1][1], outs[0][1])
        for a, b in zip(eager.modules(), layer.modules()):
            ma, mb = getattr(a, "fp8_meta", None), getattr(b, "fp8_meta", None)
            for k in (mb.amax_history if mb is not None else {}):
                torch.testing.assert_close(mb.scale[k], ma.scale[k], rtol=0, atol=0)
                torch.testing.assert_close(mb.amax_history[k], ma.amax_history[k], rtol=0, atol=0)


class _THDAttention(torch.nn.Module):
    """DotProductAttention over THD q, k, v with fixed cu_seqlens and max_seqlen (graph arguments
    are tensors only)."""

    def __init__(self, cu, max_s):
        super().__init__()
        self.dpa = te.DotProductAttention(2, 128, qkv_format="thd", attn_mask_type="padding_causal",
                                          attention_dropout=0.0)
        self.cu, self.max_s = cu, max_s

    def forward(self, q, k, v):
        return self.dpa(q, k, v, cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu, max_seqlen_q=self.max_s,
                        max_seqlen_kv=self.max_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_make_graphed_callables_thd_attention_matches_eager(fp8):
    """THD attention captured in a CUDA graph: BF16 runs cuDNN's THD graphs, fp8_dpa the padded
    bshd route (cuDNN has no FP8 THD backward on Hopper), which must not synchronize with the host
    while capturing (max_seqlen given)."""
    cu = torch.tensor([0, 100, 130, 300], dtype=torch.int32, device="cuda")
    eager, graphed_src = _THDAttention(cu, 170), _THDAttention(cu, 170)
    r = recipe.DelayedScaling(amax_history_len=4, fp8_dpa=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    sample = [torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
              for _ in range(3)]
    graphed = te.make_graphed_callables(graphed_src, tuple(sample), fp8_enabled=fp8, fp8_recipe=r)
    if fp8:
        with te.fp8_autocast(fp8_recipe=r):
            eager(*sample).sum().backward()
        _sync_fp8_state(eager, graphed_src)
    for step in range(2):
        qkv = [torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        dy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        for m in (eager, graphed):
            ins = [t.clone().requires_grad_() for t in qkv]
            with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
                y = m(*ins)
            y.backward(dy)
            outs.append((y.detach(), [t.grad for t in ins]))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
        for a, b in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(a, b)
