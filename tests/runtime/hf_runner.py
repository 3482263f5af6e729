"""A `transformers` causal LM with per-request KV caches, for tests: the cross-tokenizer drafter's
`Runner` over tiny random-weight and real models (pools drive it on llama.cpp,
`draft_engine.LlamaCppRunner`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel


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
        self.vocab_size: int = int(model.config.vocab_size)
        self.max_context_tokens: int = int(getattr(model.config, "max_position_embeddings", 32768))

    @classmethod
    def load(cls, name: str) -> ModelRunner:
        """A model from the model store (`cosine models pull`), in float32."""
        from cosine.model_store import resolve

        path = resolve(name)
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path),
                   name=name)

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
