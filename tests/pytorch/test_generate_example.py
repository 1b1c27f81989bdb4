"""examples/generate.py at test size: greedy generation with the K/V cache (non-paged and paged,
RoPE, GQA, prompts of different lengths in one padded step) sees the same logits as recomputing
every prefix. CPU float32: every next-character choice agrees and the logits differ by < 1e-5 of
their size. NVTE_TEST_DEVICE=cuda (bfloat16 through two layers): logits within 5% of their size
and at least 90% of the choices agree (bfloat16 rounding can flip near-ties)."""
import pytest

from _util import DEVICE, ON_CUDA, load_example


@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
def test_cached_generation_matches_recompute(paged):
    args = ["--device", DEVICE.type, "--steps", "30", "--new", "12"] + (["--paged", "--page-size", "8"] if paged else [])
    r = load_example("generate").main(args)
    assert r["total"] == 36
    if ON_CUDA:
        assert r["max_logit_diff"] <= 0.05 * r["max_logit"] and r["agree"] >= 0.9 * r["total"], r
    else:
        assert r["agree"] == r["total"] and r["max_logit_diff"] < 1e-5 * r["max_logit"], r


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device (NVTE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("paged", [False, True], ids=["nonpaged", "paged"])
def test_cuda_graph_decode_matches_recompute(paged):
    """--cuda-graph: every decode step of the whole model is one replay of a graph captured at the
    first step; the logits must still follow the recomputed ones (pages of 8 tokens: the sequences
    take new pages between replays, which only pre_step's table upload tells the graph)."""
    args = ["--device", "cuda", "--steps", "30", "--new", "12", "--cuda-graph"]
    r = load_example("generate").main(args + (["--paged", "--page-size", "8"] if paged else []))
    assert r["total"] == 36
    assert r["max_logit_diff"] <= 0.05 * r["max_logit"] and r["agree"] >= 0.9 * r["total"], r


def test_cuda_graph_needs_cuda():
    with pytest.raises(SystemExit):
        load_example("generate").main(["--device", "cpu", "--cuda-graph"])
