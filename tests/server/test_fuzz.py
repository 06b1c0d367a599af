"""Property-based fuzzing (hypothesis) of the wire decoder and of a live aggregator's HTTP
handlers over TLS, in sync, async, secure and federation mode (six hundred hostile requests per
mode) and in edge_secure mode (three hundred, mostly to the root's relay routes for edge
aggregators, with a secure round at its masked stage); tests/server/fuzz.py says what is drawn
and checked; bench/fuzz_server.py runs ten thousand per mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from shoal.errors import WireError
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.wire import decode_update

from .fuzz import MODES, Ctx, oracle_update, run_mode, update_body

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

SPEC = ParamSpec.of(build_model("logreg", (60,), 10))
CTX = Ctx(SPEC.numel, SPEC.hash, 3, 4, 1_000_000, 1e4, SPEC.nbytes + (1 << 20), {})


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(update_body(CTX, "f0"))
def test_wire_decoder_agrees_with_an_independent_oracle(body):
    """decode_update (zero-copy, as the server runs it) accepts exactly the bodies the oracle
    (the safetensors library plus the protocol's field rules) calls well-formed, and refuses
    everything else with a WireError."""
    want = oracle_update(body, CTX)
    try:
        update, _ = decode_update(
            bytearray(body), SPEC, CTX.max_body, copy=False, max_examples=CTX.max_examples, max_abs=CTX.max_delta_abs
        )
        got = True
        assert bool(torch.isfinite(update.delta).all()) and float(update.delta.abs().max()) <= CTX.max_delta_abs
    except WireError:
        got = False
    if want is not None:
        assert got == want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_fuzzing_a_live_server_finds_no_5xx_no_malformed_accepted_and_no_state_change(tmp_path, mode):
    batches = 6 if mode == "edge_secure" else 12  # a mode of its own for the edges' relay routes: half as many
    out = run_mode(tmp_path, mode, batches=batches, batch=50)
    assert out["requests"] == batches * 50 + out["regressions"]
    assert (
        out["5xx"],
        out["not_json"],
        out["malformed_accepted"],
        out["wellformed_refused"],
        out["state_changed"],
    ) == (0, 0, 0, 0, 0), out["examples"]
    assert out["unchanged"] and out["legit_round_version"] == 1
    # both refusal paths exercised: a tenth of the requests refused as malformed, a fiftieth as conflicts
    assert out["status"].get(400, 0) > out["requests"] // 10 and out["status"].get(409, 0) > out["requests"] // 50
