"""The peer service over real HTTPS on 127.0.0.1: auth, validation of incoming models,
a good exchange. Garbage gets 4xx and leaves the receiver's model untouched."""

from __future__ import annotations

import asyncio
import itertools
import struct
import sys
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from shoal.client.training import LocalTrainer
from shoal.config import CompressionConfig, Config, load_config
from shoal.models import build_model
from shoal.p2p.model_wire import decode_gossip_model, encode_gossip_model
from shoal.p2p.peer import Peer, PeerData, PeerSettings
from shoal.tls import client_context, make_private_ca, server_context
from shoal.wire import encode_model

TOKEN = "s3cret-network-token"


def _peer(url: str, ssl_server=None, ssl_client=None, cfg: Config | None = None) -> Peer:
    cfg = cfg or Config()
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("logreg", (60,), 10), cfg.train)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 60, generator=g), torch.randint(0, 10, (40,), generator=g)
    return Peer(
        cfg,
        trainer,
        PeerData((x, y), (x, y)),
        PeerSettings(url, (), TOKEN, url.startswith("http:"), ssl_server, ssl_client),
    )


async def _serve(peer: Peer, ctx) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(peer.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


_SEQ = itertools.count(1)


def _seq() -> int:
    """A fresh message counter: the wall clock in microseconds, strictly increasing."""
    return int(time.time() * 1e6) + next(_SEQ)


def _model(peer: Peer, params: torch.Tensor, **extra) -> bytes:
    header = {"age": 3, "num_examples": 10, "sender": "https://127.0.0.1:1", "seq": _seq(), **extra}
    return encode_model(params, peer.spec, 1, header)


@pytest.mark.timeout(60)
def test_garbage_gets_4xx_and_the_model_is_kept(tmp_path):
    pki = make_private_ca(tmp_path)

    async def main() -> None:
        peer = _peer("https://127.0.0.1:0", server_context(pki.cert, pki.key))
        runner, port = await _serve(peer, peer.s.ssl_server)
        url = f"https://127.0.0.1:{port}/gossip"
        before = peer.node.params.clone()
        version = peer.node.version
        good = before + 0.01  # near ours: within the default merge bound
        nan = good.clone()
        nan[3] = float("nan")
        wrong = torch.zeros(peer.spec.numel + 1)
        bad_spec = encode_model(wrong, peer.spec, 1, {"age": 1, "num_examples": 1, "sender": "x"})
        cases = {
            "bad body": b"\x00garbage" * 10,
            "truncated": _model(peer, good)[:-7],
            "wrong spec": bad_spec,
            "NaN": _model(peer, nan),
            "oversized": b"\0" * (peer.max_bytes + 1),
            "bad age": _model(peer, good, age=-1),
            "bad sender": _model(peer, good, sender=7),
            "header length": struct.pack("<Q", 1 << 40) + b"{}",
        }
        auth = {"Authorization": f"Bearer {TOKEN}"}
        ctx = client_context(pki.ca_cert)
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for name, body in cases.items():
                async with s.post(url, data=body, headers=auth, ssl=ctx) as r:
                    assert 400 <= r.status < 500, name
                    if r.status != 413:
                        assert "error" in await r.json(), name
                assert torch.equal(peer.node.params, before), name
                assert peer.node.version == version, name
            async with s.post(url, data=_model(peer, good), ssl=ctx) as r:
                assert r.status == 401
            async with s.post(url, data=_model(peer, good), headers={"Authorization": "Bearer wrong"}, ssl=ctx) as r:
                assert r.status == 401
            async with s.post(f"https://127.0.0.1:{port}/shuffle", data=b"{not json", headers=auth, ssl=ctx) as r:
                assert r.status == 400
            assert torch.equal(peer.node.params, before)
            # a good model is answered with ours (pre-merge) and merged (age-weighted: 3 vs 0)
            async with s.post(url, data=_model(peer, good), headers=auth, ssl=ctx) as r:
                assert r.status == 200
                body = await r.read()
            assert torch.allclose(peer.node.params, good)
            assert peer.node.age == 3 and "https://127.0.0.1:1" in peer.node.membership.view
            async with s.get(f"https://127.0.0.1:{port}/status", headers=auth, ssl=ctx) as r:
                status = await r.json()
            assert status["rejected"] >= 6 and status["merges"] == 1
        await runner.cleanup()
        assert len(body) > peer.spec.nbytes

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_two_peers_exchange_and_shuffle_over_https(tmp_path):
    pki = make_private_ca(tmp_path)

    async def main() -> None:
        sctx, cctx = server_context(pki.cert, pki.key), client_context(pki.ca_cert)
        a, b = _peer("https://127.0.0.1:0", sctx, cctx), _peer("https://127.0.0.1:0", sctx, cctx)
        ra, pa = await _serve(a, sctx)
        rb, pb = await _serve(b, sctx)
        for p, port in ((a, pa), (b, pb)):  # identities are the URLs, known once bound
            p.node.membership.self_id = f"https://127.0.0.1:{port}"
        a.node.membership.add(f"https://127.0.0.1:{pb}")
        a._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        await a.local_step()
        await b.local_step()  # an age-0 model carries no training: the age rule would not merge it
        await a.exchange()
        assert b.node.merges == 1 and a.node.merges == 1
        assert torch.allclose(a.node.params, b.node.params)
        await a.shuffle()
        assert f"https://127.0.0.1:{pa}" in b.node.membership.view
        await a._session.close()
        await ra.cleanup()
        await rb.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "client:0"], "--insecure"),
        (["--data", "shard.bin", "--insecure"], "--data 'shard.bin' not found"),  # the built-in task reads shard files
        (["--data", "client:99", "--insecure"], "the split has 30 clients"),
    ],
)
def test_peer_command_refuses_what_it_cannot_run(args, message, monkeypatch, capsys):
    """`shoal peer`'s entry point in this process (shoal.cli.main): one ``error:`` line, status 2."""
    from shoal.cli import main

    monkeypatch.setattr(sys, "argv", ["shoal", "peer", "--listen", "127.0.0.1:1", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


@pytest.mark.timeout(60)
def test_q8_models_over_http_and_a_rejecting_merge():
    """A peer with [compression] q8 answers in q8 (about a quarter of the bytes), reads a
    q8 push, and with robust.norm_bound + bound_mode = reject ignores a far-off model."""
    cfg = load_config(
        None,
        ['compression.encoding="q8"', "robust.norm_bound=5.0", 'gossip.bound_mode="reject"', "gossip.merge_radius=5.0"],
    )

    async def main() -> None:
        peer = _peer("http://127.0.0.1:0", cfg=cfg)
        runner, port = await _serve(peer, None)
        url = f"http://127.0.0.1:{port}/gossip"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        own = peer.node.params.clone()
        near = own + 0.01
        far = own + 100.0
        q8 = CompressionConfig("q8")
        extra = {"age": 3, "num_examples": 10, "sender": "http://127.0.0.1:1"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            body = encode_gossip_model(far, peer.spec, 1, {**extra, "seq": _seq()}, q8)
            async with s.post(url, data=body, headers=auth) as r:
                assert r.status == 200
                body = await r.read()
            assert torch.equal(peer.node.params, own) and peer.node.bounded == 1
            answer, header = decode_gossip_model(body, peer.spec, peer.max_bytes)
            assert header["encoding"] == "q8" and len(body) < 0.4 * len(encode_gossip_model(own, peer.spec, 1, extra))
            assert float((answer - own).abs().max()) <= float(own.abs().max()) / 127 + 1e-6
            body2 = encode_gossip_model(near, peer.spec, 1, {**extra, "seq": _seq()}, q8)
            async with s.post(url, data=body2, headers=auth) as r:
                assert r.status == 200
                body2 = await r.read()
            assert peer.node.merges == 1 and float((peer.node.params - near).abs().max()) < 0.01
            assert peer.svc.bytes_sent == len(body) + len(body2)
        await runner.cleanup()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_model_of_another_spec_is_refused_naming_both_hashes():
    """A peer running another task sends a smaller or a larger model than ours (the larger one
    over our body limit): both get 400 spec_mismatch with the two spec hashes, not a bare 413,
    and our model is untouched."""
    from shoal.params import ParamSpec

    async def main() -> None:
        peer = _peer("http://127.0.0.1:0")
        runner, port = await _serve(peer, None)
        url = f"http://127.0.0.1:{port}/gossip"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        before = peer.node.params.clone()
        extra = {"age": 3, "num_examples": 10, "sender": "http://127.0.0.1:1"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            for inputs in (20, 40_000):
                other = ParamSpec.of(build_model("logreg", (inputs,), 10))
                body = encode_gossip_model(torch.zeros(other.numel), other, 1, extra)
                assert (len(body) > peer.max_bytes) == (inputs > 20)
                async with s.post(url, data=body, headers=auth) as r:
                    assert r.status == 400, inputs
                    answer = await r.json()
                assert answer["error"] == "spec_mismatch"
                assert other.hash in answer["detail"] and peer.spec.hash in answer["detail"], answer
        assert torch.equal(peer.node.params, before) and peer.svc.rejected == 2
        await runner.cleanup()

    asyncio.run(main())


class _Rows(torch.utils.data.Dataset):
    """A map-style Dataset that is not a TensorDataset: the peer trains through a DataLoader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


@pytest.mark.timeout(60)
def test_a_peer_trains_and_evaluates_on_torch_datasets(tmp_path):
    """Dataset train/test data (the DataLoader path) train the model and give one metrics
    record with every default metric of the task on the peer's own test data; the saved model
    loads into the task's model by name."""
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("logreg", (8,), 3), Config().train)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(90, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    data = PeerData(_Rows(x[:60], y[:60]), _Rows(x[60:], y[60:]))
    peer = Peer(Config(), trainer, data, PeerSettings("http://127.0.0.1:0", (), TOKEN, True, out_dir=tmp_path))

    async def main() -> None:
        before = peer.node.params.clone()
        await peer.local_step()
        assert not torch.equal(peer.node.params, before) and peer.node.num_examples == 60
        await peer.evaluate()

    asyncio.run(main())
    from shoal.metrics import read_jsonl

    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert {"local_test_loss", "local_test_accuracy"} <= set(record) and record["local_test_num_examples"] == 30
    assert not any(k.startswith("test_") for k in record)
    assert peer.status()["metrics"]["local_test_accuracy"] == record["local_test_accuracy"]
    # the saved model is named tensors that the task's model loads, like `shoal run pull` gives
    from safetensors.torch import load_file

    saved = load_file(str(peer.save_model()))
    fresh = build_model("logreg", (8,), 3)
    fresh.load_state_dict(saved)
    assert torch.equal(torch.cat([v.reshape(-1) for v in saved.values()]).sort().values, peer.node.params.sort().values)


@pytest.mark.timeout(60)
def test_connections_are_capped_per_address_and_silent_ones_closed():
    """One address may hold at most MAX_CONNECTIONS_PER_ADDRESS connections (here 4); a
    connection that sends half a request's headers is closed at the header deadline, and the
    peer still answers."""
    from shoal.p2p.connections import GuardedRunner

    async def main() -> None:
        peer = _peer("http://127.0.0.1:0")
        peer.guard.per_address, peer.guard.header_timeout = 4, 1.0
        runner = GuardedRunner(peer.app(), peer.guard, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        conns = []
        for _ in range(6):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /gossip HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            conns.append((reader, writer))
        t0 = asyncio.get_running_loop().time()
        closed = await asyncio.gather(*[asyncio.wait_for(r.read(), 5) for r, _ in conns])
        took = asyncio.get_running_loop().time() - t0
        assert all(c == b"" for c in closed) and took < 3  # the last two at once, the others at 1 s
        assert peer.guard.refused == 2 and peer.guard.open == {} and peer.guard.count == 0
        peer.guard.per_address, peer.guard.total = 10, 3  # and a cap on all connections
        more = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        closed = await asyncio.gather(*[asyncio.wait_for(r.read(), 5) for r, _ in more])
        assert all(c == b"" for c in closed) and peer.guard.refused == 4
        conns += more
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200 and (await r.json())["connections_refused"] == 4
        peer.guard.idle_timeout = 1.0  # after an answer, the next request's headers are due by then
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"POST /gossip HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        t0 = asyncio.get_running_loop().time()
        while await asyncio.wait_for(reader.read(1 << 16), 5):
            pass
        assert asyncio.get_running_loop().time() - t0 < 3
        conns.append((reader, writer))
        for _, w in conns:
            w.close()
        await runner.cleanup()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_token_never_goes_over_plain_http_without_insecure():
    """A peer on HTTPS that is handed an http:// address (a bootstrap typo) sends it nothing,
    token least of all: a plain HTTP server on 127.0.0.1 sees no request."""
    from shoal.p2p.service import Outgoing

    async def main() -> None:
        seen: list[dict] = []

        async def record(request: web.Request) -> web.Response:
            seen.append(dict(request.headers))
            return web.Response(body=b"{}")

        app = web.Application()
        app.router.add_post("/shuffle", record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        peer = _peer("https://127.0.0.1:1")
        peer._session = aiohttp.ClientSession()
        failures: list[Exception] = []
        out = Outgoing(f"http://127.0.0.1:{port}/shuffle", b"{}", "application/json")
        await peer._contact(out, lambda data: None, failures.append)
        assert seen == [] and len(failures) == 1 and "insecure" in str(failures[0])
        insecure = _peer("http://127.0.0.1:1")  # with --insecure it is sent, as the user asked
        insecure._session = aiohttp.ClientSession()
        await insecure._contact(out, lambda data: None, failures.append)
        assert len(seen) == 1 and seen[0]["Authorization"] == f"Bearer {TOKEN}"
        await peer._session.close()
        await insecure._session.close()
        await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize(
    "bootstrap, advertise, message",
    [
        ("https://" + "a" * 64 + ".example.org:9001", None, "--bootstrap .*host label"),
        ("https://user:pw@127.0.0.1:9001", None, "--bootstrap .*user:password"),
        ("", "https://127.0.0.1:70000", "--advertise .*[Pp]ort"),
    ],
)
def test_peer_addresses_on_the_command_line_are_checked_before_serving(bootstrap, advertise, message):
    from shoal.errors import ConfigError
    from shoal.p2p.cli import run_peer

    with pytest.raises(ConfigError, match=message):
        run_peer(Config(), "127.0.0.1:1", bootstrap, "client:0", None, advertise, None, None, None, True, None)
