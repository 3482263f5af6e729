"""Cross-tokenizer drafter: drafts of a model with another vocabulary, translated via text.

Fast tests use two tiny byte-level BPE tokenizers of different vocabularies (conftest) over
random-weight models; `real_model` tests draft with SmolLM2-135M-Instruct (vocab 49,152) for a
Qwen2.5-Coder-0.5B-Instruct target (vocab 151,936): drafts continue the context in the target's
vocabulary, and the drafter's KV cache grows instead of restarting. The models run on
`transformers` here (`hf_runner`); pools run the same drafter on llama.cpp.
"""

from __future__ import annotations

import pytest
import torch

from cosine.cross_tokenizer_drafter import (
    CrossTokenizerDrafter,
    _span_confidences,
    parse_chatml,
    same_vocabulary,
)

from .conftest import build_chat_runner, build_chat_tokenizer
from .hf_runner import ModelRunner


class CountingRunner(ModelRunner):
    """A runner that records how many tokens each forward pass fed (to see KV reuse)."""

    def __init__(self, inner: ModelRunner) -> None:
        super().__init__(inner.model, inner.tokenizer, inner.name)
        self.fed: list[int] = []

    def forward(self, seq, token_ids, *, logits_to_keep=0):
        self.fed.append(len(token_ids))
        return super().forward(seq, token_ids, logits_to_keep=logits_to_keep)


class ScriptedRunner(CountingRunner):
    """A tiny model that knows one reply: after a context ending in `script[:m]` (longest m) its
    argmax is `script[m]` (EOS after the end), with top probability ~1. The KV cache is the real
    tiny model's, so caching, sync and rollback run as for any model."""

    def __init__(self, inner: ModelRunner, reply: str) -> None:
        super().__init__(inner)
        self.script = inner.encode_text(reply)
        self.eos = inner.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def forward(self, seq, token_ids, *, logits_to_keep=0):
        super().forward(seq, token_ids, logits_to_keep=logits_to_keep)
        rows = logits_to_keep or len(token_ids)
        out = torch.full((rows, self.vocab_size), -10.0)
        ids = seq.token_ids
        for row, end in enumerate(range(len(ids) - rows + 1, len(ids) + 1)):
            m = next(m for m in range(min(len(self.script), end), -1, -1) if ids[end - m:end] == self.script[:m])
            out[row, self.script[m] if m < len(self.script) else self.eos] = 10.0
        return out


# ---------------------------------------------------------------- fast: tiny tokenizers and models

REPLY = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizers():
    """(target tokenizer, drafter tokenizer): byte-level BPEs of different vocabularies (300 vs 270)."""
    target_tok, drafter_tok = build_chat_tokenizer(300), build_chat_tokenizer(270)
    assert not same_vocabulary(target_tok, drafter_tok)
    assert target_tok("The quick brown")["input_ids"] != drafter_tok("The quick brown")["input_ids"]
    return target_tok, drafter_tok


@pytest.fixture
def scripted(tokenizers):
    """(target, drafter), both knowing REPLY, each in its own vocabulary."""
    target_tok, drafter_tok = tokenizers
    return (ScriptedRunner(build_chat_runner(target_tok, seed=0, name="tiny-target"), REPLY),
            ScriptedRunner(build_chat_runner(drafter_tok, seed=1, name="tiny-drafter"), REPLY))


def _chat_context(runner: ModelRunner, reply: str = "") -> list[int]:
    ids = runner.encode_prompt("Hello, how are you today?")
    return ids + (runner.encode_text(reply) if reply else [])


def test_parse_chatml():
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
    assert parse_chatml(text) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert parse_chatml("plain text") is None
    assert parse_chatml(text + "trailing") is None
    assert parse_chatml("") is None


