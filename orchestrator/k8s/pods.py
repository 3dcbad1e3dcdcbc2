"""The objects a SpotJob owns, built as the JSON the API server takes: worker Pods, the headless
Service, the agents' token Secret and the NetworkPolicy. Pure functions: no API calls, no clock.

One worker is one Pod running ``spotjob-agent`` wrapping torchrun on one node, named
``<job>-<attempt>-<index>`` (``worker_name``) and labelled with the job, the attempt and the index,
owned by the SpotJob (deleting the job deletes its pods, Service, Secret and NetworkPolicy).

What is taken from the user's ``spec.template`` and what spotjob sets:

- the training container (``spec.containerName``, else the template's first) keeps its image
  (else ``spec.image``), resources, env, volume mounts and security context; its ``command`` and
  ``args`` must be empty (``spec.command`` is the training command; the container runs the agent);
- every other container, volume, label, annotation, nodeSelector, affinity, toleration and
  field of the template is kept as written (the checkpoint hint annotations are the controller's:
  a template that sets them is refused), and spotjob adds to it: labels
  ``spotjob.dev/{job,attempt,index}``, a required node affinity that keeps the workers off
  nodes in cool-down and off nodes that are being taken away, a preferred one away from
  avoided zones and instance types, a required pod anti-affinity (one worker of an attempt per
  node), tolerations that keep a worker on a node whose preemption taint is ``NoExecute`` long
  enough to flush, ``restartPolicy: Never`` (an attempt's pod is never restarted in place: the
  reconciler starts the next attempt), ``terminationGracePeriodSeconds`` covering the flush
  (and the training container's own ``preStop`` sleep, which holds its SIGTERM back),
  and the agent's probes (liveness on /healthz; readiness on /readyz, Ready once the node's ranks
  train, i.e. once the whole gang joined and restored);
- three volumes: ``spotjob-token`` (the per-job Secret, for ``--token-file``), ``spotjob-control``
  (the agent <-> ranks folder) and ``spotjob-staging`` (``SPOTJOB_STAGING_DIR``, an emptyDir on
  the node; a volume of that name in the template replaces it, e.g. a local NVMe disk).

The rendezvous needs no DNS. Replica 0 runs torchrun's store on its own pod IP (``$(POD_IP)``
from the downward API); the other replicas are created only once replica 0 has a pod IP, and get
that IP as ``--master-addr`` (``start_workers`` is called again while an attempt starts). A pod's
IP never changes while it exists, and an attempt's pods are never recreated, so the address
holds for the attempt's life. The headless Service still gives each worker the DNS name
``<pod>.<job>.<namespace>.svc`` for the user's own tools. The store's port is derived from the
job and the attempt (``rendezvous_port``), so that a worker of an older attempt that trains on
(a partitioned node), or another job sharing a host network (``hostNetwork: true``), never holds
the port the new attempt needs.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import math
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.control_channel import ENV_EVERY_SECONDS, ENV_EVERY_STEPS
from agent.launcher_cli import usage_problem
from agent.torchrun import ENV_LAUNCHER, Launcher
from orchestrator.crd import DOWNWARD_ENV, ENV_NAME_REFUSED, POLICY_ENV, SPOTJOB_SET_ENV
from orchestrator.k8s.cluster_signals import TAINT_RULES
from orchestrator.model import NAME_PATTERN

Object = dict[str, Any]

JOB_LABEL = "spotjob.dev/job"
"""On every object a SpotJob owns: the job's name (same namespace). The Pod informer selects on it."""
ATTEMPT_LABEL = "spotjob.dev/attempt"
INDEX_LABEL = "spotjob.dev/index"
CHECKPOINT_TIME_ANNOTATION = "spotjob.dev/last-checkpoint-time"
CHECKPOINT_STEP_ANNOTATION = "spotjob.dev/last-checkpoint-step"
"""The checkpoint hints of a running worker pod (``orchestrator.k8s.hints``): the controller's to
set from ``status.lastCheckpoint``, never the template's."""

API_VERSION = "spotjob.dev/v1alpha1"
KIND = "SpotJob"

AGENT_PORT_NAME = "spotjob-agent"
TOKEN_VOLUME = "spotjob-token"
CONTROL_VOLUME = "spotjob-control"
STAGING_VOLUME = "spotjob-staging"
TOKEN_KEY = "token"
RUN_DIR = "/var/run/spotjob"
TOKEN_DIR = f"{RUN_DIR}/token"
CONTROL_DIR = f"{RUN_DIR}/control"
STAGING_DIR = f"{RUN_DIR}/staging"
_SPOTJOB_MOUNTS = {TOKEN_DIR: TOKEN_VOLUME, CONTROL_DIR: CONTROL_VOLUME, STAGING_DIR: STAGING_VOLUME}
"""Where the training container mounts spotjob's three volumes (the template's mounts of them are dropped)."""

RENDEZVOUS_PORT_BASE = 20000
RENDEZVOUS_PORT_SPAN = 10000
"""Rendezvous ports are drawn from [20000, 30000): below the Linux ephemeral range (32768+)."""

EXIT_SLACK_SECONDS = 30
"""Added to the flush window for the agent to see the result, stop the command and exit."""

_NOT_TOLERATED = {"node.kubernetes.io/out-of-service"}
"""Declared dead by an operator: nothing there can flush, so its pods must go at once."""


