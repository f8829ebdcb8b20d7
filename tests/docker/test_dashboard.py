"""The metrics stack of docker/: the Grafana dashboard queries only series the code sends, shows every one of them,
and the compose services carry them from Airflow (StatsD) through the exporter and Prometheus to Grafana.

Prometheus names follow prom/statsd-exporter's defaults, which docker/statsd/mapping.yml keeps (it only sets an
expiry): the StatsD name with Airflow's `statsd_prefix` in front and every `.` made `_`, the InfluxDB-style tags as
labels (parsed by default), and counters with no suffix: the exporter names unmapped counters like gauges and
serves the classic text format, not OpenMetrics, so nothing adds `_total`
(`airflow.gpt_finetune.task_failed` -> `airflow_gpt_finetune_task_failed`).
"""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tasks import telemetry
from tests.docker.test_images import CFG_EXAMPLE, COMPOSE, REPO, load_compose

GRAFANA = COMPOSE.parent / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gpt_finetune.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "gpt_finetune.yaml"
PROMETHEUS_CONFIG = COMPOSE.parent / "prometheus" / "prometheus.yml"
STATSD_MAPPING = COMPOSE.parent / "statsd" / "mapping.yml"
DOCS = REPO / "docs" / "monitoring.md"
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
                    "airflow-worker", "airflow-worker-gpu")
