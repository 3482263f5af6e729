"""A test-made EAGLE-3 head for a Llama-architecture target (no trained head ships on PyPI): vLLM's
EAGLE-3 checkpoint layout (`LlamaForCausalLMEagle3`: one `midlayer` decoder layer whose attention
takes [embeds, hidden] (2 x hidden), `fc` fusing three of the target's hidden states, `norm`,
`lm_head` over the target's vocabulary, so no draft-to-target id map), small random weights.
Its drafts are rarely accepted; what it tests is the wiring and losslessness of the path, not
its acceptance (vllm/model_executor/models/llama_eagle3.py, vLLM 0.32)."""

from __future__ import annotations

import json
from pathlib import Path


def write_eagle3_head(target: Path, out: Path, intermediate_size: int = 256, seed: int = 0) -> Path:
    """Write the head for the target model directory `target` into `out` (config.json and
    model.safetensors, about 20 MB for SmolLM2-135M); returns `out`."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim", hidden // heads)
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).contiguous()

    tensors = {
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(intermediate_size, hidden),
        "midlayer.mlp.up_proj.weight": w(intermediate_size, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, intermediate_size),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "fc.weight": w(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    head = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate_size, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": vocab,
        "target_hidden_size": hidden, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
        "rope_theta": cfg.get("rope_theta", 10000.0), "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(head, indent=1))
    return out
