"""Edge aggregators in a deployment: the root's intake of partials, without I/O.

An edge aggregator serves its nodes as a root does and sends the root one partial per round
(aggregation/partial.py): the sum of its nodes' updates, their total weight and their ids.
:class:`PartialIntake` is the root's side: it checks a partial from the network as the
server checks an update (size, spec hash, dtypes, finite values, every header field), takes
the authenticated edge as its origin (never what the body claims), lets a retransmit of a
partial already taken through as a ``duplicate`` (counted once: an edge retransmits until it
hears back), refuses another partial from the same edge in the same round (``conflict``),
and streams the sum into the open sync round with SyncRounds.submit_sum, which checks every
node inside as it checks one update (selected, not yet received, from this version; all or
nothing). Only the root divides: its strategy takes the sums and steps its optimizer.

:class:`EdgeRound` is the edge's own round logic (its nodes' sum, when to close: every node,
a quorum by weight, or a margin before the root's deadline) and :class:`Retransmit` when it
sends its partial again; :class:`EdgeRounds` runs HierFAVG's ``hierarchy.edge_rounds`` edge
rounds inside one root round (the edge's own model between them). The edge process around them
(its state, the node protocol over HTTP, the route to the root) is server/edge/service.py,
app.py and uplink.py; :class:`EdgeRound`, :class:`EdgeRounds`, :class:`EdgeBuffer` and
:class:`Retransmit` are in rounds.py.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from shoal.aggregation.partial import PartialInbox, decode_partial
from shoal.algorithms import algorithm_of
from shoal.errors import Malformed, UpdateRejected, short_repr
from shoal.privacy_plan import plan_of
from shoal.wire import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from shoal.config import Config

    from ..service import ServerService

log = logging.getLogger(__name__)

#: The most node names one edge poll (POST /v1/edge/poll) may carry.
MAX_ROSTER = 10_000
MAX_EDGE_POLL_BODY = 64 + 2 * 260 * MAX_ROSTER  # its nodes, and (async) those of them waiting for a task
MAX_RECENT_PARTIALS = 64  # an async root remembers this many of each edge's partials (retransmits)


def check_edge(svc: ServerService, edge: str) -> None:
    """UpdateRejected (``not_an_edge``, answered 403) unless ``edge`` is an edge of this server."""
    if edge not in svc.cfg.hierarchy.edge_names:
        raise UpdateRejected("not_an_edge", f"{edge!r} is not an edge aggregator of this server (hierarchy.edge_names)")


def edge_terms(cfg: Config) -> dict[str, Any]:
    """What an edge and its root must run alike, by the config key an operator sets: an edge names
    them in every poll (``"config"``) and the root refuses an edge whose terms are not its own."""
    return {
        "server.mode": cfg.server.mode,
        "algorithm.name": cfg.algorithm.name,
        "privacy.mode": cfg.privacy.mode,
        "secure_aggregation.enabled": bool(cfg.secure_aggregation.enabled),
    }


def terms_mismatch(root: dict[str, Any], edge: object) -> str | None:
    """The first key on which an edge's terms (``edge``, from its poll) differ from the root's, as
    one line naming it; None when they agree. Malformed if ``edge`` is not such an object."""
    if not isinstance(edge, dict) or len(edge) > 32 or not all(isinstance(k, str) for k in edge):
        raise Malformed('an edge poll\'s "config" is an object of at most 32 config keys')
    for key, want in root.items():
        got = edge.get(key)
        if got != want or type(got) is not type(want):
            return (
                f"{key}: this edge runs {short_repr(got)}, the root's rounds run {short_repr(want)}; "
                "give the edge the root's value (an edge runs the root's task, model, privacy and "
                "secure aggregation tables)"
            )
    return None


def parse_roster(body: object) -> list[str]:
    """The node names of an edge's poll body ``{"nodes": [name, ...]}`` (an async edge may add
    ``"want": [...]``, see :func:`parse_want`; every edge adds its ``"config"`` terms, see
    :func:`edge_terms`); Malformed if it is not one."""
    if (
        not isinstance(body, dict)
        or not {"nodes"} <= set(body) <= {"nodes", "want", "config"}
        or not isinstance(body["nodes"], list)
    ):
        raise Malformed(
            'an edge poll is a JSON object {"nodes": [node names]} (and "want": [node names], "config": {...})'
        )
    nodes = body["nodes"]
    if len(nodes) > MAX_ROSTER:
        raise Malformed(f"an edge poll names {len(nodes)} nodes, over {MAX_ROSTER}")
    if not all(isinstance(n, str) and 1 <= len(n) <= 256 for n in nodes) or len(set(nodes)) != len(nodes):
        raise Malformed("an edge poll's nodes are distinct names of 1 to 256 characters")
    return nodes


def parse_want(body: dict, nodes: list[str]) -> set[str]:
    """The nodes of an async edge's poll that wait for a task (``"want"``, a subset of ``"nodes"``)."""
    want = body.get("want", [])
    if not isinstance(want, list) or not all(isinstance(n, str) for n in want) or not set(want) <= set(nodes):
        raise Malformed('an edge poll\'s "want" lists nodes that its "nodes" names')
    return set(want)


