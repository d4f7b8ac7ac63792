"""deploy/kubernetes/ and deploy/Dockerfile, checked with the real tools, since no cluster runs here:

- every kustomization (the base, every overlay, and through them every component) renders with `kubectl kustomize`;
- every object validates against Kubernetes' own schemas with `kubernetes-validate --strict` (unknown fields
  refused) for the oldest and the newest Kubernetes supported, and every custom resource against its project's
  published CRD (tests/fixtures/kubernetes/), with check-jsonschema, unknown fields refused as
  `kubectl apply --validate=strict` refuses them;
- each overlay's engine values agree with the profile they name and reach every field they must;
- every trtglm command line (the Dockerfile's entrypoint, the Job's, the servers', the LeaderWorkerSet leader's
  script run for real with a stand-in for trtglm) passes the CLI's own flag checks;
- the endpoint picker's configuration uses only plugins, parameters and keys its release knows.
The served side (probe paths, ports, metrics) is checked against a real launch in test_manifests_served.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from support.manifests import (FIXTURES, KUBERNETES, KUBERNETES_VERSIONS, components, expand, kustomizations, named,
                               render, selectors, server_container, server_pods, values)

from trtglm.cli import COMMANDS
from trtglm.cli.flags import check_argv
from trtglm.profile import load_profile

CRD_KINDS = {("LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1"), ("InferencePool", "inference.networking.k8s.io/v1"),
             ("HTTPRoute", "gateway.networking.k8s.io/v1"), ("PodMonitor", "monitoring.coreos.com/v1"),
             ("ServiceMonitor", "monitoring.coreos.com/v1"), ("PrometheusRule", "monitoring.coreos.com/v1"),
             ("ScaledObject", "keda.sh/v1alpha1")}
CHECK_OPTIONS = ("--regex-variant", "python")  # the CRDs' patterns, Go's, translated to Python's by `closed`
PICKER = json.loads((FIXTURES / "endpoint-picker-v1.5.0.json").read_text())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {folder.relative_to(KUBERNETES).as_posix(): render(folder) for folder in kustomizations()}


@pytest.fixture(scope="module")
def overlays(rendered) -> dict[str, list[dict]]:
    return {name: objects for name, objects in rendered.items() if name.startswith("overlays/")}


def test_every_component_is_rendered_by_an_overlay(rendered):
    used = set()
    for folder in kustomizations():
        used |= {(folder / c).resolve() for c in yaml.safe_load((folder / "kustomization.yaml").read_text())
                 .get("components", [])}
    assert set(components()) <= used, set(components()) - used
    assert all(rendered.values())


# --- Kubernetes' own schemas, and the CRDs' ---------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_strictly_against_kubernetes_own_schemas(rendered, tmp_path, version):
    files = []
    for name, objects in rendered.items():
        files.append(tmp_path / f"{name.replace('/', '-')}.yaml")
        files[-1].write_text(yaml.safe_dump_all(objects))
    done = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", version,
                           *map(str, files)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    no_schema = set(re.findall(r"Couldn't find schema for kind (\w+) with api version (\S+)", done.stdout))
    # everything it cannot check is a custom resource checked against its CRD below, and nothing else
    assert no_schema == {kind for kind in CRD_KINDS if any(o["kind"] == kind[0] for objs in rendered.values()
                                                           for o in objs)}
    core = sum(1 for objects in rendered.values() for o in objects if (o["kind"], o["apiVersion"]) not in CRD_KINDS)
    assert done.stdout.count(" passed for resource ") == core


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(kind, apiVersion) → the JSON Schema of its CRD version, closed as the API server's strict validation is."""
    schemas = {}
    for path in FIXTURES.glob("*.yaml"):
        crd = next(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schema = closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            schema["properties"]["apiVersion"] = {"const": api_version}
            schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
            schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata"})
            schemas[(crd["spec"]["names"]["kind"], api_version)] = schema
    return schemas


def closed(schema):
    """Unknown fields refused wherever the schema lists its fields and does not keep unknown ones; Go's patterns in
    Python's words (RE2 takes a flag such as `(?i)` anywhere, Python at the start alone)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        if isinstance(schema.get("pattern"), str) and "(?i)" in schema["pattern"][1:]:
            schema["pattern"] = "(?i)" + schema["pattern"].replace("(?i)", "")
        for value in schema.values():
            closed(value)
    elif isinstance(schema, list):
        for value in schema:
            closed(value)
    return schema


def check_jsonschema(schema: dict, objects: list[dict], folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "schema.json").write_text(json.dumps(schema))
    instances = []
    for i, obj in enumerate(objects):
        instances.append(folder / f"{i}.json")
        instances[-1].write_text(json.dumps(obj))
    return subprocess.run([str(Path(sys.executable).parent / "check-jsonschema"), *CHECK_OPTIONS, "--schemafile",
                           str(folder / "schema.json"), *map(str, instances)], capture_output=True, text=True,
                          timeout=300)


def test_every_custom_resource_validates_against_its_projects_crd(rendered, tmp_path):
    schemas = crd_schemas()
    assert set(schemas) >= CRD_KINDS
    by_kind: dict[tuple[str, str], list[dict]] = {}
    for objects in rendered.values():
        for obj in objects:
            if (obj["kind"], obj["apiVersion"]) in CRD_KINDS:
                by_kind.setdefault((obj["kind"], obj["apiVersion"]), []).append(obj)
    assert set(by_kind) == CRD_KINDS  # every kind the manifests use is there, and checked
    for kind, objects in by_kind.items():
        done = check_jsonschema(schemas[kind], objects, tmp_path / kind[0])
        assert done.returncode == 0, f"{kind}: {done.stdout}{done.stderr}"


def test_the_crd_check_refuses_an_unknown_field_and_a_wrong_type(rendered, tmp_path):
    schemas = crd_schemas()
    lws = named(rendered["overlays/chatglm3-6b-fp16-tp4-multinode"], "LeaderWorkerSet")[0]
    typo = copy.deepcopy(lws)
    typo["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    pool = named(rendered["overlays/chatglm3-6b-bf16-tp1-gateway"], "InferencePool")[0]
    port = copy.deepcopy(pool)
    port["spec"]["targetPorts"][0]["number"] = "8003"
    for obj, words in ((typo, "'sizee' was unexpected"), (port, "'8003' is not of type 'integer'")):
        done = check_jsonschema(schemas[(obj["kind"], obj["apiVersion"])], [obj], tmp_path / obj["kind"])
        assert done.returncode == 1 and words in done.stdout + done.stderr, done.stdout


# --- an overlay's engine values --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [p.name for p in kustomizations()[1:]])
def test_an_overlays_values_agree_with_its_profile_and_reach_every_field(overlays, overlay):
    objects = overlays[f"overlays/{overlay}"]
    data = values(objects)
    profile = load_profile(REPO / data["PROFILE"].removeprefix("/opt/trtglm/"))  # where the image has it
    world, pods, gpus = int(data["WORLD_SIZE"]), int(data["PODS_PER_REPLICA"]), int(data["GPUS_PER_POD"])
    assert world == profile.convert.tp_size * profile.convert.pp_size == pods * gpus
    assert {name: int(data[f"{name.upper()}_PORT"]) for name in ("http", "grpc", "metrics")} == \
        {name: getattr(profile.serve, f"{name}_port") for name in ("http", "grpc", "metrics")}
    (pod,) = server_pods(objects)
    assert len(named(objects, "Deployment", "trtglm")) == (pods == 1)  # a LeaderWorkerSet otherwise
    server = server_container(pod)
    assert server["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert {p["name"]: p["containerPort"] for p in server["ports"]} == \
        {name: int(data[f"{name.upper()}_PORT"]) for name in ("http", "grpc", "metrics", "openai")}
    for lws in named(objects, "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        assert template["size"] == pods
        assert template["workerTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
    (job,) = named(objects, "Job", "trtglm-build-engine")
    assert job["spec"]["template"]["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
    for pool in named(objects, "InferencePool"):
        assert pool["spec"]["targetPorts"] == [{"number": int(data["OPENAI_PORT"])}]


@pytest.mark.parametrize("overlay", [p.name for p in kustomizations()[1:]])
def test_an_overlays_services_monitors_and_autoscalers_find_its_servers(overlays, overlay):
    objects = overlays[f"overlays/{overlay}"]
    (pod,) = server_pods(objects)
    labels, ports = pod["metadata"]["labels"], {p["name"] for p in server_container(pod)["ports"]}
    matches = lambda selector: selector.items() <= labels.items()  # noqa: E731
    for service in named(objects, "Service"):
        if service["metadata"]["name"].startswith("trtglm-epp"):
            continue
        assert matches(service["spec"]["selector"]) and {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for monitor in named(objects, "PodMonitor"):
        assert matches(monitor["spec"]["selector"]["matchLabels"])
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    for pool in named(objects, "InferencePool"):
        assert matches(pool["spec"]["selector"]["matchLabels"])
        assert labels[PICKER["engine_label_key"]] == PICKER["engine_type"]
    workload = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in objects
                if o["kind"] in ("Deployment", "LeaderWorkerSet") and o["metadata"]["name"] == "trtglm"}
    for scaler in [*named(objects, "HorizontalPodAutoscaler"), *named(objects, "ScaledObject")]:
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) in workload
    namespace = objects[0]["metadata"]["namespace"]
    for scaled in named(objects, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            assert {labels.get("namespace") for _, labels in selectors(trigger["metadata"]["query"])} == {namespace}


def test_prometheus_adapter_serves_the_recorded_series_under_the_hpas_names(overlays):
    adapter = yaml.safe_load((KUBERNETES / "components" / "hpa" / "prometheus-adapter.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    (rules,) = named(overlays["overlays/chatglm3-6b-bf16-tp1"], "PrometheusRule")
    recorded = {r["record"] for group in rules["spec"]["groups"] for r in group["rules"]}
    served = {re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), name)
              for name in recorded if re.search(rule["seriesQuery"].split('__name__=~"')[1].split('"')[0], name)}
    (hpa,) = named(overlays["overlays/chatglm3-6b-bf16-tp1"], "HorizontalPodAutoscaler")
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served


# --- trtglm's command lines -------------------------------------------------------------------------------------


def trtglm_argv(command: list[str], args: list[str]) -> tuple[str, list[str]]:
    words = [*command, *args]
    assert words[0] == "trtglm", words
    return words[1], words[2:]


def check_cli(command: str, argv: list[str], env: dict[str, str], monkeypatch) -> None:
    """The CLI's own checks of a command line (every flag known, every value of its type), with `env` the
    container's environment (launch reads its ports from it)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_argv(command, COMMANDS[command], argv)


@pytest.mark.parametrize("overlay", [p.name for p in kustomizations()[1:]])
def test_every_trtglm_command_in_an_overlay_passes_the_clis_checks(overlays, overlay, monkeypatch):
    objects = overlays[f"overlays/{overlay}"]
    env = values(objects)
    containers = [c for d in named(objects, "Deployment", "trtglm") for c in d["spec"]["template"]["spec"]["containers"]]
    job = named(objects, "Job", "trtglm-build-engine")[0]["spec"]["template"]["spec"]
    containers += [*job["initContainers"], *job["containers"]]
    checked = []
    for container in containers:
        command, argv = trtglm_argv(*(expand(container.get(k, []), env) for k in ("command", "args")))
        check_cli(command, argv, env, monkeypatch)
        checked.append(command)
    assert sorted(checked) == sorted(["build-engine", "patch-repo", *(["launch"] if named(objects, "Deployment",
                                                                                            "trtglm") else [])])


STAND_IN_TRTGLM = """#!/bin/sh
# STAND-IN for trtglm in the LeaderWorkerSet leader's script: records its arguments and the hostfile they name.
python3 - "$@" <<'EOF'
import json, os, sys
args = sys.argv[1:]
hostfile = open(args[args.index("--hostfile") + 1]).read() if "--hostfile" in args else None
json.dump({"argv": args, "hostfile": hostfile}, open(os.environ["STAND_IN_OUT"], "w"))
EOF
"""


def test_the_leaders_script_writes_the_groups_hostfile_and_launches_on_it(overlays, tmp_path, monkeypatch):
    """The leader's script, run by sh with LeaderWorkerSet's environment for a group of 2 pods (the variables the
    controller sets) and the overlay's values: its hostfile names the leader, then each worker by the name the
    group's headless Service gives it, GPUS_PER_POD slots each, and its `trtglm launch` passes the CLI's checks."""
    objects = overlays["overlays/chatglm3-6b-fp16-tp4-multinode"]
    (lws,) = named(objects, "LeaderWorkerSet")
    leader = server_container(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "trtglm").write_text(STAND_IN_TRTGLM)
    (tmp_path / "bin" / "trtglm").chmod(0o755)
    env = {**values(objects), "LWS_LEADER_ADDRESS": "trtglm-0.trtglm.trtglm", "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": "0"}
    done = subprocess.run([*leader["command"], *leader["args"]], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                               "STAND_IN_OUT": str(tmp_path / "called.json")})
    assert done.returncode == 0, done.stderr
    called = json.loads((tmp_path / "called.json").read_text())
    assert called["hostfile"] == "trtglm-0.trtglm.trtglm slots=2\ntrtglm-0-1.trtglm.trtglm slots=2\n"
    command, argv = trtglm_argv(["trtglm"], called["argv"])
    check_cli(command, argv, env, monkeypatch)
    assert command == "launch" and {"--hostfile", "--rsh-agent", "--world-size"} <= set(argv)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (REPO / "deploy" / "Dockerfile").read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_the_dockerfiles_entrypoint_passes_the_clis_checks_and_it_copies_what_exists(monkeypatch):
    instructions = dockerfile_instructions()
    entrypoint = json.loads(next(rest for word, rest in instructions if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in instructions if word == "CMD"))
    command, argv = trtglm_argv(entrypoint, cmd)
    check_cli(command, argv, {}, monkeypatch)
    for word, rest in instructions:
        if word == "COPY":
            *sources, _ = rest.split()
            assert all((REPO / source).exists() for source in sources), rest
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    installed = re.search(r"pip install [^']*'\.\[([a-z,]+)\]'", runs).group(1).split(",")
    pyproject = (REPO / "pyproject.toml").read_text()
    extras = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    declared = re.findall(r"^([a-z]+) = ", extras, re.MULTILINE)
    assert set(installed) <= set(declared)


# --- the endpoint picker --------------------------------------------------------------------------------------


def test_the_endpoint_pickers_configuration_and_flags_are_its_releases(overlays):
    objects = overlays["overlays/chatglm3-6b-bf16-tp1-gateway"]
    (config_map,) = [c for c in named(objects, "ConfigMap") if c["metadata"]["name"].startswith("trtglm-epp")]
    (config,) = [yaml.safe_load(text) for text in config_map["data"].values()]
    assert set(config) <= set(PICKER["config_keys"])
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} <= set(PICKER["plugin_types"])
    for plugin in plugins.values():
        assert set(plugin.get("parameters", {})) <= set(PICKER["plugin_parameters"].get(plugin["type"], ())), plugin
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    refs += [source["pluginRef"] for source in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for source in config["dataLayer"]["sources"] for e in source["extractors"]]
    assert set(refs) <= set(plugins)
    assert plugins["core-metrics-extractor"]["parameters"]["defaultEngine"] == PICKER["engine_type"]
    (epp,) = named(objects, "Deployment", "trtglm-epp")
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {a[2:].split("=")[0] for a in args if a.startswith("--")} <= set(PICKER["flags"])
    assert f"/config/{next(iter(config_map['data']))}" in args
