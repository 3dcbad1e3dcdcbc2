"""What spotjob-agent reads from a torchrun command line: ranks per node and the rendezvous port.

The agent never changes the command; it only looks at it, so that it can say two things before
and after running it:

- how many ranks this node runs (``--nproc-per-node``), for "every rank closed";
- which rendezvous port *this host* must bind, if any. torchrun's rendezvous store listens on one
  host: with the default static rendezvous, on node rank 0 at ``--master-port`` (default 29500);
  with ``--rdzv-backend c10d``, on the host named by ``--rdzv-endpoint`` (default port 29400).
  ``--standalone`` picks a free port itself, and other backends (etcd) bind nothing here. When
  that port is already taken, torchrun fails with a traceback after its own timeouts and the job
  would look like a failure of the user's code; the agent checks the port first and exits
  ``EXIT_INFRA_ERROR`` instead.

Options are read as torchrun reads them: ``--name value``, ``--name=value``, either spelling
(``--master-port`` / ``--master_port``), and the ``PET_*`` environment variables torchrun takes
as defaults. Parsing stops at the first argument that is not an option: the training script.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

STATIC_DEFAULT_PORT = 29500
C10D_DEFAULT_PORT = 29400

# torchrun options that take no value; every other option takes one.
_FLAGS = {"--standalone", "--run-path", "--module", "-m", "--no-python", "--virtual-local-rank"}
_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def torchrun_args(command: Sequence[str]) -> list[str] | None:
    """The arguments of a torchrun command (``torchrun …`` or ``python -m torch.distributed.run …``),
    up to its script; None if ``command`` is not torchrun."""
    if not command:
        return None
    program = os.path.basename(command[0])
    if program == "torchrun":
        rest = list(command[1:])
    elif program.startswith("python") and len(command) >= 3 and command[1] == "-m" and command[2] in _MODULES:
        rest = list(command[3:])
    else:
        return None
    out = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--" or not arg.startswith("-"):
            break
        out.append(arg)
        name = arg.split("=", 1)[0].replace("_", "-")
        if "=" not in arg and name not in _FLAGS and i + 1 < len(rest):
            out.append(rest[i + 1])
            i += 1
        i += 1
    return out


def torchrun_options(command: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """torchrun's options as ``{"--master-port": "29500", "--standalone": "", ...}`` (dashes, not
    underscores), with ``PET_*`` environment defaults; None if ``command`` is not torchrun."""
    args = torchrun_args(command)
    if args is None:
        return None
    options: dict[str, str] = {}
    for key, value in (env or {}).items():
        if key.startswith("PET_") and value:
            options["--" + key[4:].lower().replace("_", "-")] = value
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        name = name.replace("_", "-")
        if name.startswith("--") or name in _FLAGS:
            if not eq and name not in _FLAGS and i + 1 < len(args):
                value = args[i + 1]
                i += 1
            options[name] = value
        i += 1
    return options


def torchrun_nproc(command: Sequence[str], env: Mapping[str, str] | None = None) -> int | None:
    """``--nproc-per-node N`` from a torchrun command line (the ranks on this node), if an integer."""
    options = torchrun_options(command, env)
    value = (options or {}).get("--nproc-per-node", "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class Rendezvous:
    """A rendezvous port this host must bind for the command to start."""

    port: int
    how: str
    """The options that said so, for messages (``--master-port 29500 on node rank 0``)."""


def local_rendezvous(command: Sequence[str], env: Mapping[str, str] | None = None) -> Rendezvous | None:
    """The rendezvous port torchrun will bind on this host, or None (not torchrun, standalone,
    not the rendezvous host, or options this function cannot read)."""
    options = torchrun_options(command, env)
    if options is None or "--standalone" in options:
        return None
    backend = options.get("--rdzv-backend", "static")
    endpoint = options.get("--rdzv-endpoint", "")
    try:
        if backend == "static":
            if int(options.get("--node-rank", "0")) != 0:
                return None
            if endpoint:
                _, port = _split_endpoint(endpoint, STATIC_DEFAULT_PORT)
                return Rendezvous(port, f"--rdzv-endpoint {endpoint} on node rank 0")
            port = int(options.get("--master-port", STATIC_DEFAULT_PORT))
            return Rendezvous(port, f"--master-port {port} on node rank 0")
        if backend == "c10d" and endpoint:
            host, port = _split_endpoint(endpoint, C10D_DEFAULT_PORT)
            if is_local_address(host):
                return Rendezvous(port, f"--rdzv-endpoint {endpoint} (this host)")
    except ValueError:
        return None
    return None


def _split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    if endpoint.startswith("["):  # [::1]:29400
        host, _, rest = endpoint[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, default_port
    return host, int(port)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its hostname, or an address it holds)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(address), 0))  # only an address of this machine can be bound
        except OSError:
            return False
    return True


def port_taken(port: int) -> bool:
    """Whether a TCP listener on all interfaces at ``port`` would fail because something holds it.

    Binds with ``SO_REUSEADDR``, as torch's TCPStore does, so a connection of an earlier run still
    in TIME_WAIT does not count as taken; a process listening on the port does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False
