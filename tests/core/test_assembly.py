"""shoal.assembly builds each role's parts; the constructors take them and assemble nothing."""

import dataclasses

import pytest
import torch

from shoal import assembly
from shoal.accounting_rounds import DdgRoundAccountant
from shoal.assembly import Batching, ClientParts, GossipParts, ServerParts, SimulationParts
from shoal.config import load_config
from shoal.rounds import SyncRounds
from shoal.server.service import ServerService
from shoal.simulations.dp_hooks import DistributedNoise
from shoal.simulations.gossip import GossipSimulation
from shoal.simulations.inprocess import InProcessSimulation
from shoal.simulations.run_loop import Step, run_engine


def cfg(*extra):
    return load_config(
        None,
        [
            "simulation.rounds=3",
            "simulation.num_clients=8",
            "simulation.clients_per_round=4",
            "server.clients_per_round=4",
            "server.min_nodes=4",
            "output.plots=false",
            *extra,
        ],
    )


def test_every_role_starts_from_the_same_model():
    c = cfg()
    task = assembly.task_from_config(c)
    sim = assembly.build(c, task, "simulation")
    gossip = assembly.build(c, task, "gossip")
    server = assembly.build(c, task, "server")
    client = assembly.build(c, task, "client", device="cpu", example=sim.shards.data(0))
    assert isinstance(sim, SimulationParts) and isinstance(gossip, GossipParts)
    assert isinstance(server, ServerParts) and isinstance(client, ClientParts)
    start = sim.rounds.global_params
    for flat in (gossip.client.trainer.flat, server.rounds.global_params, client.trainer.flat):
        assert torch.equal(flat.cpu(), start.cpu())
    assert sim.spec.hash == gossip.client.spec.hash == server.spec.hash == client.spec.hash
    assert isinstance(sim.rounds, SyncRounds) and sim.rounds.sample_size(8) == 4
    assert server.sync is server.rounds  # server.mode = "sync"
    with pytest.raises(dataclasses.FrozenInstanceError):
        sim.rounds = server.rounds  # type: ignore[misc]


def test_async_server_parts_have_no_sync_rounds_and_stateful_algorithms_are_refused():
    c = cfg('server.mode="async"')
    assert assembly.build(c, None, "server").sync is None
    with pytest.raises(Exception, match="server.mode = 'sync'"):
        assembly.build(cfg('server.mode="async"', 'algorithm.name="scaffold"'), None, "server")
    with pytest.raises(ValueError, match="no parts for role"):
        assembly.build(c, None, "edge")  # type: ignore[call-overload]


@pytest.mark.parametrize("mechanism", ["gaussian", "discrete_gaussian"])
def test_secure_dp_parts_are_final_when_built(mechanism):
    """The round runner, the sizing (t, K_max, the discrete Gaussian), the accountant and the noise step
    are chosen by build; running a round re-wires none of them."""
    extra = (
        *("secure_aggregation.enabled=true", "secure_aggregation.bits=20", "secure_aggregation.clip=9"),
        *('privacy.mode="distributed"', f'privacy.mechanism="{mechanism}"', "privacy.noise_multiplier=0.8"),
        "privacy.reproducible=true",
    )
    c = cfg(*extra, "simulation.rounds=1")
    parts = assembly.build(c, None, "simulation")
    sizing, privacy = parts.secure, parts.privacy
    # N = 8, t = 3: an aborted round is released as an empty one, and the round priced as the mixture of
    # Binomial(7, 1/2) others: m <= 1 nothing, m = 2 sensitivity 3C (P = 21/128), else C
    assert sizing is not None and sizing.abort_branches is not None
    assert [s for s, _ in sizing.abort_branches] == [0.0, 1.0, 3.0]
    assert [p for _, p in sizing.abort_branches] == pytest.approx([8 / 128, 99 / 128, 21 / 128])
    assert parts.runner == "secure_aggregation" and sizing is not None and privacy is not None
    accountant = privacy.accountant
    if mechanism == "discrete_gaussian":  # the mechanism's own bound, and no continuous noise step
        assert isinstance(accountant, DdgRoundAccountant) and parts.noise is None
        assert sizing.ddg is not None and sizing.ddg.shares == sizing.noise_shares
    else:  # each share sized for t survivors, the released sum topped up to K_max shares
        assert parts.noise is not None and sizing.ddg is None and not isinstance(accountant, DdgRoundAccountant)
        assert (parts.noise.shares(), parts.noise.cohort) == (sizing.noise_shares, sizing.max_summands)
    sim = InProcessSimulation(parts)
    steps = list(sim.client_steps)
    assert [s for s in steps if isinstance(s, DistributedNoise)] == ([] if parts.noise is None else [parts.noise])
    sim.run_round()
    assert sim.privacy is privacy and privacy.accountant is accountant and accountant.rounds == 1
    assert accountant.ledger[0]["abort_branches"] == [list(b) for b in sizing.abort_branches]  # in the ledger
    assert "abort_delta" not in privacy.metrics()  # nothing added to delta
    assert sim.client_steps == steps and sim.rounds is parts.rounds
    assert sim.secure_aggregation is not None and sim.secure_aggregation.sizing is sizing


def test_batching_is_decided_once_for_every_role():
    c = cfg()
    parts = assembly.build(c, None, "simulation")
    shards = parts.shards
    batching = Batching(shards.in_memory, shards.example, 4, shards.max_size())
    worker = assembly.build(c, None, "client", device="cpu", example=None, batching=batching)
    assert (worker.batched is None) == (parts.client.batched is None)
    dp = cfg('privacy.mode="local"')
    reason = assembly.batching_blocker(dp, parts.task, parts.trainer, True)
    assert reason is not None and "DP-SGD" in reason


def test_constructors_take_parts_and_say_how_to_build_them_from_a_config():
    c = cfg()
    for cls in (InProcessSimulation, GossipSimulation):
        with pytest.raises(TypeError, match="from_config"):
            cls(c)
    with pytest.raises(TypeError, match="from_config"):
        ServerService(c, c)  # type: ignore[arg-type]
    # parts built once run the same as from_config's; a part can be swapped before construction
    a, b = InProcessSimulation.from_config(c), InProcessSimulation(assembly.build(c, None, "simulation"))
    for sim in (a, b):
        sim.run_round()
    assert torch.equal(a.global_params, b.global_params)


def test_run_engine_drives_any_engine_and_closes_it_also_on_error(tmp_path):
    class Engine:
        label, title, x_axis = "toy", "toy", "round"

        def __init__(self, fail: bool):
            self.fail, self.closed = fail, 0

        def drive(self, report):
            for r in range(1, 4):
                if self.fail and r == 2:
                    raise RuntimeError("engine broke")
                report(Step(1, {"round": r, "test_accuracy": r / 10} if r != 2 else None))

        def figures(self, last):
            return {"rounds": last["round"]}

        def close(self):
            self.closed += 1

    ok = Engine(False)
    summary = run_engine(lambda: ok, cfg(), tmp_path / "ok", progress=False)
    assert summary["rounds"] == 3 and summary["final_test_accuracy"] == 0.3 and ok.closed == 1
    lines = (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the records the engine reported: rounds 1 and 3
    broken = Engine(True)
    with pytest.raises(RuntimeError, match="engine broke"):
        run_engine(lambda: broken, cfg(), tmp_path / "broken", progress=False)
    assert broken.closed == 1
