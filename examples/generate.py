"""Generation with a K/V cache: a small character-level GPT with rotary position embeddings
(te.TransformerLayer with rotary_pos_emb and grouped-query attention) is trained briefly on the
quickstart's grammar text, then continues held-out prompts of different lengths greedily, twice:
recomputing every sequence's whole prefix for each new character, and with te.InferenceParams
(each step runs only the new characters through the model; earlier keys and values come from each
layer's cache, non-paged or --paged). The cached run is fed the recomputed run's characters, so the
two see the same inputs; the script prints both continuations, how many next-character choices
agree, the largest logit difference and both speeds (each run twice: the first pays one-time graph
and plan builds, the second is the steady state).

    python examples/generate.py                        # CPU, float32
    python examples/generate.py --device cuda --paged  # GPU, bfloat16
    python examples/generate.py --device cuda --cuda-graph  # decode steps replayed as a CUDA graph
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te

_HERE = os.path.dirname(os.path.abspath(__file__))


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(_HERE, "quickstart.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RoPEGPT(torch.nn.Module):
    """Token embedding, TransformerLayers (bshd, causal, RoPE, GQA), LayerNorm, tied output head."""

    def __init__(self, vocab, hidden, heads, gqa, layers, ffn, max_len, device, dtype):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        self.layers = torch.nn.ModuleList([
            te.TransformerLayer(hidden, ffn, heads, num_gqa_groups=gqa, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", attn_input_format="bshd", layer_number=i + 1,
                                fuse_qkv_params=True, params_dtype=dtype, device=device)
            for i in range(layers)])
        self.norm = te.LayerNorm(hidden, params_dtype=dtype, device=device)
        # the angles of every position a generated sequence can reach (a buffer: moves with the model)
        self.register_buffer("rope", te.RotaryPositionEmbedding(hidden // heads)(max_len).to(device),
                             persistent=False)

    def forward(self, idx, inference_params=None):
        x = self.tok(idx)  # [b, s, hidden]
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=self.rope, inference_params=inference_params)
        return F.linear(self.norm(x), self.tok.weight)


def train(model, data, steps, lr, device):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = data.batch_at(gen)
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"train step {step + 1:4d}/{steps} loss {loss.item():.3f}", flush=True)


@torch.no_grad()
def generate_recompute(model, prompts, n, vocab_used):
    """Greedy continuation, each sequence's whole prefix through the model for every character.
    Returns the generated ids and the logits of every chosen character ([n] per sequence)."""
    out, logits_all = [], []
    for ids in prompts:
        ids, seq_logits = list(ids), []
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.tok.weight.device))[0, -1, :vocab_used].float()
            seq_logits.append(logits)
            ids.append(int(logits.argmax()))
        out.append(ids[-n:])
        logits_all.append(torch.stack(seq_logits))
    return out, logits_all


class GraphedDecode:
    """One decode step of the whole model ([b, 1] tokens, every layer, the cache writes and
    attention) captured once as a CUDA graph and replayed after each pre_step: the host then
    spends one replay per step instead of every layer's Python and launches. It holds because
    pre_step overwrites InferenceParams' index buffers in place and the batch keeps its shape and
    slots. The capture follows an eager run of the same step (both write the same cache rows, so
    repeating the step changes nothing)."""

    def __init__(self, model, params, x):
        self.x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(self.x, inference_params=params)  # (warm-up: workspaces, cuDNN graphs, GEMM plans)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):
                self.out = model(self.x, inference_params=params)
        torch.cuda.current_stream().wait_stream(side)

    def __call__(self, x):
        self.x.copy_(x)
        self.graph.replay()
        return self.out


@torch.no_grad()
def generate_cached(model, prompts, forced, params, vocab_used, cuda_graph=False):
    """The same continuation with the K/V cache: the prompts in one padded step, then one new
    character per sequence and step (cuda_graph: replayed as GraphedDecode). Fed the recomputed
    run's characters (forced)."""
    dev = model.tok.weight.device
    b, n = len(prompts), len(forced[0])
    lens = [len(p) for p in prompts]
    params.pre_step(OrderedDict((i, lens[i]) for i in range(b)))
    x = torch.zeros(b, max(lens), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        x[i, :len(p)] = torch.tensor(p, device=dev)
    logits = model(x, inference_params=params)
    steps = [logits[torch.arange(b, device=dev), torch.tensor(lens, device=dev) - 1, :vocab_used].float()]
    decode = None
    for t in range(n - 1):
        params.pre_step(OrderedDict((i, 1) for i in range(b)))
        x = torch.tensor([[forced[i][t]] for i in range(b)], device=dev)
        if cuda_graph:
            decode = decode or GraphedDecode(model, params, x)
            out = decode(x)
        else:
            out = model(x, inference_params=params)
        steps.append(out[:, 0, :vocab_used].float().clone())  # (a graph's output is overwritten by the next replay)
    return torch.stack(steps, 1)  # [b, n, vocab]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--new", type=int, default=48, help="characters to generate per prompt")
    p.add_argument("--paged", action="store_true", help="a paged K/V cache (pages of --page-size tokens)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay each decode step of the cached run as one captured CUDA graph (GPU only)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graph and device.type != "cuda":
        p.error("--cuda-graph needs --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = args.hidden or (512 if device.type == "cuda" else 64)
    heads, gqa = 4, 2
    qs = _quickstart()
    data = qs.CharData(qs.make_corpus(60_000), seq=64, batch=16)
    prompt_lens = [40, 23, 31]
    max_len = max(max(prompt_lens) + args.new, data.seq)  # (positions of generation and of training)
    torch.manual_seed(0)
    model = RoPEGPT(data.vocab, hidden, heads, gqa, args.layers, 4 * hidden, max_len, device, dtype)
    train(model, data, args.steps, 2e-3 if device.type == "cpu" else 1e-3, device)
    model.eval()
    starts = [0, 500, 1000]
    prompts = [data.val[s:s + n].tolist() for s, n in zip(starts, prompt_lens)]
    vocab_used = len(data.itos)

    kw = (dict(is_paged=True, page_size=args.page_size, total_num_pages=len(prompts) * -(-max_len // args.page_size))
          if args.paged else {})
    params = te.InferenceParams(len(prompts), max_len, gqa, hidden // heads, dtype, **kw)

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return r, time.perf_counter() - t0

    # each run twice: the first pays one-time costs (cuDNN graphs and GEMM plans of new shapes; the
    # recomputing run meets a new sequence length every step), the second is the steady state
    times = {}
    for rnd in ("first", "warm"):
        (ids, ref_logits), times["recompute", rnd] = timed(lambda: generate_recompute(model, prompts, args.new,
                                                                                      vocab_used))
        params.reset()
        cached, times["cached", rnd] = timed(lambda: generate_cached(model, prompts, ids, params, vocab_used,
                                                                    args.cuda_graph))
    ref = torch.stack(ref_logits)  # [b, n, vocab]
    agree = int((cached.argmax(-1) == ref.argmax(-1)).sum())
    diff = float((cached - ref).abs().max())
    total = len(prompts) * args.new
    for pr, gen in zip(prompts, ids):
        print(f"prompt {data.decode(pr)!r} -> {data.decode(gen)!r}")
    print(f"next-character choices that agree: {agree}/{total}; largest logit difference {diff:.3g} "
          f"(logits up to {float(ref.abs().max()):.3g})")
    for rnd in ("first", "warm"):
        t_re, t_ca = times["recompute", rnd], times["cached", rnd]
        kind = ("paged" if args.paged else "non-paged") + (", CUDA graph" if args.cuda_graph else "")
        print(f"{rnd:>5} run: recompute {total / t_re:8.1f} characters/s   K/V cache "
              f"({kind}) {total / t_ca:8.1f} characters/s   ({t_re / t_ca:.1f}x)")
    return dict(agree=agree, total=total, max_logit_diff=diff, max_logit=float(ref.abs().max()),
                recompute_s=times["recompute", "warm"], cached_s=times["cached", "warm"])

if __name__ == "__main__":
    main()
