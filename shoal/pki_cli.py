"""`shoal pki`: the federation's CA, the server's certificate and node keys (shoal/pki.py)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Provisioning without openssl: a private CA, the server's certificate, node keys.",
    no_args_is_help=True,
)


@app.command("ca")
def ca(
    out: Path = typer.Option(..., "--out", "-o", help="Folder for ca.pem (public) and ca.key (mode 0600)."),
    name: str = typer.Option("shoal private CA", "--name", help="The CA's name (the issuer of every certificate)."),
    days: int = typer.Option(3650, "--days", help="Days the CA is valid (1 to 3650)."),
) -> None:
    """Make the federation's private CA. Keep ca.key on the operator's machine, give ca.pem to every node."""
    from .pki import make_ca

    cert, key = make_ca(out, name, days)
    typer.echo(f"CA written: {cert} (give it to every node: --ca-cert) and {key} (private, mode 0600)")


@app.command("server-cert")
def server_cert(
    ca_dir: Path = typer.Option(..., "--ca-dir", help="The folder of ca.pem and ca.key (`shoal pki ca`)."),
    host: list[str] = typer.Option(
        ..., "--host", help="A host name or IP address nodes dial (repeat for each; all go in the subjectAltName)."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Folder for server.pem and server.key (default: --ca-dir)."
    ),
    days: int = typer.Option(825, "--days", help="Days the certificate is valid (1 to 3650)."),
) -> None:
    """Make the server's certificate and key for every --host; set server.tls_cert and server.tls_key to them."""
    from .pki import issue_server_cert

    cert, key = issue_server_cert(ca_dir, host, out or ca_dir, days)
    typer.echo(
        f"server certificate for {', '.join(host)}: {cert} and {key} (mode 0600); "
        f'set server.tls_cert = "{cert}" and server.tls_key = "{key}"'
    )


@app.command("peer-cert")
def peer_cert(
    ca_dir: Path = typer.Option(..., "--ca-dir", help="The folder of ca.pem and ca.key (`shoal pki ca`)."),
    name: str = typer.Option(..., "--name", help="The peer's name: the files are NAME.pem and NAME.key."),
    host: list[str] = typer.Option(
        ...,
        "--host",
        help="A host name or IP address other peers dial (repeat for each; all go in the subjectAltName).",
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for NAME.pem and NAME.key (default: --ca-dir)."),
    days: int = typer.Option(825, "--days", help="Days the certificate is valid (1 to 3650)."),
) -> None:
    """Make a gossip peer's certificate and key (server and client use) for every --host; give them to
    `shoal peer --tls-cert NAME.pem --tls-key NAME.key --ca-cert ca.pem`."""
    from .pki import check_node_name, issue_server_cert

    check_node_name(name)
    cert, key = issue_server_cert(ca_dir, host, out or ca_dir, days, name=name, client_auth=True)
    typer.echo(
        f"peer certificate for {', '.join(host)}: {cert} and {key} (mode 0600); run `shoal peer "
        f"--tls-cert {cert} --tls-key {key} --ca-cert {Path(ca_dir) / 'ca.pem'}`"
    )


@app.command("node-key")
def node_key(
    name: str = typer.Option(..., "--name", help="The node's name, as the operator registers it."),
    out: Path = typer.Option(Path("."), "--out", "-o", help="Folder for NAME.key (mode 0600) and NAME.csr."),
) -> None:
    """On the node: make its key pair. NAME.key stays here; send NAME.csr (public) to the operator."""
    from .pki import make_node_key

    made = make_node_key(out, name)
    typer.echo(
        f"{made.key} (private, stays on this node) and {made.csr} (send it to the operator); "
        f"key fingerprint {made.fingerprint} (compare it with the operator's). The operator runs "
        f"`shoal server nodes add {name} --csr {made.csr.name} --ca-dir CA_DIR` and gives back "
        f"{name}.pem and ca.pem; then: shoal client --cert {made.csr.with_suffix('.pem')} --key {made.key} "
        "--ca-cert ca.pem ..."
    )


@app.command("renew")
def renew(
    ca_dir: Path = typer.Option(..., "--ca-dir", help="The folder of ca.pem and ca.key that issued the certificate."),
    cert: Path = typer.Option(..., "--cert", help="The certificate to renew: server.pem, or a node's NAME.pem."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where the new certificate goes (default: over --cert)."),
    days: int = typer.Option(825, "--days", help="Days the new certificate is valid (1 to 3650; never past the CA)."),
    host: list[str] | None = typer.Option(
        None, "--host", help="Server certificate only: new hosts for its subjectAltName (default: the old ones)."
    ),
    rotate_key: Path | None = typer.Option(
        None,
        "--rotate-key",
        help="Server certificate only: make a new key and write it over this key file (mode 0600).",
    ),
) -> None:
    """Re-issue a server or node certificate from the same CA: same name, usage and hosts, new validity.

    The key is kept (a node's registry entry still matches), or with --rotate-key the server's is
    replaced. Restart `shoal server` to serve a renewed server certificate; a node reads its
    certificate when it starts."""
    from .pki import renew_cert

    made = renew_cert(ca_dir, cert, out, days, host or None, rotate_key)
    hosts = f" for {', '.join(made.sans)}" if made.sans else ""
    key = f"; new key {made.key} (mode 0600)" if made.key else "; same key"
    typer.echo(f"{made.kind} certificate renewed{hosts}: {made.cert}, valid until {made.not_after:%Y-%m-%d}{key}")
