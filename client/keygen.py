"""`shoal keygen`: a node's Ed25519 identity key for secure aggregation against a malicious server."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import typer


def keygen(
    out: Path = typer.Option(..., "--out", "-o", help="Private key file to write (mode 0600, never overwritten)."),
    name: str = typer.Option(..., "--name", help="The node's registered name (`shoal server nodes add NAME`)."),
) -> None:
    """Make this node's identity key and print its keys-file entry.

    Collect every node's entry into one JSON object (the keys file) and give it to every
    node with the config, outside the server: secure_aggregation.keys_file. Set
    secure_aggregation.identity_key to OUT on this node."""
    from shoal.aggregation.secagg.identity import write_identity

    public = write_identity(out)
    typer.echo(json.dumps({name: base64.b64encode(public).decode()}))