class TemplateError(ValueError):
    """The SpotJob's pod template cannot be turned into workers; the message names the field."""


@dataclass(frozen=True)
class Owner:
    """The SpotJob that owns what this module builds."""

    namespace: str
    name: str
    uid: str

    def reference(self) -> Object:
        # No blockOwnerDeletion: setting it needs update on spotjobs/finalizers (the
        # OwnerReferencesPermissionEnforcement admission plugin), and nothing here needs the
        # SpotJob to outlive its pods.
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid, "controller": True}


@dataclass(frozen=True)
class WorkerOptions:
    """How workers are built; the controller's flags set them (``spotjob-controller --agent-port``)."""

    agent_port: int = 8470
    agent_command: tuple[str, ...] = ("spotjob-agent",)
    """The agent in the training image (on its PATH)."""
    torchrun_command: tuple[str, ...] = ("torchrun",)
    agent_launcher: Launcher = "direct"
    """``spotjob-agent --launcher``, given as ``SPOTJOB_AGENT_LAUNCHER`` in the pod: direct (the agent
    starts the ranks as torchrun would, without torchrun's own start; options that are torchrun's
    own keep torchrun) or torchrun."""
    controller_namespace: str = ""
    """Where the controller's pods run (the NetworkPolicy admits them from there); "": anywhere."""
    controller_pod_labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerPlacement:
    """Where an attempt's workers may not go (required) and would rather not go (preferred)."""

    avoid_nodes: frozenset[str] = frozenset()
    """Nodes in cool-down and nodes being taken away now: never."""
    avoid_zones: frozenset[str] = frozenset()
    avoid_instance_types: frozenset[str] = frozenset()


# -- names ----------------------------------------------------------------------------------------


def service_name(job: str) -> str:
    """The headless Service: the job's own name, so workers resolve as ``<pod>.<job>.<ns>.svc``
    (prefixed ``sj-`` when the name starts with a digit: a Service name must start with a letter)."""
    return job if job[:1].isalpha() else f"sj-{job}"


def token_secret_name(owner: Owner) -> str:
    """Per incarnation of the job (its uid): a job deleted and created again under the same name
    never finds the old, garbage-collected Secret (and its old token) in its way."""
    return f"{owner.name}-agent-token-{owner.uid[:8]}"


def network_policy_name(owner: Owner) -> str:
    return f"{owner.name}-agents-{owner.uid[:8]}"


def rendezvous_port(namespace: str, name: str, attempt: int) -> int:
    """torchrun's store port for one attempt: stable for the attempt, different from the last one."""
    digest = hashlib.sha256(f"{namespace}/{name}/{attempt}".encode()).digest()
    return RENDEZVOUS_PORT_BASE + int.from_bytes(digest[:4], "big") % RENDEZVOUS_PORT_SPAN


def flush_window_seconds(flush_timeout_seconds: float) -> int:
    """How long a worker may take to flush: the spec's flush timeout, in whole seconds."""
    return max(1, math.ceil(flush_timeout_seconds))


# -- the template ---------------------------------------------------------------------------------


_ENV_NAME_REFUSED = re.compile(ENV_NAME_REFUSED)


def env_name_refused(name: str) -> bool:
    """Whether no Kubernetes version takes ``name`` for a container's variable: empty, or with a
    character other than printable ASCII, or '=' (``orchestrator.crd.ENV_NAME_REFUSED``)."""
    return not name or _ENV_NAME_REFUSED.search(name) is not None


_ENV_NAME_RULE = "printable ASCII other than '=', not empty"


def env_problems(env: Mapping[str, str], *, policy: Iterable[str] = ()) -> list[str]:
    """What in ``spec.env`` spotjob sets over it in every worker, or Kubernetes refuses in a
    container (a name it takes for no variable, a NUL in a value), each naming the variable
    (empty: fine). The CRD's rules refuse these at ``kubectl apply`` (the names spotjob sets since
    2026-12-04, the others since 2026-12-06); a SpotJob stored before then, or under an older CRD,
    keeps them (the API server never checks a stored object again): a value spotjob sets would be
    replaced without a word (``SPOTJOB_KEEP``: checkpoints removed that the user meant to keep),
    and a pod with the others refused, or its container never started, on every attempt.
    ``policy`` as for ``template_problems``."""
    set_by_spec = {v: f"spec.checkpoint.{POLICY_ENV[v]}" for v in policy}
    problems: list[str] = []
    for name, value in env.items():
        if env_name_refused(name):
            problems.append(
                f"spec.env: {name!r} is no name Kubernetes takes for a container's variable ({_ENV_NAME_RULE}): "
                "rename it"
            )
        if isinstance(value, str) and "\x00" in value:
            problems.append(
                f"spec.env.{name}: the value holds a NUL character, which no process's environment can carry "
                "(the training container would never start); remove it"
            )
        if name in DOWNWARD_ENV:
            problems.append(f"spec.env.{name}: set by spotjob (the downward API); remove it from spec.env")
        source = SPOTJOB_SET_ENV.get(name) or set_by_spec.get(name)
        if source:
            problems.append(
                f"spec.env.{name}: set by spotjob in every worker, from {source}, over this value; remove it from "
                "spec.env"
            )
    return problems


