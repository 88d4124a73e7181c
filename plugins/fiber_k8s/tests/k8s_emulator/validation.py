"""Pod defaulting and validation with the API server's field-error messages."""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from typing import Any

DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + r")*"
QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE = r"(" + QUALIFIED_NAME + r")?"
ENV_NAME = r"[-._a-zA-Z][-._a-zA-Z0-9]*"

SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                 "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
                 f"regex used for validation is '{DNS1123_SUBDOMAIN}')")
LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
             "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
             f"regex used for validation is '{DNS1123_LABEL}')")
NAME_PART_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
                 "and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', "
                 f"regex used for validation is '{QUALIFIED_NAME}')")
QUALIFIED_MSG = ("a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must "
                 "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                 f"'123-abc', regex used for validation is '{QUALIFIED_NAME}') with an optional DNS "
                 "subdomain prefix and '/' (e.g. 'example.com/MyName')")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', "
                   "'_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  "
                   f"or 'my_value',  or '12345', regex used for validation is '{LABEL_VALUE}')")
ENV_MSG = ("a valid environment variable name must consist of alphabetic characters, digits, '_', "
           "'-', or '.', and must not start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or "
           f"'MyEnvName1', regex used for validation is '{ENV_NAME}')")
QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
SUFFIXES: dict[str, Decimal | int] = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3,
            "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10,
            "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
STANDARD_RESOURCES = {"cpu", "memory", "ephemeral-storage", "pods", "storage"}
RESTART_POLICIES = ("Always", "OnFailure", "Never")
CAUSE_REASONS = {"Required value": "FieldValueRequired", "Invalid value": "FieldValueInvalid",
                 "Duplicate value": "FieldValueDuplicate", "Unsupported value": "FieldValueNotSupported",
                 "Not found": "FieldValueNotFound", "Forbidden": "FieldValueForbidden"}


class BadRequest(Exception):
    """The body cannot be decoded (400, like a decoding error in the real server)."""


class FieldError:
    def __init__(self, field: str, kind: str, value: Any = None, detail: str = "") -> None:
        self.field, self.kind, self.value, self.detail = field, kind, value, detail

    def message(self) -> str:
        text = self.kind
        if self.kind in ("Invalid value", "Duplicate value", "Unsupported value", "Not found"):
            text += ": " + (json.dumps(self.value) if isinstance(self.value, str) else str(self.value))
        return text + (f": {self.detail}" if self.detail else "")

    def __str__(self) -> str:
        return f"{self.field}: {self.message()}"

    def cause(self) -> dict[str, str]:
        return {"reason": CAUSE_REASONS[self.kind], "message": self.message(), "field": self.field}


