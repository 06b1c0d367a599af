"""A node's side of a secure `shoal server` round: its update leaves it only masked.

When the task says ``secure_aggregation``, the node runs :class:`SecAggClient`
(aggregation/secagg/protocol.py) over HTTP after training: post its public keys (without DP
with its example count and training loss, metadata in clear; under distributed DP with
neither), fetch its neighbours' keys, post encrypted shares, fetch its own, post the masked
fixed-point vector ``[w_k * clip(delta_k), w_k]`` and what the algorithm adds (SCAFFOLD's
control-variate delta: aggregation/secagg/payload.py), as the simulator does; under distributed DP
``[clip(delta_k), n_k / max_weight]``, so the example counts are only summed. Then it fetches the
unmasking request and posts its shares (sealed to the root's key of the round when the root has
edge aggregators, which relay them: aggregation/secagg/tiers.py). The state machine refuses a
request for both the self-mask and the mask-key share of one peer. The routes are in docs/protocol.md.

Distributed DP: the node takes part only when the fixed-point range leaves room for its noise
(the range check of aggregation.secagg.encoding) and every node weighs the same. It adds its
noise share N(0, z²C²/t) after the key directory, with the task's t only if t is at most the
neighbourhood the directory shows (a server that inflates t to shrink every share is refused),
and sends its unmasking shares only when the survivors it is shown number at least t, so a
server that would unmask a smaller sum gets no shares from this node.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import random
import ssl
from typing import Any, Protocol

import aiohttp
import numpy as np
import torch

from shoal.aggregation.discrete_gaussian import DdgCodec, plan, rotation_seed
from shoal.aggregation.dp import share_std
from shoal.aggregation.secagg import (
    ConsistencyRequest,
    KeyDirectory,
    SecAggClient,
    SecAggParams,
    ShareDelivery,
    UnmaskRequest,
)
from shoal.aggregation.secagg import identity as ID
from shoal.aggregation.secagg.encoding import FixedPoint, check_noise_range, encode_weighted, example_weight
from shoal.aggregation.secagg.payload import SecurePayload
from shoal.aggregation.secagg.tiers import seal_message
from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta, params_from_json
from shoal.config import PrivacyConfig, SecureAggregationConfig
from shoal.errors import Malformed, ShoalError, short_repr
from shoal.noise import NoiseSource
from shoal.privacy_plan import PrivacyPlan
from shoal.update import Update

from .algorithms import ClientProgram
from .http import Backoff, Refused, Retry
from .runlog import RunTag
from .task_message import TaskMessage

log = logging.getLogger(__name__)
log.addFilter(RunTag())  # lines of a federation run's work name the run

MIN_THRESHOLD = 0.5  # t > half of each neighbourhood (shoal.config checks the same on the server)
OCTET = {"Content-Type": "application/octet-stream"}


class SharePrivacy(Protocol):
    """The node's side of ``[privacy]`` as a secure round uses it (client/node.py's NodePrivacy)."""

    @property
    def plan(self) -> PrivacyPlan: ...

    @property
    def p(self) -> PrivacyConfig: ...

    @property
    def mode(self) -> str: ...

    def add_share(self, update: Update, t: int, round_: Any) -> Update: ...


class SecureNode(Protocol):
    """What a secure round uses of the node that runs it (client/node.py's Node): its name, its
    server connection, its stop flag, its privacy side, its client program and its own
    ``[secure_aggregation]`` settings."""

    name: str
    poll_s: float
    stop: asyncio.Event
    rand: random.Random
    http: aiohttp.ClientSession
    program: ClientProgram
    secure_cfg: SecureAggregationConfig

    @property
    def privacy(self) -> SharePrivacy | None: ...

    @property
    def url(self) -> str: ...

    @property
    def _ssl(self) -> ssl.SSLContext | bool: ...

    async def _request(self, method: str, path: str, **kw: Any) -> dict: ...

    async def _check(self, resp: aiohttp.ClientResponse) -> None: ...

    def _lost(self, leave: bool = False) -> None: ...


class _Left(Exception):
    """This node is out of the round (refused, excluded, aborted or stopping)."""


def _unreachable(node: SecureNode, url: str, route: str) -> None:
    """The server of this round did not answer: counted as any lost request (the node moves to the
    next server of its list after a few: a dead edge aggregator). A node that moved leaves the
    round, whose protocol ran at the old server (the root counts it a drop-out)."""
    node._lost()
    if node.url != url:
        raise _Left(f"{route}: {url} stopped answering; the node moved to {node.url}")


async def _post(node: SecureNode, route: str, body: bytes) -> None:
    backoff = Backoff()
    url = node.url
    while True:
        try:
            await node._request("POST", f"/v1/secagg/{route}", data=body, headers=OCTET)
            return
        except Refused as e:
            raise _Left(f"{route}: {e}") from None
        except Retry as e:
            if node.stop.is_set():
                raise _Left("stopping") from None
            _unreachable(node, url, route)
            delay = backoff.next(node.rand)
            log.warning("secure aggregation %s failed (%s); retrying in %.2f s", route, e, delay)
            await asyncio.sleep(delay)


async def _fetch(node: SecureNode, route: str, round_: int) -> bytes:
    """Long-poll GET /v1/secagg/{route} until the stage closed; the message body."""
    backoff = Backoff()
    params = {"round": str(round_), "wait": str(node.poll_s)}
    url = node.url
    while not node.stop.is_set():
        try:
            async with node.http.get(f"{node.url}/v1/secagg/{route}", params=params, ssl=node._ssl) as resp:
                await node._check(resp)
                if resp.status == 202:
                    continue
                return await resp.read()
        except Refused as e:
            raise _Left(f"{route}: {e}") from None
        except (TimeoutError, Retry, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            _unreachable(node, url, route)
            delay = backoff.next(node.rand)
            log.warning("secure aggregation %s fetch failed (%s); retrying in %.2f s", route, e, delay)
            await asyncio.sleep(delay)
    raise _Left("stopping")


def _checked_shares(t: int, directory: KeyDirectory) -> int:
    """The t a distributed-DP share is divided by, checked against the key directory: the node
    unmasks no sum with fewer than t survivors among the neighbours it is shown (the unmasking
    request lists them), so t can be at most its neighbourhood (the whole round over the full
    graph, a few nodes over SecAgg+). A server that inflates t to shrink every share is refused."""
    if t > len(directory.peers):
        raise Malformed(
            f"the task asks for t = {t} noise shares, but this node's key directory holds {len(directory.peers)} "
            f"nodes (threshold {directory.threshold}): a sum of {t} noisy inputs cannot be checked, so each share "
            "would be too small; refusing to take part"
        )
    return t


def _dp_shares(node: SecureNode, task: TaskMessage, values: FixedPoint, info: dict) -> int:
    """Distributed DP: t, after checking the round can carry this node's noise share (0 otherwise)."""
    privacy = node.privacy
    if privacy is None or not privacy.plan.client_shares:
        return 0
    t = int((task.privacy or {})["noise_shares"])
    if privacy.p.mechanism != "discrete_gaussian":  # the discrete Gaussian has no fixed-point range
        check_noise_range(values, privacy.p.clip_norm, share_std(privacy.p.clip_norm, privacy.p.noise_multiplier, t), t)
    if info.get("weighting") != "uniform":
        raise Malformed(
            f"distributed DP needs every node to weigh the same; the round says weighting = "
            f"{info.get('weighting')!r}: refusing to take part"
        )
    return t


def _distributed(node: SecureNode) -> bool:
    return node.privacy is not None and node.privacy.plan.client_shares


def _clear_meta(node: SecureNode, update: Update, payload: SecurePayload) -> dict:
    """What goes beside the keys in the clear. Without DP: the example count and train loss (and
    FedNova's step weight, a function of the count and the run's settings: payload.py).
    Distributed DP: nothing (the count travels inside the masked vector, the loss is not sent).
    Local DP: the update was stripped already (num_examples 1, no metrics: NodePrivacy.protect)."""
    if _distributed(node):
        return {}
    meta: dict = {"num_examples": int(update.num_examples), **payload.clear_meta(update)}
    if "train_loss" in update.metrics:
        meta["train_loss"] = float(update.metrics["train_loss"])
    return meta


def _masked_vector(
    node: SecureNode,
    update: Update,
    max_weight: float,
    weighting: str,
    values: FixedPoint,
    weights: FixedPoint,
    payload: SecurePayload,
) -> np.ndarray:
    """The fixed-point vector to mask: ``[w_k clip(delta_k), w_k]`` and what the algorithm adds
    (aggregation/secagg/payload.py: SCAFFOLD's control-variate delta, FedNova's normalised update);
    under distributed DP (every node weighs 1) ``[clip(delta_k), n_k / max_weight]``, so the server
    learns only the sum of the counts."""
    rng = np.random.default_rng()
    if not _distributed(node):
        weight = example_weight(update.num_examples, max_weight, weighting)
        return payload.encode(update, weight, values, weights, rng)
    x = encode_weighted(update.delta.detach().cpu().numpy(), 1.0, values, weights, rng)
    x[-1:] = weights.encode(np.array([min(update.num_examples / max_weight, 1.0)]), rng)
    return x


async def run_secure_round(node: SecureNode, task: TaskMessage, update: Update, report: dict | None = None) -> bool:
    """The protocol for one task; True when this node's unmasking shares were accepted.
    ``report``: a local-DP node's privacy report, sent with its keys."""
    round_ = task.round
    try:
        info = task.secure_aggregation
        if info is None:
            raise Malformed("the task runs no secure aggregation")
        params = params_from_json(info)
        k, bits = int(info["summands"]), int(info["bits"])
        values, weights = FixedPoint(float(info["clip"]), bits, k), FixedPoint(1.0, bits, k)
        size = params.vector_size
        payload = SecurePayload(node.program.name, update.delta.numel())  # the layout its algorithm declares
        if size != payload.vector_size:
            raise Malformed(
                f"secure_aggregation.vector_size = {size}, but this node masks {payload.vector_size} entries "
                f"(algorithm.name = {payload.algorithm!r}, {update.delta.numel()} parameters + 1 weight entry"
                + (" + the control-variate delta" if payload.masks_control else "")
                + "): the server runs another model or algorithm"
            )
        if params.threshold_fraction < MIN_THRESHOLD:  # below it the server could unmask a single input
            raise Malformed(
                f"secure_aggregation threshold fraction {params.threshold_fraction} is below "
                f"{MIN_THRESHOLD}: refusing to take part"
            )
        params = _own_minimum(node, params, k)
        t = _dp_shares(node, task, values, info)
        bad = int((~torch.isfinite(update.delta)).sum())
        if bad or not update.num_examples >= 1:  # never mask what would corrupt the sum unseen
            log.warning(
                "round %d: the update has %d NaN/Inf entries (%d examples): not joining the secure "
                "aggregation; the round goes on without this node",
                round_,
                bad,
                update.num_examples,
            )
            return False
        client = SecAggClient(node.name, params, None, *_identity(node, params))  # keys from the OS CSPRNG
        meta = {
            "round": round_,
            **_clear_meta(node, update, payload),
            **({"privacy": report} if report is not None else {}),
        }
        await _post(node, "keys", encode_message(client.advertise_keys(), meta))
        body = await _fetch(node, "keys", round_)
        directory = _expect(decode_message(body, size), KeyDirectory)
        if t:  # distributed DP: the share is sized now, for a t this node can hold the server to
            t = _checked_shares(t, directory)
            assert node.privacy is not None  # t > 0: distributed DP
            if node.privacy.p.mechanism != "discrete_gaussian":  # else the noise comes with the encoding below
                update = node.privacy.add_share(update, t, round_)
        max_weight = message_meta(body, size).get("max_weight")
        if not isinstance(max_weight, (int, float)) or not max_weight > 0:
            raise Malformed("the key directory's meta needs max_weight > 0")
        await _post(node, "shares", encode_message(client.share_keys(directory), {"round": round_}))
        delivery = _expect(decode_message(await _fetch(node, "shares", round_), size), ShareDelivery)
        x = _masked_vector(node, update, float(max_weight), str(info["weighting"]), values, weights, payload)
        codec = _ddg_codec(node, task, t, params, update.delta.numel())
        if codec is not None:  # the model entries: clip, rotate, round, integer noise (OS-keyed CSPRNG), mod 2^bits
            x = np.concatenate([codec.encode(update.delta.detach().cpu().numpy(), NoiseSource()), x[-1:]])
        await _post(node, "masked", encode_message(client.masked_input(delivery, x), {"round": round_}))
        log.info("round %d: masked input accepted", round_)
        reply = decode_message(await _fetch(node, "masked", round_), size)
        if params.malicious:  # sign the survivors shown; the unmasking then carries everyone's signatures
            check = _expect(reply, ConsistencyRequest)
            await _post(node, "consistency", encode_message(client.consistency_check(check), {"round": round_}))
            reply = decode_message(await _fetch(node, "consistency", round_), size)
        request = _expect(reply, UnmaskRequest)
        if t and len(request.survivors) < t:  # the server should have aborted
            raise Malformed(
                f"asked to unmask a sum of {len(request.survivors)} masked inputs, fewer than the t = {t} "
                "noise shares this node's noise was sized for: refusing"
            )
        answer = encode_message(client.unmask(request), {"round": round_})
        if "root_key" in info:  # the root has edges: the answer passes them sealed to the root (tiers.py)
            root_key = base64.b64decode(str(info["root_key"]), validate=True)
            answer = seal_message(answer, root_key, params.session, node.name, {"round": round_})
        await _post(node, "unmask", answer)
    except (_Left, ShoalError, KeyError, TypeError, ValueError, binascii.Error) as e:
        log.warning("round %d: out of the secure aggregation: %s: %s", round_, type(e).__name__, e)
        return False
    log.info("round %d: unmasking shares accepted", round_)
    return True


def _ddg_codec(node: SecureNode, task: TaskMessage, t: int, params: SecAggParams, dim: int) -> DdgCodec | None:
    """Distributed DP with the discrete Gaussian: the encoder this node's own config gives for t
    shares. Everything that sets the noise (z, C, bits, beta, gamma, the variance) is derived here;
    only the most summands a round may hold comes from the server, and the node refuses a task
    whose mechanism differs from the one it derived (None: another mechanism)."""
    privacy = node.privacy
    if privacy is None or not privacy.plan.client_shares or privacy.p.mechanism != "discrete_gaussian":
        return None
    theirs_table = task.privacy or {}
    p, theirs = privacy.p, theirs_table.get("ddg")
    if theirs_table.get("mechanism") != "discrete_gaussian" or not isinstance(theirs, dict):
        raise Malformed(
            "this node adds the distributed discrete Gaussian (privacy.mechanism = 'discrete_gaussian'); the "
            f"server's round runs {str(theirs_table.get('mechanism'))[:40]!r}: refusing to take part"
        )
    most = theirs.get("max_summands")
    if not isinstance(most, int) or isinstance(most, bool) or not t <= most <= 1 << 20:
        raise Malformed(f"the task's ddg.max_summands = {short_repr(most)} must be an integer in [t = {t}, 2^20]")
    mine = plan(dim, p.clip_norm, p.noise_multiplier, t, most, p.bits, p.beta, p.gamma, p.rotation)
    if {k: theirs.get(k) for k in mine.as_dict()} != mine.as_dict():
        raise Malformed(
            f"the server's discrete-Gaussian parameters {short_repr(theirs)} differ from this node's own "
            f"{mine.as_dict()}: run the node with the server's [privacy] table"
        )
    log.info(
        "round %s: discrete-Gaussian encoding, integer noise of variance %d at gamma = %.4g (t = %d), modulus 2^%d",
        task.round,
        mine.variance,
        mine.gamma,
        t,
        mine.bits,
    )
    return DdgCodec(mine, rotation_seed(params.session))


def _own_minimum(node: SecureNode, params: SecAggParams, selected: int) -> SecAggParams:
    """The round's parameters with this node's own secure_aggregation.min_inputs (the larger of
    the server's and its own): the node itself never unmasks a smaller sum, whatever the server says."""
    least = max(params.min_inputs, node.secure_cfg.min_inputs)
    if selected < least:
        raise Malformed(
            f"the round selects {selected} nodes, fewer than this node's secure_aggregation.min_inputs = "
            f"{least}: a sum that small is never unmasked, refusing to take part"
        )
    return dataclasses.replace(params, min_inputs=least)


def _identity(node: SecureNode, params: SecAggParams) -> tuple[bytes | None, dict[str, bytes] | None]:
    """This node's identity key and the keys file, when the round runs the malicious-server
    variant; a node configured for that variant refuses a round that does not run it."""
    sa = node.secure_cfg
    if sa.malicious_server and not params.malicious:
        raise Malformed(
            "this node is set to secure_aggregation.malicious_server = true, but the server's round "
            "does not run that variant: refusing to take part"
        )
    if not params.malicious:
        return None, None
    if not sa.keys_file or not sa.identity_key:
        raise Malformed(
            "the server runs the malicious-server variant: set secure_aggregation.keys_file and "
            "identity_key on this node"
        )
    identity, roster = ID.read_identity(sa.identity_key), ID.read_roster(sa.keys_file)
    if roster.get(node.name) != ID.identity_public(identity):
        raise Malformed(f"the keys file does not hold this node's ({node.name!r}) identity key")
    return identity, roster


def _expect(msg, kind):
    if not isinstance(msg, kind):
        raise Malformed(f"expected a {kind.__name__} message, got {type(msg).__name__}")
    return msg
