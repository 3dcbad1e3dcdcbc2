"""What spotjob-agent reads from a torchrun command line: ranks per node, the rendezvous port, and
whether the agent can start the ranks itself.

The agent looks at the command so that it can say two things before and after running it:

- how many ranks this node runs (``--nproc-per-node``), for "every rank closed";
- which rendezvous port *this host* must bind, if any. torchrun's rendezvous store listens on one
  host: with the default static rendezvous, on node rank 0 at ``--master-port`` (default 29500);
  with ``--rdzv-backend c10d``, on the host named by ``--rdzv-endpoint`` (default port 29400).
  ``--standalone``, and one node given neither ``--master-port`` nor ``--rdzv-endpoint``, pick a
  free port themselves (the latter since torch 2.12; for an older torchrun the agent adds
  ``--standalone``: ``standalone_command``), and other backends (etcd) bind nothing here. When
  that port is already taken, torchrun fails with a traceback after its own timeouts and the job
  would look like a failure of the user's code; the agent checks the port first and exits
  ``EXIT_INFRA_ERROR`` instead.

With ``--launcher direct`` it also asks ``direct_launch`` whether it can start the ranks the way
torchrun would without running torchrun (``agent.ranks``, which does not import torch): that saves
torchrun's own start, most of it importing torch, on every start and restart. Only a fixed set of
ranks is launched that way (``--standalone``, or the default static rendezvous with a fixed
``--nnodes``, no restarts of its own, output not redirected); for any other option the answer is
why not, and the agent runs torchrun as written.

Options are read as torchrun reads them: ``--name value``, ``--name=value``, either spelling
(``--master-port`` / ``--master_port``), the one-letter ones (``-m``, ``-r 3``, ``-r3``, ``-t=3``),
and the ``PET_*`` environment variables torchrun takes as defaults. Parsing stops at the first
argument that is not an option: the training script.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import shlex
import shutil
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

Launcher = Literal["torchrun", "direct"]
"""How spotjob-agent starts a torchrun command's ranks (``--launcher``)."""
LAUNCHERS: tuple[str, ...] = get_args(Launcher)
ENV_LAUNCHER = "SPOTJOB_AGENT_LAUNCHER"
"""The agent's ``--launcher`` default; the controller reads it too, for the agents of its pods."""

STATIC_DEFAULT_PORT = 29500
C10D_DEFAULT_PORT = 29400

# torchrun options that take no value; every other option takes one.
_FLAGS = {"--standalone", "--run-path", "--module", "--no-python", "--virtual-local-rank"}
_SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee"}
"""torchrun's one-letter spellings and the options they are (``-r3``, ``-r=3`` and ``-r 3`` alike)."""
_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _program_length(command: Sequence[str]) -> int:
    """How many leading words name torchrun: 1 (``torchrun``), 3 (``python -m torch.distributed.run``), or 0."""
    if not command:
        return 0
    program = os.path.basename(command[0])
    if program == "torchrun":
        return 1
    if program.startswith("python") and len(command) >= 3 and command[1] == "-m" and command[2] in _MODULES:
        return 3
    return 0


def torchrun_args(command: Sequence[str]) -> list[str] | None:
    """The arguments of a torchrun command (``torchrun …`` or ``python -m torch.distributed.run …``),
    up to its script; None if ``command`` is not torchrun."""
    skip = _program_length(command)
    if not skip:
        return None
    rest = list(command[skip:])
    out = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--" or not arg.startswith("-"):
            break
        out.append(arg)
        name, attached = _option(arg)
        if attached is None and name not in _FLAGS and i + 1 < len(rest):
            out.append(rest[i + 1])
            i += 1
        i += 1
    return out


def _option(arg: str) -> tuple[str, str | None]:
    """One option word as ``(its long name, the value written into it or None)``, as torchrun's
    argparse reads it: ``--master_port=1`` is ``("--master-port", "1")``, ``-r3`` and ``-r=3`` are
    ``("--redirects", "3")``, ``-m`` is ``("--module", None)``."""
    if arg.startswith("--"):
        name, eq, value = arg.partition("=")
        return name.replace("_", "-"), value if eq else None
    short, attached = arg[:2], arg[2:]
    name = _SHORT.get(short, short)
    if not attached:
        return name, None
    return name, attached.removeprefix("=")


