"""Cross-tokenizer drafting: a drafter model whose vocabulary differs from the target's.

After Hugging Face `transformers`' universal assisted generation
(`AssistedCandidateGeneratorDifferentTokenizers` in `transformers/generation/candidate_generator.py`)
and Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms
for Heterogeneous Vocabularies" (arXiv:2502.05202, its string-level "SLEM" method): tokens cross
between the two vocabularies as text.

1. Target context -> drafter ids. A target context in ChatML (`<|im_start|>role\\n...<|im_end|>`,
   as Qwen's template writes it) ending in an open assistant turn is parsed into messages and
   re-rendered with the drafter's own chat template, so the drafter sees its own markup; the reply
   so far is decoded to text and re-tokenized by the drafter. Any other context (plain completions,
   other templates) is decoded as plain text without special tokens, as `transformers` does.
2. The drafter keeps one KV cache per request; each call syncs it to the new drafter ids
   (`Runner.sync`: only the suffix that changed is fed, never a full re-prefill).
3. The drafter drafts greedily; its tokens are decoded to text and tokenized by the target's
   tokenizer after a short window of the target context, so the draft starts on the target's own
   token boundary. The last target token is dropped unless the drafter stopped at a special token:
   it could be the prefix of a longer token the following text would have merged into.

Drafts are point-mass proposals (no q exists in the target's vocabulary), which vLLM's rejection
sampler verifies losslessly for sampled requests too.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from jinja2 import TemplateError

from cosine.drafter import Draft

log = logging.getLogger(__name__)

_IM_START = "<|im_start|>"
_REPLY_HEADER = "<|im_start|>assistant\n"
_CHATML_MESSAGE = re.compile(r"<\|im_start\|>([^\n<]+)\n(.*?)<\|im_end\|>\n?", re.DOTALL)
_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
_WINDOW_TOKENS = 8  # target context tokens re-tokenized with the draft text to find its token boundary
_ANCHOR_TOKENS = 4  # drafter context tokens decoded with the draft (SentencePiece drops a leading space)
_EXTRA_DRAFTER_TOKENS = 2  # drafter tokens beyond max_tokens: one target token is dropped at the end


def parse_chatml(text: str) -> list[dict[str, str]] | None:
    """Messages of a text made only of complete ChatML turns; None if it is anything else."""
    messages: list[dict[str, str]] = []
    pos = 0
    for m in _CHATML_MESSAGE.finditer(text):
        if m.start() != pos:
            return None
        messages.append({"role": m.group(1), "content": m.group(2)})
        pos = m.end()
    return messages if pos == len(text) and messages else None


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether two tokenizers map the same strings to the same ids (then drafts need no translation)."""
    return bool(a.get_vocab() == b.get_vocab())


class Sequence(Protocol):
    """One request's KV sequence on a `Runner`: the tokens in its cache."""

    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens in the cache."""
        ...


class Runner(Protocol):
    """A causal LM with per-request KV sequences, as the drafter drives it
    (`draft_engine.LlamaCppRunner` in drafter pools)."""

    name: str
    tokenizer: Any
    max_context_tokens: int

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence / end-of-turn token ids."""
        ...

    def new_sequence(self) -> Any:
        """An empty KV sequence for a new request."""
        ...

    def sync(self, seq: Any, context_ids: Seq[int]) -> list[int]:
        """Roll back to the longest common prefix with `context_ids`; the rest, to be fed."""
        ...

    def rollback(self, seq: Any, num_tokens: int) -> None:
        """Truncate the sequence's cache to its first `num_tokens` tokens."""
        ...

    def forward(self, seq: Any, token_ids: Seq[int], *, logits_to_keep: int = 0) -> torch.Tensor:
        """Append tokens; logits [rows, vocab] (the last row: after the last token)."""
        ...

    def release(self, seq: Any) -> None:
        """Free the sequence's KV cache."""
        ...


@dataclass
class _Request:
    """One request's drafter state: its KV cache and how its prompt was translated."""

    seq: Sequence
    prompt_target_ids: tuple[int, ...]  # target ids through the open assistant header; () = plain text
    prompt_drafter_ids: list[int]  # that prompt in the drafter's chat format


