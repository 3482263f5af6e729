"""Core placement of an embedded cluster's roles (pure)."""

import pytest

from cosine.placement import cpu_list, place


def test_two_cores_split_verifier_and_drafter():
    p = place([0, 1], 1, [1])
    assert p.verifier == (0,) and p.drafters == ((1,),) and not p.shared


def test_drafters_share_the_free_cores_before_the_verifiers():
    p = place([0, 1], 1, [1, 1])  # two pools on a 2-core machine: both on core 1, the verifier alone on 0
    assert p.verifier == (0,) and p.drafters == ((1,), (1,)) and not p.shared


def test_one_core_shares_and_says_so():
    p = place([3], 1, [1])
    assert p.verifier == (3,) and p.drafters == ((3,),) and p.shared


def test_disjoint_when_enough_cores():
    p = place(range(8), 4, [2, 1, 1])
    cores = [set(p.verifier), *map(set, p.drafters)]
    assert p.verifier == (0, 1, 2, 3)
    assert all(a.isdisjoint(b) for i, a in enumerate(cores) for b in cores[i + 1:])
    assert not p.shared


def test_verifier_asking_for_more_than_exists_takes_all():
    p = place([0, 1], 4, [1])
    assert p.verifier == (0, 1) and p.shared


@pytest.mark.parametrize("args", [([], 1, [1]), ([0], 0, [1]), ([0, 1], 1, [0])])
def test_bad_input_raises(args):
    with pytest.raises(ValueError):
        place(*args)


def test_cpu_list():
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2, 5]) == "0-3,5"
