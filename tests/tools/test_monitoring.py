"""tools/monitoring: the Grafana dashboard queries only series that jlco/server/metrics.py
exports (read from its source: each metric's name literal and kind, so a counter is
queried as `<name>_total`, a histogram as `_bucket`/`_sum`/`_count`), every panel is
wired to the `datasource`, `job` and `instance` variables, the pool panels' watermark
lines are the config's defaults, and prometheus.yml scrapes localhost:8000/metrics.
Fast: no server, no jax."""
import ast
import copy
import json
import pathlib
import re

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector

from jlco.config import ServeConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MON = ROOT / "tools" / "monitoring"
METRICS_PY = ROOT / "jlco" / "server" / "metrics.py"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
METRIC_RE = re.compile(r"\b(?:jlco|process)_[a-z0-9_]+")
# The series each kind of metric puts in the exposition (`_created` is never queried).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}
KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Histogram": "histogram",
         "Gauge": "gauge", "GaugeMetricFamily": "gauge"}
PROMQL_FUNCS = {"histogram_quantile", "rate", "increase", "sum", "avg", "max", "min"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "and", "or", "unless", "le"}


def _literal_labels(call: ast.Call) -> list[str]:
    """Label names of a metric constructor: the third positional argument of Counter /
    Histogram, or the `labels` / `labelnames` keyword."""
    node = call.args[2] if len(call.args) > 2 else None
    for kw in call.keywords:
        if kw.arg in ("labels", "labelnames"):
            node = kw.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def exported_metrics(source: str) -> dict[str, tuple[str, list[str]]]:
    """{metric name: (kind, label names)} for every `Kind("jlco_...", ...)` call."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.args[0]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                and name.value.startswith("jlco_")):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        assert callee in KINDS, f"metrics.py: {name.value} made by {callee}, add its kind"
        out[name.value] = (KINDS[callee], _literal_labels(node))
    return out


def process_metrics() -> dict[str, tuple[str, list[str]]]:
    """prometheus_client's process_* families, as ProcessCollector reports them here."""
    r = CollectorRegistry()
    ProcessCollector(registry=r)
    return {f.name: (f.type, []) for f in r.collect()}


@pytest.fixture(scope="module")
def metrics():
    m = exported_metrics(METRICS_PY.read_text()) | process_metrics()
    # The parser must see the file's metrics of every kind, or every check passes vacuously.
    assert m["jlco_generated_tokens"][0] == "counter"
    assert m["jlco_request_success"] == ("counter", ["finished_reason"])
    assert m["jlco_time_to_first_token_seconds"][0] == "histogram"
    assert m["jlco_cache_hits"] == ("counter", ["layer"])
    assert m["jlco_requests_running"][0] == "gauge"
    assert "process_resident_memory_bytes" in m
    return m


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((MON / "grafana_jlco.json").read_text())


