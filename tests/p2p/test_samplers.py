"""Min-wise independent samplers (Brahms's history sample): repetition buys no samplers, failed
IDs are reset out, and the peer sampling's probes find made-up ones."""

from __future__ import annotations

import math
import random

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.p2p.membership import Membership, ShuffleRequest, ShuffleResponse
from shoal.p2p.samplers import Samplers


def keys(seed: int):
    """Seeded sampler keys so the test repeats (a peer draws its keys from the OS)."""
    return random.Random(seed).randbytes


def binomial_bound(n: int, p: float, tail: float = 1e-6) -> int:
    """The least k with P(Binomial(n, p) > k) <= tail."""
    above = 1.0
    for k in range(n + 1):
        above -= math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if above <= tail:
            return k
    return n


def test_an_attacker_repeating_its_ids_holds_only_its_share_of_distinct_ids():
    """3 attacker IDs pushed 10,000 times among 20 honest IDs each learned once: every sampler
    holds an attacker ID with probability 3/23 whatever the repetition, so 64 samplers hold at
    most the binomial bound (1e-6 tail); pushed IDs, counted by message, would be 99.8% of the
    stream. Every push falls in its own period (under the push rate), so all 10,000 fold in."""
    honest = [f"h{i:02d}" for i in range(20)]
    evil = ("e0", "e1", "e2")
    m = Membership("me", 8, 4, samplers=64, sampler_keys=keys(7))
    for i, h in enumerate(honest):
        m.learn(h, float(i))
    for k in range(10_000):
        now = 20.0 + k * m.period
        m.on_shuffle_request(ShuffleRequest(evil[k % 3], "me", tuple((e, 0) for e in evil)), now)
    assert m.floods == 0
    held = m.history.held()
    fake = sum(p in evil for p in held)
    bound = binomial_bound(64, 3 / 23)
    assert fake <= bound, (fake, bound)
    assert len({p for p in held if p not in evil}) >= 10  # the honest ones spread over the samplers
    assert sum(e.origin == "push" for e in m.view.values()) <= m.caps["push"]  # Brahms's alpha share


def test_samplers_ignore_repeats_and_keys_come_from_the_os():
    s = Samplers(8)  # production: os.urandom keys, distinct per sampler and per peer
    assert len({x.key for x in s.samplers} | {x.key for x in Samplers(8).samplers}) == 16
    s.feed_all(["a", "b", "c"])
    before = s.held()
    for _ in range(1000):
        s.feed("c")
    assert s.held() == before
    assert set(s.sample()) <= {"a", "b", "c"}
    with pytest.raises(ValueError):
        Samplers(0)


def test_a_dead_id_is_reset_out_of_its_samplers_after_failed_contacts():
    m = Membership("me", 4, 2, max_failures=2, samplers=32, sampler_keys=keys(3))
    for p in ("a", "b", "c", "dead"):
        m.learn(p, 0.0)
    held = sum(p == "dead" for p in m.history.held())
    assert held > 0
    assert m.on_failure("dead", 1.0) is False
    assert "dead" not in m.history_sample()  # suspected: not offered while its contacts fail
    assert m.on_failure("dead", 2.0) is True
    assert "dead" not in m.history.held() and m.history.resets == held
    # a stale entry of it that still circulates is quarantined: it wins no sampler back
    m.on_shuffle_request(ShuffleRequest("a", "me", (("dead", 0), ("b", 0))), 3.0)
    assert "dead" not in m.history.held()
    assert None not in m.history.held()  # the reset samplers refilled from the stream
    assert set(m.history.sample()) <= {"a", "b", "c"}


def test_shuffles_probe_unproven_history_ids_and_made_up_ones_leave():
    """A made-up ID known only to the samplers (never in the view) is contacted by a shuffle
    within a few, fails, and is reset out; live ones answer and stay."""
    m = Membership("me", 4, 2, timeout=1.0, max_failures=1, samplers=16, sampler_keys=keys(5))
    for p in ("a", "b", "c"):
        m.add(p)
    for k in range(6):
        m.learn(f"fake{k}", 0.0)
    assert any(p.startswith("fake") for p in m.history.held())
    probed = set()
    for t in range(1, 40):
        req = m.start_shuffle(float(t))
        if req.target.startswith("fake"):
            probed.add(req.target)
            m.expire(float(t) + 1.0)  # no answer
        else:
            m.on_shuffle_response(ShuffleResponse(req.target, "me", ()), float(t))
    assert probed
    assert not [p for p in m.history.held() if p is None or p.startswith("fake")], m.history.held()
    assert set(m.history.sample()) <= {"a", "b", "c"}


@pytest.mark.parametrize(
    "override", ["gossip.samplers=0", "gossip.pull_share=-0.1", "gossip.push_share=0.6", "gossip.push_share=1.0"]
)
def test_sampler_settings_out_of_range_are_refused(override):
    """No samplers, a negative share, or push and pull shares leaving no slot for the history sample."""
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])
