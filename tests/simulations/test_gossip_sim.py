"""The gossip simulation mode: virtual network, churn, loss, partitions, D-PSGD, metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.experiment import run_simulation
from shoal.simulations.gossip import GossipSimulation, LocalPeers

# Small tensors: one thread avoids oversubscribing a shared CPU (it made these tests 40x slower).
torch.set_num_threads(1)


def cfg(*extra):
    return load_config(
        None,
        [
            'simulation.mode="gossip"',
            "simulation.num_clients=12",
            "simulation.seed=1",
            "train.batch_size=20",
            "gossip.view_size=4",
            "gossip.shuffle_length=2",
            *extra,
        ],
    )


def _run(sim: GossipSimulation, rounds: int) -> GossipSimulation:
    for _ in range(rounds):
        sim.run_round()
    return sim


def test_same_seed_same_models_other_seed_other_models():
    a = _run(GossipSimulation.from_config(cfg("gossip.loss=0.1", "gossip.churn=0.2")), 3).models
    b = _run(GossipSimulation.from_config(cfg("gossip.loss=0.1", "gossip.churn=0.2")), 3).models
    c = _run(GossipSimulation.from_config(cfg("gossip.loss=0.1", "gossip.churn=0.2", "simulation.seed=2")), 3).models
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_exchanges_bring_models_together():
    """Training alone drives peers apart; exchanges pull them back (consensus distance)."""
    alone = _run(GossipSimulation.from_config(cfg("gossip.loss=1.0")), 4).evaluate()
    gossip = _run(GossipSimulation.from_config(cfg()), 4).evaluate()
    assert gossip["consensus_distance"] < 0.8 * alone["consensus_distance"]
    assert alone["messages_lost"] > 0 and gossip["messages_lost"] == 0
    assert gossip["bytes_sent_per_peer"] > 4 * 2 * 0.9 * GossipSimulation.from_config(cfg()).model_bytes / 2


def test_churn_takes_peers_offline_and_partitions_drop_messages():
    sim = _run(GossipSimulation.from_config(cfg("gossip.churn=0.3", "gossip.churn_period=2")), 4)
    ev = sim.evaluate()
    assert 0 < ev["online_peers"] < 12
    part = _run(GossipSimulation.from_config(cfg("gossip.partition_start=0", "gossip.partition_end=10")), 2)
    assert part.lost > 0  # no loss configured: every lost message tried to cross the cut
    whole = _run(GossipSimulation.from_config(cfg()), 2)
    assert whole.lost == 0


def test_dpsgd_on_a_ring_keeps_offline_models_and_mixes_the_rest():
    sim = GossipSimulation.from_config(cfg('gossip.algorithm="dpsgd"', 'gossip.topology="ring"'))
    _run(sim, 3)
    ev = sim.evaluate()
    assert ev["consensus_distance"] > 0 and ev["bytes_sent_per_peer"] == 3 * 2 * sim.model_bytes


def test_run_writes_the_gossip_metrics(tmp_path):
    summary = run_simulation(
        cfg(
            "simulation.rounds=6",
            "simulation.eval_every=3",
            "gossip.loss=0.1",
            "gossip.churn=0.3",
            "gossip.churn_period=3",
            "output.plots=false",
        ),
        tmp_path,
        progress=False,
    )
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in recs] == [3, 6]
    for key in (
        "peer_accuracy_mean",
        "peer_accuracy_min",
        "peer_accuracy_max",
        "average_model_accuracy",
        "consensus_distance",
        "bytes_sent_per_peer",
    ):
        assert np.isfinite(recs[-1][key])
    assert recs[-1]["peer_accuracy_min"] <= recs[-1]["peer_accuracy_mean"] <= recs[-1]["peer_accuracy_max"]
    assert summary["final_test_accuracy"] == recs[-1]["test_accuracy"]


def test_gossip_config_is_checked():
    with pytest.raises(ConfigError, match="gossip.shuffle_length"):
        cfg("gossip.shuffle_length=9")
    with pytest.raises(ConfigError, match="gossip.merge"):
        cfg('gossip.merge="median"')
    with pytest.raises(ConfigError, match="gossip.churn"):
        cfg("gossip.churn=1.0")


def _attack(*extra):
    return cfg(
        "simulation.num_clients=20",
        "gossip.exchanges_per_round=2",
        'attack.kind="sign_flip"',
        "attack.fraction=0.2",
        *extra,
    )


def test_sign_flip_peers_wreck_plain_merges_and_rejecting_merges_hold():
    clean = _run(
        GossipSimulation.from_config(cfg("simulation.num_clients=20", "gossip.exchanges_per_round=2")), 8
    ).evaluate()
    plain = _run(GossipSimulation.from_config(_attack("gossip.merge_bound=0", "gossip.max_abs=0")), 8).evaluate()
    default = _run(GossipSimulation.from_config(_attack()), 8).evaluate()  # the default merge bound
    robust = _run(
        GossipSimulation.from_config(_attack("robust.norm_bound=1.0", 'gossip.bound_mode="reject"')), 8
    ).evaluate()
    assert plain["attackers"] == robust["attackers"] == 4
    assert plain["consensus_distance"] > 10 * clean["consensus_distance"]  # forged models poisoned the honest ones
    assert robust["bounded_merges"] > 0
    assert robust["consensus_distance"] < 2 * clean["consensus_distance"]
    assert robust["peer_accuracy_mean"] > plain["peer_accuracy_mean"] + 0.1
    assert default["bounded_merges"] > 0
    assert default["consensus_distance"] < plain["consensus_distance"] / 2


def test_nan_peers_are_rejected_by_validation_and_counted():
    sim = _run(GossipSimulation.from_config(cfg('attack.kind="nan"', "attack.fraction=0.25")), 3)
    ev = sim.evaluate()
    assert ev["attackers"] == 3 and ev["rejected_messages"] > 0
    assert bool(torch.isfinite(sim.models[torch.as_tensor(sim.honest)]).all())


def test_q8_models_cost_a_third_of_the_bytes():
    dense = _run(GossipSimulation.from_config(cfg()), 3).evaluate()
    q8 = _run(GossipSimulation.from_config(cfg('compression.encoding="q8"')), 3).evaluate()
    assert q8["bytes_sent_per_peer"] < 0.4 * dense["bytes_sent_per_peer"]
    assert abs(q8["peer_accuracy_mean"] - dense["peer_accuracy_mean"]) < 0.05


def test_dpsgd_mixes_several_times_and_through_a_robust_rule():
    one = _run(GossipSimulation.from_config(cfg('gossip.algorithm="dpsgd"', 'gossip.topology="regular"')), 3).evaluate()
    many = _run(
        GossipSimulation.from_config(
            cfg('gossip.algorithm="dpsgd"', 'gossip.topology="regular"', "gossip.exchanges_per_round=5")
        ),
        3,
    ).evaluate()
    assert many["consensus_distance"] < 0.5 * one["consensus_distance"]
    assert many["bytes_sent_per_peer"] == pytest.approx(5 * one["bytes_sent_per_peer"])
    atk = ('gossip.algorithm="dpsgd"', 'gossip.topology="regular"', 'attack.kind="sign_flip"', "attack.fraction=0.25")
    plain = _run(GossipSimulation.from_config(cfg(*atk, "gossip.merge_bound=0", "gossip.max_abs=0")), 3).evaluate()
    default = _run(GossipSimulation.from_config(cfg(*atk)), 3).evaluate()  # the merge bound on each neighbour's model
    robust = _run(GossipSimulation.from_config(cfg(*atk, "robust.norm_bound=0.5")), 3).evaluate()
    assert robust["bounded_merges"] > 0
    assert robust["consensus_distance"] < 0.2 * plain["consensus_distance"]
    assert default["bounded_merges"] > 0
    assert default["consensus_distance"] < 0.5 * plain["consensus_distance"]


@pytest.mark.parametrize("kind", ["scale", "gaussian", "label_flip"])
def test_other_attacks_run_and_only_honest_peers_are_measured(kind):
    clean = GossipSimulation.from_config(cfg())
    sim = GossipSimulation.from_config(cfg(f'attack.kind="{kind}"', "attack.fraction=0.25"))
    atk = np.flatnonzero(sim.attackers)
    assert len(atk) == 3 and not set(sim.eval_idx) & set(atk)
    if kind == "label_flip":  # a data attack: the attackers' labels are flipped, the wire is plain
        i = int(atk[0])
        assert torch.equal(sim.shards.get(i)[1], sim.num_classes - 1 - clean.shards.get(i)[1])
        assert not sim.wire
    else:  # forged models: every model message goes through the wire
        assert sim.wire
    ev = _run(sim, 2).evaluate()
    assert ev["attackers"] == 3 and np.isfinite(ev["consensus_distance"])


class _RecordingPeers(LocalPeers):
    """Trains here and keeps each peer's model as it was right after local training (before
    averaging), and which peers were online and leaving when the round's training began."""

    def __init__(self, net):
        super().__init__(net)
        self.trained = {}

    def train(self, indices, models, round):
        self.started_online, self.vanishing = self.net.online.copy(), self.net.leaving.copy()
        for i, row in super().train(indices, models, round):
            self.trained[i] = row.clone()
            yield i, row