def template_problems(template: Mapping[str, Any] | None, container: int, *, policy: Iterable[str] = ()) -> list[str]:
    """What makes ``spec.template`` unusable for workers, each naming its field (empty: fine).

    ``container`` is the training container's index; ``policy`` the ``POLICY_ENV`` variables
    ``spec.checkpoint`` sets (its ``everySteps``, ``everySeconds``). The model checks the
    template's shape and the image; these are the rules only the pod builder knows, and the ones
    the CRD's rules on ``spec.env`` cannot see into the template for: a variable of the training
    container that spotjob sets over it would be replaced without a word.
    """
    set_by_spec = {v: f"spec.checkpoint.{POLICY_ENV[v]}" for v in policy}
    problems = _shape_problems(template or {})
    if problems:
        return problems  # the rules below, and the pod builder, read these parts
    spec = (template or {}).get("spec") or {}
    containers = spec.get("containers") or []
    if 0 <= container < len(containers):
        trainer = containers[container]
        where = f"spec.template.spec.containers[{container}]"
        for key in ("command", "args"):
            if trainer.get(key):
                problems.append(
                    f"{where}.{key} must be empty: the container runs spotjob-agent, and spec.command is the "
                    "training command it starts under torchrun"
                )
        for i, env in enumerate(trainer.get("env") or []):
            name = env.get("name") if isinstance(env, Mapping) else None
            if name in DOWNWARD_ENV:
                problems.append(f"{where}.env[{i}].name: {env.get('name')} is set by spotjob (the downward API)")
            source = (SPOTJOB_SET_ENV.get(name) or set_by_spec.get(name)) if isinstance(name, str) else None
            if source:
                problems.append(
                    f"{where}.env[{i}].name: {name} is set by spotjob in every worker, from {source}, over "
                    "this value; remove it from the template's env"
                )
    # What the API server refuses in any container's env, or the container runtime cannot start
    # with: not only the training container's (the pod builder reads no other), since any one of
    # them keeps the pod from being created or started.
    for kind in ("initContainers", "containers"):
        listed = spec.get(kind)
        for c_index, c in enumerate(listed if isinstance(listed, list) else []):
            entries = c.get("env") if isinstance(c, Mapping) else None
            for i, env in enumerate(entries if isinstance(entries, list) else []):
                if not isinstance(env, Mapping):
                    continue
                name, value = env.get("name"), env.get("value")
                at = f"spec.template.spec.{kind}[{c_index}].env[{i}]"
                if isinstance(name, str) and env_name_refused(name):
                    problems.append(
                        f"{at}.name: {name!r} is no name Kubernetes takes for a container's variable "
                        f"({_ENV_NAME_RULE}): rename it"
                    )
                if isinstance(value, str) and "\x00" in value:
                    problems.append(
                        f"{at}.value: holds a NUL character, which no process's environment can carry (the "
                        "container would never start); remove it"
                    )
    # The agent's port name marks the training container in the pod (how a worker's readiness and
    # exit code are found): on another container it would stand for the trainer.
    for kind in ("initContainers", "containers"):
        for c_index, c in enumerate(spec.get(kind) or []):
            for i, port in enumerate((c.get("ports") if isinstance(c, Mapping) else None) or []):
                if isinstance(port, Mapping) and port.get("name") == AGENT_PORT_NAME:
                    problems.append(
                        f"spec.template.spec.{kind}[{c_index}].ports[{i}].name: {AGENT_PORT_NAME} is reserved for "
                        "the agent's port; name the port otherwise"
                    )
    restart_policy = spec.get("restartPolicy")
    if restart_policy not in (None, "Never"):
        problems.append(
            f"spec.template.spec.restartPolicy must be Never or unset, not {restart_policy!r}: spotjob restarts "
            "the whole gang as a new attempt"
        )
    for i, volume in enumerate(spec.get("volumes") or []):
        if isinstance(volume, Mapping) and volume.get("name") in (TOKEN_VOLUME, CONTROL_VOLUME):
            problems.append(f"spec.template.spec.volumes[{i}].name: {volume.get('name')} is reserved for spotjob")
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            problems.append(f"spec.template.spec.{key} must be unset: spotjob names each worker")
    if spec.get("activeDeadlineSeconds") is not None:
        # The kubelet ends a pod past its deadline (DeadlineExceeded) with a SIGTERM, which the
        # agent takes as a notice: every attempt would flush and restart as a "preemption", for ever.
        problems.append(
            "spec.template.spec.activeDeadlineSeconds must be unset: the kubelet would stop every attempt's "
            "pods after that long and spotjob would take it for a preemption and start the next attempt, "
            "without end; stop a job you no longer want with kubectl delete spotjob"
        )
    problems += _metadata_problems((template or {}).get("metadata") or {})
    selector = spec.get("nodeSelector")
    if isinstance(selector, Mapping):
        problems += _label_problems(selector, "spec.template.spec.nodeSelector", "no node can carry it; fix it")
    problems += _container_problems(spec, container)
    return problems


def container_name_problems(name: str, path: str) -> list[str]:
    """``name`` at ``path``, if it is no container name Kubernetes takes (a DNS label)."""
    if len(name) <= 63 and _DNS_LABEL.fullmatch(name):
        return []
    return [
        f"{path}: {name!r} is no container name Kubernetes takes (at most 63 lowercase letters, digits or '-', "
        "starting and ending with a letter or digit)"
    ]


