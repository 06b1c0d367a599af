"""An edge's journal of its open round (``hierarchy.edge_journal``): each node's update kept on
disk before the node hears "accepted", so an edge that restarts mid-round sends what it took."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

log = logging.getLogger(__name__)


class RoundJournal:
    """The updates an edge took in the open root round, on disk (``server.out_dir``/edge-journal):
    one file per update, the node's body as it came, written (and fsynced) before the node hears
    ``accepted``. An edge restarted within the round (a crash, SIGKILL, a redeploy) takes them back
    into its sum (:meth:`entries`), so what its nodes sent is not lost. The files are the nodes'
    updates in the clear: the folder is 0700 and each file 0600 (the edge's user only), and none
    outlives its use: a round's files go once the root answered its partial (:meth:`drop_round`),
    those of any other round as soon as the root's answer shows it is not the round served here
    (:meth:`keep_round`, at start-up too), and the folder at the end of the run (:meth:`remove`).
    Sync rounds only (``hierarchy.edge_journal``)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)  # an older folder (or one made under another umask) is closed too
        self.names = {p.name for p in folder.iterdir()}  # what is on disk: pruning an empty journal reads nothing
        self.lock = threading.Lock()  # keep() runs in a worker thread

    @staticmethod
    def _name(round: int, version: int, node: str) -> str:
        return f"r{round}-v{version}-{node.encode().hex()}.update"

    def keep(self, round: int, version: int, node: str, body: bytes | bytearray | memoryview) -> None:
        path = self.folder / self._name(round, version, node)
        tmp = path.with_suffix(".tmp")
        with self.lock:
            self.names.add(tmp.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a .tmp left by a crash was made before: its mode is not ours
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with self.lock:
            self.names.discard(tmp.name)
            self.names.add(path.name)

    def nodes(self) -> list[str]:
        """Every node with an update kept (whatever its round): connected at an edge's start."""
        return sorted({bytes.fromhex(p.stem.split("-", 2)[2]).decode() for p in self._files()})

    def entries(self, round: int, version: int) -> list[tuple[str, bytes]]:
        """The (node, body) pairs kept for ``round`` / ``version``."""
        prefix = f"r{round}-v{version}-"
        return [
            (bytes.fromhex(p.stem[len(prefix) :]).decode(), p.read_bytes())
            for p in self._files()
            if p.name.startswith(prefix)
        ]

    def keep_round(self, round: int | None) -> None:
        """Remove every file but those of root round ``round`` (None: every file)."""
        self._remove(lambda n: round is None or not n.startswith(f"r{round}-v"))

    def drop_round(self, round: int) -> None:
        """The root answered round ``round``'s partial: its updates are no longer needed."""
        self._remove(lambda n: n.startswith(f"r{round}-v"))

    def remove(self) -> None:
        """The run is over: every file and the folder."""
        with self.lock:
            self.names |= {p.name for p in self.folder.iterdir()}
        self.keep_round(None)
        try:
            self.folder.rmdir()
        except OSError as e:
            log.warning("the edge journal %s is not removed: %s", self.folder, e)

    def _remove(self, which: Callable[[str], bool]) -> None:
        with self.lock:
            names = [n for n in self.names if which(n)]
            for n in names:
                (self.folder / n).unlink(missing_ok=True)
                self.names.discard(n)

    def _files(self) -> list[Path]:
        out = []
        for p in sorted(self.folder.glob("r*-v*-*.update")):
            try:
                bytes.fromhex(p.stem.split("-", 2)[2]).decode()
            except (IndexError, ValueError):
                continue  # not one of this journal's names
            out.append(p)
        return out


# --- the aiohttp side --------------------------------------------------------------------


JOURNAL = web.AppKey("journal", RoundJournal)  # an edge app's journal, when hierarchy.edge_journal is on