# the exact-average checks turn the merge bound off: with it on, a member's part farther than the
# radius is clipped (self-centered clipping in the reducer, p2p/group_average.py), so an average
# is exact among members within the radius only
EXACT = ("gossip.merge_bound=0", "gossip.max_drift=0")


def _recording(config) -> GossipSimulation:
    return GossipSimulation.from_config(config, peers=_RecordingPeers)


class _EagerPeers(LocalPeers):
    """Trains a call's whole list before handing back any row, as a pool of remote workers
    would, and keeps each call's peers."""

    def __init__(self, net):
        super().__init__(net)
        self.calls = []

    def train(self, indices, models, round):
        self.calls.append(list(indices))
        yield from list(super().train(indices, models, round))


@pytest.mark.parametrize("algorithm", ["dpsgd", "group_average", "secure_groups", "gossip"])
def test_a_pool_that_trains_the_whole_list_at_once_gives_the_same_models(algorithm):
    conf = cfg(f'gossip.algorithm="{algorithm}"', "gossip.churn=0.3", "gossip.churn_period=2")
    here = _run(GossipSimulation.from_config(conf), 2)
    eager = GossipSimulation.from_config(conf, peers=_EagerPeers)
    online = []
    for _ in range(2):
        eager.run_round()
        online.append(sorted(int(i) for i in np.flatnonzero(eager.online | eager.leaving)))
    assert torch.equal(eager.models, here.models)
    if algorithm == "gossip":  # each peer trains at its own wake time
        assert all(len(c) == 1 for c in eager.peers.calls) and len(eager.peers.calls) > 2
    else:  # every peer online at the round's start, in one call per round
        assert eager.peers.calls == online


