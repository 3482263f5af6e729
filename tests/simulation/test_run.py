"""`cosine simulate` end to end on a tiny trace: JSON and PNG written."""

import json

from cosine.cli import main


def test_simulate_trace_writes_json_and_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 0.0, "prompt_tokens": 256, "output_tokens": 32, "domain": "code"}\n'
                     '{"t": 0.2, "prompt_tokens": 64, "output_tokens": 16, "domain": "chat"}\n')
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", "--trace", str(trace), "--concurrency", "2", "--out", str(out), "--plot", str(png)]) == 0
    run = json.loads(out.read_text())["run"]
    assert run["requests"] == 2 and run["tokens"] == 48
    assert png.stat().st_size > 0