class EdgeRoster:
    """Which edge speaks for which node, at the root, without I/O.

    An edge says which of its nodes are connected (its poll, every fraction of a second). The
    root takes a claim only for a node enrolled and enabled in its own registry (``enrolled``)
    and not held by another edge that is still live: the first edge to claim a node holds it
    while it keeps naming it, and loses it ``timeout_s`` after it last did (a dead edge's
    nodes may then be claimed by the edge they re-attach to). When a round opens, the holder
    of each selected node is frozen for that round (:meth:`round_edges`): only that edge may
    send that node's task and count its update, so no node is counted by two edges in a round,
    and a node whose edge dies is that round's drop-out."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.held: dict[str, tuple[str, float]] = {}  # node -> (edge, when it last named the node)
        # nodes that moved to another edge since :meth:`take_moves`: seconds from their old edge's
        # last naming to the new edge's claim (at least timeout_s: a live holder keeps its nodes)
        self.moves: list[float] = []
        self._frozen: tuple[tuple[int, int], dict[str, str]] = ((-1, -1), {})
        self.released: dict[str, float] = {}  # nodes of an edge the root refused, and when

    def holder(self, node: str, now: float) -> str | None:
        held = self.held.get(node)
        return held[0] if held is not None and now - held[1] <= self.timeout_s else None

    def claim(
        self, edge: str, nodes: list[str], now: float, enrolled: Callable[[str], bool]
    ) -> tuple[list[str], dict[str, str]]:
        """Take ``edge``'s claim on ``nodes``: the names it now holds, and the others refused, all
        with one reason (``not_claimable``: not an enrolled node, or held by another live edge), so
        an edge's poll cannot tell which names are enrolled at the root."""
        taken: list[str] = []
        refused: dict[str, str] = {}
        for n in nodes:
            other = self.holder(n, now)
            if not enrolled(n) or (other is not None and other != edge):
                refused[n] = "not_claimable"
            else:
                before = self.held.get(n)
                if before is not None and before[0] != edge:
                    self.moves.append(now - before[1])
                self.held[n] = (edge, now)
                self.released.pop(n, None)
                taken.append(n)
        if len(self.held) > 2 * MAX_ROSTER:  # forget the nodes nobody named for long
            self.held = {n: h for n, h in self.held.items() if now - h[1] <= self.timeout_s}
        return taken, refused

    def release(self, edge: str, now: float) -> list[str]:
        """``edge`` holds no node from now on (the root refused it): the nodes it held."""
        gone = sorted(n for n, (e, _) in self.held.items() if e == edge)
        for n in gone:
            del self.held[n]
            self.released[n] = now
        if len(self.released) > 2 * MAX_ROSTER:
            self.released = {n: t for n, t in self.released.items() if now - t <= self.timeout_s}
        return gone

    def reachable(self, nodes: list[str], last_seen: dict[str, float], now: float) -> list[str]:
        """``nodes`` less those whose last word came from an edge that no longer holds them (it died,
        or the root refused it): a round must not select a node no live edge can hand its task to. A
        node that polled the root itself since stays."""
        out = []
        for n in nodes:
            held = self.held.get(n)
            via_edge = held is not None and last_seen.get(n, -1.0) <= held[1]
            if via_edge and self.holder(n, now) is None:
                continue
            if held is None and n in self.released and last_seen.get(n, -1.0) <= self.released[n]:
                continue
            out.append(n)
        return out

    def take_moves(self) -> list[float]:
        """The re-attachments since the last call (and forget them)."""
        moves, self.moves = self.moves, []
        return moves

    def rehome(self, node: str, edge: str) -> None:
        """``edge`` speaks for ``node`` in the frozen round from now on (see PartialIntake.poll)."""
        self._frozen[1][node] = edge

    def round_edges(self, round: int, version: int, selected: Iterable[str], now: float) -> dict[str, str]:
        """node -> the edge that speaks for it in this round (frozen at the round's first call)."""
        if self._frozen[0] != (round, version):
            edges = {n: e for n in selected if (e := self.holder(n, now)) is not None}
            self._frozen = ((round, version), edges)
        return self._frozen[1]