def parse_quantity(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRequest(f"quantities must match the regular expression '{QUANTITY_RE.pattern}'")
    m = QUANTITY_RE.match(str(value))
    if not m:
        raise BadRequest(f"quantities must match the regular expression '{QUANTITY_RE.pattern}'")
    num, suffix = m.groups()
    try:
        base = Decimal(num)
        if suffix in SUFFIXES:
            return base * SUFFIXES[suffix]
        if suffix[:1] in "eE":
            return base * Decimal(10) ** int(suffix[1:])
    except (InvalidOperation, ValueError):
        pass
    raise BadRequest("unable to parse quantity's suffix")


def subdomain_errors(field: str, value: str, max_len: int = 253) -> list[FieldError]:
    errs = []
    if len(value) > max_len:
        errs.append(FieldError(field, "Invalid value", value, f"must be no more than {max_len} characters"))
    if not re.fullmatch(DNS1123_SUBDOMAIN, value):
        errs.append(FieldError(field, "Invalid value", value, SUBDOMAIN_MSG))
    return errs


def dns_label_errors(field: str, value: str) -> list[FieldError]:
    errs = []
    if len(value) > 63:
        errs.append(FieldError(field, "Invalid value", value, "must be no more than 63 characters"))
    if not re.fullmatch(DNS1123_LABEL, value):
        errs.append(FieldError(field, "Invalid value", value, LABEL_MSG))
    return errs


def qualified_name_errors(field: str, key: Any) -> list[FieldError]:
    if not isinstance(key, str):
        return [FieldError(field, "Invalid value", key, QUALIFIED_MSG)]
    parts = key.split("/")
    if len(parts) > 2:
        return [FieldError(field, "Invalid value", key, QUALIFIED_MSG)]
    name, errs = parts[-1], []
    if len(parts) == 2:
        if not parts[0]:
            errs.append(FieldError(field, "Invalid value", key, "prefix part must be non-empty"))
        else:
            errs += [FieldError(field, "Invalid value", key, "prefix part " + e.detail)
                     for e in subdomain_errors(field, parts[0])]
    if not name:
        errs.append(FieldError(field, "Invalid value", key, "name part must be non-empty"))
    elif len(name) > 63:
        errs.append(FieldError(field, "Invalid value", key, "name part must be no more than 63 characters"))
    if name and not re.fullmatch(QUALIFIED_NAME, name):
        errs.append(FieldError(field, "Invalid value", key, NAME_PART_MSG))
    return errs


def label_errors(field: str, labels: Any) -> list[FieldError]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        raise BadRequest(f"{field} must be a map of strings")
    errs = []
    for k, v in labels.items():
        errs += qualified_name_errors(field, k)
        if not isinstance(v, str):
            raise BadRequest(f"{field}: label values must be strings")
        if len(v) > 63:
            errs.append(FieldError(field, "Invalid value", v, "must be no more than 63 characters"))
        if not re.fullmatch(LABEL_VALUE, v):
            errs.append(FieldError(field, "Invalid value", v, LABEL_VALUE_MSG))
    return errs


_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = {-3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}


def canonical_quantity(value: Any) -> str:
    """``value`` as the API server stores it (``resource.Quantity``'s canonical form): the
    suffix family of the input, the largest suffix with an integer mantissa (``1024Mi`` is
    ``1Gi``, ``1000m`` is ``1``, ``0.5`` is ``500m``); binary values below 1024 or with a
    fraction are written in decimal; precision beyond milli-units is rounded up."""
    q = parse_quantity(value)
    m = QUANTITY_RE.match(str(value))
    suffix = m.group(2) if m else ""
    sign, q = ("-" if q < 0 else ""), abs(q)
    if suffix.endswith("i") and q >= 1024 and q == q.to_integral_value():
        n, e = int(q), 0
        while e < 6 and n % 1024 == 0:
            n, e = n // 1024, e + 1
        return f"{sign}{n}{_BINARY[e]}"
    milli = (q * 1000).to_integral_value(rounding="ROUND_CEILING")
    n, e = int(milli), -3
    while e < 18 and n and n % 1000 == 0:
        n, e = n // 1000, e + 3
    if n == 0:
        return "0"
    if suffix[:1] in ("e", "E"):
        return f"{sign}{n}" + (f"e{e}" if e else "") if e >= 0 else f"{sign}{n}{_DECIMAL[e]}"
    return f"{sign}{n}{_DECIMAL[e]}"


SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
_MAP_FIELDS = {"labels", "annotations", "nodeSelector", "limits", "requests"}


def drop_empty(obj: Any) -> Any:
    """What the API server's JSON leaves out (``omitempty``): null, empty strings and lists,
    and empty maps (labels, nodeSelector, resource lists...); an empty struct such as
    ``resources: {}`` stays."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = drop_empty(v)
            if v is None or v == "" or v == [] or (v == {} and k in _MAP_FIELDS):
                continue
            out[k] = v
        return out
    if isinstance(obj, list):
        return [drop_empty(v) for v in obj]
    return obj


def add_token_volume(pod: dict[str, Any], suffix: str) -> None:
    """The ServiceAccount admission plugin: a projected volume with the account's token, the
    cluster's CA and the namespace, mounted read-only in every container, unless
    ``automountServiceAccountToken: false``."""
    spec = pod["spec"]
    if spec.get("automountServiceAccountToken") is False:
        return
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    if not containers:
        return
    name = f"kube-api-access-{suffix}"
    spec.setdefault("volumes", []).append({"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    "path": "namespace"}]}}]}})
    for c in containers:
        mounts = c.setdefault("volumeMounts", [])
        if isinstance(mounts, list) and not any(isinstance(m, dict) and m.get("mountPath") == SA_MOUNT
                                                for m in mounts):
            mounts.append({"name": name, "readOnly": True, "mountPath": SA_MOUNT})


def is_extended(resource: str) -> bool:
    return "/" in resource and not resource.startswith("kubernetes.io/")


def default_pod(pod: dict[str, Any]) -> None:
    """Fill the defaults the API server sets on create (before validation, as it does)."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    spec["serviceAccountName"] = spec["serviceAccount"] = sa
    tolerations = spec.setdefault("tolerations", [])
    if isinstance(tolerations, list):
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(isinstance(t, dict) and t.get("key") == key for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                    "tolerationSeconds": 300})
    for c in spec.get("containers") or []:
        if not isinstance(c, dict):
            continue
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        image = c.get("image") or ""
        tag = image.rsplit("/", 1)[-1]
        latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
        c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        res = c.setdefault("resources", {})
        if isinstance(res, dict) and isinstance(res.get("limits"), dict):
            req = res.setdefault("requests", {})
            if isinstance(req, dict):
                for k, v in res["limits"].items():
                    req.setdefault(k, v)
        for kind in ("limits", "requests"):
            values = res.get(kind) if isinstance(res, dict) else None
            if isinstance(values, dict):
                for k, v in values.items():
                    try:
                        values[k] = canonical_quantity(v)
                    except BadRequest:
                        pass  # validation names it


