"""The server's answer to a node's poll (GET /v1/task), parsed once into a typed message.

A node reads the task it is given in many places (which round, which seed, whether to evaluate,
its privacy and secure-aggregation tables, the upload's chunk size). The JSON comes from the
network, so it is checked here, once: a field of the wrong type is one clear line (the node
stops, as for any server it cannot trust), and everything after reads typed attributes.
The raw dict stays with the message for the parts that check a run's whole config against what
the node joined with (client/daemon.py) and for the privacy side, which reads its own table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.errors import short_repr
from shoal.rounds import Assignment

from .http import NodeError


def _integer(body: dict[str, Any], key: str, required: bool = True) -> int:
    """``body[key]`` as an int; a field a message need not carry is 0 when absent or not an int."""
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        if not required:
            return 0
        raise NodeError(
            f"the server's task has {key} = {short_repr(value)}, not an integer: a server this node cannot use"
        )
    return value


@dataclass(frozen=True)
class TaskMessage:
    """One poll's answer: ``work`` (train ``round`` from ``version`` with ``seed``), ``done`` (the
    run ended; ``evaluate`` asks for the final model's metrics) or anything else (wait, ask again)."""

    status: str
    round: int = 0
    version: int = 0
    seed: int = 0
    evaluate: bool = False
    reason: str = ""
    upload_chunk_bytes: int | None = None  # the model and upload are larger than one request
    privacy: dict[str, Any] | None = None  # the run's [privacy] as the server states it
    secure_aggregation: dict[str, Any] | None = None  # present: the update leaves only masked
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, body: Any) -> TaskMessage:
        """The typed task of a poll's JSON body; NodeError naming the field when it is malformed."""
        if not isinstance(body, dict) or not isinstance(body.get("status"), str):
            raise NodeError(f"the server's answer to a poll is not a task: {short_repr(body)}")
        status = body["status"]
        privacy = body.get("privacy")
        if privacy is not None and not isinstance(privacy, dict):
            privacy = {"mode": privacy}  # an older server's bare mode: checked against the node's own
        secure = body.get("secure_aggregation")
        if "secure_aggregation" in body and not isinstance(secure, dict):
            raise NodeError(f"the server's task has secure_aggregation = {short_repr(secure)}, not a table")
        chunk = body.get("upload_chunk_bytes")
        chunked = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
        work = status == "work"
        return cls(
            status=status,
            round=_integer(body, "round", work),
            version=_integer(body, "version", work),
            seed=_integer(body, "seed", work),
            evaluate=bool(body.get("evaluate")),
            reason=str(body.get("reason") or "")[:500],
            upload_chunk_bytes=chunk if chunked else None,
            privacy=privacy,
            secure_aggregation=secure,
            raw=body,
        )

    @property
    def secure(self) -> bool:
        """Whether the round runs secure aggregation (the update leaves this node only masked)."""
        return self.secure_aggregation is not None

    @property
    def key(self) -> tuple[int, int]:
        """(round, version): what a node remembers of a task it must not train again."""
        return self.round, self.version

    def assignment(self, client_id: str, seed: int | None = None) -> Assignment:
        """The pipeline's assignment for this task (``seed``: the node's own, under local DP)."""
        return Assignment(client_id, self.round, self.version, self.seed if seed is None else seed)
