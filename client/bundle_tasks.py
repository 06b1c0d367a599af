"""A node takes a run's signed task bundle: fetched, verified, checked in a worker, then installed.

A run whose task is ``bundle:SHA256`` carries the researcher's own code (shoal/bundle.py). Before
anything of it is imported on this node:

1. the node's operator must trust a publisher (``[node] trusted_publishers``; none: refused);
2. the bundle's bytes, fetched from the run (``GET /runs/{run}/v1/bundle``, at most
   ``node.bundle_max_mb``), must have the SHA-256 the run names, a manifest signed by one of those
   keys, and every file the size and SHA-256 the manifest names;
3. its files are written under ``state_dir/bundles/SHA256/`` (regular files only, names checked);
4. a worker process with a memory and time limit (``node.bundle_check_mb``, ``node.bundle_check_s``;
   server/task_check.py) imports the task with the run's [task.args] and builds its model, whose
   layout must be the one the bundle's initial model has (the model the server runs).

Only then is the task added to the node's allowed tasks, reading ``node.bundle_data``; from there
on it is checked and run as an installed task is (its bundle's file hashed again at each task).
Any failure is a refusal with its reason, which the run's status shows.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import ssl
from pathlib import Path
from typing import Any

import aiohttp

from shoal.bundle import Bundle, BundleError, verify
from shoal.bundle_model import state_module
from shoal.params import ParamSpec

from .http import Retry
from .node_config import AllowedTask, NodeConfig

log = logging.getLogger(__name__)

PREFIX = "bundle:"


async def admit_bundle(
    cfg: NodeConfig, offer: dict[str, Any], http: aiohttp.ClientSession, url: str, ssl_context: ssl.SSLContext | None
) -> str | None:
    """Why this node refuses the offered run's bundle; None when the run names no bundle or its
    bundle is verified and installed (then ``cfg.tasks`` holds it). Retry when the server did not
    answer (asked again at the next poll)."""
    name = offer["task"]
    if not name.startswith(PREFIX) or name in cfg.tasks:
        return None
    policy, who = cfg.bundles, f"node {cfg.name}"
    if not policy.trusted_publishers or policy.data is None:
        return f"{who} takes no task bundles (its config lists no [node] trusted_publishers)"
    if name != PREFIX + offer["task_sha256"]:
        return f"the run names bundle {name[:80]} with the pin {offer['task_sha256'][:16]}...; they differ"
    limit = policy.max_mb << 20
    try:
        async with http.get(f"{url}/runs/{offer['run']}/v1/bundle", ssl=ssl_context or True) as resp:
            if resp.status != 200:
                raise Retry(f"GET the bundle of {offer['run']}: {resp.status}")
            if (resp.content_length or 0) > limit:
                return f"the run's bundle is over {who}'s node.bundle_max_mb = {policy.max_mb}"
            blob = await resp.content.read(limit + 1)
    except (TimeoutError, aiohttp.ClientError) as e:
        raise Retry(f"GET the bundle of {offer['run']}: {type(e).__name__}") from None
    if len(blob) > limit:
        return f"the run's bundle is over {who}'s node.bundle_max_mb = {policy.max_mb}"
    try:
        return await asyncio.to_thread(install, cfg, offer, blob)
    except BundleError as e:
        return f"{who} refuses the run's bundle: {e}"


def install(cfg: NodeConfig, offer: dict[str, Any], blob: bytes) -> str | None:
    """Verify, write and check the bundle (in a thread); None and ``cfg.tasks`` updated when it
    passes, the reason otherwise (BundleError for a bundle that fails verification)."""
    sha = hashlib.sha256(blob).hexdigest()
    if sha != offer["task_sha256"]:
        raise BundleError(f"its bytes have SHA-256 {sha[:16]}..., the run names {offer['task_sha256'][:16]}...")
    policy = cfg.bundles
    bundle = verify(blob, policy.trusted_publishers, policy.max_mb << 20)
    folder = write_files(cfg.state_dir / "bundles", bundle)
    stored = folder.with_suffix(".bundle")
    stored.write_bytes(blob)
    stored.chmod(0o600)
    entry = f"{folder / bundle.entry_file}:{bundle.manifest.entry.rpartition(':')[2]}"
    why = check_in_worker(cfg, offer, entry, bundle)
    if why is not None:
        return f"node {cfg.name}: the bundle's task does not load here: {why}"
    cfg.tasks[offer["task"]] = AllowedTask(entry, sha, policy.data, offer["task"], stored)  # type: ignore[arg-type]
    log.info(
        "%s: bundle %s of publisher %s verified and installed", offer["run"], sha[:12], bundle.manifest.publisher[:20]
    )
    return None


def write_files(root: Path, bundle: Bundle) -> Path:
    """The bundle's files under ``root/SHA256/`` (a fresh folder each time, mode 0700, files 0600,
    never following a link: names were checked by shoal/bundle.py)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = root / bundle.sha256
    tmp = root / f"{bundle.sha256}.part"
    for old in (tmp, folder):
        if old.exists():
            shutil.rmtree(old)
    tmp.mkdir(mode=0o700)
    for name, data in bundle.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    tmp.rename(folder)
    return folder


def check_in_worker(cfg: NodeConfig, offer: dict[str, Any], entry: str, bundle: Bundle) -> str | None:
    """Import the task in a worker process under this node's limits and compare its model's
    layout with the bundle's initial model (the model the server runs): why not, or None."""
    from shoal.server.task_check import TaskChecker

    model = state_module(bundle.model)
    want = ParamSpec.of(model).with_base(model).hash
    raw = {k: dict(v) for k, v in offer["config"].items()}
    raw["task"] = {**raw.get("task", {}), "app": entry}
    checker = TaskChecker(cfg.bundles.check_mb, cfg.bundles.check_s, where="node.bundle_check")
    try:
        got, why = checker.model_check(raw)
    finally:
        checker.close()
    if why is not None:
        return why
    if got != want:
        return f"its model's layout (spec {got}) is not the bundle's initial model's ({want})"
    return None
