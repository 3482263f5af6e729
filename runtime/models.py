"""Model runner: a causal LM with a per-request KV cache (prefill, extend by k tokens, roll back).

This is the only module of the engine that calls the model's forward. Everything above it (drafters,
verification, the generation loop) talks to it in token ids and logits, so a second backend (e.g.
llama.cpp) can be added behind the same four calls: `new_sequence`, `forward`, `rollback`, `release`.

A `Sequence` holds one request's KV cache and the token ids it covers. `forward(seq, ids)` appends
`ids` to the cache in one pass and returns their logits; `rollback(seq, n)` drops all but the first
`n` cached positions (rejected draft tokens), so no step recomputes the whole prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Sequence:
    """One request's KV cache on one model.

    `token_ids` are the tokens whose keys/values are in `cache`, in order; `len(token_ids)` is the
    cache length. Owned by a single `ModelRunner`.
    """

    cache: DynamicCache
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ModelRunner:
    """A causal LM (Hugging Face `transformers`) with per-request KV caches.

    Args:
        model: a causal LM in eval mode.
        tokenizer: its tokenizer, or None for id-only use (tests with random-weight models).
        name: registry name or path, for logs and metrics.
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None, name: str = "model") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.last_layout: str | None = None  # "packed" or "padded": how the last forward_batch ran
        self._flops: tuple[float, float] | None = None
        self.vocab_size: int = int(model.config.vocab_size)
        self.max_context_tokens: int = int(getattr(model.config, "max_position_embeddings", 32768))

    @classmethod
    def load(cls, name_or_path: str, dtype: str = "float32") -> ModelRunner:
        """Load a model made available by `cosine models pull` (or any local HF model directory).

        Raises:
            cosine.runtime.model_store.ModelNotAvailable: the model is not in the local cache.
            ValueError: unknown dtype.
        """
        from cosine.runtime.model_store import resolve

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        path: Path = resolve(name_or_path)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        log.info("loaded %s (%s) in %.1f s", name_or_path, dtype, time.perf_counter() - t0)
        return cls(model, tokenizer, name=name_or_path)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (generation config's eos plus the tokenizer's)."""
        ids: set[int] = set()
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def new_sequence(self) -> Sequence:
        return Sequence(cache=DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, seq: Sequence, token_ids: Seq[int], *, logits_to_keep: int = 0) -> torch.Tensor:
        """Append `token_ids` to `seq`'s KV cache in one forward pass.

        Args:
            seq: the request's cache; extended in place by `len(token_ids)` positions.
            token_ids: new tokens, at positions `seq.num_tokens ...`; at least one.
            logits_to_keep: compute logits only for the last N positions (0 = all). The LM head over
                a 151,936-token vocabulary is a large share of a pass, so prefill keeps 1.

        Returns:
            float32 logits, shape [n, vocab_size] with n = logits_to_keep or len(token_ids).

        Raises:
            ValueError: empty `token_ids`, or the sequence would exceed the model's context.
        """
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if seq.num_tokens + n > self.max_context_tokens:
            raise ValueError(
                f"sequence of {seq.num_tokens + n} tokens exceeds the context of {self.name} "
                f"({self.max_context_tokens} tokens)"
            )
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
        out = self.model(
            input_ids=input_ids,
            past_key_values=seq.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        seq.token_ids.extend(int(t) for t in token_ids)
        return out.logits[0].float()  # [n, vocab]

    @torch.inference_mode()
    def forward_tree(self, seq: Sequence, token_ids: Seq[int], parents: Seq[int]) -> torch.Tensor:
        """Append a token tree to `seq`'s KV cache in one forward pass (tree attention, SpecInfer,
        Miao et al. 2024, arXiv:2305.09781, §4).

        Node i holds `token_ids[i]`; `parents[i]` is the index of its parent node, or -1 for a root
        that continues the cached sequence directly. Parents come before children. Each node sees
        the whole cache and its own ancestors, at position `seq.num_tokens + depth(i)`, through a
        4D attention mask, so its logits are those of the sequence cache + path to the node.
        Afterwards the cache holds every node; `keep_path` keeps only the accepted path.

        Returns:
            float32 logits, shape [n, vocab_size], row i scoring the token after node i.

        Raises:
            ValueError: empty tree, a parent index not before its child, or over the context.
        """
        n = len(token_ids)
        if n == 0 or len(parents) != n:
            raise ValueError(f"a tree needs >= 1 node and one parent per node, got {n} and {len(parents)}")
        depth: list[int] = []
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be -1 or an earlier node")
            depth.append(0 if parent < 0 else depth[parent] + 1)
        past = seq.num_tokens
        if past + max(depth) + 1 > self.max_context_tokens:
            raise ValueError(f"tree of depth {max(depth) + 1} exceeds the context of {self.name}")
        mask = torch.zeros(1, 1, n, past + n, dtype=torch.bool)
        mask[..., :past] = True
        mask[0, 0, :, past:] = _ancestor_mask(n, parents)
        out = self.model(
            input_ids=torch.tensor([list(token_ids)], dtype=torch.long),
            attention_mask=mask,
            position_ids=torch.tensor([[past + d for d in depth]], dtype=torch.long),
            past_key_values=seq.cache,
            use_cache=True,
        )
        seq.token_ids.extend(int(t) for t in token_ids)
        return out.logits[0].float()

    @torch.inference_mode()
    def forward_batch(
        self,
        seqs: Seq[Sequence],
        token_ids: Seq[Seq[int]],
        parents: Seq[Seq[int] | None] | None = None,
        logits_to_keep: Seq[int] | None = None,
        layout: str = "auto",
    ) -> list[torch.Tensor]:
        """One forward pass over several requests (continuous batching at the verifier).

        Request b appends `token_ids[b]` to `seqs[b]`: a chain, or a token tree when
        `parents[b]` is given (as in `forward_tree`). A 4D mask gives each query exactly its own
        cache and ancestors, with explicit positions. Two layouts of the same computation:
        - "padded": the KV caches gathered into one right-padded batch cache ([B, heads, max
          cached, head dim] per layer) and the new tokens padded to the longest, so a request's
          long draft costs that many rows for every request;
        - "packed": one row of all requests' new tokens (sum of their lengths) over all their
          caches concatenated, with a block-diagonal mask, as varlen kernels pack sequences
          (vLLM's flattened batches); no padding rows, but attention over every (query, key) pair.
        "auto" takes the one with fewer estimated FLOPs (`packs_better`); `last_layout` says
        which ran. Afterwards each request's cache holds its old positions plus its new tokens.
        Copying the caches costs about (cached tokens x 2 x layers x kv heads x head dim x 4 bytes)
        per pass, small next to the pass itself on the models served here.

        `logits_to_keep[b]` > 0 keeps only request b's last rows (a prefill needs one).

        Returns:
            per request, float32 logits [len(token_ids[b]) or logits_to_keep[b], vocab_size].

        Raises:
            ValueError: mismatched lengths, an empty request, a bad tree, or an unknown layout.
        """
        b = len(seqs)
        keep = list(logits_to_keep) if logits_to_keep is not None else [0] * b
        if b != len(token_ids) or (parents is not None and len(parents) != b) or len(keep) != b:
            raise ValueError("forward_batch needs one token list (and parent list, logits_to_keep) per sequence")
        if layout not in ("auto", "packed", "padded"):
            raise ValueError(f"layout must be 'auto', 'packed' or 'padded', got {layout!r}")
        if b == 1:
            tree = parents[0] if parents is not None else None
            if tree is None:
                return [self.forward(seqs[0], token_ids[0], logits_to_keep=keep[0])]
            return [self.forward_tree(seqs[0], token_ids[0], tree)]
        depths: list[list[int]] = []
        for i in range(b):
            n = len(token_ids[i])
            if n == 0:
                raise ValueError(f"request {i} of the batch has no tokens")
            tree = parents[i] if parents is not None else None
            if tree is None:
                depths.append(list(range(n)))
                continue
            d: list[int] = []
            for j, parent in enumerate(tree):
                if not -1 <= parent < j:
                    raise ValueError(f"request {i}, node {j}: parent {parent} must be -1 or an earlier node")
                d.append(0 if parent < 0 else d[parent] + 1)
            depths.append(d)
        past = [s.num_tokens for s in seqs]
        for i in range(b):
            if past[i] + max(depths[i]) + 1 > self.max_context_tokens:
                raise ValueError(f"request {i} of the batch exceeds the context of {self.name}")
        if layout == "auto":
            layout = "packed" if self.packs_better(past, [len(t) for t in token_ids]) else "padded"
        self.last_layout = layout
        if layout == "packed":
            return self._forward_packed(seqs, token_ids, parents, keep, past, depths)
        return self._forward_padded(seqs, token_ids, parents, keep, past, depths)

    def packs_better(self, past: Seq[int], num_tokens: Seq[int]) -> bool:
        """Whether one packed row beats a padded batch for a pass of requests with `past[b]`
        cached and `num_tokens[b]` new tokens, by estimated FLOPs.

        Padded: B x max(n) query rows, each attending to max(past) + max(n) keys. Packed: sum(n)
        rows attending to sum(past) + sum(n) keys (a block-diagonal mask; the attention kernel
        still computes every pair). The linear layers cost ~2 x parameters per row, attention
        ~4 x layers x heads x head dim per (query, key) pair.
        """
        b, total = len(num_tokens), sum(num_tokens)
        qmax, lmax = max(num_tokens), max(past)
        per_row, per_pair = self._flops_per_row_and_pair()
        padded = b * qmax * (per_row + per_pair * (lmax + qmax))
        packed = total * (per_row + per_pair * (sum(past) + total))
        return packed < padded

    def _flops_per_row_and_pair(self) -> tuple[float, float]:
        if self._flops is None:
            c = self.model.config
            heads = int(getattr(c, "num_attention_heads", 1))
            head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
            layers = int(getattr(c, "num_hidden_layers", 1))
            params = sum(p.numel() for p in self.model.parameters())
            self._flops = (2.0 * params, 4.0 * layers * heads * head_dim)
        return self._flops

    def _forward_packed(self, seqs, token_ids, parents, keep, past, depths) -> list[torch.Tensor]:
        """`forward_batch` as one row: every request's cache and new tokens concatenated, a
        block-diagonal mask, no padding rows."""
        n = [len(t) for t in token_ids]
        starts = [sum(past[:i]) for i in range(len(seqs))]  # each request's cache in the packed keys
        offs = [sum(n[:i]) for i in range(len(seqs))]  # and its new tokens in the packed row
        p_all, t_all = sum(past), sum(n)
        mask = torch.zeros(1, 1, t_all, p_all + t_all, dtype=torch.bool)
        ids = torch.tensor([[int(t) for ts in token_ids for t in ts]], dtype=torch.long)
        pos = torch.tensor([[past[i] + d for i in range(len(seqs)) for d in depths[i]]], dtype=torch.long)
        for i in range(len(seqs)):
            rows = slice(offs[i], offs[i] + n[i])
            mask[0, 0, rows, starts[i] : starts[i] + past[i]] = True
            tree = parents[i] if parents is not None else None
            mask[0, 0, rows, p_all + offs[i] : p_all + offs[i] + n[i]] = _ancestor_mask(n[i], tree)
        cache = DynamicCache(config=self.model.config)
        num_layers = len(seqs[0].cache.layers) if p_all else 0
        for li in range(num_layers):
            ks = [s.cache.layers[li].keys for s, m in zip(seqs, past, strict=True) if m]
            vs = [s.cache.layers[li].values for s, m in zip(seqs, past, strict=True) if m]
            cache.update(torch.cat(ks, -2), torch.cat(vs, -2), li)
        base = self.model.get_decoder()
        hidden = base(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True).last_hidden_state[0]  # [sum(n), hidden]
        rows = [list(range(offs[i] + n[i] - (keep[i] or n[i]), offs[i] + n[i])) for i in range(len(seqs))]
        logits_all = self.model.lm_head(hidden[[r for rs in rows for r in rs]]).float()
        results = []
        start = 0
        for i, s in enumerate(seqs):
            for li, layer in enumerate(cache.layers):
                lo = p_all + offs[i]
                k_new, v_new = layer.keys[:, :, lo : lo + n[i]], layer.values[:, :, lo : lo + n[i]]
                own = s.cache.layers[li] if li < len(s.cache.layers) else None
                if own is not None and past[i] and getattr(own, "keys", None) is not None:
                    own.keys, own.values = torch.cat([own.keys, k_new], -2), torch.cat([own.values, v_new], -2)
                else:
                    s.cache.update(k_new.clone(), v_new.clone(), li)
            s.token_ids.extend(int(t) for t in token_ids[i])
            results.append(logits_all[start : start + len(rows[i])])
            start += len(rows[i])
        return results

    def _forward_padded(self, seqs, token_ids, parents, keep, past, depths) -> list[torch.Tensor]:
        """`forward_batch` as a right-padded batch: one row per request."""
        b = len(seqs)
        lmax, qmax = max(past), max(len(t) for t in token_ids)
        mask = torch.zeros(b, 1, qmax, lmax + qmax, dtype=torch.bool)
        ids = torch.zeros(b, qmax, dtype=torch.long)
        pos = torch.zeros(b, qmax, dtype=torch.long)
        for i in range(b):
            n = len(token_ids[i])
            ids[i, :n] = torch.tensor(list(token_ids[i]), dtype=torch.long)
            pos[i, :n] = torch.tensor([past[i] + d for d in depths[i]], dtype=torch.long)
            mask[i, 0, :, : past[i]] = True
            tree = parents[i] if parents is not None else None
            mask[i, 0, :n, lmax : lmax + n] = _ancestor_mask(n, tree)
            for j in range(n, qmax):  # padding queries see only themselves (no all-masked rows)
                mask[i, 0, j, lmax + j] = True
        cache = DynamicCache(config=self.model.config)
        for li in range(len(seqs[0].cache.layers) if lmax else 0):
            ks, vs = [], []
            for i, s in enumerate(seqs):
                layer = s.cache.layers[li] if li < len(s.cache.layers) else None
                k = layer.keys if layer is not None and getattr(layer, "keys", None) is not None else None
                if k is None or past[i] == 0:
                    ref = next(x.cache.layers[li].keys for x in seqs if x.num_tokens)
                    k = v = ref.new_zeros(1, ref.shape[1], 0, ref.shape[3])
                else:
                    v = layer.values
                pad = lmax - k.shape[-2]
                if pad:
                    k = torch.nn.functional.pad(k, (0, 0, 0, pad))
                    v = torch.nn.functional.pad(v, (0, 0, 0, pad))
                ks.append(k)
                vs.append(v)
            cache.update(torch.cat(ks), torch.cat(vs), li)
        base = self.model.get_decoder()
        hidden = base(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True).last_hidden_state  # [B, qmax, hidden]
        rows = [list(range(len(t) - (keep[i] or len(t)), len(t))) for i, t in enumerate(token_ids)]
        flat = torch.cat([hidden[i, r] for i, r in enumerate(rows)])
        logits_all = self.model.lm_head(flat).float()
        results = []
        start = 0
        for i, s in enumerate(seqs):
            n = len(token_ids[i])
            for li, layer in enumerate(cache.layers):
                k = torch.cat([layer.keys[i : i + 1, :, : past[i]], layer.keys[i : i + 1, :, lmax : lmax + n]], -2)
                v = torch.cat([layer.values[i : i + 1, :, : past[i]], layer.values[i : i + 1, :, lmax : lmax + n]], -2)
                if li < len(s.cache.layers) and getattr(s.cache.layers[li], "keys", None) is not None:
                    s.cache.layers[li].keys, s.cache.layers[li].values = k, v
                else:
                    s.cache.update(k, v, li)
            s.token_ids.extend(int(t) for t in token_ids[i])
            results.append(logits_all[start : start + len(rows[i])])
            start += len(rows[i])
        return results

    def keep_path(self, seq: Sequence, num_prefix: int, node_offsets: Seq[int]) -> None:
        """Keep the first `num_prefix` cached positions plus the positions `num_prefix + j` for j in
        `node_offsets` (ascending): the accepted path of a tree appended by `forward_tree`."""
        keep = [*range(num_prefix), *(num_prefix + j for j in node_offsets)]
        if keep == list(range(len(keep))):
            self.rollback(seq, len(keep))
            return
        index = torch.tensor(keep, dtype=torch.long)
        for layer in seq.cache.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        seq.token_ids[:] = [seq.token_ids[i] for i in keep]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the first `num_tokens` cached positions (drop rejected draft tokens)."""
        drop = seq.num_tokens - num_tokens
        if drop < 0:
            raise ValueError(f"cannot roll back to {num_tokens} tokens: only {seq.num_tokens} cached")
        if drop:
            seq.cache.crop(-drop)
            del seq.token_ids[num_tokens:]

    def sync(self, seq: Sequence, context_ids: Seq[int]) -> list[int]:
        """Roll `seq` back to its longest common prefix with `context_ids`.

        Returns the suffix of `context_ids` not yet in the cache (to be fed with `forward`).
        """
        common = 0
        limit = min(seq.num_tokens, len(context_ids))
        cached = seq.token_ids
        while common < limit and cached[common] == context_ids[common]:
            common += 1
        self.rollback(seq, common)
        return list(context_ids[common:])

    def release(self, seq: Sequence) -> None:
        """Free a request's KV cache."""
        seq.cache = DynamicCache(config=self.model.config)
        seq.token_ids.clear()

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt: chat messages get the model's chat template (with the generation
        prompt); plain text is tokenized as is.

        Raises:
            ValueError: empty prompt, or no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            if not self.tokenizer.chat_template:
                return self.encode_text(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if not prompt or not any(m.get("content", "").strip() for m in prompt):
            raise ValueError("prompt is empty")
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of raw text, without the chat template (for `/v1/completions`).

        Raises:
            ValueError: no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer")
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def decode(self, token_ids: Seq[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _ancestor_mask(n: int, parents: Seq[int] | None) -> torch.Tensor:
    """[n, n] bool: new token j attends to itself and its ancestors among the new tokens; a chain
    (causal, lower triangular) when `parents` is None, else a tree whose parents come first."""
    if parents is None:
        return torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.eye(n, dtype=torch.bool)
    for j, parent in enumerate(parents):
        if parent >= 0:
            mask[j] |= mask[parent]
    return mask


def tiny_qwen2(vocab_size: int = 64, seed: int = 0, num_layers: int = 2) -> ModelRunner:
    """A random-weight Qwen2 model built from a config: same code path as the real models, in
    milliseconds. For tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # sharpen the output so random models have confident, diverse argmaxes
        model.lm_head.weight.mul_(8.0)
    return ModelRunner(model, None, name=f"tiny-qwen2-{seed}")
