"""Cyclon peer sampling: bounded views, shuffles, failure detection, rejoin."""

from __future__ import annotations

import random

import pytest

from shoal.p2p.membership import Membership, ShuffleRequest, ShuffleResponse


def _network(n: int, view_size: int = 5, shuffle_length: int = 3) -> dict[str, Membership]:
    """n peers that each know only the next peer on a ring (no one knows everyone)."""
    ids = [f"p{i}" for i in range(n)]
    return {
        p: Membership(
            p,
            view_size,
            shuffle_length,
            timeout=1.0,
            max_failures=1,
            quarantine=50.0,
            seed=i,
            bootstrap_peers=(ids[(i + 1) % n],),
            sampler_keys=keys(i),
        )
        for i, p in enumerate(ids)
    }


def keys(seed: int):
    """A seeded key source for the history samplers, so a test's run repeats (peers draw theirs
    from the OS)."""
    return random.Random(seed).randbytes


def _cycle(net: dict[str, Membership], now: float, dead: set[str] = frozenset()) -> None:
    for pid in sorted(net):
        if pid in dead:
            continue
        m = net[pid]
        m.expire(now)
        req = m.start_shuffle(now)
        if req is None or req.target in dead:
            continue
        resp = net[req.target].on_shuffle_request(req, now)
        m.on_shuffle_response(resp, now)


def test_view_is_bounded_and_never_holds_self():
    m = Membership("me", view_size=3, shuffle_length=2)
    for p in ["a", "b", "me", "c", "d"]:
        m.add(p)
    assert m.peers() == ["a", "b", "c"]


def test_shuffle_targets_the_oldest_and_sends_a_fresh_self_pointer():
    m = Membership("me", view_size=4, shuffle_length=3, seed=1)
    for p, age in [("a", 0), ("b", 5), ("c", 1)]:
        m.add(p, age)
    req = m.start_shuffle(now=0.0)
    assert req.target == "b" and ("me", 0) in req.entries and len(req.entries) == 3
    assert "b" not in m.view  # Cyclon frees the target's slot
    assert all(e.age >= 1 for e in m.view.values())


def test_shuffles_mix_a_ring_into_well_connected_bounded_views():
    net = _network(30)
    for t in range(30):
        _cycle(net, float(t))
    sizes = [len(m.view) for m in net.values()]
    assert max(sizes) <= 5 and min(sizes) >= 3
    # indegree: every peer is known by someone, and knowledge spread well beyond the ring
    known = {p for m in net.values() for p in m.view}
    assert known == set(net)
    ring_only = sum(1 for i, m in enumerate(net.values()) if m.peers() == [f"p{(i + 1) % 30}"])
    assert ring_only == 0


def test_dead_peers_leave_every_view():
    net = _network(20)
    for t in range(10):
        _cycle(net, float(t))
    dead = {"p3", "p7"}
    for t in range(10, 40):
        _cycle(net, float(t), dead)
    for pid, m in net.items():
        if pid not in dead:
            assert not (set(m.view) & dead), (pid, m.peers())


def test_timeouts_make_suspicion_then_removal():
    m = Membership("me", view_size=4, shuffle_length=2, timeout=2.0, max_failures=2, quarantine=10.0)
    m.add("x")
    m.add("y")
    assert m.on_failure("x", now=0.0) is False
    assert "x" in m.suspected() and "x" in m.view
    assert m.sample() == "y"  # healthy peers first
    assert m.on_failure("x", now=1.0) is True
    assert "x" not in m.view
    # stale entries of x that still circulate are ignored while quarantined...
    m._fold((("x", 0),), replaceable=[], now=5.0)
    assert "x" not in m.view
    # ...but a direct message from x proves it alive
    m.heard_from("x", now=6.0)
    assert "x" in m.view


