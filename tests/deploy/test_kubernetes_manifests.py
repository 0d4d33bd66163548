"""deploy/kubernetes/ renders (`kubectl kustomize`) and every object is valid, offline: the Kubernetes OpenAPI
schemas for the built-in kinds, KEDA's CRD schema for the ScaledObjects; a broken field fails."""

from __future__ import annotations

import shutil

import pytest

from tests.support.kubernetes import MANIFESTS, OVERLAYS, find, render, validate


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_its_kind(rendered, overlay):
    objects = rendered[overlay]
    for obj in objects:
        validate(obj)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ScaledObject", "PodDisruptionBudget", "ConfigMap", "Service"} <= kinds, kinds
    assert ("StatefulSet" in kinds) == (overlay == "with-redis"), "Redis runs in the cluster only when asked"
    assert all(o["metadata"].get("namespace") == "tokenbus" for o in objects)


def test_no_secret_is_inlined(rendered):
    for obj in rendered["with-redis"]:
        assert obj["kind"] != "Secret", "Secrets are created by the operator and only referenced"
        text = repr(obj)
        assert "password=" not in text.lower() and "sk-" not in text, obj["metadata"]["name"]
        for kind in ("Deployment", "StatefulSet"):
            if obj["kind"] != kind:
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if {"PASSWORD", "KEYS", "SECRET", "TOKEN", "AUTH"} & set(e["name"].split("_")):
                        assert "secretKeyRef" in e.get("valueFrom", {}), (obj["metadata"]["name"], e)
                    if "@" in e.get("value", ""):  # a URL with credentials: the password only by reference
                        assert ":$(REDIS_PASSWORD)@" in e["value"], (obj["metadata"]["name"], e)


def test_the_redis_component_points_the_fleet_at_itself(rendered):
    hosts = {o: find(rendered[o], "ConfigMap", "tokenbus")[0]["data"]["redis-host"] for o in OVERLAYS}
    assert hosts["with-redis"] == "redis" and find(rendered["with-redis"], "Service", "redis")
    assert hosts["external-redis"] != "redis"
    (redis,) = find(rendered["with-redis"], "StatefulSet", "redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--maxmemory-policy") + 1] == "noeviction"


@pytest.mark.parametrize("where, broken", [
    ("Deployment", lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSecond=90)),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(startupProbe={"httpGet": {
        "path": "/healthz", "port": "metrics"}, "failureTreshold": 60})),
    ("PodDisruptionBudget", lambda p: p["spec"].update(maxUnavailable=[1])),
    ("ScaledObject", lambda s: s["spec"].update(minReplicaCont=0)),
    ("ScaledObject", lambda s: s["spec"]["triggers"][0].pop("type")),
    ("ScaledObject", lambda s: s["spec"].update(pollingInterval="15s")),
])
def test_a_broken_field_fails_validation(rendered, where, broken):
    import copy

    obj = copy.deepcopy(find(rendered["external-redis"], where)[0])
    broken(obj)
    with pytest.raises(AssertionError, match=where):
        validate(obj)


def test_a_broken_field_in_a_manifest_file_fails(tmp_path):
    """The same through the files: a typo in the worker's Deployment or ScaledObject is caught after rendering."""
    for name, good, bad in (("deployment.yaml", "terminationGracePeriodSeconds:", "terminationGracePeriod:"),
                            ("scaledobject.yaml", "cooldownPeriod:", "coolDownPeriod:")):
        tree = tmp_path / name
        shutil.copytree(MANIFESTS, tree)
        path = tree / "worker" / name
        assert good in path.read_text()
        path.write_text(path.read_text().replace(good, bad))
        objects = render("external-redis", tree)
        with pytest.raises(AssertionError, match="was unexpected"):
            for obj in objects:
                validate(obj)