def test_secure_groups_give_each_member_its_group_weighted_average():
    sim = _recording(cfg('gossip.algorithm="secure_groups"', "gossip.group_size=4", "secure_aggregation.bits=20"))
    sim.run_round()
    groups = sim.algorithm.last_groups
    assert sorted(i for g in groups for i in g) == list(range(sim.n)) and min(map(len, groups)) >= 2
    quantum = 2 * sim.cfg.secure_aggregation.clip / 2**20
    for members in groups:
        w = torch.tensor([float(sim.shards.size(i)) for i in members])
        offsets = torch.stack([(sim.peers.trained[i] - sim.init).clamp(-1, 1) for i in members])
        expected = sim.init + (w[:, None] * offsets).sum(0) / w.sum()
        for i in members:  # every member holds the same group average, and nothing else
            assert torch.allclose(sim.models[i], expected, atol=len(members) * quantum * 4, rtol=0)


def test_secure_groups_below_threshold_keep_their_models():
    sim = _recording(cfg('gossip.algorithm="secure_groups"', "secure_aggregation.dropout_share=1.0"))
    sim.run_round()
    assert sim.evaluate()["aborted_groups"] == len(sim.algorithm.last_groups)
    for i in range(sim.n):
        assert torch.equal(sim.models[i], sim.peers.trained[i])


def test_group_average_gives_each_group_its_weighted_average_and_counts_the_bytes():
    sim = _recording(cfg('gossip.algorithm="group_average"', "gossip.group_size=4", "gossip.group_levels=1", *EXACT))
    sim.run_round()
    groups = sim.algorithm.last_groups
    assert sorted(i for g in groups for i in g) == list(range(sim.n))
    assert sorted(map(len, groups)) == [3] * 4  # 12 peers on a 4 x 3 grid, round 0 groups along axis 0
    for members in groups:
        w = torch.tensor([float(sim.shards.size(i)) for i in members], dtype=torch.float64)
        want = (w[:, None] * torch.stack([sim.peers.trained[i].double() for i in members])).sum(0) / w.sum()
        for i in members:
            assert torch.allclose(sim.models[i].double(), want, atol=1e-6)
    ev = sim.evaluate()
    assert ev["group_groups"] == 4 and ev["group_incomplete"] == 0
    # each member sends 2 (k - 1) slices of about 1/k of the model each, plus their headers
    assert 2 * 2 / 3 * sim.spec.nbytes < ev["bytes_sent_per_peer"] < 2 * 2 / 3 * sim.spec.nbytes + 4 * 600
    assert ev["bytes_sent_per_peer_per_round"] == ev["bytes_sent_per_peer"]
    sim.run_round()  # the next round groups along the other axis: every group meets every earlier one
    assert {len(g) for g in sim.algorithm.last_groups} == {4}


