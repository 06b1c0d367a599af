"""Fuzz live gossip peers over TLS with 10,000 hostile requests per gossip.algorithm.

    .venv/bin/python bench/fuzz_peer.py [--requests 10000] [--algorithms gossip,group_average,dpsgd,secure_groups]

For each algorithm (tests/p2p/fuzz.py says what is drawn and how each answer is checked):
three real peers (serving, training and exchanging on 127.0.0.1 over HTTPS, with a
certificate authority made here); once the target has merged, hostile requests go to it
eight at a time (the issue's probes among them: long host labels, user:pass@ senders,
FLT_MAX / 1e30 / NaN models, 20-digit and boolean ages, metadata and documentation
addresses, deep JSON and 5,000-digit integers, slices and secure messages for rounds that
are not open or for another algorithm, oversized and truncated bodies, no or wrong token),
then 20 connections that send half a request's headers and stop, and one ``Expect:
100-continue`` without the token. It prints, per algorithm: requests, invalid requests
sent, answers of 5xx, invalid requests accepted, error answers that are not JSON, the
answers by status, the target's model finite and its largest absolute value against
``gossip.max_abs``, local steps and merges before and after (honest merges go on), the
peers' 500s, the slow connections closed, the 401 before 100 Continue, and the time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.p2p.fuzz import ALGORITHMS, fuzz_algorithm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the peers' refusals are the point, not news
    rows = []
    for algorithm in args.algorithms.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            res = asyncio.run(fuzz_algorithm(algorithm, args.requests, Path(tmp), seed=args.seed))
        row = res.row()
        rows.append(row)
        print(
            f"{algorithm:14s} requests {res.requests} (invalid {res.invalid_sent}) in {res.seconds:.1f} s: "
            f"5xx {res.answers_5xx}, invalid accepted {res.invalid_accepted}, non-JSON errors {res.not_json}, "
            f"transport errors {res.transport_errors}; statuses {dict(sorted(res.by_status.items()))}"
        )
        print(
            f"{'':14s} model finite {res.model_finite}, max |x| {res.model_max_abs:.3g} "
            f"(<= max_abs: {res.within_max_abs}), norm / honest peers' {res.norm_ratio:.2f} (<= 2); steps {res.steps_before} -> {res.steps_after}, merges "
            f"{res.merges_before} -> {res.merges_after}; peer 500s {res.peer_errors}, peers up {res.peers_up}; "
            f"slow-header connections closed {res.slow_closed}/{res.slow_opened}; 401 before 100 Continue "
            f"{res.expect_unauthorized}; ok {res.ok}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
