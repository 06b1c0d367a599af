import torch

from shoal.config import load_config
from shoal.simulations.inprocess import InProcessSimulation


def small_cfg(*extra):
    return load_config(
        None, ["simulation.rounds=3", "simulation.num_clients=12", "simulation.clients_per_round=4", *extra]
    )


def test_same_seed_same_numbers_other_seed_other_numbers():
    def final(seed):
        sim = InProcessSimulation.from_config(small_cfg(f"simulation.seed={seed}"))
        for _ in range(3):
            sim.run_round()
        return sim.global_params.clone()

    a, b, c = final(1), final(1), final(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_round_equals_hand_rolled_fedavg():
    """One round of the engine = example-weighted mean of independently trained clients."""
    sim = InProcessSimulation.from_config(small_cfg())
    g0 = sim.global_params.clone()
    tasks = sim.rounds.start_round(sim.client_ids)
    # Train the same tasks by hand, then let the engine run them itself.
    deltas, weights = [], []
    for t in tasks:
        x, y = sim.shards.get(sim._index[t.client_id])
        u = sim.trainer.train(g0, x, y, t.seed, t.version)
        deltas.append(u.delta)
        weights.append(u.num_examples)
        sim.rounds.submit(t.client_id, u)
    sim.rounds.finish_round()
    w = torch.tensor(weights, dtype=torch.float64)
    expected = g0 + (torch.stack(deltas).double() * (w / w.sum())[:, None]).sum(0).float()
    assert torch.allclose(sim.global_params, expected, atol=1e-6)


def test_clients_are_data_not_model_copies():
    cfg = load_config(None, ["simulation.num_clients=2000", "simulation.rounds=1", "model.name=2nn"])
    sim = InProcessSimulation.from_config(cfg)
    assert len(sim.client_ids) == 2000
    # one trainer, one model: memory is the dataset plus O(model), not 2000 models
    assert sum(1 for _ in sim.trainer.model.parameters()) == 6
    summary = sim.run_round()
    assert summary.num_results == 10 and summary.version == 1
