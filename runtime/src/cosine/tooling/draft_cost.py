"""Draft cost per token of each drafter engine and model, on the cores a drafter pool gets.

`cosine bench` measures it in the same run as the servers (`--draft-cost`), so the equal-resource
comparison has the drafters' own speed beside the verifier's step time: a drafter pays only if it
drafts a token in well under a verifier step. Each (engine, model) runs in a child process pinned
to the pool's cores (`os.sched_setaffinity`; vLLM's OpenMP threads bound to the same cores), the
engine a pool with that `engine` would run (`draft_engine.LlamaCppEngine` on the model's GGUF file,
`draft_engine.VllmEngine` on its weights), on real workload prompts rendered by the model's chat
template:
- prefill: the prompts' tokens fed once (`max_tokens` = 1), in prompt tokens per second;
- draft: `k` greedy draft tokens continuing each prompt, `batch` requests drafted together (one
  batched decode per draft step), in seconds per draft step and per draft token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

ENGINES = ("llamacpp", "vllm")


@dataclass(frozen=True)
class DraftCost:
    """One (engine, model, batch) measurement. cores: the cores the measuring process could run on;
    threads: how many the engine was given.
    prefill_tokens_per_s: prompt tokens ingested per second (all `batch` prompts in one call).
    draft_step_s: seconds per draft step (every request of the batch advanced by one token).
    draft_s_per_token: draft_step_s / batch. draft_tokens: draft tokens timed."""

    engine: str
    model: str
    cores: tuple[int, ...]
    threads: int
    batch: int
    prompt_tokens: int
    prefill_tokens_per_s: float
    draft_step_s: float
    draft_s_per_token: float
    draft_tokens: int


def _engine(engine: str, model: str, threads: int):  # engine: one of ENGINES
    from cosine import draft_engine
    from cosine.model_store import resolve, resolve_gguf

    if engine == "llamacpp":
        return draft_engine.LlamaCppEngine(str(resolve_gguf(model)), model, threads=threads, max_requests=16,
                                           ctx_tokens=16384)
    return draft_engine.VllmEngine(str(resolve(model)), model, dtype="float32", max_model_len=4096)


def measure(engine: str, model: str, prompts: Sequence[Sequence[dict[str, str]]], k: int,
            batches: Sequence[int], threads: int) -> list[DraftCost]:
    """Time `engine` drafting for `model` in this process (see the module docstring).

    Args:
        prompts: chat messages per prompt; the first max(batches) are used.
        k: draft tokens per request per timed draft. batches: requests drafted together.
        threads: cores the engine computes on (llama.cpp's threads; vLLM binds its own).
    Raises:
        ValueError: an unknown engine, fewer prompts than the largest batch, or k < 1.
    """
    from transformers import AutoTokenizer

    from cosine.draft_engine import DraftJob
    from cosine.model_store import resolve

    if engine not in ENGINES:
        raise ValueError(f"unknown drafter engine {engine!r}; choose among {list(ENGINES)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not batches or len(prompts) < max(batches):
        raise ValueError(f"need at least {max(batches, default=1)} prompts for batches {list(batches)}, "
                         f"got {len(prompts)}")
    tokenizer = AutoTokenizer.from_pretrained(resolve(model))
    contexts = [tuple(tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)) for m in prompts[: max(batches)]]
    eng = _engine(engine, model, threads)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    out = []
    for b in batches:
        ids = [f"{engine}-{b}-{i}" for i in range(b)]
        t0 = time.perf_counter()
        eng.draft([DraftJob(r, ctx, 1) for r, ctx in zip(ids, contexts, strict=False)])
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = eng.draft([DraftJob(r, ctx, k) for r, ctx in zip(ids, contexts, strict=False)])
        draft_s = time.perf_counter() - t0
        drafted = sum(len(r.token_ids) for r in results)
        steps = max(len(r.token_ids) for r in results) or 1
        for r in ids:
            eng.release(r)
        prompt_tokens = sum(len(c) for c in contexts[:b])
        out.append(DraftCost(engine, model, cores, threads, b, prompt_tokens, prompt_tokens / prefill_s,
                             draft_s / steps, draft_s / max(1, drafted), drafted))
    return out


def measure_in_child(engine: str, model: str, prompts: Sequence[Sequence[dict[str, str]]], k: int,
                     batches: Sequence[int], cores: Sequence[int], timeout_s: float = 900) -> list[DraftCost]:
    """`measure` in a child process pinned to `cores` (vLLM's OpenMP threads bound to them,
    `VLLM_CPU_KVCACHE_SPACE` 1 GiB unless set).

    Raises:
        RuntimeError: the child failed (its last output lines are in the message).
        subprocess.TimeoutExpired: it took over `timeout_s` seconds.
    """
    from cosine.placement import cpu_list

    request = json.dumps({"engine": engine, "model": model, "prompts": [list(p) for p in prompts], "k": k,
                          "batches": list(batches), "threads": len(cores)})
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run([sys.executable, "-m", "cosine.tooling.draft_cost"], input=request, capture_output=True,
                          text=True, env=env, timeout=timeout_s, check=False,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"draft cost of {engine} on {model} failed (exit {proc.returncode}): {tail}")
    return [DraftCost(**{**row, "cores": tuple(row["cores"])}) for row in json.loads(lines[-1])["costs"]]


def _main() -> None:
    req = json.loads(sys.stdin.read())
    costs = measure(req["engine"], req["model"], req["prompts"], req["k"], req["batches"], req["threads"])
    print(json.dumps({"costs": [asdict(c) for c in costs]}), flush=True)


if __name__ == "__main__":
    _main()