def test_span_confidences_take_the_least_sure_overlapping_piece():
    # drafter pieces "ab" | "c" | "de" (ends 2, 3, 5); target tokens "abc" | "d" | "e"
    assert _span_confidences([3, 4, 5], [2, 3, 5], [0.9, 0.5, 0.8]) == [0.5, 0.8, 0.8]
    assert _span_confidences([], [2], [0.9]) == []


def test_drafts_are_target_ids_continuing_the_context(scripted):
    target, drafter_runner = scripted
    drafter = CrossTokenizerDrafter(drafter_runner, target.tokenizer, name="x")
    ctx = _chat_context(target, "The quick")
    draft = drafter.propose("r", ctx, 4)
    assert draft.drafter == "x" and draft.draft_s > 0
    assert draft.num_tokens == 4 and len(draft.confidences) == 4
    assert all(0 <= t < target.vocab_size for t in draft.token_ids)
    assert all(0.99 < c <= 1.0 for c in draft.confidences)
    # the target's own tokens of the reply's continuation, in the target's vocabulary
    whole = target.encode_text("The quick brown fox jumps over the lazy dog.")
    assert list(draft.token_ids) == whole[len(target.encode_text("The quick")):][:4]
    assert target.tokenizer.decode(ctx + list(draft.token_ids)).startswith(target.tokenizer.decode(ctx))
    # the drafter's prompt is in its own vocabulary and chat format
    prompt = drafter_runner.encode_prompt("Hello, how are you today?")
    assert drafter._requests["r"].seq.token_ids[: len(prompt)] == prompt


def test_end_of_turn_maps_to_the_targets_token(scripted):
    target, drafter_runner = scripted
    drafter = CrossTokenizerDrafter(drafter_runner, target.tokenizer)
    draft = drafter.propose("r", _chat_context(target, "The quick brown fox jumps over the lazy"), 8)
    # the text is complete (the drafter ended its turn), so no token is held back
    assert target.tokenizer.decode(draft.token_ids) == " dog.<|im_end|>"
    assert draft.token_ids[-1] == target.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_kv_cache_is_reused_across_calls(scripted):
    target, drafter_runner = scripted
    drafter = CrossTokenizerDrafter(drafter_runner, target.tokenizer)
    ctx = _chat_context(target, "The quick")
    drafter.propose("r", ctx, 4)
    prefill = drafter_runner.fed[0]
    cached = drafter.cached_tokens("r")
    assert prefill > 10 and cached >= prefill
    for word in (" brown", " fox", " jumps"):
        ctx = ctx + target.encode_text(word)
        drafter_runner.fed.clear()
        drafter.propose("r", ctx, 4)
        assert drafter_runner.fed[0] < 8, f"re-prefilled {drafter_runner.fed[0]} tokens"  # the new suffix only
        assert drafter.cached_tokens("r") > cached
        cached = drafter.cached_tokens("r")
    drafter.release("r")
    assert drafter.cached_tokens("r") == 0


def test_odd_inputs_give_empty_drafts(scripted):
    target, drafter_runner = scripted
    drafter = CrossTokenizerDrafter(drafter_runner, target.tokenizer)
    ctx = _chat_context(target, "The quick")
    assert drafter.propose("r", ctx, 0).num_tokens == 0
    assert drafter.propose("r", [], 4).num_tokens == 0
    assert drafter.propose("r", [*ctx, 10**6], 4).num_tokens == 0
    assert drafter.propose("r", [*ctx, -1], 4).num_tokens == 0
    euro = target.encode_text(" \u20ac")  # 3 UTF-8 bytes, split over byte tokens in this vocabulary
    assert "\ufffd" in target.tokenizer.decode(ctx + euro[:-1])
    assert drafter.propose("r", ctx + euro[:-1], 4).num_tokens == 0  # ends inside a character
    assert drafter.propose("r", ctx + euro, 4).num_tokens > 0
    # special tokens only; plain text (no chat markup); a context beyond the drafter's window
    assert drafter.propose("s", target.tokenizer.convert_tokens_to_ids(["<|im_start|>"]), 4).num_tokens == 0
    plain = drafter.propose("t", target.encode_text("The quick"), 4)
    assert target.tokenizer.decode(plain.token_ids).startswith(" brown")
    assert drafter.propose("u", target.encode_text("The quick " * 200), 4).num_tokens == 0


