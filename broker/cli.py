"""`kvbroker serve | gateway | status | cancel | trace`: the operator's commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import click
import msgspec

from protocols.logs import configure_logging

from .timeline import field_stats, phase_steps, read_events


@click.group()
def main() -> None:
    """kvbroker: move KV cache between prefill and decode vLLM instances."""


@main.command()
@click.option("--bind", default="tcp://127.0.0.1:7100", show_default=True, help="ZMQ address to serve on.")
@click.option("--backend", type=click.Choice(["asyncio", "trio"]), default="asyncio", show_default=True)
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY, else json.")
@click.option("--log-level", default="info", show_default=True)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus /metrics on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option("--heartbeat", "heartbeat_s", type=float, default=1.0, show_default=True, help="Seconds between peer heartbeats.")
@click.option("--peer-lease", "peer_lease_s", type=float, default=5.0, show_default=True, help="Evict a silent peer after this many seconds.")
@click.option("--transfer-lease", "transfer_lease_s", type=float, default=30.0, show_default=True, help="Longest a transfer may live.")
@click.option("--credit-timeout", "credit_timeout_s", type=float, default=10.0, show_default=True, help="Longest wait for room in a decode pool.")
@click.option("--max-attempts", type=int, default=3, show_default=True, help="Deliveries tried before a transfer fails.")
@click.option("--max-transfers", type=int, default=100_000, show_default=True)
@click.option("--max-peers", type=int, default=4096, show_default=True)
@click.option(
    "--curve-secret-file", type=click.Path(exists=True, dir_okay=False), default=None,
    help="Z85 CURVE secret key from `kvbroker keygen`: traffic is encrypted and peers need the public key.",
)
@click.option(
    "--curve-clients", type=click.Path(exists=True, file_okay=False), default=None,
    help="Folder of peers' public keys (*.key, from `kvbroker keygen --name`): only those peers get in.",
)
@click.option("--port-file", type=click.Path(dir_okay=False), default=None, help="Write the bound endpoint here once serving (for --bind ...:0).")
def serve(**opts: Any) -> None:
    """Run the broker daemon (binds to loopback unless told otherwise)."""
    from .core import BrokerConfig
    from .daemon import DaemonConfig
    from .daemon import serve as run

    configure_logging(opts["log_format"] or ("console" if sys.stderr.isatty() else "json"), opts["log_level"])
    try:
        core = BrokerConfig(
            heartbeat_s=opts["heartbeat_s"],
            peer_lease_s=opts["peer_lease_s"],
            transfer_lease_s=opts["transfer_lease_s"],
            credit_timeout_s=opts["credit_timeout_s"],
            max_attempts=opts["max_attempts"],
            max_transfers=opts["max_transfers"],
            max_peers=opts["max_peers"],
            note_steps=opts["log_level"].lower() == "debug",
            note_transfers=opts["log_level"].lower() in ("debug", "info"),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    secret = Path(opts["curve_secret_file"]).read_bytes().strip() if opts["curve_secret_file"] else None
    clients = None
    if opts["curve_clients"]:
        if secret is None:
            raise click.UsageError("--curve-clients needs --curve-secret-file: client keys are checked only under CURVE.")
        clients = _client_keys(Path(opts["curve_clients"]))
    run(
        DaemonConfig(
            bind=opts["bind"],
            metrics_port=opts["metrics_port"],
            metrics_host=opts["metrics_host"],
            curve_secret_key=secret,
            curve_client_keys=clients,
            port_file=opts["port_file"],
            core=core,
        ),
        backend=opts["backend"],
    )


def _client_keys(folder: Path) -> frozenset[bytes]:
    """The Z85 public keys in a folder's *.key files; a bad or missing one is a usage error."""
    keys = set()
    for path in sorted(folder.glob("*.key")):
        key = path.read_bytes().strip()
        if len(key) != 40:
            raise click.UsageError(f"{path} does not hold a 40-character Z85 public key; make it with `kvbroker keygen --name`.")
        keys.add(key)
    if not keys:
        raise click.UsageError(f"{folder} has no *.key files: no peer could connect; copy the peers' public keys there.")
    return frozenset(keys)