def validate_pod(pod: dict[str, Any]) -> list[FieldError]:
    """Return the field errors of a defaulted pod; raises BadRequest for undecodable input."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    errs: list[FieldError] = []
    name = meta.get("name")
    if not name:
        errs.append(FieldError("metadata.name", "Required value", detail="name or generateName is required"))
    else:
        errs += subdomain_errors("metadata.name", name)
    errs += label_errors("metadata.labels", meta.get("labels"))
    for k in meta.get("annotations") or {}:
        errs += qualified_name_errors("metadata.annotations", k)
    for ref in meta.get("ownerReferences") or []:
        for f, what in (("apiVersion", "version"), ("kind", "kind"), ("name", "name"), ("uid", "uid")):
            if not (ref or {}).get(f):
                errs.append(FieldError(f"metadata.ownerReferences.{f}", "Invalid value", "",
                                       f"{what} must not be empty"))
    errs += label_errors("spec.nodeSelector", spec.get("nodeSelector"))
    rp = spec.get("restartPolicy")
    if rp not in RESTART_POLICIES:
        errs.append(FieldError("spec.restartPolicy", "Unsupported value", rp,
                               "supported values: " + ", ".join(f'"{p}"' for p in RESTART_POLICIES)))
    sa = spec.get("serviceAccountName")
    if sa:
        errs += subdomain_errors("spec.serviceAccountName", sa)
    for i, t in enumerate(spec.get("tolerations") or []):
        f = f"spec.tolerations[{i}]"
        if t.get("operator", "Equal") not in ("Equal", "Exists"):
            errs.append(FieldError(f + ".operator", "Unsupported value", t.get("operator"),
                                   'supported values: "Equal", "Exists"'))
        if t.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            errs.append(FieldError(f + ".effect", "Unsupported value", t.get("effect"),
                                   'supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"'))
    volumes: set[str] = set()
    for i, v in enumerate(spec.get("volumes") or []):
        f = f"spec.volumes[{i}]"
        errs += unique_name_errors(f + ".name", (v or {}).get("name") or "", volumes)
        sources = [k for k in v or {} if k != "name"]
        if not sources:
            errs.append(FieldError(f, "Required value", detail="must specify a volume type"))
        pvc = (v or {}).get("persistentVolumeClaim")
        if pvc is not None and not pvc.get("claimName"):
            errs.append(FieldError(f + ".persistentVolumeClaim.claimName", "Required value"))
        hp = (v or {}).get("hostPath")
        if hp is not None and not hp.get("path"):
            errs.append(FieldError(f + ".hostPath.path", "Required value"))
    containers = spec.get("containers")
    if not containers:
        errs.append(FieldError("spec.containers", "Required value"))
    elif not isinstance(containers, list):
        raise BadRequest("spec.containers must be a list")
    names: set[str] = set()
    for i, c in enumerate(containers or []):
        errs += container_errors(f"spec.containers[{i}]", c, names, volumes)
    return errs


def unique_name_errors(field: str, name: str, seen: set[str]) -> list[FieldError]:
    """A list member's name: required, a DNS label, not used by an earlier member."""
    if not name:
        return [FieldError(field, "Required value")]
    errs = dns_label_errors(field, name)
    if name in seen:
        errs.append(FieldError(field, "Duplicate value", name))
    seen.add(name)
    return errs