def test_chat_template_refusing_the_prompt_falls_back_to_plain_text(tokenizers):
    target_tok, _ = tokenizers
    drafter_tok = build_chat_tokenizer(270)
    drafter_tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    )
    target = build_chat_runner(target_tok, seed=0)
    drafter = CrossTokenizerDrafter(ScriptedRunner(build_chat_runner(drafter_tok, seed=1), REPLY), target_tok)
    ctx = target.encode_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    draft = drafter.propose("r", ctx + target.encode_text("The quick"), 4)
    assert target_tok.decode(draft.token_ids).startswith(" brown")
    assert drafter._requests["r"].prompt_target_ids == ()  # plain text mode


def test_random_drafter_never_raises(tokenizers):
    """A random-weight drafter emits invalid UTF-8 and special tokens: drafts stay valid or empty."""
    target_tok, drafter_tok = tokenizers
    drafter = CrossTokenizerDrafter(build_chat_runner(drafter_tok, seed=2), target_tok)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        ctx = [int(t) for t in torch.randint(0, len(target_tok), (20,), generator=gen)]
        for n in range(1, 4):
            draft = drafter.propose(f"r{seed}", ctx[: 5 * n], 6)
            assert draft.num_tokens <= 6 and all(0 <= t < len(target_tok) for t in draft.token_ids)


def test_served_over_grpc_in_the_targets_vocabulary(scripted):
    from cosine.draft_engine import SequentialEngine
    from cosine.transport.drafter_service import DrafterServicer, serve
    from cosine.transport.remote_drafter import RemoteDrafter

    target, drafter_runner = scripted
    local = CrossTokenizerDrafter(drafter_runner, target.tokenizer, name="chat")
    engine = SequentialEngine(CrossTokenizerDrafter(drafter_runner, target.tokenizer, name="chat"), target.vocab_size)
    servicer = DrafterServicer(engine, "chat", "tiny-target", vocab_size=target.vocab_size)
    server = serve(servicer, port=0)
    try:
        remote = RemoteDrafter(f"127.0.0.1:{server.bound_port}", "chat")
        info = remote.info()
        assert (info.vocab_size, info.tokenizer_family) == (target.vocab_size, "tiny-target")
        for reply in ("The quick", "The quick brown fox"):
            ctx = _chat_context(target, reply)
            got, want = remote.propose("r", ctx, 4), local.propose("r", ctx, 4)
            assert got.token_ids == want.token_ids and got.num_tokens > 0
    finally:
        server.stop(None)


def _cluster(pool: dict) -> dict:
    return {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"}, "drafterPools": [pool]}


def test_manifest_needs_translate_tokenizer_for_another_family(tmp_path):
    import yaml

    from cosine.manifest import load_manifest, parse_spec, tokenizer_problems

    def problems(pool: dict) -> list[str]:
        return tokenizer_problems(parse_spec({"spec": _cluster(pool)}))

    smol = {"name": "chat", "model": "smollm2-135m-instruct"}
    assert len(problems(smol)) == 1 and "spec.drafterPools[0].translateTokenizer: true" in problems(smol)[0]
    assert problems({**smol, "translateTokenizer": True}) == []
    assert problems({"name": "c", "model": "qwen2.5-coder-0.5b-instruct"}) == []
    assert problems({"name": "c", "model": "/models/mine"}) == []  # unknown family: the user's call
    # a declared tokenizer is what is judged (the check is the webhook's own, one function)
    (declared,) = problems({"name": "c", "model": "/models/mine", "tokenizer": "HuggingFaceTB/SmolLM2-135M"})
    assert declared.startswith("spec.drafterPools[0].tokenizer: tokenizer family 'smollm2'")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"kind": "CoSineCluster", "spec": _cluster(smol)}))
    with pytest.raises(ValueError, match="translateTokenizer"):
        load_manifest(path)


