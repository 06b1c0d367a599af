"""Fuzz a live `shoal server`-like aggregator over TLS with 10,000 hostile requests per mode.

    .venv/bin/python bench/fuzz_server.py [--requests 10000] [--modes sync,async,secure,federation,edge_secure]

For each of sync, async, secure, federation (a federation server hosting one run: its
node routes under /runs/run-1, offers, answers and the runs routes of `shoal run`) and
edge_secure mode (a root's relay routes for edge aggregators in a secure round;
tests/server/fuzz.py says what is drawn and how each
answer is checked) it prints: the requests sent, answers of 5xx, error answers that are not
JSON, malformed bodies accepted (by an oracle independent of shoal.wire), well-formed bodies
refused, requests after which model bytes / version / checkpoints / counters differed, whether
they were unchanged from first to last, and the version a legitimate round reached afterwards.
Then two timed cases: `wait=nan` (answered at once) and upload slots held by clients that send
headers with `Expect: 100-continue` and no body (a good upload goes through; each holder is
answered 408 within server.body_timeout_s).

With ``--insiders N``: N requests from insiders (tests/server/insider_fuzz.py says what is drawn):
a researcher submitting runs with unregistered task references and configs below the floors,
reading and stopping another researcher's run; nodes without a task opening chunked uploads; an
edge claiming names that are no enrolled node; each credential on another role's routes. Per
category: requests, answers of 5xx, hostile requests accepted, requests after which the state
differed.

    .venv/bin/python bench/fuzz_server.py --insiders 3000 --modes none
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.fuzz import FUZZERS, MODES, Request, ServerThread, prepare, raw_request, run_mode  # noqa: E402
from tests.server.hostile import good_update  # noqa: E402
from tests.server.insider_fuzz import fuzz as fuzz_insiders  # noqa: E402
from tests.server.insider_fuzz import insider_federation  # noqa: E402


def insiders(tmp: Path, requests: int) -> None:
    """The insider fuzzer's table (see the module doc)."""
    import asyncio

    async def main():
        async with insider_federation(tmp) as ins:
            return await fuzz_insiders(ins, batches=max(1, requests // 50), batch=50)

    t0 = time.perf_counter()
    figures = asyncio.run(main())
    print(f"{'insiders':10} {'requests':>9} {'5xx':>5} {'accepted':>9} {'state changed':>14}  status counts")
    for category, f in figures.items():
        print(
            f"{category:10} {f.requests:>9} {f.five_xx:>5} {f.accepted:>9} {f.state_changed:>14}  "
            f"{dict(sorted(f.status.items()))}"
        )
        for e in f.examples:
            print("  example:", e)
    print(f"({time.perf_counter() - t0:.0f} s)")


def timed_cases(tmp: Path) -> dict:
    with ServerThread(tmp, "sync") as server:
        ctx = server.call(lambda: prepare(server))
        t0 = time.perf_counter()
        status, _, body = server.send(raw_request(Request("GET", "/v1/task?wait=nan", "f0"), ctx))
        nan_ms = (time.perf_counter() - t0) * 1e3
        svc = server.svc
        slots = svc.cfg.server.ingest_slots
        body_len = len(server.call(lambda: good_update(svc, "n0")))
        holders = []
        for i in range(slots):  # every slot's worth of silent uploads, two nodes' worth
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            tls = server.client_ssl.wrap_socket(sock, server_hostname="127.0.0.1")
            token = ctx.tokens[FUZZERS[i % 2]]
            tls.sendall(
                (
                    f"POST /v1/update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Length: {body_len}\r\nExpect: 100-continue\r\n\r\n"
                ).encode()
            )
            holders.append((tls, time.perf_counter()))
        time.sleep(0.2)
        node = sorted(svc.rounds.selected)[0]
        t0 = time.perf_counter()
        up_status, _, up_body = server.send(
            raw_request(
                Request("POST", "/v1/update", node, server.call(lambda: good_update(svc, node)), expect100=True), ctx
            )
        )
        upload_ms = (time.perf_counter() - t0) * 1e3
        answers = []
        for tls, t_start in holders:
            data = b""
            while True:
                try:
                    b = tls.recv(65536)
                except OSError:
                    break
                if not b:
                    break
                data += b
            final = data.split(b"\r\n\r\n", 1)[1] if data.startswith(b"HTTP/1.1 100") else data
            answers.append((final[:12].decode("latin-1"), round(time.perf_counter() - t_start, 2)))
            tls.close()
    return {
        "wait_nan": {"status": status, "ms": round(nan_ms, 1), "answer": json.loads(body)["error"]},
        "held_slots": {
            "holders": slots,
            "body_timeout_s": svc.cfg.server.body_timeout_s,
            "good_upload": {"status": up_status, "ms": round(upload_ms, 1)},
            "holder_answers": answers,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="per mode (a multiple of 50)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, or none")
    ap.add_argument("--insiders", type=int, default=0, help="requests of the insider fuzzer (0: not run)")
    args = ap.parse_args()
    rows = []
    if args.insiders:
        with tempfile.TemporaryDirectory() as tmp:
            insiders(Path(tmp), args.insiders)
    if args.modes == "none":
        return
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            (Path(tmp) / mode).mkdir()
            out = run_mode(Path(tmp) / mode, mode, batches=max(1, args.requests // 50), batch=50)
            rows.append(out)
            print(json.dumps({k: v for k, v in out.items() if k != "examples"}), flush=True)
            for e in out["examples"]:
                print("  example:", e)
        (Path(tmp) / "timed").mkdir()
        timed = timed_cases(Path(tmp) / "timed")
    print()
    print(
        f"{'mode':10} {'requests':>9} {'5xx':>5} {'not JSON':>9} {'malformed accepted':>19} "
        f"{'well-formed refused':>20} {'state changed':>14} {'unchanged':>10} {'legit version':>14} {'seconds':>8}"
    )
    for r in rows:
        print(
            f"{r['mode']:10} {r['requests']:>9} {r['5xx']:>5} {r['not_json']:>9} {r['malformed_accepted']:>19} "
            f"{r['wellformed_refused']:>20} {r['state_changed']:>14} {str(r['unchanged']):>10} "
            f"{r['legit_round_version']:>14} {r['seconds']:>8}"
        )
    print()
    print("status counts:", {r["mode"]: r["status"] for r in rows})
    print("timed cases:", json.dumps(timed))


if __name__ == "__main__":
    main()
