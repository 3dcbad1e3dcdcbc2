"""The Pod Security Standards' ``restricted`` profile (which includes ``baseline``), as a checker of
one pod spec: what Pod Security Admission with ``enforce: restricted`` refuses.

Written from the published standard ("Pod Security Standards", kubernetes.io), control by control,
for ``containers``, ``initContainers`` and ``ephemeralContainers`` alike. ``violations(spec)``
names each control a pod spec breaks, in the words of the API server's refusal
(``violates PodSecurity "restricted:latest": <control> (<what to set>), ...``), so the test API
server can answer a pod create as a real one does (``refusal_message``).

Not modeled: the per-version differences of older policy versions (``restricted:v1.2x``), the
exemptions an admin configures (users, runtime classes, namespaces), AppArmor and SELinux
annotations (only their securityContext fields), and Windows pods (``spec.os.name: windows``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

_CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
_VOLUME_TYPES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
_SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
_SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for kind in _CONTAINER_KINDS for c in spec.get(kind) or []]


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _containers_s(names: list[str]) -> str:
    return f"container{'s' if len(names) > 1 else ''} {_quoted(names)}"


def violations(spec: Mapping[str, Any]) -> list[str]:
    """Each control of ``restricted`` the pod spec breaks (empty: the pod is admitted)."""
    out: list[str] = []
    pod_sc: Mapping[str, Any] = spec.get("securityContext") or {}
    containers = _containers(spec)

    def sc(c: Mapping[str, Any]) -> Mapping[str, Any]:
        return c.get("securityContext") or {}

    # -- baseline
    hosts = [f"{k}={spec[k]}".replace("True", "true") for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        out.append(f"host namespaces ({', '.join(hosts)})")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess") or any(
        (sc(c).get("windowsOptions") or {}).get("hostProcess") for c in containers
    ):
        out.append("hostProcess (pod or containers must not set securityContext.windowsOptions.hostProcess=true)")
    privileged = [c["name"] for c in containers if sc(c).get("privileged")]
    if privileged:
        out.append(f"privileged ({_containers_s(privileged)} must not set securityContext.privileged=true)")
    host_path = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_path:
        out.append(f"hostPath volumes (volume{'s' if len(host_path) > 1 else ''} {_quoted(host_path)})")
    host_ports = [
        str(p["hostPort"]) for c in containers for p in c.get("ports") or [] if p.get("hostPort") not in (None, 0)
    ]
    if host_ports:
        out.append(f"hostPort (containers use hostPorts {', '.join(host_ports)})")
    selinux = [pod_sc.get("seLinuxOptions") or {}] + [sc(c).get("seLinuxOptions") or {} for c in containers]
    if any(o.get("type", "") not in _SELINUX_TYPES or o.get("user") or o.get("role") for o in selinux):
        out.append("seLinuxOptions (pod or containers set forbidden securityContext.seLinuxOptions)")
    proc = [c["name"] for c in containers if sc(c).get("procMount") not in (None, "Default")]
    if proc:
        out.append(f"procMount ({_containers_s(proc)} must not set securityContext.procMount)")
    sysctls = [s.get("name", "") for s in pod_sc.get("sysctls") or [] if s.get("name") not in _SAFE_SYSCTLS]
    if sysctls:
        out.append(f"forbidden sysctls ({', '.join(sysctls)})")
    apparmor = [pod_sc.get("appArmorProfile") or {}] + [sc(c).get("appArmorProfile") or {} for c in containers]
    if any(p.get("type") not in (None, "RuntimeDefault", "Localhost") for p in apparmor):
        out.append("forbidden AppArmor profile (pod or containers set appArmorProfile.type Unconfined)")

    # -- restricted
    volumes = [v["name"] for v in spec.get("volumes") or [] if not (set(v) - {"name"}) <= _VOLUME_TYPES]
    if volumes:
        out.append(f"restricted volume types (volume{'s' if len(volumes) > 1 else ''} {_quoted(volumes)})")
    escalating = [c["name"] for c in containers if sc(c).get("allowPrivilegeEscalation") is not False]
    if escalating:
        out.append(
            f"allowPrivilegeEscalation != false ({_containers_s(escalating)} must set "
            "securityContext.allowPrivilegeEscalation=false)"
        )
    unrestricted = [
        c["name"]
        for c in containers
        if "ALL" not in ((sc(c).get("capabilities") or {}).get("drop") or [])
        or set((sc(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}
    ]
    if unrestricted:
        out.append(
            f"unrestricted capabilities ({_containers_s(unrestricted)} must set "
            'securityContext.capabilities.drop=["ALL"]; and may only add "NET_BIND_SERVICE")'
        )
    root_ok = pod_sc.get("runAsNonRoot") is True
    as_root = [
        c["name"]
        for c in containers
        if sc(c).get("runAsNonRoot") is False or (not root_ok and sc(c).get("runAsNonRoot") is not True)
    ]
    if as_root:
        out.append(f"runAsNonRoot != true (pod or {_containers_s(as_root)} must set securityContext.runAsNonRoot=true)")
    if pod_sc.get("runAsUser") == 0 or any(sc(c).get("runAsUser") == 0 for c in containers):
        out.append("runAsUser=0 (pod and containers must not set runAsUser=0)")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    seccomp = [
        c["name"]
        for c in containers
        if (sc(c).get("seccompProfile") or {}).get("type") not in _SECCOMP_OK
        and ((sc(c).get("seccompProfile") or {}).get("type") is not None or pod_seccomp not in _SECCOMP_OK)
    ]
    if seccomp or pod_seccomp == "Unconfined":
        out.append(
            f"seccompProfile (pod or {_containers_s(seccomp or ['*'])} must set securityContext.seccompProfile.type "
            'to "RuntimeDefault" or "Localhost")'
        )
    return out


def refusal_message(pod_name: str, problems: list[str]) -> str:
    """The message of the API server's 403 for a pod ``restricted`` refuses."""
    return f'pods "{pod_name}" is forbidden: violates PodSecurity "restricted:latest": {", ".join(problems)}'
