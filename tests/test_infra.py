"""Offline checks of the deployment files under infra/ (no cluster, no Docker, no network).

KubeRay and Prometheus-operator CRD schemas are not available offline, so the fields that matter
are checked by hand: kinds and API versions, required fields, one image and one Ray version
everywhere, job specs that exist and load, commands that the CLI really accepts, no credentials,
a valid cron schedule, and dashboards/rules that use exactly the metrics of pipeline/job/metrics.py.
"""

from __future__ import annotations

import json
import re
import shlex
import zoneinfo
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.job import metrics

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
IMAGE = "ghcr.io/spec-pipeline/worker:0.1.0"
SAMPLE_DATE = "2026-01-02"

EXPECTED_FILES = [
    "README.md",
    "docker/Dockerfile",
    "docker/Dockerfile.dockerignore",
    "docker/constraints.txt",
    "kuberay/raycluster.yaml",
    "kuberay/rayjob-translate.yaml",
    "kuberay/cronjob-nightly-translate.yaml",
    "cluster-launcher.yaml",
    "monitoring/prometheus.yml",
    "monitoring/pipeline-rules.yml",
    "monitoring/podmonitor.yaml",
    "monitoring/prometheusrule.yaml",
    "monitoring/grafana-dashboard.json",
]
EXPECTED_KINDS = {
    "kuberay/raycluster.yaml": [("ray.io/v1", "RayCluster")],
    "kuberay/rayjob-translate.yaml": [("ray.io/v1", "RayJob")],
    "kuberay/cronjob-nightly-translate.yaml": [("batch/v1", "CronJob")],
    "monitoring/podmonitor.yaml": [("monitoring.coreos.com/v1", "PodMonitor")],
    "monitoring/prometheusrule.yaml": [("monitoring.coreos.com/v1", "PrometheusRule")],
}
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SECRET_ENV_NAMES = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "RAY_AUTH_TOKEN",
    "HF_TOKEN",
}


# -- helpers -------------------------------------------------------------------------------------


def _rel(path: Path) -> str:
    return path.relative_to(INFRA).as_posix()


def _infra_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def _yaml_docs(rel: str) -> list:
    return [d for d in yaml.safe_load_all((INFRA / rel).read_text()) if d is not None]


def _doc(rel: str) -> dict:
    docs = _yaml_docs(rel)
    assert len(docs) == 1, f"{rel}: expected one document"
    return docs[0]


def _render(text: str) -> str:
    return text.replace("${DATE}", SAMPLE_DATE)