class PartialIntake:
    """The root's intake of edge partials into its sync rounds: the tier of a ServerService
    (server/tier.py), which makes it (``ServerService(..., tier=PartialIntake)``)."""

    def __init__(self, service: ServerService):
        self.service = service
        self._inbox: PartialInbox | None = None
        self.roster = EdgeRoster(service.cfg.hierarchy.edge_timeout_s)
        self._taken: tuple[int, set[str], int, int] = (-1, set(), 0, 0)  # round, edges, partial bytes, nodes
        # async roots: which edge handed out each node's open task (only it may count the node's
        # update; kept in the root's checkpoints, so that a restarted root still takes the partials
        # of tasks it handed out before), the partials taken towards the next version, and each
        # edge's recent partials (a retransmit of one of them is answered as a duplicate, counted once)
        self.task_via: dict[str, str] = self._restored_task_via()
        self._buffered: tuple[set[str], int, int] = (set(), 0, 0)
        self._recent: dict[str, OrderedDict[str, dict[str, Any]]] = {}
        self.terms = edge_terms(service.cfg)
        self.refused_edges: dict[str, str] = {}  # edge -> why the root refused it (its config), until it agrees
        self._claims_logged: dict[tuple[str, str], str] = {}
        numel = service.spec.numel
        # a float64 sum of the whole model, and a header naming up to ~40,000 nodes
        self.max_bytes = 8 * numel + MAX_HEADER_BYTES + 4096

    def _restored_task_via(self) -> dict[str, str]:
        """The edge of each open task the restored checkpoint names (none on a fresh start): only
        nodes whose task the restored rounds still hold, each with a known edge."""
        svc = self.service
        saved = svc.restored_tier.get("task_via")
        outstanding = getattr(svc.rounds, "outstanding", None)
        if not isinstance(saved, dict) or outstanding is None:
            return {}
        edges = set(svc.cfg.hierarchy.edge_names)
        return {n: e for n, e in saved.items() if n in outstanding and isinstance(e, str) and e in edges}

    def available(self, nodes: list[str], now: float) -> list[str]:
        """The connected ``nodes`` a round may select: not a node whose last word came from an edge
        that no longer holds it."""
        return self.roster.reachable(nodes, self.service.last_seen, now)

    def state(self) -> dict[str, Any]:
        """Kept in each checkpoint: which edge handed out each open task of an async root."""
        return {"task_via": dict(self.task_via)}

    def figures(self, round_: int) -> dict[str, Any]:
        """A version's record: the edges whose partial the root took in that round (the same keys as
        the simulator's), the partials' bytes (the root's ingress from edges) and the nodes inside;
        the nodes that moved to another edge since the last version (``hier_nodes_reattached``) and
        the longest of those moves as the root saw it (``hier_reattach_s``: from the old edge's
        last word on the node to the new edge's claim)."""
        moves = self.roster.take_moves()
        out: dict[str, Any] = {"hier_nodes_reattached": len(moves)}
        if moves:
            out["hier_reattach_s"] = round(max(moves), 3)
        r, edges, nbytes, nodes = self._taken
        if r == round_:
            out.update(hier_edges_reporting=len(edges), hier_bytes_edge_root_up=nbytes, hier_nodes_via_edges=nodes)
        return out

    def status(self, now: float) -> dict[str, Any]:
        """The tier in the run's status: the edges that hold nodes now, and those refused (why)."""
        live = sorted({e for n in self.roster.held if (e := self.roster.holder(n, now)) is not None})
        return {"edges_live": live, "edges_refused": dict(self.refused_edges)}

    def check_terms(self, edge: str, body: object, now: float) -> None:
        """UpdateRejected (``config_mismatch``) when the edge's poll names terms (:func:`edge_terms`)
        other than this root's: it holds no node from then on (rounds select none of them) and the
        run's status names it, until it polls with the root's terms."""
        terms = body.get("config") if isinstance(body, dict) else None
        if terms is None:
            return
        why = terms_mismatch(self.terms, terms)
        if why is None:
            if self.refused_edges.pop(edge, None) is not None:
                log.info("edge %s runs this root's terms now", edge)
            return
        gone = self.roster.release(edge, now)
        if self.refused_edges.get(edge) != why:
            log.warning("edge %s refused (its nodes are not selected: %s): %s", edge, short_repr(gone), why)
        self.refused_edges[edge] = why
        raise UpdateRejected("config_mismatch", why)

    def _why_not(self) -> str | None:
        cfg = self.service.cfg
        if self.service.sync is None and cfg.asynchronous.algorithm != "fedbuff":
            return (
                f"asynchronous.algorithm = {cfg.asynchronous.algorithm!r} mixes each update into the model as it "
                "arrives; an async root takes edge partials into FedBuff's buffer only"
            )
        if self.service.sync is None and cfg.robust.norm_bound:
            return "robust.norm_bound bounds each update, which a sum hides"
        if cfg.secure_aggregation.enabled and cfg.secure_aggregation.malicious_server:
            return "secure_aggregation.malicious_server = true: its consistency round through edges is not built"
        plan = plan_of(cfg)
        distributed_secure = plan.client_shares and plan.secure
        if plan.enabled and not (distributed_secure and self.service.sync is not None):
            return (
                f"privacy.mode = {cfg.privacy.mode!r}: the DP mean clips each update, which a sum hides (distributed "
                "DP runs through edges with secure aggregation in sync rounds: each node clips and adds its noise "
                "share before masking)"
            )
        if not algorithm_of(cfg).summable:
            return f"algorithm.name = {cfg.algorithm.name!r} needs each node's own step and state, not a sum"
        if cfg.robust.rule != "mean":
            return f"robust.rule = {cfg.robust.rule!r} needs each update, not a sum"
        return None

    def inbox(self) -> PartialInbox:
        """The open round's inbox (a new one when the round changed)."""
        r = self.service.sync
        assert r is not None
        if self._inbox is None or (self._inbox.round, self._inbox.version) != (r.round, r.version):
            self._inbox = PartialInbox(r.round, r.version, self.service.spec.numel, self.service.cfg.strategy.weighting)
        return self._inbox

    def poll(
        self,
        edge: str,
        body: object,
        enrolled: Callable[[str], bool],
        now: float,
        revoked: Callable[[str], bool] = lambda _n: False,
    ) -> dict[str, Any]:
        """An edge's poll (POST /v1/edge/poll): its connected nodes, claimed for it (:class:`EdgeRoster`;
        ``enrolled`` says a name is a node enabled in the root's registry) and counted as connected
        (rounds select them as they select nodes polling the root); the answer is the tasks of the
        open round for the nodes this edge speaks for in it, or ``wait``, or ``done``. ``revoked`` says a
        name was revoked at the root: those among the refused names are listed for the edge to refuse
        (names never enrolled are not, so a poll cannot probe the registry). A ShoalError with
        nothing changed if the poll is refused."""
        svc = self.service
        names = svc.cfg.hierarchy.edge_names
        try:
            check_edge(svc, edge)
            why = self._why_not()
            if why is not None:
                raise UpdateRejected("not_supported", f"this server takes no edges: {why}")
            nodes = parse_roster(body)
            self.check_terms(edge, body, now)
        except Exception as e:
            svc.refused(getattr(e, "code", "error"))
            raise
        taken, refused = self.roster.claim(edge, nodes, now, lambda n: n not in names and enrolled(n))
        if svc.sync is None:
            return self._poll_async(edge, taken, refused, parse_want(body, nodes), now, revoked)  # type: ignore[arg-type]
        works = {n: svc.poll(n, now) for n in taken}  # each is seen (connected) as if it polled the root
        answer = self._answer(edge, taken, refused, revoked)
        if svc.done:
            return answer
        r = svc.sync
        assert r is not None  # async roots answered above
        if not r.open:
            return {**answer, "status": "wait"}
        edges = self.roster.round_edges(r.round, r.version, r.selected, now)
        if not svc.cfg.secure_aggregation.enabled:
            # a plain round: a selected node this edge now holds (it re-attached here after its edge of
            # the round died, or no edge held it when the round opened) gets its task here. Its old
            # edge, if it comes back, cannot count it (not_your_node): one edge per node and round.
            # If this edge's partial of the round is in already, the node cannot be counted in this
            # round: the root stops waiting for it (it is attached, not late)
            sent = edge in self.inbox().origins
            for n in taken:
                if n in r.selected and n not in r.received and edges.get(n) != edge:
                    if sent:
                        if svc.refused_task.get(n) != (r.round, r.version):
                            log.info("round %d: node %s re-attached to edge %s after its partial", r.round, n, edge)
                            svc.refused_task[n] = (r.round, r.version)
                        continue
                    log.info("round %d: node %s re-attached to edge %s, which hands out its task", r.round, n, edge)
                    self.roster.rehome(n, edge)
        tasks = {
            n: int(w["seed"])
            for n, w in works.items()
            if w is not None and w.get("status") == "work" and w["round"] == r.round and edges.get(n) == edge
        }
        if not tasks:
            return {**answer, "status": "wait"}
        secure = [w["secure_aggregation"] for w in works.values() if w is not None and "secure_aggregation" in w]
        if secure:  # one protocol for the whole cohort: the edge relays it (server/edge/secure.py)
            answer["secure_aggregation"] = secure[0]
        privacy = [w["privacy"] for w in works.values() if w is not None and "privacy" in w]
        if privacy:  # distributed DP: the round's t and noise, which each node checks against its own config
            answer["privacy"] = privacy[0]
        left = r.time_left(now)
        return {
            **answer,
            "status": "work",
            "round": r.round,
            "version": r.version,
            "tasks": tasks,
            **({"deadline_s": round(left, 3)} if left is not None else {}),
        }

    def _answer(
        self, edge: str, taken: list[str], refused: dict[str, str], revoked: Callable[[str], bool]
    ) -> dict[str, Any]:
        """What every answer to an edge's poll says (sync or async root): the version, how many of its
        nodes it holds, the claims refused, and ``done`` (with the reason) once the run ended."""
        svc = self.service
        answer: dict[str, Any] = {"edge": edge, "version": svc.version, "nodes": len(taken)}
        if refused:
            answer["refused"] = dict(sorted(refused.items())[:100])
        # every node it named that the root revoked: the edge refuses it from this answer on, whatever
        # its own copy of the registry says
        gone = sorted(n for n in refused if revoked(n))
        if gone:
            answer["revoked"] = gone
        for n, why in refused.items():  # each refused claim logged once (until its reason changes)
            if self._claims_logged.get((edge, n)) != why:
                if len(self._claims_logged) >= 2 * MAX_ROSTER:
                    self._claims_logged.clear()
                self._claims_logged[(edge, n)] = why
                log.info("edge %s's claim on node %s refused: %s", edge, n, why)
        if svc.done:
            answer["status"] = "done"
            if svc.stop_reason is not None:
                answer["reason"] = svc.stop_reason
        return answer

    def _poll_async(
        self,
        edge: str,
        taken: list[str],
        refused: dict[str, str],
        want: set[str],
        now: float,
        revoked: Callable[[str], bool],
    ) -> dict[str, Any]:
        """An async root's answer to an edge's poll: a task from the current version for each node
        it holds that waits for one (``want``); the others are only seen (connected). A node's task
        handed out here replaces any other it held (at the root or through another edge)."""
        svc = self.service
        tasks: dict[str, int] = {}
        for n in taken:
            if n not in want:
                svc.seen(n, now)
                continue
            work = svc.poll(n, now)
            if work is not None and work.get("status") == "work":
                tasks[n] = int(work["seed"])
                self.task_via[n] = edge
        answer = self._answer(edge, taken, refused, revoked)
        if svc.done:
            return answer
        if not tasks:
            return {**answer, "status": "wait"}
        return {**answer, "status": "work", "round": svc.version, "tasks": tasks}

    def _submit_async(self, edge: str, body: bytes | bytearray | memoryview, now: float) -> dict[str, Any]:
        """A partial from an edge of an async root: its nodes' updates, all trained from the partial's
        version, into FedBuff's buffer with their staleness weight (AsyncRounds.submit_sum; a partial
        of k nodes counts k). Each node inside must hold an open task handed out through this edge,
        from that version, no more than ``asynchronous.max_staleness`` versions old (all or nothing:
        a partial of a node that holds no such task is refused whole, nothing changed)."""
        svc = self.service
        from shoal.async_rounds import AsyncRounds

        r = svc.rounds
        assert isinstance(r, AsyncRounds)
        part = decode_partial(body, svc.spec.numel, svc.spec.hash, self.max_bytes).sealed(edge)
        digest = part.digest()
        recent = self._recent.setdefault(edge, OrderedDict())
        if digest in recent:  # a retransmit of a partial already taken: counted once
            return {**recent[digest], "status": "duplicate"}
        if svc.done:
            raise UpdateRejected("done", f"training is complete at version {r.version}; no more partials")
        if part.version > r.version:
            raise UpdateRejected("unknown_version", f"partial of version {part.version}, newer than {r.version}")
        foreign = sorted(n for n in part.senders if self.task_via.get(n) != edge)
        if foreign:
            raise UpdateRejected(
                "not_your_node",
                f"edge {edge!r} handed out no open task to {short_repr(foreign[:5])}: a partial holds only nodes "
                "whose task came through this edge (POST /v1/edge/poll)",
            )
        advanced = r.submit_sum(part.to_partial_sum())
        for n in part.senders:
            self.task_via.pop(n, None)
        answer = {"status": "accepted", "round": part.round, "version": r.version, "nodes": part.count}
        recent[digest] = answer
        while len(recent) > MAX_RECENT_PARTIALS:
            recent.popitem(last=False)
        edges, nbytes, nodes = self._buffered
        self._buffered = (edges | {edge}, nbytes + len(body), nodes + part.count)
        if advanced:
            self._taken = (r.round, *self._buffered)
            self._buffered = (set(), 0, 0)
        return answer

    def submit(self, edge: str, body: bytes | bytearray | memoryview, now: float) -> dict[str, Any]:
        """Validate a partial from ``edge`` (the authenticated identity) and merge it into the open
        round (an async root: into FedBuff's buffer); raises a ShoalError (WireError or
        UpdateRejected) with nothing changed if refused."""
        svc = self.service  # an edge is no node: it is not marked seen, so rounds never select it
        if svc.sync is None:
            try:
                check_edge(svc, edge)
                why = self._why_not()
                if why is not None:
                    raise UpdateRejected("not_supported", f"this server takes no partials: {why}")
                version = svc.version
                answer = self._submit_async(edge, body, now)
            except Exception as e:
                svc.refused(getattr(e, "code", "error"))
                svc.activity.refused(edge, getattr(e, "code", "error"), str(e), now)
                raise
            if answer["status"] == "accepted":
                svc.counters.accepted += answer["nodes"]
                svc.counters.bytes_received += len(body)
                svc.activity.accepted(edge, len(body), version, now)
                if svc.version != version:
                    svc.new_version(svc.rounds.version_fields(), now)
            return answer
        try:
            check_edge(svc, edge)
            why = self._why_not()
            if why is None and svc.cfg.secure_aggregation.enabled:  # server/edge/secure.py
                why = "its rounds are secure: an edge sends its nodes' masked sum (POST /v1/edge/secagg/masked_sum)"
            if why is not None:
                raise UpdateRejected("not_supported", f"this server takes no partials: {why}")
            part = decode_partial(body, svc.spec.numel, svc.spec.hash, self.max_bytes)
            part = part.sealed(edge)  # the authenticated edge is its origin, whatever the body says
            r = svc.sync
            assert r is not None
            if svc.done:
                raise UpdateRejected("done", f"training is complete at version {r.version}; no more partials")
            if not r.open:
                raise UpdateRejected("round_closed", f"no round is open (version {r.version})")
            held = self.roster.round_edges(r.round, r.version, r.selected, now)
            foreign = sorted(n for n in part.senders if held.get(n) != edge)
            if foreign:
                raise UpdateRejected(
                    "not_your_node",
                    f"edge {edge!r} does not speak for {short_repr(foreign[:5])} in round {r.round}: a partial may "
                    "hold only the selected nodes that this edge claimed when the round opened (POST /v1/edge/poll)",
                )
            inbox = self.inbox()
            receipt, merged = inbox.admit(part)
            if merged is not None:
                if not merged.senders:
                    raise UpdateRejected("empty", "a partial of no node")
                try:
                    r.submit_sum(merged.to_partial_sum())
                except BaseException:
                    inbox.release(edge)
                    raise
                inbox.record(edge)
        except Exception as e:
            svc.refused(getattr(e, "code", "error"))
            svc.activity.refused(edge, getattr(e, "code", "error"), str(e), now)
            raise
        if merged is not None:
            svc.counters.accepted += len(merged.senders)
            svc.counters.bytes_received += len(body)
            svc.activity.accepted(edge, len(body), r.round, now)
            if self._taken[0] != r.round:
                self._taken = (r.round, set(), 0, 0)
            _, edges, nbytes, nodes = self._taken
            self._taken = (r.round, edges | {edge}, nbytes + len(body), nodes + len(merged.senders))
            # an edge sends one partial a round: its other nodes (closed out at its quorum or its
            # margin) will not report in this round, and the root stops waiting for them
            for n, holder in held.items():
                if holder == edge and n not in r.received:
                    svc.refused_task[n] = (r.round, r.version)
        return {
            "status": "accepted" if merged is not None else "duplicate",
            "round": r.round,
            "version": svc.version,
            "nodes": receipt.senders,
        }
