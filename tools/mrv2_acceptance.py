"""Accepted tokens per verifier step through vLLM's GPU runner (MRV2, async scheduling on), per
domain, for each draft source alone and composed: what the MRV2 seam buys, independent of speed.

MRV2 runs here under Triton's interpreter (`cosine.mrv2_harness`), far too slowly to time, but the
tokens each verification step yields do not depend on speed. Every system runs the same prompts
one at a time (concurrency 1), greedy, on the target (Qwen2.5-Coder-1.5B-Instruct):
- `draft`: vLLM's own `draft_model` speculation with the 0.5B drafter, on MRV2 (what
  `vllm-draft` is on a GPU);
- `lookup`: CoSine with no engine drafter (vLLM's device lookup inside, the suffix trees'
  anchored candidates beside it);
- `cosine-draft`: CoSine composing the 0.5B draft model with lookup.
A step is one `update_from_output` of the scheduler that decoded the request (its prefill step
is left out); tokens per step = the request's output tokens after the first / its decode steps.

Under the interpreter a step takes seconds, and CoSine's adaptive k and the drafter's depth are
priced from the step times it measures: a pass curve steep where a GPU's is flat. `--gpu HW`
prices them on that GPU instead: each step's seconds are the simulator's roofline for the step on
`HW` (`cosine.simulation.cost_models`, both models in bfloat16: the target's pass over the step's
tokens plus one drafter forward over the batch per draft token the drafter drafted), a model of a
GPU standing in for one that cannot run here. The acceptance stays measured; each system's
modelled seconds per output token on `HW` are reported beside it (vLLM's `draft_model` drafting
its k every step).

    python tools/mrv2_acceptance.py --workload mixed --limit 1 --workload heldout --limit 4 \
        --max-tokens 32 --out results/mrv2_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SYSTEMS = ("draft", "lookup", "cosine-draft")
TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def _engine(system: str, k: int, draft_k: int, fixed: bool = False):
    import torch

    if not torch.cuda.is_available():  # on a GPU host vLLM runs MRV2 natively
        from cosine import mrv2_harness

        mrv2_harness.enable()
    from cosine_spec.cluster_spec import SpeculationSpec
    from cosine_spec.verifier_spec import SpeculatorSpec
    from vllm import LLM

    from cosine import vllm_hooks
    from cosine.model_store import resolve

    target, drafter = str(resolve(TARGET)), str(resolve(DRAFTER))
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
    if system == "draft":
        return LLM(
            model=target,
            speculative_config={"method": "draft_model", "model": drafter, "num_speculative_tokens": draft_k},
            **kw,
        )
    speculator = SpeculatorSpec("draftModel", drafter) if system == "cosine-draft" else None
    return vllm_hooks.cosine_llm(
        target,
        SpeculationSpec(max_draft_len=k, adaptive=not fixed),
        {},
        speculator,
        drafter if speculator else None,
        **kw,
    )


def gpu_step_s(hardware: str):
    """(tokens in the pass, KV tokens cached, drafter forwards, requests) -> modelled seconds of a
    decode step on `hardware` (a `profiles.yaml` GPU): the target's roofline pass plus the
    drafter's forwards, both models in bfloat16 (`cosine.simulation.cost_models.Roofline`)."""
    from dataclasses import replace

    from cosine.simulation.cost_models import load_profiles

    profiles = load_profiles()
    target, drafter = (
        replace(profiles.roofline(m, hardware), model=replace(profiles.models[m], dtype_bytes=2))
        for m in (TARGET, DRAFTER)
    )

    def step_s(num_tokens: int, kv_tokens: int, depth: int, num_requests: int) -> float:
        return target.pass_s(num_tokens, kv_tokens) + depth * drafter.pass_s(max(1, num_requests), kv_tokens)

    return step_s