def _container_problems(spec: Mapping[str, Any], container: int) -> list[str]:
    """What the API server refuses in the template's containers: a name that is no DNS label,
    missing or taken twice (init containers and containers share one set of names), a container
    without an image (the training container's may come from ``spec.image``, which the model
    checks), an image with spaces around it, two mounts at one path in a container, and a mount of
    no volume the pod has. Each one kept every worker pod from being created, on every pass."""
    problems: list[str] = []
    volumes = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, Mapping)}
    volumes |= set(_SPOTJOB_MOUNTS.values())
    seen: dict[str, str] = {}
    for kind in ("initContainers", "containers"):
        listed = spec.get(kind)
        for i, c in enumerate(listed if isinstance(listed, list) else []):
            if not isinstance(c, Mapping):
                continue
            at = f"spec.template.spec.{kind}[{i}]"
            trainer = kind == "containers" and i == container
            name = c.get("name")
            if not isinstance(name, str) or not name:
                problems.append(f"{at}.name is required")
            elif name in seen:
                problems.append(f"{at}.name: {name!r} is also {seen[name]}'s: Kubernetes takes each name once in a pod")
            else:
                problems += container_name_problems(name, f"{at}.name")
                seen[name] = at
            image = c.get("image")
            if image is not None and not isinstance(image, str):
                problems.append(f"{at}.image must be a string, not {_json_type(image)}")
            elif isinstance(image, str) and image and image != image.strip():
                problems.append(f"{at}.image: {image!r} has spaces around it, which Kubernetes refuses: remove them")
            elif not image and not trainer:
                problems.append(
                    f"{at}.image is required: Kubernetes refuses a pod with a container without an image (spec.image "
                    "is the training container's only; a container of spec.fallback.template whose name is none of "
                    "spec.template's is added to the pod as another container, so check its name)"
                )
            problems += _mount_problems(c, at, volumes, trainer=trainer)
    return problems


def _mount_problems(c: Mapping[str, Any], at: str, volumes: set[Any], *, trainer: bool) -> list[str]:
    """A container's volume mounts the API server refuses: two at one path, or of no volume of the
    pod. In the training container, spotjob mounts its three volumes (and drops the template's
    mounts of them), so a mount of another volume at one of their paths would be a second there."""
    problems: list[str] = []
    paths: dict[str, int] = {}
    mounts = c.get("volumeMounts")
    for j, m in enumerate(mounts if isinstance(mounts, list) else []):
        if not isinstance(m, Mapping):
            continue
        name, path = m.get("name"), m.get("mountPath")
        if trainer and name in _SPOTJOB_MOUNTS.values():
            continue  # replaced by spotjob's own mount of it
        if isinstance(name, str) and name and name not in volumes:
            problems.append(
                f"{at}.volumeMounts[{j}].name: {name!r} is no volume of the pod: add it to "
                "spec.template.spec.volumes, or remove the mount"
            )
        if not isinstance(path, str) or not path:
            continue
        normal = posixpath.normpath(path)
        if trainer and normal in _SPOTJOB_MOUNTS:
            reserved = _SPOTJOB_MOUNTS[normal]
            fix = (
                f"to stage checkpoints on a disk of your own, name its volume {STAGING_VOLUME} (spotjob mounts it "
                "there) and remove this mount"
                if reserved == STAGING_VOLUME
                else "mount it elsewhere"
            )
            problems.append(f"{at}.volumeMounts[{j}].mountPath: {path} is where spotjob mounts {reserved}; {fix}")
        elif normal in paths:
            problems.append(
                f"{at}.volumeMounts[{j}].mountPath: {path} is volumeMounts[{paths[normal]}]'s too: Kubernetes "
                "takes one mount at a path"
            )
        else:
            paths[normal] = j
    return problems


# What the API server takes in a pod's labels and annotations (Kubernetes' apimachinery validation):
# a key is a qualified name, an optional DNS subdomain prefix and '/', then a name; a label's value
# is a name or empty; all of a pod's annotations, keys and values, take at most 256 KiB.
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_LABEL = re.compile(NAME_PATTERN)  # a job's name is a DNS label too
_NAME_RULE = "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
_KEY_RULE = f"an optional prefix (a lowercase DNS subdomain of at most 253 characters) and '/', then {_NAME_RULE}"
ANNOTATIONS_MAX_BYTES = 256 * 1024
"""The most all of a pod's annotations may take, keys and values (Kubernetes' TotalAnnotationSizeLimitB)."""


def _qualified_name(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if "/" in prefix:
        return False
    if key.count("/") == 1 and not (len(prefix) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in prefix.split("."))):
        return False  # the prefix is a DNS subdomain: DNS labels joined by dots
    return len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None


def _label_problems(labels_: Mapping[str, Any], path: str, fix: str) -> list[str]:
    """The keys and values of the label map at ``path`` (a pod's labels, a nodeSelector) the API
    server refuses; ``fix``: what to do about a value it refuses."""
    problems: list[str] = []
    for key, value in labels_.items():
        if not _qualified_name(str(key)):
            problems.append(f"{path}: {key!r} is no label key Kubernetes takes ({_KEY_RULE})")
        elif isinstance(value, str) and value and not (len(value) <= 63 and _QUALIFIED_NAME.fullmatch(value)):
            problems.append(
                f"{path}.{key}: {value!r} is no label value Kubernetes takes ({_NAME_RULE}, or empty): {fix}"
            )
    return problems