def torchrun_options(command: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """torchrun's options as ``{"--master-port": "29500", "--standalone": "", ...}`` (dashes, not
    underscores; a one-letter spelling under its long name: ``-r 3`` is ``--redirects``), with
    ``PET_*`` environment defaults; None if ``command`` is not torchrun."""
    args = torchrun_args(command)
    if args is None:
        return None
    options: dict[str, str] = {}
    for key, value in (env or {}).items():
        if key.startswith("PET_") and value:
            options["--" + key[4:].lower().replace("_", "-")] = value
    i = 0
    while i < len(args):
        name, attached = _option(args[i])
        value = attached or ""
        if attached is None and name not in _FLAGS and i + 1 < len(args):
            value = args[i + 1]
            i += 1
        options[name] = value
        i += 1
    return options


def in_place_restart_warning(command: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """What to tell a user whose torchrun restarts its worker group in place (``--max-restarts N``,
    N > 0, or ``PET_MAX_RESTARTS``); None otherwise. Under torch 2.13 on CPU/gloo a restarted
    group fails in ``init_process_group`` or hangs in the next ``new_group()`` (the Checkpointer
    makes two), with or without the agent (README "Known limits"); spotjob's own restarts start a
    fresh torchrun instead."""
    restarts = (torchrun_options(command, env) or {}).get("--max-restarts", "0")
    if restarts in ("", "0"):
        return None
    return (
        f"torchrun --max-restarts {restarts} restarts the worker group in place, which under torch's gloo "
        "groups can fail or hang in the Checkpointer's process groups; leave it at 0 and let spotjob restart "
        "the job (spotjob run --max-restarts, the SpotJob's maxRestarts)"
    )


def torchrun_nproc(command: Sequence[str], env: Mapping[str, str] | None = None) -> int | None:
    """``--nproc-per-node N`` from a torchrun command line (the ranks on this node), if an integer."""
    options = torchrun_options(command, env)
    value = (options or {}).get("--nproc-per-node", "")
    return int(value) if value.isdigit() else None


def node_ranks(command: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[range, int] | None:
    """``(this node's global ranks, the world size)`` of a torchrun command whose rendezvous
    numbers the nodes as given: one node, or the static rendezvous with a fixed ``--nnodes`` and
    ``--node-rank`` (what the controller and ``spotjob run`` write). None when the rendezvous
    assigns them (c10d, elastic sizes), ``--nproc-per-node`` is not a number, or the command is
    not torchrun: then nobody knows before the ranks meet."""
    options = torchrun_options(command, env)
    if options is None:
        return None
    nproc, nnodes = options.get("--nproc-per-node", "1"), options.get("--nnodes", "1")
    low, _, high = nnodes.partition(":")
    if not nproc.isdigit() or int(nproc) < 1 or not low.isdigit() or (high and high != low) or int(low) < 1:
        return None
    per_node, nodes = int(nproc), int(low)
    if nodes == 1:
        return range(per_node), per_node
    node = options.get("--node-rank", "0")
    if options.get("--rdzv-backend", "static") != "static" or not node.isdigit() or int(node) >= nodes:
        return None
    return range(int(node) * per_node, (int(node) + 1) * per_node), nodes * per_node


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
    if options is None or "--standalone" in options or _picks_own_port(options):
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


def meeting_point(command: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Where the ranks of this torchrun command meet (the rendezvous store's host and port), or None
    (not torchrun, a port torchrun picks itself, or options this function cannot read)."""
    options = torchrun_options(command, env)
    if options is None or _picks_own_port(options):
        return None
    backend = options.get("--rdzv-backend", "static")
    endpoint = options.get("--rdzv-endpoint", "")
    try:
        if backend == "static":
            if endpoint:
                return _split_endpoint(endpoint, STATIC_DEFAULT_PORT)
            return options.get("--master-addr", "127.0.0.1"), int(options.get("--master-port", STATIC_DEFAULT_PORT))
        if endpoint:
            return _split_endpoint(endpoint, C10D_DEFAULT_PORT)
    except ValueError:
        return None
    return None


def probe_meeting_point(host: str, port: int, timeout: float = 3.0) -> str:
    """What a TCP connection to the rendezvous store at ``host:port`` finds, in words for a log line.

    Opens and closes one connection and sends nothing (the store drops a client that leaves
    before its handshake)."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return (
            f"nothing accepts connections at {where} (refused): the store's host (node rank 0) has not "
            "started it, or the address or port is wrong"
        )
    except TimeoutError:
        return (
            f"{where} did not answer within {timeout:g} s: a firewall or NetworkPolicy drops the packets, "
            "or the address is wrong"
        )
    except OSError as e:
        return f"{where} cannot be reached ({e.strerror or e}): the address is wrong or unreachable from here"
    return (
        f"{where} accepted a connection: if that is the store (and not a proxy on the way, such as a service "
        "mesh's sidecar), the ranks wait for peers that have not joined (a node that did not start or cannot "
        "reach it, fewer ranks started than the world size)"
    )


def standalone_command(command: Sequence[str], env: Mapping[str, str] | None = None) -> list[str] | None:
    """``command`` with ``--standalone`` added after torchrun's name, when it runs one node with the
    default static rendezvous and neither ``--master-port`` nor ``--rdzv-endpoint``; None for any
    other command (``--standalone`` given already, too).

    torchrun 2.12 and later run such a command as ``--standalone`` themselves (c10d on
    ``localhost:0``, a fresh run id), so a second job on the machine gets a free port of its own;
    torchrun 2.9 to 2.11 bind 29500, and the second job failed with ``EADDRINUSE``. Added for
    every torch, the option makes each torchrun do what 2.12 does, without reading which torch
    the torchrun on PATH belongs to (it may not be the agent's)."""
    options = torchrun_options(command, env)
    if options is None or "--standalone" in options or not _picks_own_port(options):
        return None
    skip = _program_length(command)
    return [*command[:skip], "--standalone", *command[skip:]]


def _picks_own_port(options: Mapping[str, str]) -> bool:
    """Whether torchrun picks a free port itself: ``--standalone``, or one node (``--nnodes 1``,
    the default) with the default static rendezvous given neither ``--master-port`` nor
    ``--rdzv-endpoint``, which torchrun 2.12 and later run as ``--standalone`` does (and older
    ones do too, as the agent adds ``--standalone``: ``standalone_command``). Two such jobs on one
    machine never meet on 29500."""
    if "--standalone" in options:
        return True
    if options.get("--rdzv-backend", "static") != "static" or "--master-port" in options:
        return False
    if options.get("--rdzv-endpoint"):
        return False
    return options.get("--nnodes", "1").rpartition(":")[2] == "1"


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


# -- starting the ranks without torchrun -----------------------------------------------------------

_DIRECT_OPTIONS = frozenset(
    {
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--standalone",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--max-restarts",
        "--monitor-interval",
        "--start-method",
        "--role",
        "--module",
        "--no-python",
    }
)
"""torchrun options ``direct_launch`` takes; any other one (redirects, log folders, elastic sizes,
NUMA binding, ...) is torchrun's own business, and the agent runs torchrun for it."""


@dataclass(frozen=True)
class DirectLaunch:
    """What ``agent.ranks`` needs to start one node's ranks as torchrun's static rendezvous would."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    """0: a free port, picked when the ranks start (``--standalone``)."""
    run_id: str
    role: str
    command: list[str]
    """One rank's command: torchrun's interpreter, ``-u`` and the script (or ``-m`` and the module),
    then its arguments; ``${local_rank}`` is replaced per rank, as torchrun does."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DirectLaunch:
        return cls(**json.loads(text))


def direct_launch(command: Sequence[str], env: Mapping[str, str] | None = None) -> DirectLaunch | str:
    """How ``agent.ranks`` would start this torchrun command's ranks on this node, or, as a string,
    why it cannot (the agent then runs torchrun as written)."""
    env = dict(os.environ if env is None else env)
    skip = _program_length(command)
    options = torchrun_options(command, env)
    args = torchrun_args(command)
    if not skip or options is None or args is None:
        return "the command is not torchrun"
    if skip == 3 and command[2] == "torch.distributed.launch":
        return "torch.distributed.launch (deprecated) passes --local-rank its own way"
    other = sorted(set(options) - _DIRECT_OPTIONS)
    if other:
        return f"{', '.join(other)} {'is' if len(other) == 1 else 'are'} torchrun's own"
    rest = list(command[skip + len(args) :])
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        return "torchrun is given no script"
    nproc_text = options.get("--nproc-per-node", "1")
    if not nproc_text.isdigit() or int(nproc_text) < 1:
        return f"--nproc-per-node {nproc_text} is not a number of ranks"
    low, _, high = options.get("--nnodes", "1").partition(":")
    if not low.isdigit() or (high and high != low) or int(low) < 1:
        return f"--nnodes {options['--nnodes']} is an elastic range, which torchrun's rendezvous handles"
    if options.get("--max-restarts", "0") != "0":
        return f"--max-restarts {options['--max-restarts']}: torchrun restarts its ranks itself"
    nnodes = int(low)
    backend = options.get("--rdzv-backend", "static")
    try:
        if "--standalone" in options and nnodes != 1:
            return "--standalone with more than one node"
        if _picks_own_port(options):
            addr, port, run_id = "127.0.0.1", 0, str(uuid.uuid4())
        elif backend == "static":
            addr = options.get("--master-addr", "127.0.0.1")
            port = int(options.get("--master-port", STATIC_DEFAULT_PORT))
            if options.get("--rdzv-endpoint"):
                addr, port = _split_endpoint(options["--rdzv-endpoint"], STATIC_DEFAULT_PORT)
            run_id = options.get("--rdzv-id", "none")
        else:
            return f"--rdzv-backend {backend}: its rendezvous is torchrun's"
        node_rank = int(options.get("--node-rank", "0"))
    except ValueError as e:
        return f"an option is not what torchrun takes: {e}"
    if not 0 <= node_rank < nnodes:
        return f"--node-rank {node_rank} is not one of the {nnodes} nodes"
    if "--no-python" in options:
        if "--module" in options:
            return "--no-python with --module"
        program: list[str] = []
    else:
        interpreter = _interpreter(command, env)
        if isinstance(interpreter, str):
            return interpreter
        program = [*interpreter, "-u"]
        if "--module" in options:
            program.append("-m")
    return DirectLaunch(
        nproc=int(nproc_text),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        run_id=run_id,
        role=options.get("--role", "default"),
        command=[*program, *rest],
    )


def _interpreter(command: Sequence[str], env: Mapping[str, str]) -> list[str] | str:
    """The Python torchrun would run its ranks with (``PYTHON_EXEC``, else its own ``sys.executable``),
    or why it is unknown."""
    path = env.get("PATH", os.defpath)
    if env.get("PYTHON_EXEC"):
        return [env["PYTHON_EXEC"]]
    if os.path.basename(command[0]).startswith("python"):
        found = shutil.which(command[0], path=path)
        return [found] if found else f"{command[0]} is not on PATH"
    script = shutil.which(command[0], path=path)
    if script is None:
        return f"{command[0]} is not on PATH"
    try:
        with open(script, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError as e:
        return f"cannot read {script}: {e}"
    words = shlex.split(first[2:]) if first.startswith("#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) == 2:
        found = shutil.which(words[1], path=path)
        return [found] if found else f"{script} runs {words[1]}, which is not on PATH"
    if len(words) == 1 and os.path.basename(words[0]).startswith("python") and os.access(words[0], os.X_OK):
        return [words[0]]
    return f"cannot tell which Python {script} runs (its first line is {first[:80]!r})"