def all_panels(dash: dict) -> list[dict]:
    """Top-level panels and those nested in collapsed rows."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def query_panels(dash: dict) -> list[dict]:
    return [p for p in all_panels(dash) if p.get("type") != "row"]


def _bracket_problems(expr: str) -> list[str]:
    depth, pairs = [], {")": "(", "}": "{", "]": "["}
    for ch in re.sub(r'"[^"]*"', '""', expr):
        if ch in "({[":
            depth.append(ch)
        elif ch in pairs and (not depth or depth.pop() != pairs[ch]):
            return [f"unbalanced {ch!r}"]
    return [f"unclosed {depth[-1]!r}"] if depth else []


def expr_problems(expr: str, metrics: dict) -> list[str]:
    """What is wrong with one PromQL expression (empty: nothing found)."""
    problems = _bracket_problems(expr)
    if expr.count('"') % 2:
        problems.append("odd number of quotes")
    series = {name + s: name for name, (kind, _) in metrics.items() for s in SUFFIXES[kind]}
    labels = {"job", "instance", "le"} | {l for _, ls in metrics.values() for l in ls}
    found = list(METRIC_RE.finditer(expr))
    if not found:
        problems.append("no jlco_/process_ metric")
    for m in found:
        if m.group() not in series:
            problems.append(f"{m.group()}: not a series metrics.py exports "
                            f"({sorted(n for n in series if n.startswith(m.group()[:12]))})")
        sel = re.match(r"\{([^}]*)\}", expr[m.end():])
        if not sel or '=~"$job"' not in sel.group(1) or '=~"$instance"' not in sel.group(1):
            problems.append(f'{m.group()}: select job=~"$job", instance=~"$instance"')
    for grp in re.findall(r"\bby \(([^)]*)\)", expr):
        problems += [f"by ({l}): no metric has that label"
                     for l in (x.strip() for x in grp.split(",")) if l not in labels]
    for f in re.findall(r"\b([a-z_]+)\s*\(", expr):
        if f not in PROMQL_FUNCS | PROMQL_WORDS:
            problems.append(f"{f}(: unknown function")
    return problems


def dashboard_problems(dash: dict, metrics: dict) -> list[str]:
    problems = []
    ids = [p.get("id") for p in all_panels(dash)]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids not unique: {ids}")
    for p in query_panels(dash):
        t = p.get("title") or f"panel {p.get('id')}"
        if not p.get("title"):
            problems.append(f"{t}: no title")
        if p.get("datasource") != DS_REF:
            problems.append(f"{t}: datasource is not the $datasource variable")
        if not p.get("targets"):
            problems.append(f"{t}: no targets")
        if not p.get("description"):
            problems.append(f"{t}: no description")
        refs = [q.get("refId") for q in p.get("targets", [])]
        if len(refs) != len(set(refs)):
            problems.append(f"{t}: refIds not unique: {refs}")
        for q in p.get("targets", []):
            if q.get("datasource", DS_REF) != DS_REF:
                problems.append(f"{t}/{q.get('refId')}: target datasource")
            problems += [f"{t}/{q.get('refId')}: {e}"
                         for e in expr_problems(q.get("expr", ""), metrics)]
    return problems


def test_top_level_fields(dashboard):
    assert dashboard["uid"] == "jlco-offload"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] and dashboard["id"] is None
    assert isinstance(dashboard["panels"], list) and len(query_panels(dashboard)) >= 15
    for key in ("time", "refresh", "tags", "annotations", "editable"):
        assert key in dashboard, key


def test_template_variables(dashboard):
    var = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert var["datasource"]["type"] == "datasource"
    assert var["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        v = var[name]
        assert v["type"] == "query" and v["datasource"] == DS_REF, name
        assert re.search(r"label_values\(jlco_[a-z_]+.*, " + name + r"\)", v["definition"])


def test_every_expression_uses_exported_series(dashboard, metrics):
    assert dashboard_problems(dashboard, metrics) == []


def test_covers_the_metrics_that_matter(dashboard, metrics):
    used = {m for p in query_panels(dashboard) for q in p["targets"]
            for m in METRIC_RE.findall(q["expr"])}
    bases = {n for n in metrics if any(n + s in used for s in SUFFIXES[metrics[n][0]])}
    unused = {n for n in metrics if n.startswith("jlco_")} - bases
    # Misses are lookups - hits (shown as the hit rate).
    assert unused <= {"jlco_cache_misses"}, f"no panel shows {sorted(unused)}"
    assert "process_resident_memory_bytes" in bases


@pytest.mark.parametrize("edit, expect", [
    (("jlco_h2d_bytes_total", "jlco_h2d_byte_total"), "jlco_h2d_byte_total: not a series"),
    (("jlco_requests_waiting{", "jlco_requests_waiting_total{"), "not a series"),
    (("jlco_generated_tokens_total", "jlco_generated_tokens"), "jlco_generated_tokens: not"),
    (("jlco_engine_step_seconds_bucket", "jlco_engine_step_seconds"), "not a series"),
    (("by (layer)", "by (layers)"), "by (layers): no metric has that label"),
    (('instance=~"$instance"}', "}"), 'select job=~"$job", instance=~"$instance"'),
    (("histogram_quantile(", "histogram_quantil("), "unknown function"),
    (("[1m])))", "[1m]))"), "unclosed"),
])
def test_a_broken_dashboard_fails(dashboard, metrics, edit, expect):
    """The checks above can fail: each edit, applied to the shipped dashboard, is caught."""
    text = json.dumps(dashboard)
    old, new = (json.dumps(e)[1:-1] for e in edit)     # as written inside JSON strings
    assert old in text
    broken = json.loads(text.replace(old, new))
    problems = dashboard_problems(broken, metrics)
    assert any(expect in p for p in problems), problems


def test_a_broken_panel_fails(dashboard, metrics):
    d = copy.deepcopy(dashboard)
    panels = query_panels(d)
    panels[0]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    panels[1]["targets"] = []
    panels[2]["id"] = panels[3]["id"]
    panels[4]["title"] = ""
    problems = "\n".join(dashboard_problems(d, metrics))
    for expect in ("datasource is not", "no targets", "ids not unique", "no title"):
        assert expect in problems, problems


@pytest.mark.parametrize("title, pool", [("Host pool usage", "host"),
                                         ("Device pool usage", "device")])
def test_pool_panels_show_the_config_watermarks(dashboard, title, pool):
    (p,) = [p for p in query_panels(dashboard) if p["title"] == title]
    cfg = ServeConfig()
    low, high = getattr(cfg, f"{pool}_low_watermark"), getattr(cfg, f"{pool}_high_watermark")
    steps = [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, low, high]
    assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    for field in (f"serve.{pool}_low_watermark", f"serve.{pool}_high_watermark"):
        assert field in p["description"], field
    (expr,) = [q["expr"] for q in p["targets"]]
    assert re.search(rf"jlco_{pool}_pool_bytes_used\{{.*\}} / jlco_{pool}_pool_bytes_capacity",
                     expr)


def test_readme_describes_every_panel(dashboard):
    readme = (MON / "README.md").read_text()
    missing = [p["title"] for p in query_panels(dashboard) if p["title"] not in readme]
    assert missing == []
    assert "prometheus.yml" in readme and "docker run" in readme


def _yaml_lines(text: str) -> list[str]:
    return [ln.split("#", 1)[0].rstrip() for ln in text.splitlines()
            if ln.split("#", 1)[0].strip()]


def test_prometheus_config_lines():
    """Without a YAML parser: the keys a scrape of one local server needs, indented
    under scrape_configs."""
    lines = _yaml_lines((MON / "prometheus.yml").read_text())
    assert all("\t" not in ln for ln in lines)
    assert "scrape_configs:" in lines
    body = lines[lines.index("scrape_configs:") + 1:]
    assert body and all(ln.startswith("  ") for ln in body)
    flat = [ln.strip() for ln in body]
    assert "- job_name: jlco" in flat
    assert "metrics_path: /metrics" in flat
    assert "scrape_interval: 5s" in flat
    assert '- targets: ["localhost:8000"]' in flat


def test_prometheus_config_parses():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((MON / "prometheus.yml").read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "jlco" and job["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": [f"localhost:{ServeConfig().port}"]}]
