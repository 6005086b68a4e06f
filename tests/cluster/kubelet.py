"""What a kubelet does for a container that kwok does not (kwok runs no containers), done by the
tests the way the kubelet does it:

- `environment()`: resolve `env` (`value` with $(VAR) references to earlier variables,
  `configMapKeyRef`, `secretKeyRef`, `fieldRef`), refusing like the kubelet
  (CreateContainerConfigError) when a referenced ConfigMap, Secret or key is missing and the
  reference is not optional;
- `command_line()`: `command` + `args` with $(VAR) expanded from that environment ($$ is a
  literal $; an undefined reference stays as written);
- `probe()`: an httpGet probe: the port by number or by the container port's name (a name no
  container port has fails the probe), the path, the scheme, `timeoutSeconds`; 200-399 passes.

The tests use them to run the chart's operator Deployment as a local process exactly as its pod
spec says, to see what a serving pod's SGLang would be started with, and to decide readiness
in probe-* namespaces (where kwok leaves it to them).
"""

from __future__ import annotations

import base64
import re
import ssl
import urllib.error
import urllib.request

from controlplane import Api

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ContainerConfigError(Exception):
    """The kubelet's CreateContainerConfigError: the container would not start."""


def expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, text)


def _field(pod: dict, path: str) -> str:
    meta = pod["metadata"]
    m = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
            "metadata.uid": meta.get("uid", ""), "spec.nodeName": pod["spec"].get("nodeName", ""),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": (pod.get("status") or {}).get("podIP", "")}[path]


def environment(api: Api, pod: dict, container: str) -> dict[str, str]:
    ns = pod["metadata"]["namespace"]
    ctr = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    env: dict[str, str] = {}
    for var in ctr.get("env") or []:
        name, src = var["name"], var.get("valueFrom")
        if src is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in src:
            env[name] = _field(pod, src["fieldRef"]["fieldPath"])
        else:
            kind, ref = (("ConfigMap", src["configMapKeyRef"]) if "configMapKeyRef" in src
                         else ("Secret", src["secretKeyRef"]))
            obj = api.get(kind, ns, ref["name"])
            data = (obj or {}).get("data") or {}
            if obj is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                what = (f'{kind.lower()} "{ref["name"]}" not found' if obj is None
                        else f'couldn\'t find key {ref["key"]} in {kind} {ns}/{ref["name"]}')
                raise ContainerConfigError(f"{name}: {what}")
            value = data[ref["key"]]
            env[name] = base64.b64decode(value).decode() if kind == "Secret" else value
    return env


def command_line(api: Api, pod: dict, container: str) -> list[str]:
    env = environment(api, pod, container)
    ctr = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    return [expand(x, env) for x in (ctr.get("command") or []) + (ctr.get("args") or [])]


def probe_port(pod: dict, container: str, kind: str) -> int:
    ctr = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    port = ctr[kind]["httpGet"]["port"]
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in ctr.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ContainerConfigError(f"{kind}: the container has no port named {port!r}")


def probe(pod: dict, container: str, kind: str, host: str = "127.0.0.1",
          ports: dict[int, int] | None = None) -> tuple[bool, str]:
    """Run the container's `kind` probe (startupProbe, readinessProbe, livenessProbe) against
    `host`, the container port mapped through `ports` (where the stand-in listens)."""
    ctr = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    spec = ctr[kind]
    get = spec["httpGet"]
    try:
        port = probe_port(pod, container, kind)
    except ContainerConfigError as e:
        return False, str(e)
    port = (ports or {}).get(port, port)
    url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{port}{get.get('path', '/')}"
    try:
        with urllib.request.urlopen(url, timeout=spec.get("timeoutSeconds", 1),
                                    context=ssl.create_default_context()) as r:
            return 200 <= r.status < 400, f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (OSError, urllib.error.URLError) as e:
        return False, f"{url}: {e}"