def test_group_average_equal_weights_and_determinism():
    sim = _recording(
        cfg('gossip.algorithm="group_average"', 'gossip.group_weights="equal"', "gossip.group_levels=1", *EXACT)
    )
    sim.run_round()
    for members in sim.algorithm.last_groups:
        want = torch.stack([sim.peers.trained[i] for i in members]).mean(0)
        assert all(torch.allclose(sim.models[i], want, atol=1e-6) for i in members)
    churn = ('gossip.algorithm="group_average"', "gossip.churn=0.3", "gossip.churn_period=2", "gossip.loss=0.05")
    a = _run(GossipSimulation.from_config(cfg(*churn)), 4).models
    b = _run(GossipSimulation.from_config(cfg(*churn)), 4).models
    assert torch.equal(a, b)


def test_group_average_with_churn_survivors_of_a_group_agree_and_vanished_peers_keep_their_models():
    sim = _recording(
        cfg(
            'gossip.algorithm="group_average"',
            "simulation.num_clients=30",
            "gossip.churn=0.3",
            "gossip.churn_period=2",
            *EXACT,
        )
    )
    seen_vanish = seen_offline = 0
    for _ in range(6):
        sim.run_round()
        for members in sim.algorithm.last_groups:
            survivors = [i for i in members if sim.peers.started_online[i] and not sim.peers.vanishing[i]]
            seen_offline += sum(not sim.peers.started_online[i] for i in members)
            for i in members:
                if sim.peers.vanishing[i]:
                    seen_vanish += 1
            # every survivor of a group ends with the same model (no loss: what arrived is the same for all)
            for i in survivors[1:]:
                assert torch.equal(sim.models[i], sim.models[survivors[0]])
    ev = sim.evaluate()
    assert seen_vanish > 0 and seen_offline > 0 and ev["group_vanished"] == seen_vanish
    assert ev["group_incomplete"] > 0


def test_group_average_settings_are_checked():
    with pytest.raises(ConfigError, match="gossip.group_weights"):
        cfg('gossip.algorithm="group_average"', 'gossip.group_weights="age"')
    with pytest.raises(ConfigError, match="group_average"):
        cfg('gossip.algorithm="group_average"', 'robust.rule="median"')
    with pytest.raises(ConfigError, match="group_average"):
        cfg('gossip.algorithm="group_average"', 'compression.encoding="q8"')
    cfg('gossip.algorithm="group_average"', 'attack.kind="sign_flip"', "attack.fraction=0.2")  # simulated now


def test_group_average_d_exchanges_per_round_on_a_full_grid_give_the_global_weighted_average():
    sim = _recording(
        cfg('gossip.algorithm="group_average"', "gossip.exchanges_per_round=2", "gossip.group_levels=1", *EXACT)
    )
    sim.run_round()  # 12 peers on a 3 x 4 grid: two exchanges, one along each axis
    w = torch.tensor([float(sim.shards.size(i)) for i in range(sim.n)], dtype=torch.float64)
    want = (w[:, None] * torch.stack([sim.peers.trained[i].double() for i in range(sim.n)])).sum(0) / w.sum()
    for i in range(sim.n):
        assert torch.allclose(sim.models[i].double(), want, atol=1e-6)
    bytes_two = sim.evaluate()["bytes_sent_per_peer"]
    # the default: one exchange through both axes (a hierarchical all-reduce): the same average, fewer bytes
    one = _recording(cfg('gossip.algorithm="group_average"', *EXACT))
    one.run_round()
    for i in range(one.n):
        assert torch.allclose(one.models[i].double(), want, atol=1e-6)
    assert one.evaluate()["bytes_sent_per_peer"] < bytes_two  # same messages, smaller slices (headers weigh here)