def test_unanswered_shuffle_expires_as_a_failure():
    m = Membership("me", view_size=4, shuffle_length=2, timeout=2.0, max_failures=1)
    m.add("a")
    req = m.start_shuffle(now=0.0)
    assert m.expire(now=1.0) == []
    assert m.expire(now=2.5) == [req.target]


def test_restarted_peer_rejoins_through_bootstrap():
    net = _network(10)
    for t in range(10):
        _cycle(net, float(t))
    fresh = Membership("p4", 5, 3, timeout=1.0, max_failures=1, seed=99, bootstrap_peers=("p0",), sampler_keys=keys(99))
    net["p4"] = fresh
    for pid, m in net.items():
        if pid != "p4":
            m.remove("p4", now=10.0)  # everyone had dropped it
    holders = set()  # Cyclon moves entries every cycle: who held p4 lately, not one snapshot
    for t in range(11, 25):
        _cycle(net, float(t))
        if t >= 20:
            holders |= {p for p, m in net.items() if "p4" in m.view}
    assert len(holders) >= 2, holders
    assert len(fresh.view) >= 3


def test_empty_view_refills_from_bootstrap():
    m = Membership("me", view_size=3, shuffle_length=2, bootstrap_peers=("b1", "b2"))
    m.remove("b1", 0.0)
    m.remove("b2", 0.0)
    assert m.start_shuffle(1.0).target in {"b1", "b2"}


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        Membership("me", view_size=2, shuffle_length=3)


def test_free_slots_are_topped_up_from_bootstrap_once_quarantine_ends():
    m = Membership("me", view_size=4, shuffle_length=2, max_failures=1, quarantine=10.0, bootstrap_peers=("b1", "b2"))
    m.add("x")
    m.on_failure("b2", now=0.0)
    m.rejoin(now=5.0)
    assert "b2" not in m.view  # still quarantined: a dead bootstrap peer is not re-added at once
    m.rejoin(now=11.0)
    assert "b2" in m.view


def test_two_cliques_with_full_views_rejoin_through_a_lost_bootstrap_peer():
    """Ten peers on a bootstrap ring whose startup timeouts left two closed cliques of five (view
    size 4: every view full of its own clique, each side having removed the other). Shuffles
    alone never bridge that; a bootstrap peer missing from the directory once its quarantine
    ends takes the oldest view slot, so the ring's two cross links join the halves again."""
    ids = [f"p{i}" for i in range(10)]
    ring = {p: ids[(i + 1) % 10] for i, p in enumerate(ids)}
    net = {
        p: Membership(
            p, 4, 2, timeout=1.0, max_failures=2, quarantine=30.0, seed=i, bootstrap_peers=(ring[p],), period=0.5
        )
        for i, p in enumerate(ids)
    }
    cliques = [ids[:5], ids[5:]]
    for clique in cliques:
        for p in clique:
            m = net[p]
            m.view.clear()
            m.known.clear()
            for q in clique:
                m.add(q)
            for q in ids:
                if q not in clique:
                    m.remove(q, now=0.0)
    for t in range(20):  # inside the quarantine: still two cliques
        _cycle(net, t * 0.5)
    assert all(set(net[p].directory()) <= set(c) for c in cliques for p in c)
    for t in range(20, 140):
        _cycle(net, t * 0.5)
    for p, m in net.items():
        assert len(m.directory()) >= 7, (p, m.directory())
        assert len(m.view) <= 4


def test_a_dead_bootstrap_peer_is_retried_once_per_quarantine_not_every_shuffle():
    m = Membership("me", 3, 2, timeout=1.0, max_failures=1, quarantine=10.0, bootstrap_peers=("boot",))
    for p in ("a", "b", "c"):
        m.add(p)
    m.remove("boot", now=0.0)
    contacts = 0
    for t in range(60):
        req = m.start_shuffle(float(t))
        if req.target == "boot":
            contacts += 1
            m.expire(float(t) + 2.0)  # never answers: removed and quarantined again
        else:
            m.on_shuffle_response(ShuffleResponse(req.target, "me", ()), float(t))
        m.expire(float(t))
    assert 3 <= contacts <= 6  # about once per 10 s quarantine (plus the timeout), not 60 times


