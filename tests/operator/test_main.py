"""``cosine-operator``'s command line: kopf's arguments, and a peering priority per replica."""

from __future__ import annotations

from cosine_operator.__main__ import kopf_args, peering_priority


def test_peering_replicas_get_distinct_priorities_from_their_pod_names() -> None:
    # kopf pauses every replica that sees a live peer of equal priority: the chart's two replicas
    # share their arguments, so the priority must come from each pod's own name (POD_ID).
    a = kopf_args(["--peering=cosine-operator", "--all-namespaces"], {"POD_ID": "cosine-operator-5d9f-abcde"})
    b = kopf_args(["--peering=cosine-operator", "--all-namespaces"], {"POD_ID": "cosine-operator-5d9f-fghij"})
    (pa,), (pb,) = ([x for x in args if x.startswith("--priority=")] for args in (a, b))
    assert pa != pb
    assert pa == f"--priority={peering_priority('cosine-operator-5d9f-abcde')}"
    assert 1 <= peering_priority("x") <= 2**28


def test_priority_only_with_peering_a_pod_name_and_none_given() -> None:
    pod = {"POD_ID": "p-1"}
    assert not any(a.startswith("--priority") for a in kopf_args(["--standalone", "-A"], pod))
    assert not any(a.startswith("--priority") for a in kopf_args(["--peering=x", "-A"], {}))
    assert kopf_args(["--peering=x", "--priority=7"], pod).count("--priority=7") == 1
    assert not any(a.startswith("--priority=") for a in kopf_args(["--peering", "x", "--dev"], pod))
    assert kopf_args(["run", "-A"], {})[:3] == ["run", "-m", "cosine_operator.handlers"]