def _walk(node, path=()):
    """Yield (path, key, value) for every mapping entry in a parsed document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*path, i))


def _containers(doc) -> list[dict]:
    """Every container (and init container) of every pod template in a document."""
    found = []
    for _, key, value in _walk(doc):
        if key in ("containers", "initContainers") and isinstance(value, list):
            found.extend(value)
    return found


def _exported_names() -> set[str]:
    return {metrics.EXPORTED_PREFIX + name for name in metrics.METRIC_NAMES}


def _metric_refs(expr: str) -> set[str]:
    """Exported metric names referenced by a PromQL expression (histogram series -> base name)."""
    histograms = {metrics.EXPORTED_PREFIX + n for n in metrics.HISTOGRAMS}
    refs = set()
    for name in re.findall(r"\bray_pipeline_[A-Za-z0-9_]+", expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in histograms:
                name = name[: -len(suffix)]
        refs.add(name)
    return refs


def _promql_labels(expr: str) -> set[str]:
    """Label names an expression groups by or matches on."""
    labels = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in group.split(",") if x.strip())
    for selector in re.findall(r"\{([^{}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    return labels


def _rules_exprs() -> list[str]:
    groups = _doc("monitoring/pipeline-rules.yml")["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _dashboard() -> dict:
    return json.loads((INFRA / "monitoring/grafana-dashboard.json").read_text())


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


# -- cron ----------------------------------------------------------------------------------------

_CRON_FIELDS = [
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    (
        "month",
        1,
        12,
        {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())},
    ),
    ("day of week", 0, 7, {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}),
]
_CRON_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


def cron_problems(expr: str) -> list[str]:
    """Problems with a standard 5-field cron expression (Kubernetes CronJob syntax); [] if valid."""
    if expr.strip() in _CRON_MACROS:
        return []
    fields = expr.split()
    if len(fields) != 5:
        return [f"expected 5 fields, got {len(fields)}"]
    problems = []
    for text, (name, low, high, names) in zip(fields, _CRON_FIELDS):

        def value(token: str, name=name, low=low, high=high, names=names) -> int:
            token = token.lower()
            number = names[token] if token in names else int(token) if token.isdigit() else None
            if number is None or not low <= number <= high:
                raise ValueError(f"{name}: {token!r} is not in {low}-{high}")
            return number

        for item in text.split(","):
            try:
                base, _, step = item.partition("/")
                if step and (not step.isdigit() or int(step) == 0):
                    raise ValueError(f"{name}: bad step {step!r}")
                if base in ("*", "?"):
                    continue
                start, dash, end = base.partition("-")
                first = value(start)
                if dash and value(end) < first:
                    raise ValueError(f"{name}: range {base!r} runs backwards")
            except ValueError as exc:
                problems.append(str(exc))
    return problems


@pytest.mark.parametrize(
    "expr, ok",
    [
        ("0 2 * * *", True),
        ("*/15 0-6,22 1 jan-mar mon-fri", True),
        ("@daily", True),
        ("0 2 * *", False),
        ("60 2 * * *", False),
        ("0 24 * * *", False),
        ("0 2 0 * *", False),
        ("0 2 * * 8", False),
        ("0 5-2 * * *", False),
        ("*/0 * * * *", False),
    ],
)
def test_cron_validator(expr, ok):
    assert (cron_problems(expr) == []) is ok


# -- files and parsing -----------------------------------------------------------------------------


def test_expected_files_exist():
    missing = [f for f in EXPECTED_FILES if not (INFRA / f).is_file()]
    assert not missing, f"missing under infra/: {missing}"


def test_every_yaml_and_json_parses():
    yaml_files = _infra_files(".yaml", ".yml")
    json_files = _infra_files(".json")
    assert len(yaml_files) >= 8 and json_files
    for path in yaml_files:
        docs = list(yaml.safe_load_all(_render(path.read_text())))
        assert any(d is not None for d in docs), f"{_rel(path)} is empty"
    for path in json_files:
        json.loads(path.read_text())


def test_kinds_and_api_versions():
    for rel, expected in EXPECTED_KINDS.items():
        docs = _yaml_docs(rel)
        assert [(d.get("apiVersion"), d.get("kind")) for d in docs] == expected, rel
        for d in docs:
            name = _render(d["metadata"]["name"])
            assert DNS1123_LABEL.match(name) and len(name) <= 63, f"{rel}: bad metadata.name {name!r}"


def test_no_kubernetes_secret_objects_and_no_literal_credentials():
    key_id = re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")
    assignment = re.compile(
        r"(?i)(aws_secret_access_key|aws_session_token|aws_access_key_id)\s*[:=]\s*['\"]?([A-Za-z0-9/+=]{16,})"
    )
    for path in _infra_files(""):
        text = path.read_text()
        assert not key_id.search(text), f"{_rel(path)}: looks like an AWS access key id"
        assert not assignment.search(text), f"{_rel(path)}: literal AWS credential"
    for path in _infra_files(".yaml", ".yml"):
        for doc in yaml.safe_load_all(_render(path.read_text())):
            if not isinstance(doc, dict):
                continue
            assert doc.get("kind") != "Secret", f"{_rel(path)}: Secrets are created by hand, not committed"
            for container in _containers(doc):
                for env in container.get("env", []):
                    if env["name"] in SECRET_ENV_NAMES:
                        assert "value" not in env, f"{_rel(path)}: {env['name']} must come from a Secret"
                        assert "secretKeyRef" in env.get("valueFrom", {}), env


# -- image and versions ----------------------------------------------------------------------------


def _ray_version_pin() -> str:
    text = (INFRA / "docker/constraints.txt").read_text()
    match = re.search(r"^ray(?:\[[^\]]*\])?==([\w.]+)\s*$", text, re.MULTILINE)
    assert match, "constraints.txt must pin ray"
    return match.group(1)


def test_one_image_everywhere():
    images = {}
    for rel in EXPECTED_KINDS:
        for doc in _yaml_docs(rel):
            for container in _containers(doc):
                images.setdefault(container["image"], []).append(rel)
    launcher = _doc("cluster-launcher.yaml")
    images.setdefault(launcher["docker"]["image"], []).append("cluster-launcher.yaml")
    assert set(images) == {IMAGE}, images
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob-translate.yaml", "cluster-launcher.yaml"):
        assert rel in images[IMAGE]
    assert f"-t {IMAGE}" in (INFRA / "docker/Dockerfile").read_text()
    assert IMAGE in (INFRA / "README.md").read_text()


def test_one_ray_version_everywhere():
    version = _ray_version_pin()
    dockerfile = (INFRA / "docker/Dockerfile").read_text()
    assert f"ARG RAY_VERSION={version}\n" in dockerfile
    specs = [
        _doc("kuberay/raycluster.yaml")["spec"],
        _doc("kuberay/rayjob-translate.yaml")["spec"]["rayClusterSpec"],
    ]
    assert [s["rayVersion"] for s in specs] == [version, version]


def test_constraints_satisfy_the_package_requirements():
    from packaging.requirements import Requirement

    pins = {}
    for line in (INFRA / "docker/constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraint not pinned: {line}"
            pins[req.name.lower().replace("_", "-")] = spec.version
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        if name == "torch":
            continue  # pinned by the Dockerfile's TORCH_VERSION
        assert name in pins, f"{name} is a dependency but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {dep}"


def test_dockerfile():
    text = (INFRA / "docker/Dockerfile").read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.MULTILINE)
    assert re.search(
        r"^ARG BASE_IMAGE=rayproject/ray:\$\{RAY_VERSION\}-py3\d+-(gpu|cu\d+)$", text, re.MULTILINE
    )
    assert re.search(r"RAY_USAGE_STATS_ENABLED=0", text)
    assert not re.search(r"^\s*(ENV|ARG)\b.*HF_HUB_OFFLINE", text, re.MULTILINE), (
        "HF_HUB_OFFLINE is left to users"
    )
    assert re.search(r"pip install -c /home/ray/constraints.txt .* \.\s", text), (
        "installs the repo with constraints"
    )
    # the C++ the drafters and the policy load, built into the image (a missing compiler fails
    # the build rather than leaving the workers on the Python paths)
    assert "lookups.library() and search.library()" in text
    ignore = (INFRA / "docker/Dockerfile.dockerignore").read_text().splitlines()
    for line in text.splitlines():
        if line.startswith("COPY "):
            sources = [s for s in line.split()[1:-1] if not s.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY source {source} is not in the repo"
                allowed = {f"!{source}", f"!{source}/"}
                assert allowed & set(ignore), f"{source} is not allowed into the build context"


# -- KubeRay manifests -----------------------------------------------------------------------------


def _check_ray_cluster_spec(spec: dict, where: str) -> None:
    assert spec.get("enableInTreeAutoscaling") is True, where
    head = spec["headGroupSpec"]
    for group in [head, *spec["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), (
            f"{where}: rayStartParams values must be strings"
        )
        assert params.get("metrics-export-port") == "8080", where
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c.get("name") and c.get("image") for c in containers), where
        ray = containers[0]
        assert {"containerPort": 8080, "name": "metrics"} in ray["ports"], f"{where}: metrics port"
        secrets = [e["secretRef"]["name"] for e in ray.get("envFrom", []) if "secretRef" in e]
        assert "spec-pipeline-aws" in secrets, f"{where}: AWS credentials come from the Secret via envFrom"
    head_ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert head_ports["dashboard"] == 8265 and head_ports["metrics"] == 8080, where
    head_resources = head["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in head_resources.get("limits", {}), f"{where}: the head is CPU-only"
    assert head["rayStartParams"].get("num-cpus") == "0", f"{where}: no actors on the head"
    gpu_groups = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    assert len(gpu_groups) == 1, where
    group = gpu_groups[0]
    assert group["minReplicas"] == 0 <= group["replicas"] <= group["maxReplicas"], where
    assert group["maxReplicas"] >= 1, where
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1, where
    _check_gpu_group_fits_the_job(group, where)


def _check_gpu_group_fits_the_job(group: dict, where: str) -> None:
    """One actor of jobs/translate.yaml fits a GPU pod, and maxReplicas covers its actors."""
    from pipeline.spec import load_spec

    ex = load_spec(str(ROOT / "jobs/translate.yaml"), run_id="check", date=SAMPLE_DATE).execution
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert float(limits["cpu"]) >= ex.num_cpus and limits["nvidia.com/gpu"] >= ex.num_gpus, where
    assert group["maxReplicas"] >= ex.num_actors, f"{where}: fewer GPU pods than the job's actors"


K8S_VERSION = "1.33.0"


def _pod_templates(spec: dict):
    """(group, pod template) pairs of a RayCluster spec or of a RayJob's inline cluster."""
    cluster = spec.get("rayClusterSpec", spec)
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]
    if "submitterPodTemplate" in spec:
        yield "submitter", spec["submitterPodTemplate"]


