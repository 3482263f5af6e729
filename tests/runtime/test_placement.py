"""Core placement of an embedded cluster's roles (pure)."""

import pytest

from cosine.manifest import load_manifest
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


# ---- auto: pools get cores only where their measured gain beats what the verifier loses

from cosine.placement import Choice, Evidence, choose  # noqa: E402

# figures of the same shape as a 2-core bench: verifier step 0.61 s on both cores, 1.36 s on one
# beside the pool; the pool drafts at 0.14 s/token, accepted at 0.74/token, half its drafts in time
MEASURED = dict(pass_s=0.61, kept_pass_s=1.36, draft_token_s=0.14, pool_alpha=0.74, pool_use=0.5,
                lookup_hit=0.23, lookup_alpha=0.87, lookup_tokens=5, source="bench.json")


def test_unmeasured_pools_stay_off_a_cpu_verifiers_cores():
    c = choose(Evidence(cores=2, pool_cores=1))
    assert c.mode == "lookup" and "not measured" in c.reason and "all 2 cores" in c.reason


def test_a_gpu_verifier_loses_nothing_to_the_pools():
    assert choose(Evidence(cores=2, pool_cores=1, verifier_on_gpu=True)).mode == "split"


def test_two_cores_measured_the_pool_costs_more_than_it_gives():
    c = choose(Evidence(cores=2, pool_cores=1, **MEASURED))
    assert c.mode == "lookup" and c.split_tok_s < c.lookup_tok_s
    assert "bench.json" in c.reason and "tok/s" in c.reason


def test_many_cores_a_fast_accurate_pool_gets_its_own():
    # one core of 16 costs the verifier 1/15 of its step (the compute-bound default); the pool
    # drafts 8 tokens well within a step, accepted at 0.8 each, always in time
    e = Evidence(cores=16, pool_cores=1, pass_s=0.1, draft_token_s=0.005, pool_alpha=0.8, pool_use=1.0,
                 lookup_hit=0.2, lookup_alpha=0.6, lookup_tokens=4)
    c = choose(e)
    assert c.mode == "split" and c.split_tok_s > c.lookup_tok_s
    # the same pool, too slow to draft within a step, adds nothing worth a core
    assert choose(Evidence(**{**e.__dict__, "draft_token_s": 1.0})).mode == "lookup"


def test_split_must_win_by_more_than_the_margin():
    e = Evidence(cores=2, pool_cores=1, pass_s=0.5, kept_pass_s=0.5, draft_token_s=0.01, pool_alpha=0.0,
                 lookup_hit=0.0)
    assert choose(e).mode == "lookup"  # equal goodput: the pools' cores buy nothing


@pytest.mark.parametrize("cores, pool_cores", [(0, 1), (2, -1)])
def test_bad_evidence_raises(cores, pool_cores):
    with pytest.raises(ValueError):
        choose(Evidence(cores=cores, pool_cores=pool_cores))


def test_serve_modes_bind_the_verifier_and_start_pools_as_chosen():
    from cosine.placement import assign, local_pool_cores, plan

    spec = load_manifest(None).spec  # the shipped cluster: verifier 1 thread, one 1-thread pool
    assert local_pool_cores(spec) == 1
    split = assign(spec, "split", [1, 0])
    assert split.verifier == (0,) and split.drafters == ((1,),) and not split.shared
    lookup = assign(spec, "lookup", [0, 1])
    assert lookup.verifier == (0, 1) and lookup.drafters == ()  # no pool started
    overlap = assign(spec, "overlap", [0, 1])
    assert overlap.verifier == (0, 1) and overlap.drafters == ((0,),) and overlap.shared
    with pytest.raises(ValueError, match="placement must be"):
        assign(spec, "auto", [0, 1])  # resolved before serving
    # auto without a bench: the unmeasured pool stays off, and the verifier gets every core
    choice, where = plan("auto", spec, [0, 1])
    assert choice.mode == "lookup" and where == lookup
    assert plan("split", spec, [0, 1]) == (Choice("split", "asked for"), split)


def test_a_cpu_list_reads_back_as_its_cores():
    from cosine.placement import parse_cpu_list

    for cores in ((0,), (0, 1), (0, 2, 3, 7), tuple(range(16))):
        assert parse_cpu_list(cpu_list(cores)) == cores
    for bad in ("", "a", "3-1", "0,,1", "1-"):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_the_embedded_verifier_runs_the_verifier_pods_command(tmp_path):
    """Catches: `cosine serve` starting its verifier with flags `cosine verifier` does not take,
    or without its cores or its pools' address files."""
    from cosine.cli import build_parser
    from cosine.embedded import LocalPools, verifier_pod_command

    manifest = load_manifest(None)
    pools = LocalPools.__new__(LocalPools)  # no replica started: only its address files are asked for
    pools.directory, pools.replicas = tmp_path, {p.name: [] for p in manifest.spec.drafter_pools}
    cmd = verifier_pod_command(manifest, 8123, "0.0.0.0", 9100, (1, 2, 3), pools)
    assert cmd[1:4] == ["-m", "cosine", "verifier"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.http_port, args.host, args.metrics_port, args.cores) == (8123, "0.0.0.0", 9100, (1, 2, 3))
    assert args.drafter == [f"{p.name}=file://{tmp_path / p.name}.addresses" for p in manifest.spec.drafter_pools]
    assert build_parser().parse_args(verifier_pod_command(manifest, 8123, "h", 0, (), None)[3:]).cores == ()
