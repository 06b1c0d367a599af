import math

import pytest

from shoal.config import HeterogeneityConfig
from shoal.simulations.virtual_clock import ClientTiming, EventQueue

IDS = [f"c{i}" for i in range(200)]


def test_events_pop_in_time_order_ties_in_schedule_order():
    q = EventQueue()
    q.schedule(5.0, "b")
    q.schedule(1.0, "a")
    q.schedule(5.0, "c")
    assert [(q.pop().kind, q.now) for _ in range(3)] == [("a", 1.0), ("b", 5.0), ("c", 5.0)]
    with pytest.raises(ValueError, match="before now"):
        q.schedule(4.0, "past")


def test_compute_time_is_steps_over_speed_and_sigma_zero_means_equal_speeds():
    t = ClientTiming(HeterogeneityConfig(step_time_s=0.5), IDS, seed=0)
    assert all(s == 1.0 for s in t.speed.values())
    assert t.compute_s("c3", 60) == 30.0
    assert t.network_s("c3") == 0.0 and t.available("c3", 1e9) and t.online_until("c3", 0.0) == math.inf


def test_lognormal_speeds_are_heavy_tailed_and_seeded():
    a = ClientTiming(HeterogeneityConfig(speed_sigma=1.0), IDS, seed=1)
    b = ClientTiming(HeterogeneityConfig(speed_sigma=1.0), IDS, seed=1)
    c = ClientTiming(HeterogeneityConfig(speed_sigma=1.0), IDS, seed=2)
    assert a.speed == b.speed and a.speed != c.speed
    s = sorted(a.speed.values())
    assert s[-1] / s[0] > 20  # sigma = 1 over 200 clients spans well over an order of magnitude
    assert a.compute_s(IDS[0], 10) == pytest.approx(10 * 0.05 / a.speed[IDS[0]])


def test_availability_alternates_with_the_configured_duty_cycle():
    cfg = HeterogeneityConfig(mean_on_s=30.0, mean_off_s=10.0)
    t = ClientTiming(cfg, IDS, seed=0)
    on = sum(t.available(c, 500.0) for c in IDS) / len(IDS)
    assert 0.6 < on < 0.9  # expected 0.75
    c = IDS[0]
    now = 500.0
    if t.available(c, now):
        end = t.online_until(c, now)
        assert end > now and not t.available(c, end)
    else:
        back = t.next_online([c], now)
        assert back > now and t.available(c, back)


def test_idle_clients_view_is_the_list_without_the_busy_ones():
    """The async engine's view of idle clients equals the list it replaces, for any busy set."""
    import random

    from shoal.simulations.async_engine import IdleClients

    gen = random.Random(0)
    for _ in range(300):
        n = gen.randint(1, 40)
        ids = [f"c{i}" for i in range(n)]
        busy = sorted(gen.sample(range(n), gen.randint(0, n)))
        view, want = IdleClients(ids, busy), [c for i, c in enumerate(ids) if i not in busy]
        assert len(view) == len(want) and list(view) == want and view[:] == want
        if want:
            assert view[-1] == want[-1]
        with pytest.raises(IndexError):
            view[len(want)]


def test_network_delays_are_drawn_per_client_whatever_the_order_of_first_use():
    cfg = HeterogeneityConfig(network_delay_s=2.0)
    a, b = ClientTiming(cfg, IDS, seed=3), ClientTiming(cfg, IDS, seed=3)
    first = [a.network_s(c) for c in IDS[:20]]
    second = [b.network_s(c) for c in reversed(IDS[:20])][::-1]  # generators made in the other order
    assert first == second and len(set(first)) == 20
