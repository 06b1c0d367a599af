"""`shoal bundle`: a publisher key, and task bundles packed from a folder (the file side of
shoal/bundle.py, which is the format alone).

A researcher makes a key pair once (`shoal bundle keygen --out publisher.key`), gives the printed
public key to the node operators (they list it in ``[node] trusted_publishers``), and from then on
submits runs of their own task with `shoal run submit --bundle DIR --task task.py:name --key
publisher.key`: nothing is installed on the nodes.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import typer

from .bundle import MAGIC, MAX_CODE_BYTES, MAX_FILES, BundleError, check_name, load_private_key, pack
from .errors import ConfigError

log = logging.getLogger(__name__)

app = typer.Typer(help="Signed task bundles: publisher keys, packing.", no_args_is_help=True)
SKIPPED = ("__pycache__",)  # and hidden files and folders (a name starting with '.')


def read_folder(root: Path) -> dict[str, bytes]:
    """The files under ``root`` (or the one file ``root``) by their bundle names; BundleError for a
    symbolic link, a special file, a name a bundle cannot hold, too many files or bytes. Hidden
    entries and ``__pycache__`` folders are left out."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise BundleError(f"{root} is a symbolic link; a bundle holds regular files only")
    if stat.S_ISREG(st.st_mode):
        return {check_name(root.name): _read_regular(root)}
    if not stat.S_ISDIR(st.st_mode):
        raise BundleError(f"{root} is neither a folder nor a regular file")
    files: dict[str, bytes] = {}
    total = 0
    for folder, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED)
        for d in dirs:
            if os.path.islink(os.path.join(folder, d)):
                raise BundleError(f"{Path(folder) / d} is a symbolic link; a bundle holds regular files only")
        for name in sorted(n for n in names if not n.startswith(".") and not n.endswith(".pyc")):
            path = Path(folder) / name
            rel = check_name(path.relative_to(root).as_posix())
            files[rel] = _read_regular(path)
            total += len(files[rel])
            if len(files) >= MAX_FILES or total > MAX_CODE_BYTES:
                raise BundleError(
                    f"{root} holds more than {MAX_FILES - 1} files or {MAX_CODE_BYTES} bytes: bundle the task's own "
                    "files only (hidden files and __pycache__ are left out)"
                )
    return files


def _read_regular(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if os.path.islink(path):
            raise BundleError(f"{path} is a symbolic link; a bundle holds regular files only") from None
        raise BundleError(f"{path} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{path} is not a regular file")
        return f.read(MAX_CODE_BYTES + 1)


def bundle_for_run(source: Path, entry: str, key_file: Path | None, raw: dict[str, Any]) -> bytes:
    """The signed bundle to submit with the run config ``raw``: ``source`` as it is when it is a
    bundle file already, else its files packed with the model's initial state, built here (on the
    researcher's machine) from the task loaded with the run's [task.args] and seeded by its
    simulation.seed, as every engine starts it."""
    try:
        if source.is_file() and source.read_bytes()[: len(MAGIC)] == MAGIC:
            return source.read_bytes()
    except OSError as e:
        raise ConfigError(f"--bundle {source}: {e.strerror}") from None
    if key_file is None:
        raise ConfigError("--bundle packs and signs the task: give --key publisher.key (`shoal bundle keygen`)")
    try:
        files = read_folder(source)
        key = load_private_key(key_file.read_bytes())
    except OSError as e:
        raise ConfigError(f"--bundle {source} / --key {key_file}: {e.strerror}") from None
    model = initial_model_bytes(source, entry, raw)
    return pack(files, entry, key, model)


def initial_model_bytes(source: Path, entry: str, raw: dict[str, Any]) -> bytes:
    from .bundle_model import initial_state
    from .config import config_from_dict
    from .task import load_task, make_model

    where = source if source.is_dir() else source.parent
    path, _, attr = entry.rpartition(":")
    cfg = config_from_dict({k: v for k, v in raw.items() if k in ("simulation", "task")})
    task = load_task(f"{where.resolve() / path}:{attr}", cfg.task.args)
    model = make_model(task, cfg.simulation.seed)
    return initial_state(model, task.exchange_buffers)


@app.command("keygen")
def keygen(
    out: Path = typer.Option(..., "--out", "-o", help="The private key file to write (mode 0600, never overwritten)."),
) -> None:
    """Make a publisher key pair: OUT (private, 0600) and OUT.pub; prints the public key that node
    operators list as node.trusted_publishers in their node configs."""
    from .bundle import new_private_key, private_key_pem, public_key_text
    from .pki import write_secret

    key = new_private_key()
    write_secret(out, private_key_pem(key))
    public = public_key_text(key)
    Path(f"{out}.pub").write_text(public + "\n")
    typer.echo(public)


@app.command("pack")
def pack_command(
    source: Path = typer.Argument(..., help="The task's folder, or its one .py file."),
    task: str = typer.Option(..., "--task", "-t", help="The entry: file.py:name, relative to the folder."),
    key: Path = typer.Option(..., "--key", help="The publisher's private key (`shoal bundle keygen`)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="The run's TOML (its task.args and simulation.seed)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="The bundle file to write."),
) -> None:
    """Pack and sign a bundle into a file (`shoal run submit --bundle FILE` sends it as it is)."""
    import tomllib

    raw = tomllib.loads(config.read_text()) if config is not None else {}
    blob = bundle_for_run(source, task, key, raw)
    out.write_bytes(blob)
    typer.echo(f"{out}: {len(blob)} bytes")