# ---------------------------------------------------------------- real models

TARGET, DRAFTER = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real():
    from cosine.model_store import pull

    # one thread: on a shared 2-core machine two spinning threads per process run ~10x slower
    torch.set_num_threads(1)
    pull(TARGET, progress=False)
    pull(DRAFTER, progress=False)
    return ModelRunner.load(TARGET), ModelRunner.load(DRAFTER)


@pytest.mark.real_model
def test_real_drafts_continue_the_context(real):
    target, drafter_runner = real
    drafter = CrossTokenizerDrafter(drafter_runner, target.tokenizer)
    ctx = target.encode_prompt("What is the capital of France? Answer in one sentence.")
    ctx += target.encode_text("The capital of France")
    draft = drafter.propose("r", ctx, 8)
    text = target.decode(draft.token_ids)
    print(f"draft: {text!r} confidences {[round(c, 2) for c in draft.confidences]}")
    assert draft.num_tokens > 0 and all(0 <= t < target.vocab_size for t in draft.token_ids)
    assert target.tokenizer.decode(ctx + list(draft.token_ids)).startswith(target.tokenizer.decode(ctx))
    assert "Paris" in text


@pytest.mark.real_model
def test_real_kv_cache_grows_instead_of_restarting(real):
    target, drafter_runner = real
    runner = CountingRunner(drafter_runner)
    drafter = CrossTokenizerDrafter(runner, target.tokenizer)
    ctx = target.encode_prompt("Name three primary colors.")
    ctx += target.encode_text("The three primary colors are")
    drafter.propose("r", ctx, 4)
    seq = drafter._requests["r"].seq
    assert runner.fed[0] > 20 and sum(runner.fed) == seq.num_tokens  # prefill, then one pass per draft token
    context_tokens = runner.fed[0]
    for word in (" red", ",", " blue", " and"):
        ctx += target.encode_text(word)
        runner.fed.clear()
        drafter.propose("r", ctx, 4)
        assert drafter._requests["r"].seq is seq
        assert runner.fed[0] <= 4, runner.fed  # the new suffix only (and a re-tokenized last word)
        now = seq.num_tokens - sum(runner.fed[1:])  # cached tokens of the context, without this draft's
        assert now > context_tokens
        context_tokens = now
    drafter.release("r")
    assert drafter.cached_tokens("r") == 0


@pytest.mark.real_model
def test_real_pool_with_translate_tokenizer_drafts_in_the_verifiers_vocabulary(real):
    from cosine_spec.cluster_spec import parse_cluster_spec

    from cosine.draft_engine import LlamaCppEngine
    from cosine.roles import drafter_engine

    target, _ = real
    spec = parse_cluster_spec({"verifier": {"model": TARGET}, "drafterPools": [
        {"name": "chat", "model": DRAFTER, "translateTokenizer": True},
        {"name": "coder", "model": TARGET, "translateTokenizer": True},  # same vocabulary: no translation
    ]})
    engine, vocab, family = drafter_engine(spec.pool("chat"), spec.verifier)
    drafter = engine.drafter
    assert isinstance(drafter, CrossTokenizerDrafter) and drafter.name == "chat"
    assert (vocab, family) == (target.vocab_size, "qwen2")
    draft = drafter.propose("r", target.encode_prompt("Say hello.") + target.encode_text("Hello"), 4)
    assert draft.num_tokens > 0 and all(0 <= t < vocab for t in draft.token_ids)
    same, vocab, family = drafter_engine(spec.pool("coder"), spec.verifier)  # llama.cpp on the target's GGUF
    assert isinstance(same, LlamaCppEngine) and family == "qwen2" and vocab >= 151643
    same.close()