def _metadata_problems(meta: Mapping[str, Any]) -> list[str]:
    """The template's labels and annotations the API server would refuse in every worker pod (the
    CRD keeps the template as written): each names the field and the rule. Values of the wrong
    JSON type are ``_shape_problems``' to name."""
    labels_ = meta.get("labels")
    problems = (
        _label_problems(labels_, "spec.template.metadata.labels", "shorten or change it, or make it an annotation")
        if isinstance(labels_, Mapping)
        else []
    )
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        for key in annotations:
            if not _qualified_name(str(key).lower()):
                problems.append(
                    f"spec.template.metadata.annotations: {key!r} is no annotation key Kubernetes takes ({_KEY_RULE})"
                )
            elif key in (CHECKPOINT_TIME_ANNOTATION, CHECKPOINT_STEP_ANNOTATION):
                # Copied into every pod, it advertised a checkpoint that need not exist (the hints
                # are patched only once one is committed), and schedulers rank victims by it.
                problems.append(
                    f"spec.template.metadata.annotations: {key!r} is set by the controller on the running worker "
                    "pods from status.lastCheckpoint (README 'Checkpoint hints for schedulers'); remove it"
                )
        size = sum(len(str(k).encode()) + len(v.encode()) for k, v in annotations.items() if isinstance(v, str))
        if size > ANNOTATIONS_MAX_BYTES:
            problems.append(
                f"spec.template.metadata.annotations take {size} bytes (keys and values), more than the "
                f"{ANNOTATIONS_MAX_BYTES} (256 KiB) Kubernetes allows a pod: shorten or remove some"
            )
    return problems


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _shape_problems(template: Mapping[str, Any]) -> list[str]:
    """The parts of the template the pod builder reads or merges into, not of the JSON type the Pod
    API gives them: the CRD keeps the template as written (``x-kubernetes-preserve-unknown-fields``),
    so ``env: {A: "1"}`` (``spec.env``'s map form) in a container, or a label or nodeSelector value
    written ``2`` (or YAML's ``true``), reached the pod builder, which failed every pass (or the API
    server refused every pod) without a word on the SpotJob. Each names its field; null counts as
    absent."""
    problems: list[str] = []

    def check(value: Any, path: str, want: type | tuple[type, ...], words: str, hint: str = "") -> bool:
        if value is None or (isinstance(value, want) and not isinstance(value, bool)):
            return value is not None
        problems.append(f"spec.template.{path} must be {words}, not {_json_type(value)}{hint}")
        return False

    def objects(value: Any, path: str, hint: str = "") -> list[tuple[str, Mapping[str, Any]]]:
        """The items of a list of objects at ``path`` (checked), with their paths."""
        if not check(value, path, list, "a list of objects", hint):
            return []
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
        return [(p, item) for p, item in items if check(item, p, dict, "an object")]

    meta = template.get("metadata") or {}
    for key in ("labels", "annotations"):
        if check(meta.get(key), f"metadata.{key}", dict, "an object of strings"):
            for name, value in meta[key].items():
                check(value, f"metadata.{key}.{name}", str, "a string", ': quote it ("2", "true")')
    spec = template.get("spec") or {}
    # Every container, not only the training one (the pod builder reads only its): a sidecar's or an
    # init container's part of the wrong type makes the API server refuse the pod all the same.
    for kind in ("initContainers", "containers"):
        for where, c in objects(spec.get(kind), f"spec.{kind}"):
            for path, item in objects(c.get("env"), f"{where}.env", " (spec.env is the map form: NAME: value)"):
                if item.get("name") is None:  # an empty one is named with the rule below
                    problems.append(f"spec.template.{path}.name is required")
                check(item.get("name"), f"{path}.name", str, "a string")
                check(item.get("value"), f"{path}.value", str, "a string", ': quote it ("2", "true")')
            objects(c.get("ports"), f"{where}.ports")
            objects(c.get("volumeMounts"), f"{where}.volumeMounts")
            if check(c.get("lifecycle"), f"{where}.lifecycle", dict, "an object"):
                pre_stop = c["lifecycle"].get("preStop")
                if check(pre_stop, f"{where}.lifecycle.preStop", dict, "an object"):
                    sleep = pre_stop.get("sleep")
                    if check(sleep, f"{where}.lifecycle.preStop.sleep", dict, "an object"):
                        check(sleep.get("seconds"), f"{where}.lifecycle.preStop.sleep.seconds", int, "a whole number")
    objects(spec.get("volumes"), "spec.volumes")
    objects(spec.get("tolerations"), "spec.tolerations")
    # A node's labels are strings: `gpu: true` (YAML's boolean) or `zone: 1` made every pod a 422.
    if check(spec.get("nodeSelector"), "spec.nodeSelector", dict, "an object of strings"):
        for key, value in spec["nodeSelector"].items():
            check(value, f"spec.nodeSelector.{key}", str, "a string", ': quote it ("true", "2")')
    grace = spec.get("terminationGracePeriodSeconds")
    if not isinstance(grace, str) or not grace.strip().lstrip("-").isdigit():  # "60" was taken, and still is
        check(grace, "spec.terminationGracePeriodSeconds", (int, float), "a number")
    if check(spec.get("affinity"), "spec.affinity", dict, "an object"):
        node = spec["affinity"].get("nodeAffinity")
        if check(node, "spec.affinity.nodeAffinity", dict, "an object"):
            path = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
            if check(required, path, dict, "an object"):
                for term_path, term in objects(required.get("nodeSelectorTerms"), f"{path}.nodeSelectorTerms"):
                    check(term.get("matchFields"), f"{term_path}.matchFields", list, "a list")
            path = "spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"
            check(node.get("preferredDuringSchedulingIgnoredDuringExecution"), path, list, "a list")
        anti = spec["affinity"].get("podAntiAffinity")
        if check(anti, "spec.affinity.podAntiAffinity", dict, "an object"):
            path = "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution"
            check(anti.get("requiredDuringSchedulingIgnoredDuringExecution"), path, list, "a list")
    return problems


