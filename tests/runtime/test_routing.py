"""Routing policy, tested with synthetic acceptance streams (plain numbers, seeded draws)."""

import random
from dataclasses import replace

from cosine.routing import (
    DrafterProfile,
    Outcome,
    RouterState,
    RoutingSettings,
    classify_prompt,
    expected_acceptance,
    observe,
    observe_all,
    optimistic_acceptance,
    route,
)

A, B = DrafterProfile("coder", ("code", "math")), DrafterProfile("chatty", ("chat",))
S = RoutingSettings()


def simulate(truth, steps, rng, state=None, domain="code"):
    """truth: drafter -> per-token acceptance probability. Returns (state, choices)."""
    state = state or RouterState()
    choices = []
    for _ in range(steps):
        name = route(domain, [A, B], state, S, rng.betavariate)[0]
        choices.append(name)
        k, n = 4, 0
        while n < k and rng.random() < truth[name]:
            n += 1
        state = observe(state, name, domain, k, n, 0.6, S)
    return state, choices


def test_expertise_is_the_prior():
    assert expected_acceptance(RouterState(), A, "code", S) > expected_acceptance(RouterState(), B, "code", S)
    assert expected_acceptance(RouterState(), B, "chat", S) > expected_acceptance(RouterState(), A, "chat", S)


def test_converges_to_the_best_drafter_per_domain():
    rng = random.Random(0)
    _, choices = simulate({"coder": 0.85, "chatty": 0.3}, 200, rng, domain="code")
    assert choices[-50:].count("coder") >= 45
    # against the declared expertise: on chat the coder turns out better, and the router learns it
    _, choices = simulate({"coder": 0.8, "chatty": 0.2}, 300, rng, domain="chat")
    assert choices[-50:].count("coder") >= 40


def test_recovers_after_a_drafter_degrades():
    rng = random.Random(1)
    state, _ = simulate({"coder": 0.9, "chatty": 0.5}, 200, rng)
    state, choices = simulate({"coder": 0.05, "chatty": 0.5}, 300, rng, state)  # coder's quality drops
    assert choices[-50:].count("chatty") >= 40


def test_optimistic_acceptance_is_an_upper_bound_that_tightens_with_evidence():
    prior_mean = expected_acceptance(RouterState(), A, "chat", S)
    assert optimistic_acceptance(RouterState(), A, "chat", S) > prior_mean + 0.3  # no evidence: wide
    assert optimistic_acceptance(RouterState(), A, "chat", replace(S, optimism_sd=0.0)) == prior_mean
    rng = random.Random(3)
    for truth in (0.2, 0.9):
        state = RouterState()
        for _ in range(100):
            n = 0
            while n < 4 and rng.random() < truth:
                n += 1
            state = observe(state, "coder", "chat", 4, n, 0.6, S)
        mean, upper = expected_acceptance(state, A, "chat", S), optimistic_acceptance(state, A, "chat", S)
        assert mean < upper < mean + 0.15  # tight: the optimism is spent
        assert abs(mean - truth) < 0.15


def test_skips_unavailable_drafters():
    assert route("code", [A, B], RouterState(), S, random.Random(0).betavariate, lambda n: n != "coder") == ["chatty"]
    assert route("code", [A, B], RouterState(), S, random.Random(0).betavariate, lambda n: False) == []


def test_classify_prompt():
    assert classify_prompt("Write a Python function that reverses a string.") == "code"
    assert classify_prompt("```python\ndef f(x):\n    return x\n```\nRename f to g.") == "edit"
    assert classify_prompt("Janet has 3 apples and buys 5 more. How many apples does she have?") == "math"
    assert classify_prompt("What are good tips for a job interview?") == "chat"


def test_observe_all_is_observe_in_turn():
    """One step's outcomes folded in together give the state that observing each in turn gives."""
    rng = random.Random(5)
    state = RouterState()
    for _ in range(30):
        outcomes = [Outcome(rng.choice("ab"), rng.choice(("code", "chat")), rng.randrange(0, 5), 0,
                            rng.random()) for _ in range(rng.randrange(0, 6))]
        outcomes = [o._replace(num_accepted=rng.randrange(0, o.num_draft_tokens + 1)) for o in outcomes]
        one_by_one = state
        for o in outcomes:
            one_by_one = observe(one_by_one, *o, S)
        state = observe_all(state, outcomes, S)
        assert state == one_by_one
