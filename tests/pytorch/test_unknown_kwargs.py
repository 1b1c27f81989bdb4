"""Keyword arguments that are no TE 2.x parameter of a module raise TypeError naming them, as TE's
modules (plain Python signatures) do, whatever their value: a misspelt option set to False used to
be accepted silently. TE's own parameter names keep working: accepted at their defaults,
NotImplementedError when set to something this adapter does not implement."""
import pytest
import torch

import transformer_engine.pytorch as te

from _util import DEVICE, dev

try:
    from transformer_engine.pytorch import MultiheadAttention, DotProductAttention  # noqa: F401
    HAVE_ATTN = True
except ImportError:  # pragma: no cover
    HAVE_ATTN = False

needs_attn = pytest.mark.skipif(not HAVE_ATTN, reason="attention modules not built")

# name -> constructor taking extra keyword arguments
MAKERS = {
    "Linear": lambda **kw: te.Linear(8, 8, device=DEVICE, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(8, 8, device=DEVICE, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(8, 16, device=DEVICE, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(2, 8, 8, device=DEVICE, **kw),
    "LayerNorm": lambda **kw: te.LayerNorm(8, device=DEVICE, **kw),
    "RMSNorm": lambda **kw: te.RMSNorm(8, device=DEVICE, **kw),
    "DotProductAttention": lambda **kw: te.DotProductAttention(2, 4, **kw),
    "MultiheadAttention": lambda **kw: te.MultiheadAttention(8, 2, device=DEVICE, **kw),
    "TransformerLayer": lambda **kw: te.TransformerLayer(8, 16, 2, device=DEVICE, **kw),
}
ATTN = {"DotProductAttention", "MultiheadAttention", "TransformerLayer"}


def _params(names):
    return [pytest.param(n, marks=needs_attn) if n in ATTN else n for n in names]


@pytest.mark.parametrize("module", _params(MAKERS))
@pytest.mark.parametrize("kw", [dict(bogus=0), dict(bogus=None), dict(fuse_wgrad_acumulation=False),
                                dict(bogus=True), dict(bogus="x")])
def test_unknown_constructor_keyword_raises_type_error(module, kw):
    name = next(iter(kw))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        MAKERS[module](**kw)


# TE 2.x parameters taken through **kwargs: (accepted at TE's default, unimplemented setting)
TE_NAMES = {
    "Linear": [(dict(delay_wgrad_compute=False), dict(delay_wgrad_compute=True)),
               (dict(symmetric_ar_type=None), dict(symmetric_ar_type="multimem_all_reduce")),
               (dict(save_original_input=False), dict(save_original_input=True)),
               (dict(ub_overlap_rs_dgrad=False, ub_name="proj"), None)],
    "LayerNormLinear": [(dict(delay_wgrad_compute=False), dict(delay_wgrad_compute=True)),
                        (dict(symmetric_ar_type=None), dict(symmetric_ar_type="one_shot")),
                        (dict(ub_bulk_wgrad=True, ub_name="qkv"), None)],
    "LayerNormMLP": [(dict(activation_params=None), dict(activation_params={"limit": 7.0})),
                     (dict(checkpoint=False), dict(checkpoint=True)),
                     (dict(delay_wgrad_compute=False), dict(delay_wgrad_compute=True)),
                     (dict(ub_overlap_rs=True), None)],
    "DotProductAttention": [(dict(return_max_logit=False), dict(return_max_logit=True)),
                            (dict(bottom_right_diagonal=True), None),
                            (dict(name="core"), None)],
    "MultiheadAttention": [(dict(qk_norm_type="RMSNorm", qk_norm_eps=1e-6, qk_norm_before_rope=True), None),
                           (dict(seq_length=4, micro_batch_size=1, ub_overlap_ag=False), None)],
    "TransformerLayer": [(dict(activation_params=None), dict(activation_params={"limit": 7.0})),
                         (dict(bottom_right_diagonal=None, enc_dec_bottom_right_diagonal=False), None),
                         (dict(qk_norm_type="LayerNorm", qk_norm_eps=1e-6), None),
                         (dict(ub_tp_comm_overlap=False, ub_overlap_ag=True, ub_bulk_dgrad=True), None)],
}


@pytest.mark.parametrize("module,ok,bad", [
    pytest.param(m, ok, bad, marks=needs_attn) if m in ATTN else (m, ok, bad)
    for m, cases in TE_NAMES.items() for ok, bad in cases])
def test_te_constructor_names_keep_working(module, ok, bad):
    MAKERS[module](**ok)
    if bad is not None:
        name = next(iter(bad))
        with pytest.raises(NotImplementedError, match=name) as err:
            MAKERS[module](**bad)
        assert not isinstance(err.value, TypeError)  # (a TE name: not the unknown-name error)


def test_tp_size_still_checked():
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.Linear(8, 8, tp_size=2, device=DEVICE)


# ------------------------------------------------------------------ forward()
def _qkv():
    g = torch.Generator().manual_seed(0)
    return [dev(torch.randn(4, 1, 2, 4, generator=g)) for _ in range(3)]


@needs_attn
@pytest.mark.parametrize("kw", [dict(bogus=None), dict(bogus=False), dict(cu_seqlen_q=None), dict(bogus=1)])
def test_unknown_forward_keyword_raises_type_error(kw):
    name = next(iter(kw))
    x = dev(torch.randn(4, 1, 8))
    calls = {"DotProductAttention": lambda: te.DotProductAttention(2, 4)(*_qkv(), **kw),
             "MultiheadAttention": lambda: te.MultiheadAttention(8, 2, device=DEVICE)(x, **kw),
             "TransformerLayer": lambda: te.TransformerLayer(8, 16, 2, device=DEVICE)(x, **kw)}
    for who, call in calls.items():
        with pytest.raises(TypeError, match=f"{who}.forward\\(\\) got an unexpected keyword argument '{name}'"):
            call()


@needs_attn
def test_te_forward_names_keep_working():
    x = dev(torch.randn(4, 1, 8))
    dpa = te.DotProductAttention(2, 4)
    q, k, v = _qkv()
    ref = dpa(q, k, v)
    assert torch.equal(dpa(q, k, v, fp8_output=False, bottom_right_diagonal=None, num_splits=1, score_mod=None,
                           bf16_backward=False), ref)
    with pytest.raises(NotImplementedError, match="score_mod"):
        dpa(q, k, v, score_mod=lambda s: s)
    # DotProductAttention.forward's own TE names are no MultiheadAttention.forward names (as in TE)
    mha = te.MultiheadAttention(8, 2, device=DEVICE, attention_dropout=0.0)
    mha.eval()
    ref = mha(x)
    assert torch.equal(mha(x, bottom_right_diagonal=None), ref)
    assert torch.equal(mha(x, bottom_right_diagonal=True), ref)  # (forced top-left for the causal default)
    with pytest.raises(TypeError, match="num_splits"):
        mha(x, num_splits=1)
    layer = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0, device=DEVICE)
    layer.eval()
    ref = layer(x)
    same = layer(x, bottom_right_diagonal=None, enc_dec_bottom_right_diagonal=None, checkpoint_core_attention=False,
                 alibi_slopes=None, fast_zero_fill=True, cu_seqlens_q=None, cu_seqlens_kv=None,
                 cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                 pad_between_seqs=None)
    assert torch.equal(same, ref)
    # (bottom_right_diagonal's values: test_attention_window_args.py)
