"""The circuit breaker the proposer keeps per pool and a replica pool per replica, with plain numbers."""

import pytest

from cosine.breaker import Breaker


def test_opens_after_failures_in_a_row_and_probes_after_the_retry():
    b = Breaker(down_after=3, retry_s=5.0)
    assert not b.failed(10.0) and not b.failed(11.0) and b.allows(11.0)
    assert b.failed(12.0) and not b.allows(16.9) and b.allows(17.0)  # out for 5 s from the third
    assert b.succeeded()  # it had been failing long enough to be out: it answers again
    assert b.failures == 0 and not b.succeeded()


def test_a_success_resets_the_count_and_a_fatal_failure_opens_at_once():
    b = Breaker(down_after=2, retry_s=1.0)
    b.failed(0.0)
    b.succeeded()
    assert not b.failed(1.0)  # one in a row again, not two
    assert Breaker(down_after=3, retry_s=1.0).failed(0.0, fatal=True)
    with pytest.raises(ValueError):
        Breaker(down_after=0)