class CrossTokenizerDrafter:
    """A `Drafter` over a causal LM whose tokenizer differs from the target's; drafts in target ids.

    Args:
        runner: the drafter model (with its tokenizer).
        target_tokenizer: the target model's tokenizer (`transformers` tokenizer).
        name: drafter name for metrics and routing (default: the runner's).

    Raises:
        ValueError: `runner` has no tokenizer.
    """

    def __init__(self, runner: Runner, target_tokenizer: Any, name: str | None = None) -> None:
        if runner.tokenizer is None:
            raise ValueError(f"{runner.name} has no tokenizer; a cross-tokenizer drafter translates via text")
        self.runner = runner
        self.name = name or runner.name
        self.target_tokenizer = target_tokenizer
        self._tok = runner.tokenizer
        self._target_vocab = len(target_tokenizer)
        im_start = target_tokenizer.convert_tokens_to_ids(_IM_START)
        self._target_im_start: int | None = im_start if im_start != target_tokenizer.unk_token_id else None
        self._drafter_stops = frozenset(runner.eos_token_ids) | frozenset(self._tok.all_special_ids)
        # a drafter end-of-turn becomes the target's token of the same spelling (<|im_end|> -> <|im_end|>)
        self._stop_to_target: dict[int, int] = {}
        for d in runner.eos_token_ids:
            t = target_tokenizer.convert_tokens_to_ids(self._tok.convert_ids_to_tokens(d))
            if isinstance(t, int) and t != target_tokenizer.unk_token_id and 0 <= t < self._target_vocab:
                self._stop_to_target[d] = t
        self._target_default_system = _default_system_prompt(target_tokenizer)
        self._requests: dict[str, _Request] = {}

    def propose(self, request_id: str, context_ids: Seq[int], max_tokens: int, *, min_confidence: float = 0.0) -> Draft:
        """Draft up to `max_tokens` TARGET tokens continuing `context_ids` (target prompt + emitted ids).

        The drafter drafts greedily (a point-mass draft). It drafts about
        `max_tokens + 2` drafter tokens, stopping early at a drafter special token (end of turn:
        mapped to the target's token of the same spelling when there is one) or at the first
        position whose top probability is below `min_confidence`.

        Returns:
            a `Draft` of k <= `max_tokens` target token ids; `confidences[j]` is the lowest top
            probability among the drafter tokens whose text overlaps target token j (a merged
            token is only as sure as its least sure piece); `draft_s` is wall seconds of the call.
            Empty when nothing can be proposed: `max_tokens` <= 0, ids outside the target's
            vocabulary, a context ending inside a UTF-8 character, a context beyond the
            drafter's window. Never raises on such input.
        """
        t0 = time.perf_counter()
        ctx = [int(t) for t in context_ids]
        if max_tokens <= 0 or not ctx or not all(0 <= t < self._target_vocab for t in ctx):
            return self._empty(t0)
        try:
            return self._propose(request_id, ctx, max_tokens, min_confidence, t0)
        except (ValueError, IndexError, TypeError, OverflowError, RuntimeError) as e:
            # a tokenizer or model refusing odd input costs this draft, not the request
            log.warning("%s: no draft for request %s: %s", self.name, request_id, e)
            self.release(request_id)
            return self._empty(t0)

    def release(self, request_id: str) -> None:
        """Free a request's drafter KV cache."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.runner.release(req.seq)

    def cached_tokens(self, request_id: str) -> int:
        """Drafter tokens in the request's KV cache (0 for an unknown request)."""
        req = self._requests.get(request_id)
        return req.seq.num_tokens if req is not None else 0

    # ------------------------------------------------------------------ internals

    def _empty(self, t0: float) -> Draft:
        return Draft((), (), self.name, time.perf_counter() - t0)

    def _propose(self, request_id: str, ctx: list[int], max_tokens: int, min_confidence: float, t0: float) -> Draft:
        req = self._request(request_id, ctx)
        drafter_ids = self._drafter_ids(req, ctx)
        num_draft = max_tokens + _EXTRA_DRAFTER_TOKENS
        if not drafter_ids or len(drafter_ids) + num_draft > self.runner.max_context_tokens:
            return self._empty(t0)
        tokens, confs, stop = self._draft(req.seq, drafter_ids, num_draft, min_confidence)
        text, ends = self._drafter_text(drafter_ids, tokens)
        complete = stop is not None and len(ends) == len(tokens)  # the drafter ended the text itself
        target_ids = self._to_target(ctx, text) if text else []
        if not complete and target_ids:
            target_ids.pop()  # may be the prefix of a longer token the next text would merge into
        target_confs = _span_confidences(self._target_ends(target_ids), ends, confs[: len(ends)])
        if complete and stop is not None and stop in self._stop_to_target:
            target_ids.append(self._stop_to_target[stop])
            target_confs.append(confs[-1] if len(confs) > len(tokens) else 1.0)
        target_ids, target_confs = target_ids[:max_tokens], target_confs[:max_tokens]
        return Draft(tuple(target_ids), tuple(target_confs), self.name, time.perf_counter() - t0)

    def _request(self, request_id: str, ctx: list[int]) -> _Request:
        """The request's state, translating its prompt on the first call (or if the prompt changed)."""
        req = self._requests.get(request_id)
        if req is not None and tuple(ctx[: len(req.prompt_target_ids)]) == req.prompt_target_ids:
            return req
        prompt_len, prompt_drafter_ids = self._translate_prompt(ctx)
        seq = req.seq if req is not None else self.runner.new_sequence()
        req = self._requests[request_id] = _Request(seq, tuple(ctx[:prompt_len]), prompt_drafter_ids)
        return req

    def _translate_prompt(self, ctx: list[int]) -> tuple[int, list[int]]:
        """(target tokens of a ChatML prompt through its open assistant header, the same prompt in
        the drafter's chat template); (0, []) when the context is not such a prompt."""
        if self._target_im_start is None or self._tok.chat_template is None:
            return 0, []
        try:
            start = len(ctx) - 1 - ctx[::-1].index(self._target_im_start)
        except ValueError:
            return 0, []
        header_end = next(  # each token of the ASCII header is at least one character
            (j for j in range(start + 1, min(start + len(_REPLY_HEADER), len(ctx)) + 1)
             if self._target_decode(ctx[start:j], skip_special=False) == _REPLY_HEADER),
            None,
        )
        messages = parse_chatml(self._target_decode(ctx[:start], skip_special=False))
        if header_end is None or messages is None:
            return 0, []
        if messages[0]["role"] == "system" and messages[0]["content"] == self._target_default_system:
            messages = messages[1:]  # the target's own persona: let the drafter's template use its own
        try:
            prompt = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # e.g. a role the drafter's template refuses: draft from plain text
            log.debug("%s: chat template refused the prompt (%s); using plain text", self.name, e)
            return 0, []
        return header_end, self._drafter_encode(str(prompt), special=False)

    def _drafter_ids(self, req: _Request, ctx: list[int]) -> list[int]:
        """The context in drafter ids; [] when it ends inside a UTF-8 character."""
        chat = bool(req.prompt_target_ids)
        text = self._target_decode(ctx[len(req.prompt_target_ids):] if chat else ctx, skip_special=True)
        if text.endswith(_REPLACEMENT):  # the character is finished by a token the target has not emitted
            return []
        if chat:
            return req.prompt_drafter_ids + (self._drafter_encode(text, special=False) if text else [])
        return self._drafter_encode(text, special=True) if text else []

    def _draft(
        self, seq: Sequence, drafter_ids: list[int], num_draft: int, min_confidence: float
    ) -> tuple[list[int], list[float], int | None]:
        """Greedy drafter tokens, their top probabilities, and the special token that stopped
        drafting (None if none did). When a special token stopped it, its probability is the last
        entry of the confidences (one more than tokens)."""
        todo = self.runner.sync(seq, drafter_ids)
        if not todo:  # everything cached: re-feed the last token to get its logits
            self.runner.rollback(seq, seq.num_tokens - 1)
            todo = [drafter_ids[-1]]
        logits = self.runner.forward(seq, todo, logits_to_keep=1)[-1]  # [drafter vocab]
        tokens: list[int] = []
        confs: list[float] = []
        for i in range(num_draft):
            top = torch.softmax(logits, dim=-1).max(dim=-1)
            conf, tok = float(top.values), int(top.indices)
            if conf < min_confidence:
                break
            if tok in self._drafter_stops:
                confs.append(conf)
                return tokens, confs, tok
            tokens.append(tok)
            confs.append(conf)
            if i + 1 < num_draft:
                logits = self.runner.forward(seq, [tok])[-1]
        return tokens, confs, None

    def _drafter_text(self, drafter_ids: list[int], tokens: list[int]) -> tuple[str, list[int]]:
        """Text of the drafted tokens and, per token, the character offset where its text ends.

        Decoded after a few context tokens (a SentencePiece decoder drops the leading space of a
        text's first token), and cut before the first incomplete or invalid UTF-8 character: the
        offsets list is then shorter than `tokens`.
        """
        anchor = drafter_ids[-_ANCHOR_TOKENS:]
        anchor_text = self._drafter_decode(anchor)
        ends: list[int] = []
        text = ""
        for i in range(1, len(tokens) + 1):
            full = self._drafter_decode(anchor + tokens[:i])
            piece = full[len(anchor_text):] if full.startswith(anchor_text) else self._drafter_decode(tokens[:i])
            if _REPLACEMENT in piece:
                if not piece.endswith(_REPLACEMENT) or i == len(tokens):
                    break  # invalid bytes, or the draft ends inside a character
                continue  # the next token may finish the character
            text = piece
            ends.extend([len(text)] * (i - len(ends)))
        return text, ends

    def _to_target(self, ctx: list[int], text: str) -> list[int]:
        """Target ids of `text` as it continues `ctx`: tokenized after the last few context tokens
        (canonical boundaries, e.g. whitespace before a word) when those re-tokenize unchanged,
        else on its own (the context's last token would merge with the draft's first, which the
        target cannot do: it emits its next token at the end of the context's text)."""
        window = ctx[-_WINDOW_TOKENS:]
        window_text = self._target_decode(window, skip_special=False)
        ids = self._target_encode(window_text + text)
        if ids[: len(window)] == window:
            return ids[len(window):]
        return self._target_encode(text)

    def _target_ends(self, target_ids: list[int]) -> list[int]:
        """Character offset in the draft text where each target token's text ends."""
        return [len(self._target_decode(target_ids[: j + 1], skip_special=True)) for j in range(len(target_ids))]

    def _target_decode(self, ids: Seq[int], *, skip_special: bool) -> str:
        return str(self.target_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        ))

    def _target_encode(self, text: str) -> list[int]:
        return [int(t) for t in self.target_tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _drafter_decode(self, ids: Seq[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _drafter_encode(self, text: str, *, special: bool) -> list[int]:
        return [int(t) for t in self._tok(text, add_special_tokens=special)["input_ids"]]


def _span_confidences(target_ends: list[int], drafter_ends: list[int], drafter_confs: list[float]) -> list[float]:
    """Per target token, the lowest confidence among the drafter tokens whose text overlaps it.

    Both ends lists are character offsets into the same draft text, non-decreasing.
    """
    out: list[float] = []
    start = 0
    for end in target_ends:
        overlapping = [
            c for c, d_end, d_start in zip(drafter_confs, drafter_ends, [0, *drafter_ends], strict=False)
            if d_end > start and d_start < max(end, start + 1)
        ]
        out.append(min(overlapping) if overlapping else (drafter_confs[-1] if drafter_confs else 0.0))
        start = end
    return out


def _default_system_prompt(tokenizer: Any) -> str | None:
    """The system message a ChatML chat template adds when a conversation has none (Qwen's
    "You are Qwen, ..."), or None."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    except (ValueError, TypeError, AttributeError, TemplateError):  # no (usable) chat template
        return None
    messages = parse_chatml(str(text))
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"]
    return None