COUNTER_SUFFIX = ""  # statsd_exporter adds none (see the module docstring)
# The exporter's defaults (statsd_exporter --help): StatsD lines in, Prometheus series out.
EXPORTER_STATSD_PORT, EXPORTER_WEB_PORT = 9125, 9102

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLES = re.compile(r"\$\{?\w+\}?")
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:([^,()]*?)\s*,\s*)?\w+\s*\)")  # Grafana's: (metric, label)
_NAME = re.compile(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan"}


def compose_services() -> dict:
    return load_compose(COMPOSE)["services"]


def statsd_prefix() -> str:
    return compose_services()["airflow-scheduler"]["environment"]["AIRFLOW__METRICS__STATSD_PREFIX"]


def prometheus_name(statsd_name: str, prefix: str) -> str:
    name = f"{prefix}.{statsd_name}".replace(".", "_")
    counters = {telemetry.counter_metric(counter) for counter in telemetry.COUNTERS}
    return name + COUNTER_SUFFIX if statsd_name in counters else name


def emitted() -> dict[str, str]:
    """Prometheus name -> the name the code sends, for every metric of tasks.telemetry."""
    prefix = statsd_prefix()
    return {prometheus_name(name, prefix): name for name in telemetry.metric_names()}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, also those inside collapsed rows, without the rows themselves."""
    found = []
    for panel in board["panels"]:
        found += [inner for inner in panel.get("panels", []) if inner.get("type") != "row"]
        if panel["type"] != "row":
            found.append(panel)
    return found


def expressions(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [(f"panel {panel['title']!r}", target["expr"]) for panel in panels(board) for target in panel["targets"]]
    found += [(f"variable {var['name']!r}", var["query"] if isinstance(var["query"], str) else var["query"]["query"])
              for var in board["templating"]["list"] if var["type"] == "query"]
    return found


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    groupings, dashboard variables, function calls and keywords are taken out."""
    bare = _LABEL_VALUES.sub(lambda match: f" {match.group(1) or ''} ", _STRINGS.sub('""', expr))
    for pattern in (_MATCHERS, _RANGES, _GROUPING, _VARIABLES):
        bare = pattern.sub(" ", bare)
    return {name for name in _NAME.findall(bare) if name not in _KEYWORDS}


def volume_target(service: dict, host_path: Path) -> str | None:
    """Where a service mounts host_path (short syntax, relative to the compose file), or None."""
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith(".") and (COMPOSE.parent / source).resolve() == host_path.resolve():
            return target
    return None


def flag(service: dict, name: str) -> str | None:
    command = service.get("command") or []
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    return values[-1] if values else None


def test_metric_name_extraction():
    expr = ('sum by (run, task) (rate(airflow_a_b{run=~"$run", task="x"}[5m])) / on (run) '
            'max_over_time(airflow_c[$__range]) + 1e3 * airflow_d offset 5m')
    assert metric_names_in(expr) == {"airflow_a_b", "airflow_c", "airflow_d"}
    assert metric_names_in('label_values(airflow_e{run=~"$run"}, task)') == {"airflow_e"}
    assert metric_names_in("label_values(run)") == set()


# -- the dashboard ----------------------------------------------------------------------------------------------


def test_dashboard_parses_with_panels_targets_and_variables():
    board = dashboard()
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    assert board["uid"] and board["title"] and 36 <= board["schemaVersion"] <= 41
    ids = [panel["id"] for panel in board["panels"]] + [p["id"] for panel in board["panels"]
                                                         for p in panel.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert len(panels(board)) >= 15
    for panel in panels(board):
        where = f"panel {panel['title']!r}"
        assert panel["type"] in {"timeseries", "stat", "bargauge", "gauge", "table"}, where
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, where
        assert panel["targets"], f"{where} has no query"
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), where
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, where
            assert target["expr"].strip(), where
            assert 'run=~"$run"' in target["expr"], f"{where}: {target['expr']} ignores the run variable"

    variables = {var["name"]: var for var in board["templating"]["list"]}
    assert {"run", "task"} <= set(variables)
    worker = {name for name, statsd in emitted().items() if statsd.startswith(telemetry.worker_metric(""))}
    for name, label in (("run", "run"), ("task", "task")):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == uid
        query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
        match = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", query)
        assert match, f"variable {name}: {query}"
        assert match.group(1) in worker and match.group(3) == label, f"variable {name}: {query}"
    worker_targets = [target["expr"] for panel in panels(board) for target in panel["targets"]
                      if metric_names_in(target["expr"]) & worker]
    assert worker_targets and all('task=~"$task"' in expr for expr in worker_targets)


def test_every_metric_in_the_queries_is_one_the_code_emits():
    known = emitted()
    queried = [(where, expr, metric_names_in(expr)) for where, expr in expressions(dashboard())]
    assert sum(len(names) for _, _, names in queried) >= len(telemetry.WORKER_GAUGES)
    unknown = [f"{where}: {sorted(names - set(known))} in {expr}" for where, expr, names in queried
               if names - set(known)]
    assert not unknown, ("the dashboard queries series nothing sends (tasks/telemetry.py lists what is sent): "
                         + "; ".join(unknown))


def test_every_emitted_metric_has_a_panel():
    shown = set().union(*(metric_names_in(target["expr"]) for panel in panels(dashboard())
                          for target in panel["targets"]))
    prefix = statsd_prefix()
    workers = {prometheus_name(telemetry.worker_metric(field), prefix) for field in telemetry.WORKER_GAUGES}
    assert not workers - shown, f"worker gauges no panel shows: {sorted(workers - shown)}"
    assert not set(emitted()) - shown, f"metrics the code sends that no panel shows: {sorted(set(emitted()) - shown)}"


def test_gpu_panels_say_they_are_empty_on_cpu_runs():
    prefix = statsd_prefix()
    gpu = {prometheus_name(telemetry.worker_metric(field), prefix)
           for field in ("gpu_util", "gpu_mem_reserved_mb", "gpu_mem_peak_mb")}
    for panel in panels(dashboard()):
        if any(metric_names_in(target["expr"]) & gpu for target in panel["targets"]):
            assert "CPU runs" in panel["description"], panel["title"]


# -- provisioning and the compose stack -------------------------------------------------------------------------


def test_grafana_provisioning_points_at_prometheus_and_the_mounted_dashboards():
    services = compose_services()
    grafana = services["grafana"]
    provisioning = grafana["environment"].get("GF_PATHS_PROVISIONING", "/etc/grafana/provisioning")
    assert volume_target(grafana, GRAFANA / "provisioning") == provisioning

    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    url = urlparse(source["url"])
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert url.hostname == "prometheus" and "prometheus" in services
    assert any(str(port).endswith(f":{url.port}") for port in services["prometheus"]["ports"])

    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    mounted = volume_target(grafana, DASHBOARD.parent)
    assert mounted and provider["options"]["path"].rstrip("/") == mounted.rstrip("/")
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home is None or home == f"{mounted}/{DASHBOARD.name}"


def test_airflow_sends_statsd_to_the_exporter():
    services = compose_services()
    exporter = services["statsd-exporter"]
    udp = flag(exporter, "statsd.listen-udp") or f":{EXPORTER_STATSD_PORT}"
    for name in AIRFLOW_SERVICES:
        env = services[name]["environment"]
        assert env["AIRFLOW__METRICS__STATSD_ON"] == "True", name
        assert env["AIRFLOW__METRICS__STATSD_HOST"] == "statsd-exporter", name
        assert udp == f":{env['AIRFLOW__METRICS__STATSD_PORT']}", f"{name}: StatsD port is not the exporter's UDP"
        assert env["AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED"] == "True", f"{name}: tags would not become labels"
        assert env["AIRFLOW__METRICS__STATSD_PREFIX"] == statsd_prefix(), name
    assert "--no-statsd.parse-influxdb-tags" not in (exporter.get("command") or [])

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read_string(CFG_EXAMPLE.read_text())
    assert cfg.getboolean("metrics", "statsd_on") and cfg.getboolean("metrics", "statsd_influxdb_enabled")
    assert cfg.getint("metrics", "statsd_port") == EXPORTER_STATSD_PORT
    assert cfg["metrics"]["statsd_prefix"] == statsd_prefix()


def test_the_exporter_keeps_the_default_names():
    exporter = compose_services()["statsd-exporter"]
    mapping_file = flag(exporter, "statsd.mapping-config")
    assert mapping_file and volume_target(exporter, STATSD_MAPPING) == mapping_file
    mapping = yaml.safe_load(STATSD_MAPPING.read_text())
    assert not mapping.get("mappings"), "a mapping renames series: the dashboard and this test assume none"
    ttl = re.fullmatch(r"(\d+)([smh])", str(mapping["defaults"]["ttl"]))
    assert ttl and int(ttl.group(1)) * {"s": 1, "m": 60, "h": 3600}[ttl.group(2)] >= 60, \
        "series must outlive the 2 s between two live lines by far"


def test_prometheus_scrapes_the_exporter():
    services = compose_services()
    prometheus = services["prometheus"]
    config_file = flag(prometheus, "config.file")
    assert config_file and volume_target(prometheus, PROMETHEUS_CONFIG) == config_file
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    web = flag(services["statsd-exporter"], "web.listen-address") or f":{EXPORTER_WEB_PORT}"
    targets = {target for job in config["scrape_configs"] for static in job.get("static_configs", [])
               for target in static["targets"]}
    assert f"statsd-exporter{web}" in targets
    scrape = re.fullmatch(r"(\d+)s", config["global"]["scrape_interval"])
    assert scrape and int(scrape.group(1)) <= 15, "live lines come every 2 s: scrape often enough to see them"


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_consoles_are_loopback_only(service):
    assert all(str(port).startswith("127.0.0.1:") for port in compose_services()[service]["ports"])


def test_grafana_takes_its_admin_password_from_docker_env():
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["environment"]
    assert raw["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD in docker/.env}"
    assert raw["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_the_monitoring_page_lists_every_metric():
    text = DOCS.read_text()
    missing = sorted(name for name in telemetry.metric_names() if f"`{name}`" not in text)
    assert not missing, f"metrics docs/monitoring.md does not describe: {missing}"