def _asks_broker(command: Any) -> Any:
    """The options of a command that asks the broker one thing: where, how long, which keys."""
    for option in reversed([
        click.option("--broker", default="tcp://127.0.0.1:7100", show_default=True, help="Broker address."),
        click.option("--timeout", type=float, default=3.0, show_default=True),
        click.option("--curve-server-key", default=None, help="The broker's Z85 CURVE public key, if it serves with one."),
        click.option(
            "--curve-client-secret-file", type=click.Path(exists=True, dir_okay=False), default=None,
            help="This client's secret key (`kvbroker keygen --name`), for a broker serving with --curve-clients.",
        ),
    ]):
        command = option(command)
    return command


def _ask(call: Any, *args: Any, broker: str, timeout: float, curve_server_key: str | None,
         curve_client_secret_file: str | None) -> Any:
    """`call(broker, *args, timeout, keys)` run once, its failure one sentence."""
    client_secret = Path(curve_client_secret_file).read_bytes() if curve_client_secret_file else None
    try:
        return anyio.run(call, broker, *args, timeout, curve_server_key, client_secret)
    except TimeoutError:
        raise click.ClickException(
            f"the broker at {broker} did not answer within {timeout:g} s; is `kvbroker serve --bind {broker}` running?"
        ) from None
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@_asks_broker
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def status(as_json: bool, **where: Any) -> None:
    """Show peers, pools and transfers in flight."""
    from .status import fetch_status, render_status

    snap = _ask(fetch_status, **where)
    if as_json:
        click.echo(msgspec.json.encode(snap).decode())
    else:
        click.echo(render_status(snap))


@main.command()
@click.argument("transfer_id")
@_asks_broker
@click.option("--reason", default="", help="Why, for the peers' logs.")
def cancel(transfer_id: str, reason: str, **where: Any) -> None:
    """Say that the request behind TRANSFER_ID was given up: its KV is freed on both sides now."""
    from .status import cancel_transfer

    got = _ask(cancel_transfer, transfer_id, reason, **where)
    click.echo(f"{transfer_id}: ended {got.ended}, already moving {got.left}")


@main.command()
@click.option("--broker", default="tcp://127.0.0.1:7100", show_default=True, help="Broker address, asked for the registered instances.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve HTTP on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to serve HTTP on (0: any free port).")
@click.option("--prefill", "prefills", multiple=True, metavar="ID=http://HOST:PORT",
              help="A prefill vLLM server and the instance_id its connector registers (repeat for several).")
@click.option("--decode", "decodes", multiple=True, metavar="ID=http://HOST:PORT",
              help="A decode vLLM server and the instance_id its connector registers (repeat for several).")
@click.option("--request-timeout", "request_timeout_s", type=float, default=600.0, show_default=True,
              help="Longest a client's request may take, generation included.")
@click.option("--decode-attempts", type=int, default=2, show_default=True,
              help="Decode instances tried for one request, with the same transfer_id.")
@click.option("--max-body-bytes", type=int, default=32 << 20, show_default=True)
@click.option("--backend", type=click.Choice(["asyncio", "trio"]), default="asyncio", show_default=True)
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY, else json.")
@click.option("--log-level", default="info", show_default=True)
@click.option("--curve-server-key", default=None, help="The broker's Z85 CURVE public key, if it serves with one.")
@click.option(
    "--curve-client-secret-file", type=click.Path(exists=True, dir_okay=False), default=None,
    help="This gateway's secret key (`kvbroker keygen --name`), for a broker serving with --curve-clients.",
)
@click.option("--port-file", type=click.Path(dir_okay=False), default=None, help="Write the bound port here once serving.")
@click.option("--grant-key-file", type=click.Path(dir_okay=False), default=None,
              help="The secret the decode instances name as grant_key_file: D's requests then carry a signed grant.")