def test_manifests_match_the_kubernetes_schema():
    """The official Kubernetes OpenAPI schema (strict: unknown fields are errors) for the CronJob
    and for every pod template inside the KubeRay objects, whose CRD schema does not ship offline."""
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(_doc("kuberay/cronjob-nightly-translate.yaml"), K8S_VERSION, strict=True)
    rayjob = yaml.safe_load(_render((INFRA / "kuberay/rayjob-translate.yaml").read_text()))
    for doc in (_doc("kuberay/raycluster.yaml"), rayjob):
        templates = dict(_pod_templates(doc["spec"]))
        assert {"head", "gpu"} <= set(templates), templates.keys()
        for group, template in templates.items():
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}}
            kv.validate({**wrapped, "template": template}, K8S_VERSION, strict=True)
    # and the check has teeth: a misspelled field is refused
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
    broken["template"] = {"spec": {"containers": [{"name": "a", "image": IMAGE, "resource": {}}]}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


def test_raycluster():
    doc = _doc("kuberay/raycluster.yaml")
    _check_ray_cluster_spec(doc["spec"], "raycluster.yaml")
    assert doc["spec"]["authOptions"] == {"mode": "token", "secretName": "spec-pipeline-ray-auth"}


def test_rayjob():
    raw = (INFRA / "kuberay/rayjob-translate.yaml").read_text()
    assert "${DATE}" in raw
    rendered = yaml.safe_load(_render(raw))
    assert "${" not in json.dumps(rendered), "an unrendered placeholder is left"
    spec = rendered["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec, "inline cluster: shutdownAfterJobFinishes applies to it"
    _check_ray_cluster_spec(spec["rayClusterSpec"], "rayjob-translate.yaml")
    assert "python -m pipeline.cli run jobs/translate.yaml" in spec["entrypoint"]


def test_cronjob():
    doc = _doc("kuberay/cronjob-nightly-translate.yaml")
    spec = doc["spec"]
    assert cron_problems(spec["schedule"]) == [], spec["schedule"]
    assert spec["schedule"] == "0 2 * * *" and spec["timeZone"] in zoneinfo.available_timezones()
    assert spec["concurrencyPolicy"] == "Forbid"
    job = spec["jobTemplate"]["spec"]
    assert job["backoffLimit"] == 0, "a retried submitter would start a second Ray job for the same night"
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    (container,) = pod["containers"]
    script = "\n".join(container.get("command", []) + container.get("args", []))
    assert "date -u -d yesterday +%F" in script
    # The Jobs API address points at the long-lived cluster's head service, dashboard port.
    cluster = _doc("kuberay/raycluster.yaml")["metadata"]["name"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_DASHBOARD_URL"]["value"] == f"http://{cluster}-head-svc:8265"
    token = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] == _doc("kuberay/raycluster.yaml")["spec"]["authOptions"]["secretName"]


# -- commands --------------------------------------------------------------------------------------


def _pipeline_invocations(text: str) -> list[list[str]]:
    """`pipeline ...` / `python -m pipeline.cli ...` command lines in a shell snippet, as argv
    after the program (e.g. ['submit', 'jobs/translate.yaml', '--wait'])."""
    text = text.replace("\\\n", " ")
    found = []
    for line in re.split(r"\n|&&|;|\|", text):
        line = line.strip().removeprefix("exec ")
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, token in enumerate(tokens):
            if token == "pipeline" and i == 0:
                found.append(tokens[1:])
            elif tokens[i : i + 3] == ["python", "-m", "pipeline.cli"]:
                found.append(tokens[i + 3 :])
    return [argv for argv in found if argv]


def _command_lines() -> list[tuple[str, list[str]]]:
    lines = []
    rayjob = yaml.safe_load(_render((INFRA / "kuberay/rayjob-translate.yaml").read_text()))
    lines += [("rayjob entrypoint", a) for a in _pipeline_invocations(rayjob["spec"]["entrypoint"])]
    cron = _doc("kuberay/cronjob-nightly-translate.yaml")
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    lines += [("cronjob", a) for a in _pipeline_invocations("\n".join(container["args"]))]
    readme = (INFRA / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        lines += [("infra/README.md", a) for a in _pipeline_invocations(block)]
    return lines


def test_manifests_run_real_cli_commands():
    lines = _command_lines()
    sources = {source for source, _ in lines}
    assert {"rayjob entrypoint", "cronjob", "infra/README.md"} <= sources
    runner = CliRunner()
    for source, argv in lines:
        sub, args = argv[0], argv[1:]
        assert sub in main.commands, f"{source}: `pipeline {sub}` is not a command"
        command = main.commands[sub]
        result = runner.invoke(main, [sub, "--help"])
        assert result.exit_code == 0, (source, result.output)
        # Parse the arguments exactly as the CLI would, without running anything.
        command.make_context(sub, list(args))
        spec = next((a for a in args if a.endswith((".yaml", ".yml"))), None)
        if spec is not None:
            assert (ROOT / spec).is_file(), f"{source}: {spec} does not exist"


def test_nightly_commands_use_translate_spec_that_loads():
    from pipeline.spec import load_spec

    nightly = [argv for source, argv in _command_lines() if source in ("rayjob entrypoint", "cronjob")]
    assert {argv[0] for argv in nightly} == {"run", "submit"}
    for argv in nightly:
        ctx = main.commands[argv[0]].make_context(argv[0], list(argv[1:]))
        assert ctx.params["spec_path"] == "jobs/translate.yaml"
        run_id = ctx.params["run_id"].replace("$DATE", SAMPLE_DATE)
        date = ctx.params["date"].replace("$DATE", SAMPLE_DATE)
        spec = load_spec(str(ROOT / ctx.params["spec_path"]), run_id=run_id, date=date)
        assert spec.run_id == f"nightly-{SAMPLE_DATE}" and SAMPLE_DATE in spec.output.url


def test_referenced_repo_paths_exist():
    pattern = re.compile(r"\b((?:jobs|configs)/[\w.-]+\.ya?ml)\b")
    referenced = set()
    for path in _infra_files(""):
        referenced.update(pattern.findall(path.read_text()))
    assert "jobs/translate.yaml" in referenced
    missing = sorted(p for p in referenced if not (ROOT / p).is_file())
    assert not missing, f"referenced but missing: {missing}"


# -- cluster launcher ------------------------------------------------------------------------------


def test_cluster_launcher():
    config = _doc("cluster-launcher.yaml")
    assert config["provider"]["type"] == "aws" and config["provider"]["region"]
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "no actors on the head"
    gpu = [t for name, t in types.items() if name != config["head_node_type"]]
    assert gpu and all(re.match(r"^(g|p)\d", t["node_config"]["InstanceType"]) for t in gpu), "GPU workers"
    assert all(t["max_workers"] <= config["max_workers"] for t in gpu)
    assert all("ImageId" in t["node_config"] for t in types.values())
    assert config["file_mounts"] == {"~/spec-pipeline": "."}
    assert any(re.search(r"pip install .*~/spec-pipeline(\s|$)", c) for c in config["setup_commands"]), (
        "setup_commands install the package"
    )
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert sum("--metrics-export-port=8080" in c for c in starts) == 2


# -- monitoring ------------------------------------------------------------------------------------


def test_prometheus_config():
    config = _doc("monitoring/prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"ray-launcher", "ray-pods"} <= set(jobs)
    for rule_file in config["rule_files"]:
        assert (INFRA / "monitoring" / rule_file).is_file(), rule_file
    keep = jobs["ray-pods"]["relabel_configs"]
    assert {
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "metrics",
        "action": "keep",
    } in keep


def test_podmonitor_selects_the_ray_pods():
    monitor = _doc("monitoring/podmonitor.yaml")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob-translate.yaml"):
        doc = yaml.safe_load(_render((INFRA / rel).read_text()))
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            labels = {
                **group["template"]["metadata"]["labels"],
                "ray.io/is-ray-node": "yes",
            }  # KubeRay adds it
            assert selector.items() <= labels.items(), f"{rel}: pods not selected by the PodMonitor"


def test_prometheusrule_matches_rules_file():
    rules = _doc("monitoring/pipeline-rules.yml")["groups"]
    assert _doc("monitoring/prometheusrule.yaml")["spec"]["groups"] == rules
    for group in rules:
        for rule in group["rules"]:
            assert ("record" in rule) != ("alert" in rule) and rule["expr"], rule


def test_rules_use_only_real_metrics_and_labels():
    exported = _exported_names()
    labels = {"pipeline_job", "shard", "status", "reason", "outcome", "drafter", "position", "event", "le"}
    used = set()
    for expr in _rules_exprs():
        used |= _metric_refs(expr)
        assert _promql_labels(expr) <= labels, expr
    assert used and used <= exported, used - exported


def test_dashboard_covers_exactly_the_metrics():
    exported = _exported_names()
    used = set()
    labels = {"pipeline_job", "shard", "status", "reason", "outcome", "drafter", "position", "event", "le"}
    for expr in _dashboard_exprs():
        refs = _metric_refs(expr)
        assert refs, f"panel query without a pipeline metric: {expr}"
        used |= refs
        assert _promql_labels(expr) <= labels, expr
    assert used <= exported, f"unknown metrics in the dashboard: {sorted(used - exported)}"
    assert exported <= used, f"metrics without a panel: {sorted(exported - used)}"


def test_dashboard_structure():
    dashboard = _dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    text = json.dumps(dashboard["panels"])
    for name in set(re.findall(r"\$\{?(\w+)", text)) - {"__range", "__rate_interval", "__interval"}:
        assert name in variables, f"undefined dashboard variable ${name}"
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel[
                "title"
            ]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in ("rows / s", "tokens / s", "α", "τ", "speedup", "failures", "quantiles"):
        assert word in titles, word


def test_metric_names_are_prometheus_names():
    assert len(set(metrics.METRIC_NAMES)) == len(metrics.METRIC_NAMES) == 21
    for name in metrics.METRIC_NAMES:
        assert re.match(r"^pipeline_[a-z0-9_]+$", name), name
    for name in metrics.COUNTERS:
        assert name.endswith("_total"), name