# -- workers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker pod needs from the job's spec (a view, so this module does not follow the model)."""

    template: Mapping[str, Any] | None
    container: int
    """The training container's index in the template (ignored without a template)."""
    container_name: str
    """Its name (the container built without a template gets it)."""
    image: str | None
    command: Sequence[str]
    env: Mapping[str, str]
    replicas: int
    nproc_per_node: int
    checkpoint_uri: str
    every_steps: int | None
    every_seconds: float | None
    keep: int
    flush_timeout_seconds: float


def agent_settings_problem(job_identity: str, spec: WorkerSpec, options: WorkerOptions) -> str | None:
    """What every worker's spotjob-agent would refuse at its start (a usage error: it exits 2 before
    it starts anything) in the command line and the environment ``worker_pod`` gives it, in the
    agent's own words (``agent.launcher_cli.usage_problem``: its own parsing, not a copy of its
    rules); None when it would start. A bad value in ``spec.env`` (``SPOTJOB_AGENT_PREFETCH=nodes``,
    a negative timeout) or in the template's training container ``env``: the values written there
    only, not a ``valueFrom`` (known in the pod alone) nor the image's own environment."""
    namespace, _, name = job_identity.partition("/")
    owner = Owner(namespace=namespace, name=name, uid="")
    argv = _agent_args(job_identity, spec, attempt=0, index=0, master_addr=None, owner=owner, options=options)
    trainer: Mapping[str, Any] = {}
    if spec.template is not None:
        containers = ((spec.template.get("spec") or {}).get("containers")) or []
        if 0 <= spec.container < len(containers) and isinstance(containers[spec.container], Mapping):
            trainer = containers[spec.container]
    # An env that is not a list of objects is template_problems' to name; here it is left out.
    listed = trainer.get("env")
    listed = [e for e in listed if isinstance(e, Mapping)] if isinstance(listed, list) else []
    written = _env(listed, {**spec.env, ENV_LAUNCHER: options.agent_launcher})
    env = {
        str(e["name"]): str(e["value"])
        for e in written
        if isinstance(e, Mapping) and isinstance(e.get("name"), str) and e.get("value") is not None
    }
    return usage_problem(argv, env)


def labels(owner: Owner, attempt: int | None = None, index: int | None = None) -> dict[str, str]:
    out = {JOB_LABEL: owner.name}
    if attempt is not None:
        out[ATTEMPT_LABEL] = str(attempt)
    if index is not None:
        out[INDEX_LABEL] = str(index)
    return out