def container_errors(f: str, c: dict[str, Any], names: set[str], volumes: set[str]) -> list[FieldError]:
    errs = unique_name_errors(f + ".name", c.get("name") or "", names)
    if not c.get("image"):
        errs.append(FieldError(f + ".image", "Required value"))
    if c.get("imagePullPolicy") not in ("Always", "IfNotPresent", "Never"):
        errs.append(FieldError(f + ".imagePullPolicy", "Unsupported value", c.get("imagePullPolicy"),
                               'supported values: "Always", "IfNotPresent", "Never"'))
    for key in ("command", "args"):
        if c.get(key) is not None and not (isinstance(c[key], list)
                                           and all(isinstance(a, str) for a in c[key])):
            raise BadRequest(f"{f}.{key} must be a list of strings")
    for j, e in enumerate(c.get("env") or []):
        ename = (e or {}).get("name") or ""
        if not ename:
            errs.append(FieldError(f"{f}.env[{j}].name", "Required value"))
        elif not re.fullmatch(ENV_NAME, ename):
            errs.append(FieldError(f"{f}.env[{j}].name", "Invalid value", ename, ENV_MSG))
    for j, m in enumerate(c.get("volumeMounts") or []):
        if not (m or {}).get("mountPath"):
            errs.append(FieldError(f"{f}.volumeMounts[{j}].mountPath", "Required value"))
        if (m or {}).get("name") not in volumes:
            errs.append(FieldError(f"{f}.volumeMounts[{j}].name", "Not found", (m or {}).get("name")))
    res = c.get("resources") or {}
    parsed: dict[str, dict[str, Decimal]] = {}
    for kind in ("limits", "requests"):
        parsed[kind] = {}
        for r, q in (res.get(kind) or {}).items():
            rf = f"{f}.resources.{kind}[{r}]"
            if r not in STANDARD_RESOURCES and not r.startswith("hugepages-") and "/" not in r:
                errs.append(FieldError(rf, "Invalid value", r, "must be a standard resource type or fully qualified"))
                continue
            val = parsed[kind][r] = parse_quantity(q)
            if val < 0:
                errs.append(FieldError(rf, "Invalid value", str(q), "must be greater than or equal to 0"))
            if is_extended(r) and val != val.to_integral_value():
                errs.append(FieldError(rf, "Invalid value", str(q), "must be an integer"))
    for r, req in parsed["requests"].items():
        lim = parsed["limits"].get(r)
        if is_extended(r):
            if lim is None:
                errs.append(FieldError(f + ".resources.limits", "Required value",
                                       detail="Limit must be set for non overcommitable resources"))
            elif req != lim:
                errs.append(FieldError(f + ".resources.requests", "Invalid value",
                                       str(res["requests"][r]), f"must be equal to {r} limit of {res['limits'][r]}"))
        elif lim is not None and req > lim:
            errs.append(FieldError(f + ".resources.requests", "Invalid value", str(res["requests"][r]),
                                   f"must be less than or equal to {r} limit of {res['limits'][r]}"))
    return errs


def qos_class(pod: dict[str, Any]) -> str:
    """As the API server computes it: from the non-zero cpu and memory requests and limits
    only (a pod that asks only for GPUs is BestEffort)."""
    def compute(values: Any) -> dict[str, Decimal]:
        return {k: q for k, v in (values or {}).items() if k in ("cpu", "memory") and (q := parse_quantity(v))}

    res = [c.get("resources") or {} for c in pod["spec"]["containers"]]
    pairs = [(compute(r.get("requests")), compute(r.get("limits"))) for r in res]
    if not any(req or lim for req, lim in pairs):
        return "BestEffort"
    guaranteed = all(set(lim) == {"cpu", "memory"} and all(lim.get(k) == v for k, v in req.items())
                     and set(req) == set(lim) for req, lim in pairs)
    return "Guaranteed" if guaranteed else "Burstable"


def invalid_message(kind: str, name: str, errs: list[FieldError]) -> str:
    body = str(errs[0]) if len(errs) == 1 else "[" + ", ".join(str(e) for e in errs) + "]"
    return f'{kind} "{name}" is invalid: {body}'
