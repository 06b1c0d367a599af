"""The async server's FedBuff uses the [robust] rule (the same make_async_rounds as the simulator)."""

from __future__ import annotations

import time

import pytest
import torch

from shoal.errors import WireError
from shoal.server.store import open_service
from shoal.update import Update
from shoal.wire import encode_update

from .live import small_config


def test_fedbuff_median_on_the_server_ignores_one_huge_update_and_refuses_nan(tmp_path):
    sections = {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 3}, "robust": {"rule": "median"}}
    svc = open_service(small_config(tmp_path, sections, mode="async", rounds=4, min_nodes=1))
    x0 = svc.rounds.global_params.clone()
    now = time.monotonic()
    names = ["n0", "n1", "n2", "n3"]
    assert all(svc.poll(n, now)["status"] == "work" for n in names)
    nan = encode_update(Update(torch.full((svc.spec.numel,), float("nan")), 5, 0, "n3"), svc.spec)
    with pytest.raises(WireError):
        svc.submit("n3", nan, now)
    assert svc.counters.rejected == {"non_finite": 1} and svc.version == 0
    for n, v in zip(names[:3], (0.01, 0.02, 1000.0)):
        svc.submit(n, encode_update(Update(torch.full((svc.spec.numel,), v), 5, 0, n), svc.spec), now)
    assert svc.version == 1
    # median of {0.01, 0.02, 1000} = 0.02 per coordinate; FedAvg server step at lr 1
    torch.testing.assert_close(svc.rounds.global_params, x0 + 0.02)