def run_system(
    system: str, prompts: list[dict], max_tokens: int, k: int, draft_k: int, fixed: bool = False, gpu: str = ""
) -> dict:
    """Per prompt: (domain, output tokens, decode steps, and with `gpu` their modelled seconds
    there) for `system` (in this process)."""
    llm = _engine(system, k, draft_k, fixed)  # first: the harness patches vLLM before it is imported
    from vllm import SamplingParams

    from cosine.vllm_mrv2 import PLAN_ATTR

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: dict[str, int] = defaultdict(int)
    modelled: dict[str, float] = defaultdict(float)
    update = scheduler.update_from_output
    model = gpu_step_s(gpu) if gpu else None
    cosine = getattr(scheduler, "cosine", None)

    def kv_tokens() -> int:
        return sum(r.num_computed_tokens for r in scheduler.running)

    step = {"s": 0.0}  # the modelled seconds of the step being folded in

    if model is not None and cosine is not None:  # CoSine prices k and the drafter's depth on the GPU
        from dataclasses import replace

        observe = cosine.observe_step
        cosine.observe_step = lambda record: observe(replace(record, step_s=step["s"]))

    def counted(scheduler_output, model_runner_output):
        decoding = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests.get(rid)
            if request is not None and request.num_computed_tokens - n >= request.num_prompt_tokens:
                steps[rid] += 1  # a decode step (not the prefill)
                decoding.append(rid)
        if model is not None:
            # the drafter's forwards after this step: vLLM's drafts its k every step; CoSine's, the
            # plan's depth (the step's engine depth, `vllm_mrv2`); none for lookup on the device
            plan = getattr(scheduler_output, PLAN_ATTR, None)
            depth = {"draft": draft_k, "cosine-draft": plan.inner_depth if plan is not None else k}.get(system, 0)
            step["s"] = model(scheduler_output.total_num_scheduled_tokens, kv_tokens(), depth, len(decoding))
            for rid in decoding:
                modelled[rid] += step["s"] / len(decoding)
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = counted
    tokenizer = llm.get_tokenizer()
    rows = []
    for p in prompts:
        text = tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        before = dict(steps)
        out = llm.generate([text], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        new = {rid: n - before.get(rid, 0) for rid, n in steps.items() if n != before.get(rid, 0)}
        rows.append(
            {
                "id": p["id"],
                "domain": p["domain"],
                "tokens": len(out.outputs[0].token_ids),
                "steps": sum(new.values()),
                "output": list(out.outputs[0].token_ids),
                **({"modelled_s": sum(modelled.pop(rid, 0.0) for rid in new)} if model else {}),
            }
        )
    # what CoSine's adaptive k was priced with: the pass curve it fitted from the step times it
    # measured (under the interpreter, not a GPU's; with `gpu`, modelled there) and the seconds of
    # each deeper drafter forward
    pricing = {}
    if cosine is not None and cosine.chooser.curve is not None:
        pricing = {"pass_curve": [list(p) for p in cosine.chooser.curve.points], "depth_s": cosine.chooser.depth_s()}
    llm.llm_engine.engine_core.shutdown()
    return {"system": system, "rows": rows, "pricing": pricing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", default=[])
    parser.add_argument("--limit", action="append", type=int, default=[])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--k", type=int, default=8, help="CoSine's maxDraftLen (its default: 8)")
    parser.add_argument("--draft-k", type=int, default=4, help="vLLM draft_model's num_speculative_tokens")
    parser.add_argument(
        "--fixed-k",
        action="store_true",
        help="CoSine's k fixed at --k (speculation.adaptive: false): under the interpreter the step times that "
        "price k and the drafter's depth are not a GPU's, so this isolates the choice of draft",
    )
    parser.add_argument(
        "--gpu",
        default="",
        help="price CoSine's adaptive k and the drafter's depth on this GPU of the simulator's profiles "
        "(e.g. l4, a100-80gb): each step's seconds modelled there, not the interpreter's",
    )
    parser.add_argument("--out", type=Path, default=Path("results/mrv2_acceptance.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one system in a process of its own (vLLM holds process-wide state)
        job = json.loads(args.child)
        print(
            "RESULT"
            + json.dumps(
                run_system(
                    job["system"],
                    job["prompts"],
                    job["max_tokens"],
                    job["k"],
                    job["draft_k"],
                    job.get("fixed", False),
                    job.get("gpu", ""),
                )
            )
        )
        return 0
    from cosine.tooling.workloads import load, resolve_workload

    prompts = []
    for i, name in enumerate(args.workload or ["mixed"]):
        limit = args.limit[i] if i < len(args.limit) else None
        chosen, per_domain = [], defaultdict(int)
        for p in load(resolve_workload(name)):
            if limit is None or per_domain[p.domain] < limit:
                per_domain[p.domain] += 1
                chosen.append({"id": p.id, "domain": f"{name}/{p.domain}", "messages": p.messages()})
        prompts += chosen
    results = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for system in args.systems.split(","):
        job = {
            "system": system,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "k": args.k,
            "draft_k": args.draft_k,
            **({"fixed": True} if args.fixed_k else {}),
            **({"gpu": args.gpu} if args.gpu else {}),
        }
        # each system's rows are kept beside --out as it finishes: a rerun with the same job reuses them
        kept = args.out.with_suffix(f".{system}.json")
        if kept.exists() and json.loads(kept.read_text()).get("job") == job:
            results.append(json.loads(kept.read_text())["result"])
            print(f"{system}: kept from {kept}", flush=True)
            continue
        out = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(job)],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
        if out.returncode or not lines:
            sys.stderr.write(f"{system} failed (exit {out.returncode}; -9: killed, e.g. out of memory)\n")
            sys.stderr.write(out.stderr[-3000:])
            return 1
        results.append(json.loads(lines[-1][len("RESULT") :]))
        kept.write_text(json.dumps({"job": job, "result": results[-1]}))
        print(f"{system}: done", flush=True)
    table: dict[str, dict[str, float]] = defaultdict(dict)
    tpot: dict[str, dict[str, float]] = defaultdict(dict)  # with --gpu: modelled ms per output token
    for r in results:
        per: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for row in r["rows"]:
            per[row["domain"]][0] += max(0, row["tokens"] - 1)
            per[row["domain"]][1] += row["steps"]
            per[row["domain"]][2] += row.get("modelled_s", 0.0)
        for domain, (tokens, steps, seconds) in per.items():
            table[domain][r["system"]] = round(tokens / steps, 3) if steps else 0.0
            if seconds and tokens:
                tpot[domain][r["system"]] = round(1000 * seconds / tokens, 2)
    same = all(
        a["output"] == b["output"] for r in results[1:] for a, b in zip(results[0]["rows"], r["rows"], strict=True)
    )
    summary = {"tokens_per_step": table, "outputs_identical": same, "runs": results}
    if args.gpu:
        summary |= {"gpu": args.gpu, "modelled_tpot_ms": tpot}
    args.out.write_text(json.dumps(summary, indent=1))
    systems = [r["system"] for r in results]
    for title, values in (("tokens per step", table), (f"modelled TPOT on {args.gpu}, ms", tpot)):
        if not values:
            continue
        print(f"{title}:\n| domain | " + " | ".join(systems) + " |")
        print("|---|" + "---|" * len(systems))
        for domain, row in sorted(values.items()):
            print(f"| {domain} | " + " | ".join(f"{row.get(s, 0):.2f}" for s in systems) + " |")
    print(f"outputs identical across systems: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
