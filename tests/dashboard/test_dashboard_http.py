"""The server's page over real HTTPS on 127.0.0.1: login, session cookie, CSRF refusal, CSP,
the JSON endpoints (with a session or the admin token, never a node's token), logout, expiry."""

from __future__ import annotations

import asyncio

import aiohttp

from shoal.tls import client_context, make_private_ca, server_context
from shoal.web.dashboard import COOKIE, CSP, Sessions, curves

from ..server.live import ADMIN, live_server


def _cookie(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    """The session cookie's value and its whole Set-Cookie line (read by hand: aiohttp's jar
    would not keep a cookie of an IP address)."""
    line = next(v for k, v in resp.headers.items() if k.lower() == "set-cookie" and v.startswith(COOKIE + "="))
    return line.split(";", 1)[0].split("=", 1)[1], line


def test_login_session_csp_and_json_endpoints(tmp_path):
    pki = make_private_ca(tmp_path / "pki")

    async def scenario():
        async with live_server(tmp_path, ["n0"], ssl_context=server_context(pki.cert, pki.key)) as live:
            url = live.url
            origin = {"Origin": url}
            conn = aiohttp.TCPConnector(ssl=client_context(pki.ca_cert))
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=20)) as http:
                # Without a login: the page sends to the login form, the JSON answers 401.
                async with http.get(url + "/", allow_redirects=False) as resp:
                    assert resp.status == 303 and resp.headers["Location"] == "/login"
                for path in ("/v1/dashboard/runs", "/v1/dashboard/runs/run", "/v1/dashboard/nodes"):
                    async with http.get(url + path) as resp:
                        assert resp.status == 401, path
                        assert resp.headers["Content-Security-Policy"] == CSP
                    node = {"Authorization": f"Bearer {live.tokens['n0']}"}
                    async with http.get(url + path, headers=node) as resp:
                        assert resp.status == 401, f"a node's token opened {path}"
                async with http.get(url + "/login") as resp:
                    assert resp.status == 200 and resp.headers["Content-Security-Policy"] == CSP
                    assert "<script>" not in await resp.text()  # scripts are files: the CSP allows no inline one
                async with http.get(url + "/static/dashboard.js") as resp:
                    assert resp.status == 200 and resp.content_type == "text/javascript"
                async with http.get(url + "/static/..%2Fdashboard.py") as resp:
                    assert resp.status == 404

                # A wrong token, a cross-site form and an oversized body open nothing.
                form = {"token": live.tokens[ADMIN]}
                wrong = {"token": "x" * 40}
                async with http.post(url + "/login", data=wrong, headers=origin, allow_redirects=False) as r:
                    assert r.status == 303 and r.headers["Location"] == "/login?failed=1"
                    assert COOKIE not in str(r.headers)
                evil = {"Origin": "https://evil.example"}
                async with http.post(url + "/login", data=form, headers=evil, allow_redirects=False) as r:
                    assert r.status == 403 and COOKIE not in str(r.headers)
                async with http.post(url + "/login", data=form, headers={"Sec-Fetch-Site": "cross-site"}) as r:
                    assert r.status == 403
                async with http.post(url + "/login", data={"token": "a" * 5000}, headers=origin) as r:
                    assert r.status == 400

                # The admin token logs in: an HttpOnly, Secure, SameSite=Strict cookie, never a URL.
                async with http.post(url + "/login", data=form, headers=origin, allow_redirects=False) as r:
                    assert r.status == 303 and r.headers["Location"] == "/"
                    sid, line = _cookie(r)
                attrs = {a.strip().split("=")[0].lower() for a in line.split(";")[1:]}
                assert {"httponly", "secure", "samesite", "path", "max-age"} <= attrs
                assert "samesite=strict" in line.lower() and live.tokens[ADMIN] not in line
                session = {"Cookie": f"{COOKIE}={sid}"}
                async with http.get(url + "/", headers=session, allow_redirects=False) as resp:
                    assert resp.status == 200 and resp.headers["Content-Security-Policy"] == CSP
                    assert resp.headers["X-Frame-Options"] == "DENY"
                    page = await resp.text()
                    assert '<script src="/static/dashboard.js"' in page and "<script>" not in page
                async with http.get(url + "/v1/dashboard/runs", headers=session) as resp:
                    runs = (await resp.json())["runs"]
                assert [(r["run"], r["status"], r["mode"], r["version"]) for r in runs] == [
                    ("run", "running", "sync", 0)
                ]
                async with http.get(url + "/v1/dashboard/runs/run", headers=session) as resp:
                    run = await resp.json()
                assert run["traffic"]["live"] and run["traffic"]["bytes_up"] == 0 and run["metrics"] == {}
                async with http.get(url + "/v1/dashboard/runs/nope", headers=session) as resp:
                    assert resp.status == 404
                async with http.get(url + "/v1/dashboard/nodes", headers=session) as resp:
                    nodes = (await resp.json())["nodes"]
                assert [(n["name"], n["online"], n["revoked"]) for n in nodes] == [("n0", False, False)]
                # Scripts read the same JSON with the admin token.
                admin = {"Authorization": f"Bearer {live.tokens[ADMIN]}"}
                async with http.get(url + "/v1/dashboard/nodes", headers=admin) as resp:
                    assert resp.status == 200 and (await resp.json())["nodes"] == nodes

                # A node that fetched the model counts as bytes down; a refused upload is counted by its
                # reason and is the node's last refusal; a revoked node shows as revoked.
                n0 = {"Authorization": f"Bearer {live.tokens['n0']}"}
                async with http.get(url + "/v1/model", headers=n0) as r:
                    sent = len(await r.read())
                async with http.post(url + "/v1/update", data=b"\x00" * 64, headers=n0) as r:
                    assert r.status == 400
                    code = (await r.json())["error"]
                live.registry.revoke("n0")
                async with http.get(url + "/v1/dashboard/runs/run", headers=admin) as resp:
                    traffic = (await resp.json())["traffic"]
                assert traffic["bytes_down"] == sent and traffic["refused"] == {code: 1} and traffic["accepted"] == 0
                async with http.get(url + "/v1/dashboard/nodes", headers=admin) as resp:
                    refusal = (await resp.json())["nodes"][0]["last_refusal"]
                assert (refusal["run"], refusal["code"]) == ("run", code) and refusal["detail"]
                async with http.get(url + "/v1/dashboard/nodes", headers=admin) as resp:
                    assert (await resp.json())["nodes"][0]["revoked"] is True

                # Logging out ends the session (a cross-site logout is refused).
                async with http.post(url + "/logout", headers={**session, **evil}, allow_redirects=False) as r:
                    assert r.status == 403
                async with http.post(url + "/logout", headers={**session, **origin}, allow_redirects=False) as r:
                    assert r.status == 303
                async with http.get(url + "/v1/dashboard/runs", headers=session) as resp:
                    assert resp.status == 401

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_page_is_off_without_an_admin_token(tmp_path):
    async def scenario():
        async with live_server(tmp_path, ["n0"], admin_token_file="") as live:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
                async with http.get(live.url + "/v1/dashboard/runs") as resp:
                    assert resp.status == 403 and (await resp.json())["error"] == "dashboard_off"
                async with http.post(live.url + "/login", data={"token": "x" * 40}) as resp:
                    assert resp.status == 403

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_sessions_expire_and_are_capped():
    s = Sessions(ttl_s=100, idle_s=10, cap=3)
    a = s.create(0.0)
    assert s.valid(a, 5.0) and s.valid(a, 14.0)  # each use restarts the idle clock
    assert not s.valid(a, 30.0) and not s.valid(a, 31.0)  # idle too long: gone for good
    b = s.create(0.0)
    for t in range(9, 100, 9):
        assert s.valid(b, float(t))
    assert not s.valid(b, 101.0)  # past its lifetime however busy
    first = s.create(0.0)
    for _ in range(3):
        s.create(0.0)
    assert not s.valid(first, 1.0)  # the oldest of four went
    assert not s.valid(None, 1.0) and not s.valid("x" * 500, 1.0)


