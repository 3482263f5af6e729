"""Tooling beside the serving path: what measures and shows CoSine, never what serves it.

`vllm_bench` (`cosine bench`: CoSine against vLLM's own speculative methods, as servers),
`demo` (`cosine demo`, what `make run` runs), `draft_cost` (a drafter engine's cost per draft
token), `workloads` (the benchmark prompts). The serving path (`roles` -> `vllm_hooks` ->
`proposer` -> the policies) imports nothing from here (.importlinter).
"""