def fake_share(peers: list[str | None]) -> float:
    return sum(p is not None and p.startswith("sybil") for p in peers) / max(len(peers), 1)


def test_an_insider_advertising_sybils_cannot_stop_merges_or_fill_the_directory_for_good():
    """One insider sends a peer 4 messages a second for 60 s (two shuffles naming made-up
    addresses out of 50, two pushes from made-up senders), on a virtual clock. The peer's
    exchanges (one a second) reach a peer that answers at least every 5 s throughout; the
    directory never holds more than its bound and holds no made-up entry 30 s after the attack.
    Made-up entries hold under half of the peer's view on average during the attack (before
    the history samplers and Brahms's view mix: up to the whole view, 0.16 to 0.83 on average
    over ten seeds), its samplers hold no more than the made-up share of the distinct IDs
    (50 of 55) during the attack and none 30 s after it (failed probes reset them out)."""
    honest = [f"h{i}" for i in range(4)]
    sybils = [f"sybil{k}" for k in range(50)]
    net = {
        p: Membership(
            p,
            4,
            2,
            timeout=1.0,
            max_failures=1,
            seed=i,
            bootstrap_peers=tuple(q for q in honest if q != p),
            sampler_keys=keys(i),
        )
        for i, p in enumerate(honest)
    }
    me = Membership(
        "me", 4, 2, timeout=1.0, max_failures=1, seed=9, bootstrap_peers=("h0",), max_known=40, sampler_keys=keys(9)
    )
    me.forget_after = 20.0
    alive = set(honest) | {"me"}
    net["me"] = me
    last_merge, worst_gap, most_fake, fake_at_90 = 0.0, 0.0, 0, -1
    view_shares, sampler_shares = [], []
    for step in range(100 * 4):
        now = step / 4
        if now < 60:  # the insider, 4 messages a second
            if step % 2 == 0:
                entries = tuple((sybils[(step * 3 + k) % 50], 0) for k in range(4))
                me.on_shuffle_request(ShuffleRequest("evil", "me", entries), now)
            else:
                me.heard_from(sybils[step % 50], now)
        if step % 4:
            continue
        for pid in sorted(net):  # once a second: every peer shuffles, "me" also exchanges
            m = net[pid]
            m.expire(now)
            req = m.start_shuffle(now)
            if req is not None:
                if req.target in alive:
                    m.on_shuffle_response(net[req.target].on_shuffle_request(req, now), now)
                else:
                    m.cancel(req.target)
                    m.on_failure(req.target, now)
        partner = me.sample()
        if partner in alive:
            me.on_success(partner, now)
            last_merge = now
        elif partner is not None:
            me.on_failure(partner, now)
        worst_gap = max(worst_gap, now - last_merge)
        most_fake = max(most_fake, sum(p.startswith("sybil") for p in me.known))
        if now < 60:
            view_shares.append(fake_share(list(me.view)))
            sampler_shares.append(fake_share(me.history.held()))
        if now == 90:
            fake_at_90 = sum(p.startswith("sybil") for p in me.known)
            assert fake_share(me.history.held()) == 0  # every made-up ID probed and reset out
    assert worst_gap <= 5.0, worst_gap
    assert fake_at_90 == 0  # 30 s after the attack
    assert len(me.known) <= 40 and most_fake <= 40
    assert not [p for p in me.known if p.startswith("sybil")]  # 40 s after the attack: all forgotten
    assert me.floods > 0  # the insider's shuffles beyond the rate changed nothing
    assert sum(view_shares) / len(view_shares) < 0.5, sum(view_shares) / len(view_shares)
    assert sum(sampler_shares) / len(sampler_shares) <= 50 / 55, sum(sampler_shares) / len(sampler_shares)
    assert me.history.resets > 0
