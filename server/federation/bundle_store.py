"""The federation's signed task bundles: stored as bytes, never imported (shoal/bundle.py).

`shoal run submit --bundle` uploads a bundle (``POST /v1/runs/bundles``), then names it as the
run's task: ``bundle:SHA256``. The server checks the bundle's format, limits and file hashes
(shoal/bundle.py ``read``) and reads the model's initial state as data (shoal/bundle_model.py):
none of the researcher's code runs here, and the server's own task check (server/task_check.py)
is for registered tasks only. Whether a publisher is trusted is each node's decision: a node
fetches the bundle (``GET /runs/{run}/v1/bundle``) and verifies the signature and every hash
against its own ``[node] trusted_publishers`` before anything is imported there.

Bundles are kept per submitter (a researcher runs only the bundles they uploaded), at most
MAX_PER_SUBMITTER each; the oldest that no queued or running run names makes room.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from shoal.bundle import BundleError, read
from shoal.bundle_model import BundledModel, state_module

from ..task_registry import RunError, TaskEntry

log = logging.getLogger(__name__)

PREFIX = "bundle:"
MAX_PER_SUBMITTER = 32
_REF = re.compile(r"bundle:([0-9a-f]{64})")
_WHO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def is_bundle(task: object) -> bool:
    """A run's task names a bundle (``bundle:SHA256``), not a registered task."""
    return isinstance(task, str) and task.startswith(PREFIX)


def bundle_app(ref: str) -> str:
    """What a bundle run's config carries as task.app on the server: a name ``load_task`` refuses
    before importing anything (its attribute is not an identifier), so no path can ever load it."""
    return f"{ref}:-"


class BundleStore:
    """``federation.dir/bundles/<submitter>/<sha256>.bundle``, files of mode 0600."""

    def __init__(self, folder: Path, max_bytes: int, max_parameters: int = 0):
        self.folder, self.max_bytes, self.max_parameters = folder, max_bytes, max_parameters

    def _dir(self, who: str) -> Path:
        if not _WHO.fullmatch(who):  # submitter names are the server's own (admin, researchers' names)
            raise RunError("bad_submitter", "this submitter's name cannot name a folder", 403)
        return self.folder / who

    def add(self, who: str, blob: bytes, in_use: set[str]) -> dict[str, object]:
        """Check and keep a bundle (call it in a thread: it hashes and parses up to max_bytes).
        RunError 400 ``bad_bundle`` with the reason for anything :func:`shoal.bundle.read` refuses
        or a model that is not a layout of finite float32 tensors."""
        try:
            manifest, _, bundle = read(blob, self.max_bytes)
            numel = sum(p.numel() for p in state_module(bundle.model, self.max_parameters).parameters())
        except BundleError as e:
            log.warning("a bundle from %s refused: %s", who, e)
            raise RunError("bad_bundle", f"the bundle: {e}") from None
        folder = self._dir(who)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"{bundle.sha256}.bundle"
        if not path.exists():
            self._make_room(folder, in_use)
            tmp = path.with_suffix(".part")
            tmp.write_bytes(blob)
            tmp.chmod(0o600)
            tmp.replace(path)
        log.info(
            "bundle %s from %s: %d files, entry %s, publisher %s, %d parameters",
            bundle.sha256[:12],
            who,
            len(manifest.files),
            manifest.entry,
            manifest.publisher[:20],
            numel,
        )
        return {"task": PREFIX + bundle.sha256, "files": len(manifest.files), "parameters": numel}

    def _make_room(self, folder: Path, in_use: set[str]) -> None:
        kept = sorted(folder.glob("*.bundle"), key=lambda p: p.stat().st_mtime)
        while len(kept) >= MAX_PER_SUBMITTER:
            old = next((p for p in kept if PREFIX + p.stem not in in_use), None)
            if old is None:
                raise RunError("too_many_bundles", f"{MAX_PER_SUBMITTER} bundles are in use by your runs", 429)
            old.unlink()
            kept.remove(old)

    def resolve(self, task: object, who: str) -> TaskEntry:
        """The run's bundle, uploaded by ``who``: RunError (400, one line) otherwise."""
        m = _REF.fullmatch(task) if isinstance(task, str) else None
        if m is None:
            raise RunError("bad_task", "a bundle is named bundle:SHA256, as `POST /v1/runs/bundles` answered")
        if not (self._dir(who) / f"{m[1]}.bundle").is_file():
            raise RunError("unknown_bundle", f"no bundle {m[1][:12]}... uploaded by {who}: upload it first")
        return TaskEntry(m[0], m[0], m[1], "bundle")

    def blob(self, ref: str, who: str) -> bytes:
        return (self._dir(who) / f"{self.resolve(ref, who).sha256}.bundle").read_bytes()

    def task(self, ref: str, who: str) -> BundledModel:
        """The server's stand-in for the bundle's task: its initial model, read as data."""
        try:
            _, _, bundle = read(self.blob(ref, who), self.max_bytes)
        except (OSError, BundleError) as e:
            raise RunError("bad_bundle", f"the stored bundle cannot be read: {e}") from None
        return BundledModel(bundle.model, self.max_parameters)