def worker_pod(
    owner: Owner,
    job_identity: str,
    spec: WorkerSpec,
    *,
    name: str,
    attempt: int,
    index: int,
    master_addr: str | None,
    placement: WorkerPlacement,
    options: WorkerOptions,
) -> Object:
    """Worker ``index`` of ``attempt``. ``master_addr`` is replica 0's pod IP (None for replica 0,
    which uses its own). Raises ``TemplateError`` for a template ``template_problems`` refuses."""
    every = ((ENV_EVERY_STEPS, spec.every_steps), (ENV_EVERY_SECONDS, spec.every_seconds))
    policy = [v for v, on in every if on is not None]
    problems = template_problems(spec.template, spec.container, policy=policy)
    if problems:
        raise TemplateError("; ".join(problems))
    if index > 0 and not master_addr:
        raise ValueError("replicas after the first need replica 0's address")
    template = copy.deepcopy(dict(spec.template or {}))
    meta = dict(template.get("metadata") or {})
    pod_spec: Object = dict(template.get("spec") or {})

    pod_labels = {**(meta.get("labels") or {}), **labels(owner, attempt, index)}
    annotations = dict(meta.get("annotations") or {})
    window = flush_window_seconds(spec.flush_timeout_seconds)

    containers = [dict(c) for c in pod_spec.get("containers") or []]
    index_ = spec.container if spec.template is not None else 0
    if not containers:
        containers, index_ = [{"name": spec.container_name}], 0
    trainer = containers[index_]
    trainer["image"] = trainer.get("image") or spec.image
    trainer["command"] = list(options.agent_command)
    # The tail of the log becomes the termination message of an agent that exits non-zero, so the
    # backend can say why one refused its options (an image older than the controller).
    trainer.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    trainer["args"] = _agent_args(
        job_identity, spec, attempt=attempt, index=index, master_addr=master_addr, owner=owner, options=options
    )
    # The launcher goes in the environment, not as --launcher: an agent older than that flag
    # (spotjob before 2026-12-02) ignores the variable and runs torchrun, where it would refuse the
    # flag and exit 2 on every worker. README "Upgrading" has the supported skew.
    trainer["env"] = _env(trainer.get("env") or [], {**spec.env, ENV_LAUNCHER: options.agent_launcher})
    trainer["ports"] = [
        p
        for p in trainer.get("ports") or []
        if p.get("name") != AGENT_PORT_NAME and p.get("containerPort") != options.agent_port
    ] + [{"name": AGENT_PORT_NAME, "containerPort": options.agent_port, "protocol": "TCP"}]
    trainer["volumeMounts"] = [
        m for m in trainer.get("volumeMounts") or [] if m.get("name") not in _SPOTJOB_MOUNTS.values()
    ] + [
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": CONTROL_VOLUME, "mountPath": CONTROL_DIR},
        {"name": STAGING_VOLUME, "mountPath": STAGING_DIR},
    ]
    # Ready once the node's ranks train (its first rank reports past "starting"), which they do
    # only once every rank of every replica joined the rendezvous and restored.
    trainer["readinessProbe"] = {
        "httpGet": {"path": "/readyz", "port": AGENT_PORT_NAME},
        "periodSeconds": 2,
        "timeoutSeconds": 2,
        "failureThreshold": 3,
    }
    trainer["livenessProbe"] = {
        "httpGet": {"path": "/healthz", "port": AGENT_PORT_NAME},
        "initialDelaySeconds": 10,
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }
    containers[index_] = trainer

    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") not in (TOKEN_VOLUME, CONTROL_VOLUME)]
    volumes.append(
        {
            "name": TOKEN_VOLUME,
            # Readable by the container's user whatever it is (no fsGroup needed): only this pod's
            # own processes see the volume.
            "secret": {"secretName": token_secret_name(owner), "defaultMode": 0o444},
        }
    )
    volumes.append({"name": CONTROL_VOLUME, "emptyDir": {}})
    if not any(v.get("name") == STAGING_VOLUME for v in volumes):
        volumes.append({"name": STAGING_VOLUME, "emptyDir": {}})

    pod_spec["containers"] = containers
    pod_spec["volumes"] = volumes
    pod_spec["restartPolicy"] = "Never"
    pod_spec["terminationGracePeriodSeconds"] = max(
        int(pod_spec.get("terminationGracePeriodSeconds") or 0),
        window + EXIT_SLACK_SECONDS + _pre_stop_sleep_seconds(trainer),
    )
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = service_name(owner.name)
    pod_spec["affinity"] = _affinity(pod_spec.get("affinity"), owner, attempt, placement)
    pod_spec["tolerations"] = _tolerations(pod_spec.get("tolerations") or [], window + EXIT_SLACK_SECONDS)
    if not pod_spec["affinity"]:
        del pod_spec["affinity"]

    metadata: Object = {
        "name": name,
        "namespace": owner.namespace,
        "labels": pod_labels,
        "ownerReferences": [owner.reference()],
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _pre_stop_sleep_seconds(container: Mapping[str, Any]) -> int:
    """How long the container's own ``preStop`` sleep action holds back its SIGTERM (0 without one).

    The kubelet runs the hook first and SIGTERMs the agent after it, within the one grace period:
    the sleep must be added for the flush window to stay whole. An exec or httpGet hook takes an
    unknown time, out of ``EXIT_SLACK_SECONDS`` (README "Limits on Kubernetes")."""
    seconds = (((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds")
    return max(0, int(seconds)) if isinstance(seconds, int) else 0


def _agent_args(
    job_identity: str,
    spec: WorkerSpec,
    *,
    attempt: int,
    index: int,
    master_addr: str | None,
    owner: Owner,
    options: WorkerOptions,
) -> list[str]:
    window = flush_window_seconds(spec.flush_timeout_seconds)
    args = [
        "--control-host", "$(POD_IP)",
        "--control-port", str(options.agent_port),
        "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}",
        "--job-name", job_identity,
        "--checkpoint-uri", spec.checkpoint_uri,
        "--keep", str(spec.keep),
        "--attempt", str(attempt),
        "--staging-dir", STAGING_DIR,
        "--control-dir", CONTROL_DIR,
        # A SIGTERM (a drain, a graceful node shutdown) is a notice: flush within the window.
        "--sigterm-grace", str(window),
        "--flush-timeout", str(window),
    ]  # fmt: skip
    if spec.every_steps is not None:
        args += ["--every-steps", str(spec.every_steps)]
    if spec.every_seconds is not None:
        args += ["--every-seconds", f"{spec.every_seconds:g}"]
    torchrun = [
        *options.torchrun_command,
        "--nproc-per-node", str(spec.nproc_per_node),
        "--nnodes", str(spec.replicas),
        "--node-rank", str(index),
        "--master-addr", master_addr if index > 0 and master_addr else "$(POD_IP)",
        "--master-port", str(rendezvous_port(owner.namespace, owner.name, attempt)),
        # A rank that fails fails the attempt: the reconciler restarts the whole gang.
        "--max-restarts", "0",
    ]  # fmt: skip
    return [*args, "--", *torchrun, *spec.command]


def _env(container_env: Iterable[Mapping[str, Any]], extra: Mapping[str, str]) -> list[Object]:
    taken = set(extra) | set(DOWNWARD_ENV)
    env: list[Object] = [dict(e) for e in container_env if e.get("name") not in taken]
    env += [{"name": k, "value": str(v)} for k, v in extra.items()]
    # Declared last, but $(POD_IP) in args refers to the container's env whatever its order.
    env += [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    return env


def _affinity(user: Mapping[str, Any] | None, owner: Owner, attempt: int, placement: WorkerPlacement) -> Object:
    affinity: Object = copy.deepcopy(dict(user or {}))
    node_affinity: Object = dict(affinity.get("nodeAffinity") or {})
    if placement.avoid_nodes:
        # A node field selector takes exactly one value per In/NotIn requirement (the API server
        # refuses more: "must be only one value ... for node field selector"): one requirement per
        # node, ANDed within a term.
        avoid = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in sorted(placement.avoid_nodes)]
        required = dict(node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
        terms = [dict(t) for t in required.get("nodeSelectorTerms") or []] or [{}]
        for term in terms:  # terms are ORed: every one of them must exclude the nodes
            term["matchFields"] = [*(term.get("matchFields") or []), *avoid]
        required["nodeSelectorTerms"] = terms
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = required
    preferred = list(node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    for key, values in (
        ("topology.kubernetes.io/zone", placement.avoid_zones),
        ("node.kubernetes.io/instance-type", placement.avoid_instance_types),
    ):
        if values:
            preferred.append(
                {
                    "weight": 100,
                    "preference": {"matchExpressions": [{"key": key, "operator": "NotIn", "values": sorted(values)}]},
                }
            )
    if preferred:
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    if node_affinity:
        affinity["nodeAffinity"] = node_affinity
    # One worker of an attempt per node: torchrun's --nnodes counts nodes, and one node going away
    # must not take two workers.
    anti: Object = dict(affinity.get("podAntiAffinity") or {})
    anti["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *(anti.get("requiredDuringSchedulingIgnoredDuringExecution") or []),
        {
            "labelSelector": {"matchLabels": labels(owner, attempt)},
            "topologyKey": "kubernetes.io/hostname",
        },
    ]
    affinity["podAntiAffinity"] = anti
    return affinity


def _tolerations(user: Iterable[Mapping[str, Any]], seconds: int) -> list[Object]:
    """The user's tolerations, plus: stay on a node whose preemption taint is NoExecute (NTH can be
    configured so) for the flush window, instead of being evicted before the flush.

    Only the NoExecute variants are tolerated: the NoSchedule taints these tools set by default
    still keep new workers off those nodes, and the required node affinity keeps them off nodes
    tainted NoExecute (a NoExecute toleration would otherwise let the scheduler pick them).
    """
    out = [dict(t) for t in user]
    for rule in TAINT_RULES:
        if rule.key in _NOT_TOLERATED:
            continue
        out.append({"key": rule.key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds})
    return out


# -- reading a worker pod --------------------------------------------------------------------------


def training_container_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The status of the container that runs the agent in a worker pod (the one exposing the
    agent's port, else the first); empty until the kubelet reported it. Its readiness and exit code
    are the worker's: the template's other containers (sidecars, helpers) say nothing of training."""
    containers = (pod.get("spec") or {}).get("containers") or []
    name = next(
        (c.get("name") for c in containers if any(p.get("name") == AGENT_PORT_NAME for p in c.get("ports") or [])),
        containers[0].get("name") if containers else None,
    )
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == name:
            return dict(status)
    return {}


# -- the job's other objects -----------------------------------------------------------------------


def headless_service(owner: Owner, agent_port: int) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(owner.name),
            "namespace": owner.namespace,
            "labels": labels(owner),
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "clusterIP": "None",
            "selector": labels(owner),
            # Workers resolve each other while their ranks restore, before they are Ready.
            "publishNotReadyAddresses": True,
            "ports": [{"name": AGENT_PORT_NAME, "port": agent_port, "targetPort": agent_port, "protocol": "TCP"}],
        },
    }


def token_secret(owner: Owner, token: str) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(owner),
            "namespace": owner.namespace,
            "labels": labels(owner),
            "ownerReferences": [owner.reference()],
        },
        "type": "Opaque",
        # Never changes (the token is derived from the job's uid): kubelets need not watch it.
        "immutable": True,
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def network_policy(owner: Owner, options: WorkerOptions) -> Object:
    """Ingress to the job's pods: from each other on every port (torchrun, gloo/NCCL), and from the
    controller's pods to the agent's port. Everything else is denied; egress is untouched."""
    controller: Object = {"podSelector": {"matchLabels": dict(options.controller_pod_labels)}}
    if options.controller_namespace:
        controller["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": options.controller_namespace}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(owner),
            "namespace": owner.namespace,
            "labels": labels(owner),
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "podSelector": {"matchLabels": labels(owner)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": labels(owner)}}]},
                {"from": [controller], "ports": [{"protocol": "TCP", "port": options.agent_port}]},
            ],
        },
    }
