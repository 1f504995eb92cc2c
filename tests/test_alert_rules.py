"""The Prometheus alerts and the Grafana dashboard of ``deploy/``: promtool checks the rules and runs
their unit tests, every alert has a case where it fires and one where it stays quiet, every metric
the rules and the dashboard name is one a real lighthouse's /metrics describes, and the fallback
alert fires on what a real lighthouse showed after a real outage."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from lighthouse import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from tests.http_util import call
from tests.procs import ROOT, ProcessPool, poll
from worker_client import ManagerClient

RULES = ROOT / "deploy" / "prometheus" / "lighthouse-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "lighthouse-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "lighthouse.json"
# Made by Prometheus, not scraped: whether a scrape answered (the LighthouseDown alert).
PROMETHEUS_OWN = {"up"}
# PromQL words that look like metric names: keywords and operators (functions are followed by "(").
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
_PROMQL_WORDS |= {"offset", "bool", "inf", "nan", "atan2"}
_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})? (\S+)")


def promtool() -> str:
    """promtool's path; fails (never skips) without it: the rules would go unchecked."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (Debian's; .ci/run does)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, ranges, strings, label lists
    and function names left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group()
        if word.lower() in _PROMQL_WORDS or expr[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def alert_rules() -> dict[str, str]:
    """Alert name -> its expression."""
    doc = yaml.safe_load(RULES.read_text())
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    return {rule["alert"]: rule["expr"] for rule in rules if "alert" in rule}


def dashboard_exprs(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panels' targets, annotations, and the query of a
    variable (``label_values(METRIC, label)``: its metric)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                found = re.fullmatch(r"label_values\((\w+),\s*\w+\)", value)
                assert found is not None, f"a variable query the check cannot read: {value}"
                yield found.group(1)
            else:
                yield from dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def exposed(url: str) -> tuple[set[str], list[str]]:
    """The metric names a lighthouse's /metrics describes (each with HELP and TYPE), and its samples."""
    answer = call(url, "GET", "/metrics")
    assert answer.status == 200, answer.body
    lines = answer.body.decode().splitlines()
    helped = {line.split()[2] for line in lines if line.startswith("# HELP ")}
    typed = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
    assert helped == typed, helped ^ typed
    return helped, [line for line in lines if line and not line.startswith("#")]


def test_the_metric_name_reader_finds_names_and_only_names() -> None:
    expr = (
        'sum without (replica_id) (increase(lighthouse_a_total{job=~"$job",x="y or z"}[10m])) > 0\n'
        "or lighthouse_b > max_over_time(lighthouse_c[30m] offset 1h) and on (job) up == 1e3"
    )
    assert metric_names(expr) == {"lighthouse_a_total", "lighthouse_b", "lighthouse_c", "up"}


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    checked = run_promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout, checked.stdout
    tested = run_promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_quiet() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(alert_rules())
    assert len(alerts) >= 10, alerts
    assert alerts - fires == set(), f"alerts no unit test shows firing: {sorted(alerts - fires)}"
    assert alerts - quiet == set(), f"alerts no unit test shows quiet: {sorted(alerts - quiet)}"
    assert (fires | quiet) - alerts == set(), "unit tests of alerts the rules do not have"


def test_the_rules_and_the_dashboard_name_only_metrics_a_lighthouse_describes(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    names, _ = exposed(lh.url)  # described (HELP, TYPE) even while no sample has a value yet
    allowed = names | PROMETHEUS_OWN
    for alert, expr in alert_rules().items():
        used = metric_names(expr)
        assert used, f"{alert}: no metric found in {expr!r}"
        assert used <= allowed, f"{alert} names metrics /metrics does not describe: {sorted(used - allowed)}"
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(dashboard_exprs(dashboard))
    used_by_dashboard: set[str] = set()
    for expr in exprs:
        used = metric_names(expr)
        assert used, f"no metric found in the dashboard's {expr!r}"
        assert used <= names, f"the dashboard names metrics /metrics lacks: {sorted(used - names)}"
        used_by_dashboard |= used
    # Every metric an alert watches is drawn too, so an alert can be seen in its context.
    watched = set().union(*map(metric_names, alert_rules().values())) - PROMETHEUS_OWN
    assert watched - used_by_dashboard == set(), sorted(watched - used_by_dashboard)
    # A layout Grafana places as written: unique ids, within its 24 columns.
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), ids
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
    assert all(p["targets"] for p in dashboard["panels"] if p["type"] != "row")


def test_a_manager_without_a_push_stream_is_counted_as_polling(procs: ProcessPool) -> None:
    """``lighthouse_managers_polling`` (the ManagersPolling alert's): a ``--poll`` manager counts, one
    on its push stream does not."""
    lh = procs.lighthouse({"lr": 1})
    procs.manager(lh.address, "pushed", cache_ttl=0.5)
    for replica in ("polled0", "polled1"):
        procs.manager(lh.address, replica, cache_ttl=0.5, extra=["--poll"])
    counts = ['lighthouse_managers{job="default"} 3', 'lighthouse_managers_polling{job="default"} 2']
    poll(lambda: set(counts) <= set(exposed(lh.url)[1]), 15, 0.05, "three managers, two polling")
    managers = call(lh.url, "GET", "/api/managers").json["managers"]
    modes = {m["replica_id"]: m["mode"] for m in managers}
    assert modes == {"pushed": "push", "polled0": "poll", "polled1": "poll"}, modes


def test_a_group_that_took_up_a_change_late_is_counted_as_the_timeline_names_it(procs: ProcessPool) -> None:
    """``lighthouse_late_switches_total`` (the ChangeAppliedLate alert's) counts a switch the timeline
    calls late, as the lighthouse hears it from a manager it knew before the switch."""
    lh = procs.lighthouse({"lr": 1})
    with LighthouseClient(lh.address) as client:

        def report(replica: str, version: int, step: int, switch: tuple[int, int] | None = None) -> None:
            switches = (
                []
                if switch is None
                else [pb.StepSwitch(version=version, step=switch[0], previous_step=switch[1])]
            )
            status = pb.ManagerStatus(
                replica_id=replica,
                address="x:1",
                version=version,
                live_version=version,
                step=step,
                switches=switches,
            )
            client.heartbeat(status, timeout=5)

        for replica in ("g0", "g1"):  # each serving v1 at step 45
            report(replica, 1, 45)
        due = call(lh.url, "PATCH", "/api/config?effective_step=50", {"lr": 2}).json["version"]
        report("g0", due, 50, (50, 49))  # on time: from step 50
        report("g1", due, 53, (53, 52))  # late: steps 50-52 on v1
        report("g2", due, 53, (53, 52))  # late too, but never heard from before: not known, not counted
    late = call(lh.url, "GET", "/api/config/timeline").json["late_groups"]
    assert [(g["replica_id"], g["switched_at_step"]) for g in late] == [("g1", 53), ("g2", 53)], late
    _, samples = exposed(lh.url)
    assert 'lighthouse_late_switches_total{job="default"} 1' in samples, samples


def _series(samples: list[str], instance: str) -> dict[str, float]:
    """Scraped sample lines as promtool input series, labelled as a scrape with honor_labels labels
    them: the target's ``instance``, and ``job="lighthouse"`` where the lighthouse sets no job."""
    out = {}
    for line in samples:
        found = _SAMPLE.fullmatch(line)
        assert found is not None, line
        name, labels, value = found.groups()
        inner = (labels or "{}")[1:-1]
        if not re.search(r'(^|,)job="', inner):
            inner = f'job="lighthouse",{inner}' if inner else 'job="lighthouse"'
        out[f'{name}{{instance="{instance}",{inner}}}'] = float(value)
    return out


def test_the_fallback_alert_fires_on_what_a_lighthouse_shows_after_a_real_outage(
    procs: ProcessPool, tmp_path: Path
) -> None:
    """A lighthouse is killed while a group trains: its worker's steps past the step lease get the
    fallback. The lighthouse restarted, the manager reports them; the scrapes of before and after,
    as Prometheus would hold them (one series across the restart), make promtool fire the alert,
    and nothing fires on the scrape of before."""
    lh = procs.lighthouse({"lr": 0.1})
    manager = procs.manager(lh.address, "g0", cache_ttl=0.5, lighthouse_timeout=0.5, backoff=0.2)
    client = ManagerClient(manager.address, timeout=timedelta(seconds=5))
    try:
        step = 0
        for _ in range(20):
            cfg = client.get_config(step=step)
            assert cfg.source in ("lighthouse", "cache") and cfg["lr"] == "0.1", (step, cfg.source)
            step += 1
        _, before = exposed(lh.url)
        counter = 'lighthouse_manager_steps_past_lease_total{job="default",replica_id="g0"} 0'
        assert counter in before, before

        lh.signal(signal.SIGKILL)
        lh.wait(10)
        fallbacks = 0
        for _ in range(10_000):  # the steps its lease covers, then the fallback
            cfg = client.get_config(step=step)
            step += 1
            if cfg.source == "fallback":
                assert dict(cfg) == {}, cfg
                fallbacks += 1
                if fallbacks == 3:
                    break
        assert fallbacks == 3, step

        restarted = procs.restart_lighthouse(lh, config_path=tmp_path / "config.json")

        def reported() -> list[str] | None:
            _, samples = exposed(restarted.url)
            counts = [s for s in samples if s.startswith("lighthouse_manager_steps_past_lease_total{")]
            return samples if counts and float(counts[0].split()[-1]) >= 3 else None

        after = poll(reported, 20, 0.05, "the manager's report of its steps past the lease")
    finally:
        client.close()

    instance = lh.url.split("://", 1)[-1].rstrip("/")
    old, new = _series(before, instance), _series(after, instance)
    minutes = 5  # each scrape held for 5 one-minute samples: before at 0-4m, after at 5-9m
    input_series = []
    for series in sorted(old.keys() | new.keys()):
        values = [old.get(series), new.get(series)]
        if any(v is not None and not math.isfinite(v) for v in values):
            continue  # a training metric's NaN: not one an alert here reads
        text = " ".join(" ".join([repr(v) if v is not None else "_"] * minutes) for v in values)
        input_series.append({"series": series, "values": text})
    expected = {
        "exp_labels": {"severity": "critical", "instance": instance, "job": "default"},
        "exp_annotations": {
            "summary": "Workers of job default got the fallback instead of the job's config",
            "description": "A manager served steps past its step lease without a confirmed config (the "
            "empty fallback, or the last good one with --serve-stale), or says it serves the fallback now.",
        },
    }
    checks = [{"eval_time": "4m", "alertname": alert, "exp_alerts": []} for alert in sorted(alert_rules())]
    checks.append({"eval_time": "7m", "alertname": "ManagersServedFallback", "exp_alerts": [expected]})
    unit_test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series, "alert_rule_test": checks}],
    }
    path = tmp_path / "outage.test.yml"
    path.write_text(yaml.safe_dump(unit_test, sort_keys=False))
    tested = run_promtool("test", "rules", str(path))
    assert tested.returncode == 0, tested.stdout + tested.stderr + path.read_text()