def gateway(**opts: Any) -> None:
    """Serve an OpenAI-compatible API that sends each request to a prefill and a decode instance."""
    from gateway.proxy import GatewayConfig
    from gateway.proxy import serve as run
    from gateway.routes import Upstream
    from protocols.grants import read_key

    configure_logging(opts["log_format"] or ("console" if sys.stderr.isatty() else "json"), opts["log_level"])
    try:
        ups = [Upstream.parse("prefill", s) for s in opts["prefills"]] + [Upstream.parse("decode", s) for s in opts["decodes"]]
        config = GatewayConfig(
            upstreams=ups, broker=opts["broker"], host=opts["host"], port=opts["port"],
            request_timeout_s=opts["request_timeout_s"], decode_attempts=opts["decode_attempts"],
            max_body_bytes=opts["max_body_bytes"], curve_server_key=opts["curve_server_key"],
            curve_client_secret=Path(opts["curve_client_secret_file"]).read_bytes() if opts["curve_client_secret_file"] else None,
            port_file=opts["port_file"],
            grant_key=read_key(opts["grant_key_file"], what="--grant-key-file") if opts["grant_key_file"] else None,
        )
    except ValueError as exc:  # a GrantKeyError too
        raise click.UsageError(str(exc)) from None
    run(config, backend=opts["backend"])


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True)
@click.option("--name", default="broker", show_default=True, help="Key file names: NAME.key_secret and NAME.key.")
def keygen(out_dir: str, name: str) -> None:
    """Make a CURVE key pair: NAME.key_secret (keep it) and NAME.key (the public key).

    For the broker (the default name), `serve --curve-secret-file broker.key_secret`, and
    peers name broker.key's key as curve_server_key. For a peer (`--name p0`), the peer
    names p0.key_secret as curve_client_secret_file, and p0.key goes into the broker's
    --curve-clients folder.
    """
    import os

    import zmq

    if not name or "/" in name or name.startswith("."):
        raise click.UsageError(f"--name {name!r} must be a plain file name, such as the peer's instance id.")
    public, secret = zmq.curve_keypair()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    secret_path = out / f"{name}.key_secret"
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    (out / f"{name}.key").write_bytes(public + b"\n")
    if name == "broker":
        click.echo(f"secret: {secret_path} (serve --curve-secret-file)\npublic: {public.decode()} (curve_server_key on peers)")
    else:
        click.echo(f"secret: {secret_path} (curve_client_secret_file on that peer)\n"
                   f"public: {out / (name + '.key')} (into the broker's --curve-clients folder)")


@main.command()
@click.argument("transfer_id")
@click.argument("logs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the matching JSON lines.")
def trace(transfer_id: str, logs: tuple[str, ...], as_json: bool) -> None:
    """One transfer's timeline across processes, from their JSON log files."""
    events = [e for e in read_events(logs or ("-",), lambda line: transfer_id in line)
              if e.get("transfer_id") == transfer_id]
    if not events:
        raise click.ClickException(f"no log line carries transfer_id {transfer_id}; pass the JSON log files of every process")
    events.sort(key=lambda e: str(e.get("timestamp", "")))
    for e in events:
        if as_json:
            click.echo(json.dumps(e))
            continue
        extra = {k: v for k, v in e.items() if k not in ("timestamp", "event", "level", "transfer_id", "role", "instance", "source")}
        who = f"{e.get('role', '?')}/{e.get('instance', e.get('source'))}"
        click.echo(f"{e.get('timestamp', '?'):32} {who:24} {e.get('event', '?'):24} {json.dumps(extra, default=str)}")


@main.command()
@click.argument("logs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--prefix", default="", help="Only the transfers whose id starts with this.")
def phases(logs: tuple[str, ...], prefix: str) -> None:
    """Where transfers spend their time: for each event of a transfer and the next one,
    how long that took over every transfer in the JSON log files (median and 90th
    percentile, in the order the steps usually come); then the durations the lines
    carry (fields ending in _us or _ms). Pass every process's log."""
    events = [e for e in read_events(logs or ("-",)) if str(e["transfer_id"]).startswith(prefix)]
    steps, whole = phase_steps(events)
    if whole is None:
        raise click.ClickException("no transfer with two or more events in these logs; pass the JSON log files of every process")
    click.echo(f"{'from':28} {'to':28} {'transfers':>9} {'median ms':>10} {'p90 ms':>9} {'at ms':>8}")
    for s in [*steps, whole]:
        click.echo(f"{s.first:28} {s.then:28} {s.transfers:9d} {s.median_ms:10.3f} {s.p90_ms:9.3f} {s.at_ms:8.3f}")
    fields = field_stats(events)
    if fields:
        click.echo(f"\n{'event':28} {'field':28} {'lines':>9} {'median':>10} {'p90':>9}")
        for f in fields:
            click.echo(f"{f.event:28} {f.name:28} {f.lines:9d} {f.median:10.3f} {f.p90:9.3f}")

if __name__ == "__main__":
    main()
