"""A thousand hostile requests per gossip.algorithm against live peers over HTTPS on 127.0.0.1
(tests/p2p/fuzz.py says what is drawn and checked; bench/fuzz_peer.py runs ten thousand)."""

from __future__ import annotations

import asyncio

import pytest

from .fuzz import ALGORITHMS, fuzz_algorithm

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_thousand_hostile_requests_leave_the_peer_up_bounded_and_merging(algorithm, tmp_path):
    res = asyncio.run(fuzz_algorithm(algorithm, 1000, tmp_path, seed=1, slow=20))
    row = res.row()
    assert res.requests == 1000 and res.invalid_sent > 700, row
    assert res.answers_5xx == 0 and res.invalid_accepted == 0 and res.not_json == 0, row
    assert res.model_finite and res.within_max_abs, row
    assert res.steps_after > res.steps_before and res.merges_after > res.merges_before, row
    assert res.peer_errors == 0 and res.peers_up, row
    assert res.slow_closed == res.slow_opened == 20, row  # partial headers: closed at the header deadline
    assert res.expect_unauthorized, row  # 401 before any 100 Continue
