"""Measure what `cosine simulate` assumes of a GPU target: the time of one verification pass by
batch size and tokens per sequence (1 = plain decode, k + 1 = a draft of k verified), and the
time of an EAGLE-3 draft head's forward, on the paper's model shapes (a development script: run
it on a machine with a CUDA GPU; nothing of the project's tests needs one).

    python3 tools/gpu_pass_times.py --out pass_times.json

A pass is timed on a stack of `--layers` decoder layers of the model's shape (bf16, random
weights: the time does not depend on the values), with a KV cache of `--context` tokens per
sequence, captured in a CUDA graph (as vLLM runs its decode steps) and replayed; the full model's
pass is that time scaled to its layer count plus its LM head, timed alone. The EAGLE-3 head is
one decoder layer of the target's width fed by a fusion of three of the target's hidden states
(a `3 * hidden -> hidden` projection), with an LM head over a 32,000-token draft vocabulary
(Li et al. 2025, "EAGLE-3", arXiv:2503.01840, §3): one forward per draft token, at the batch's
size. The attention is PyTorch's `scaled_dot_product_attention` over the cache (not vLLM's
paged kernels): at these context lengths a decode pass is the weights' read, which this measures.

Output: one JSON object, `{"device": ..., "models": {name: {"layers_timed": n, "rows": [{"batch",
"tokens", "pass_s"}], "lm_head_s": {batch*tokens: s}, "eagle3_head_s": {batch: s}}}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# The paper's targets (config.json of each): Llama-3.x-70B / DeepSeek-R1-Distill-Llama-70B and
# Qwen2.5-32B.
SHAPES = {
    "llama-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256},
    "qwen-32b": {"layers": 64, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn": 27648, "vocab": 152064},
}
EAGLE3_DRAFT_VOCAB = 32000


def _layer(torch, s: dict, device: str, dtype) -> dict:
    h, hd = s["hidden"], s["hidden"] // s["heads"]

    def w(*shape):
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02)

    return {"q": w(h, s["heads"] * hd), "k": w(h, s["kv_heads"] * hd), "v": w(h, s["kv_heads"] * hd),
            "o": w(s["heads"] * hd, h), "gate": w(h, s["ffn"]), "up": w(h, s["ffn"]), "down": w(s["ffn"], h),
            "n1": torch.ones(h, device=device, dtype=dtype), "n2": torch.ones(h, device=device, dtype=dtype)}


def _rms(torch, x, weight):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight


def _forward(torch, layers: list[dict], s: dict, x, caches: list, attention: bool = True):
    """x: [batch, tokens, hidden]; caches[i]: (k, v) of [batch, kv_heads, context, head_dim].
    Without `attention`, the new tokens' values stand for its output: the projections and the MLP
    alone (what the roofline models), apart from the attention kernel this script has (SDPA over a
    concatenated cache, not vLLM's paged attention)."""
    import torch.nn.functional as F

    b, t, h = x.shape
    hd = h // s["heads"]
    for p, (kc, vc) in zip(layers, caches, strict=True):
        y = _rms(torch, x, p["n1"])
        q = (y @ p["q"]).view(b, t, s["heads"], hd).transpose(1, 2)
        k = (y @ p["k"]).view(b, t, s["kv_heads"], hd).transpose(1, 2)
        v = (y @ p["v"]).view(b, t, s["kv_heads"], hd).transpose(1, 2)
        if attention:
            k = torch.cat([kc, k], dim=2)
            v = torch.cat([vc, v], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # the new tokens see the whole cache
        else:
            a = q + v.repeat_interleave(s["heads"] // s["kv_heads"], dim=1) + k.sum()
        x = x + a.transpose(1, 2).reshape(b, t, h) @ p["o"]
        y = _rms(torch, x, p["n2"])
        x = x + (F.silu(y @ p["gate"]) * (y @ p["up"])) @ p["down"]
    return x


def _time_graph(torch, fn, reps: int) -> float:
    """Seconds per call of `fn` (no arguments, static shapes) captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # warm-up (and the allocator's pools) before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def measure(model: str, layers_timed: int, batches: list[int], tokens: list[int], context: int, reps: int,
            device: str = "cuda", attention: bool = True) -> dict:
    import torch

    dtype = torch.bfloat16
    s = SHAPES[model]
    hd = s["hidden"] // s["heads"]
    layers = [_layer(torch, s, device, dtype) for _ in range(layers_timed)]
    lm_head = torch.randn(s["hidden"], s["vocab"], device=device, dtype=dtype) * 0.02
    rows, lm = [], {}
    for b in batches:
        caches = [(torch.randn(b, s["kv_heads"], context, hd, device=device, dtype=dtype),
                   torch.randn(b, s["kv_heads"], context, hd, device=device, dtype=dtype)) for _ in layers]
        for t in tokens:
            x = torch.randn(b, t, s["hidden"], device=device, dtype=dtype)
            stack = _time_graph(torch, lambda x=x, caches=caches: _forward(torch, layers, s, x, caches, attention),
                                reps)
            flat = torch.randn(b * t, s["hidden"], device=device, dtype=dtype)
            head = _time_graph(torch, lambda flat=flat: flat @ lm_head, reps)
            lm[str(b * t)] = head
            rows.append({"batch": b, "tokens": t, "stack_s": stack,
                         "pass_s": stack * s["layers"] / layers_timed + head})
            print(f"{model} batch {b:3d} tokens {t}: {rows[-1]['pass_s'] * 1e3:7.2f} ms "
                  f"({stack * 1e3:.2f} ms for {layers_timed} layers, LM head {head * 1e3:.2f} ms)", flush=True)
        del caches
    # EAGLE-3's head: fuse three hidden states, one decoder layer, the draft vocabulary's LM head
    head_layer = [_layer(torch, s, device, dtype)]
    fuse = torch.randn(3 * s["hidden"], s["hidden"], device=device, dtype=dtype) * 0.02
    draft_lm = torch.randn(s["hidden"], EAGLE3_DRAFT_VOCAB, device=device, dtype=dtype) * 0.02
    eagle = {}
    for b in batches:
        cache = [(torch.randn(b, s["kv_heads"], context, hd, device=device, dtype=dtype),
                  torch.randn(b, s["kv_heads"], context, hd, device=device, dtype=dtype))]
        feats = torch.randn(b, 1, 3 * s["hidden"], device=device, dtype=dtype)

        def step(feats=feats, cache=cache):
            y = _forward(torch, head_layer, s, feats @ fuse, cache)
            return y[:, -1] @ draft_lm

        eagle[str(b)] = _time_graph(torch, step, reps)
        print(f"{model} EAGLE-3 head batch {b:3d}: {eagle[str(b)] * 1e3:.3f} ms per draft token", flush=True)
    return {"layers_timed": layers_timed, "context": context, "attention": attention, "rows": rows,
            "lm_head_s": lm, "eagle3_head_s": eagle}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-70b,qwen-32b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers timed (the rest is scaled)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", default="1,4,8", help="tokens per sequence in a pass (k + 1)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-attention", action="store_true", help="time the projections and MLP alone")
    ap.add_argument("--out", default="pass_times.json")
    args = ap.parse_args(argv)
    import torch

    out = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
           "torch": torch.__version__, "dtype": "bfloat16", "models": {}}
    for model in args.models.split(","):
        out["models"][model] = measure(model, args.layers, [int(b) for b in args.batches.split(",")],
                                       [int(t) for t in args.tokens.split(",")], args.context, args.reps,
                                       args.device, not args.no_attention)
        torch.cuda.empty_cache()  # the model's weights went with `measure`
        with open(args.out, "w") as f:  # what is measured so far, if a later model runs out of time
            json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