def test_curves_keep_every_metric_and_drop_what_is_not_a_number():
    records = [
        {"round": 1, "version": 1, "test_accuracy": 0.5, "train_loss": 2.0, "num_results": 3, "elapsed_s": 1.0},
        {"version": 1, "evaluation": "federated", "fed_r2": 0.1, "<b>odd</b>": 7},
        {"round": 2, "version": 2, "test_accuracy": 0.75, "train_loss": None, "num_results": 2, "num_late": 1},
        {"round": 3, "version": 3, "epsilon": 1.5, "target_epsilon": 4.0, "flag": True},
    ]
    c = curves(records)
    assert c["metrics"] == {
        "<b>odd</b>": [[1, 7]],
        "fed_r2": [[1, 0.1]],
        "test_accuracy": [[1, 0.5], [2, 0.75]],
        "train_loss": [[1, 2.0]],
    }
    assert c["epsilon"] == {"points": [[3, 1.5]], "server": [], "target": 4.0, "mode": None}
    assert c["participation"] == {"num_results": [[1, 3], [2, 2]], "num_late": [[2, 1]]}
    # local DP whose nodes keep their epsilons: no points, and the mode says why
    kept = curves([{"version": 1, "epsilon": None, "privacy_mode": "local", "delta": 1e-5}])
    assert kept["epsilon"] == {"points": [], "server": [], "target": None, "mode": "local"}


def test_the_server_console_says_where_the_run_is():
    from shoal.server.activity import console_line

    record = {"round": 3, "version": 3, "test_accuracy": 0.91234, "train_loss": 0.1, "num_results": 3, "num_late": 1}
    line = console_line({**record, "epsilon": 1.234, "target_epsilon": 4.0, "elapsed_s": 12.34}, 40)
    assert line == (
        "version 3 of 40 (round 3): test_accuracy 0.9123, train_loss 0.1, 3 results (1 late), epsilon 1.23 of 4, 12.3 s"
    )
