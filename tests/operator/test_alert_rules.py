"""The alerts, checked by Prometheus' own ``promtool`` on synthetic series.

The operator's PrometheusRule for a sample resource is written as a rule file;
``promtool check rules`` parses it and ``promtool test rules`` evaluates it over
three synthetic histories (input_series, one sample a minute for 90 minutes):

* ``unhealthy``: good figures for an hour, then hit rates fall (token, block,
  session), lookups are slow, fallbacks high, a sidecar target down, a sidecar's
  shared tier down: every alert but ``DscacheSidecarAbsent`` fires, with its labels
  and annotations;
* ``healthy``: good figures throughout: no alert fires;
* ``no sidecar``: server series but no sidecar target: only ``DscacheSidecarAbsent``;
* ``vllm unhealthy`` / ``vllm healthy``: a vLLM track (``spec.engine: vllm``) whose
  own figures (vLLM's prompt tokens by source) fall after an hour, or hold: the
  token hit-rate alerts read vLLM's series as the server's.

A broken expression (a flipped comparison) makes ``promtool test rules`` fail.
The chart's cluster-wide rules come from the same code (``dscache_operator.chartrules``):
their template must be current, and the rules it renders must pass ``promtool check rules``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from dscache_operator import chartrules
from dscache_operator.desired import prometheus_rule
from dscache_operator.desired.common import Owner
from dscache_operator.desired.monitoring import Scope, alert_rules
from dscache_operator.spec import DeepSeekCacheDeploymentSpec, parse_spec
from needs import need_binary

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner("chat", "prod", "0c5f0e38-8a7a-4f5b-9d63-2c1d3d1c2a11")
SERVER = '{namespace="prod",service="chat-blue"%s}'
SIDECAR = 'up{namespace="prod",service="chat-blue",endpoint="metrics",pod="chat-blue-0"}'
#: The sidecar's shared-tier health (present only where spec.cache.shared is set).
REMOTE_UP = (
    'dscache_sidecar_remote_up{namespace="prod",service="chat-blue",endpoint="metrics",'
    'pod="chat-blue-0"}'
)
EVAL = "90m"
SERVER_ALERTS = (
    "DscacheHitRateLow",
    "DscacheBlockHitRateLow",
    "DscacheSessionHitRateLow",
    "DscacheHitRateDropped",
    "DscacheLookupSlow",
    "DscacheFallbackRateHigh",
)


@pytest.fixture
def spec() -> DeepSeekCacheDeploymentSpec:
    return parse_spec({"model": {"preset": "tiny-gqa", "revision": "1"}, "replicas": 2})


def _series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": name + (SERVER % labels), "values": values}


def _counter(rate: int, later: int | None = None) -> str:
    """A counter rising ``rate`` a minute for 90 minutes (``later`` a minute after 60)."""
    if later is None:
        return f"0+{rate}x90"
    return f"0+{rate}x60 {60 * rate + later}+{later}x29"


def _server(healthy: bool) -> list[dict[str, str]]:
    """Model-server series: 90% hit rates, fast lookups, no fallbacks; or, after an hour, not."""
    # 90% hits; when unhealthy, 10% from minute 61 on.
    hits = _counter(90) if healthy else _counter(90, 10)
    misses = _counter(10) if healthy else _counter(10, 90)
    tokens = "dscache_server_prompt_tokens_total"
    series = [
        _series(tokens, ',source="reused"', hits),
        _series(tokens, ',source="recomputed"', misses),
    ]
    for level in ("token", "block", "session"):
        series += [
            _series("dscache_server_cache_hits_total", f',level="{level}"', hits),
            _series("dscache_server_cache_misses_total", f',level="{level}"', misses),
        ]
    fast = 100 if healthy else 1  # lookups under 5 ms, or 99% of them over 50 ms
    bucket = "dscache_server_cache_op_seconds_bucket"
    for le, n in (("0.005", fast), ("0.05", fast), ("0.1", 100), ("+Inf", 100)):
        series.append(_series(bucket, f',op="lookup",le="{le}"', _counter(n)))
    fallbacks = "dscache_server_cache_fallbacks_total"
    series += [
        _series(fallbacks, ',reason="unavailable"', _counter(0 if healthy else 20)),
        _series("dscache_server_requests_total", ',endpoint="chat",code="200"', _counter(100)),
    ]
    return series


#: The alerts a vLLM track's own series can fire (the block and session levels,
#: lookups and fallbacks are the reference server's figures).
VLLM_ALERTS = ("DscacheHitRateLow", "DscacheHitRateDropped")


def _vllm(healthy: bool) -> list[dict[str, str]]:
    """vLLM's series: 90% of prompt tokens cached (prefix cache and dscache), or 10%
    from minute 61 on."""
    by_source = "vllm:prompt_tokens_by_source_total"
    return [
        _series("vllm:prompt_tokens_total", "", _counter(100)),
        _series(by_source, ',source="local_cache_hit"', _counter(50, 50 if healthy else 5)),
        _series(by_source, ',source="external_kv_transfer"', _counter(40, 40 if healthy else 5)),
        _series(by_source, ',source="local_compute"', _counter(10, 10 if healthy else 90)),
    ]


def _expected(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    notes = {
        k: v.replace("{{ $labels.pod }}", labels.get("pod", ""))
        for k, v in rule["annotations"].items()
    }
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": notes}


def _unit_tests(rules: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    names = sorted(rules)
    sidecar_labels = {
        "namespace": "prod",
        "service": "chat-blue",
        "endpoint": "metrics",
        "pod": "chat-blue-0",
    }

    def case(alerts: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        return [{"eval_time": EVAL, "alertname": n, "exp_alerts": alerts.get(n, [])} for n in names]

    unhealthy = {n: [_expected(rules[n], {})] for n in SERVER_ALERTS}
    unhealthy["DscacheSidecarDown"] = [_expected(rules["DscacheSidecarDown"], sidecar_labels)]
    unhealthy["DscacheSharedTierDown"] = [_expected(rules["DscacheSharedTierDown"], sidecar_labels)]
    absent = {"namespace": "prod", "endpoint": "metrics"}
    return [
        {
            "name": "unhealthy",
            "interval": "1m",
            "input_series": [
                *_server(False),
                {"series": SIDECAR, "values": "0x90"},
                {"series": REMOTE_UP, "values": "1x60 0x30"},
            ],
            "alert_rule_test": case(unhealthy),
        },
        {
            "name": "healthy",
            "interval": "1m",
            "input_series": [
                *_server(True),
                {"series": SIDECAR, "values": "1x90"},
                {"series": REMOTE_UP, "values": "1x90"},
            ],
            "alert_rule_test": case({}),
        },
        {
            "name": "vllm unhealthy",
            "interval": "1m",
            "input_series": [*_vllm(False), {"series": SIDECAR, "values": "1x90"}],
            "alert_rule_test": case({n: [_expected(rules[n], {})] for n in VLLM_ALERTS}),
        },
        {
            "name": "vllm healthy",
            "interval": "1m",
            "input_series": [*_vllm(True), {"series": SIDECAR, "values": "1x90"}],
            "alert_rule_test": case({}),
        },
        {
            "name": "no sidecar",
            "interval": "1m",
            "input_series": _server(True),
            "alert_rule_test": case(
                {"DscacheSidecarAbsent": [_expected(rules["DscacheSidecarAbsent"], absent)]}
            ),
        },
    ]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = need_binary("promtool", "prometheus")
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False
    )


def _write(tmp_path: Path, groups: list[dict[str, Any]]) -> tuple[Path, Path]:
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    tests_file = tmp_path / "tests.yaml"
    tests_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [rules_file.name],
                "evaluation_interval": "1m",
                "tests": _unit_tests(rules),
            },
            sort_keys=False,
        )
    )
    return rules_file, tests_file


@pytest.mark.slow  # promtool test-rules over every alert: about 2 s
def test_every_alert_fires_on_bad_series_and_stays_quiet_on_good_ones(
    spec: DeepSeekCacheDeploymentSpec, tmp_path: Path
) -> None:
    groups = prometheus_rule(OWNER, spec)["spec"]["groups"]
    alerts = {r["alert"] for r in groups[0]["rules"]}
    assert alerts == {
        *SERVER_ALERTS,
        "DscacheSidecarDown",
        "DscacheSidecarAbsent",
        "DscacheSharedTierDown",
    }
    for rule in groups[0]["rules"]:
        assert rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"].startswith("prod/chat: ")
        assert len(rule["annotations"]["description"]) > 80  # a runbook, not a title
    rules_file, tests_file = _write(tmp_path, groups)
    checked = _promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", str(tests_file))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout + tested.stderr


@pytest.mark.slow  # promtool test-rules over every alert: about 2 s
def test_a_broken_expression_fails_the_rule_tests(
    spec: DeepSeekCacheDeploymentSpec, tmp_path: Path
) -> None:
    groups = prometheus_rule(OWNER, spec)["spec"]["groups"]
    (rule,) = [r for r in groups[0]["rules"] if r["alert"] == "DscacheBlockHitRateLow"]
    rule["expr"] = rule["expr"].replace(" < ", " > ")  # the comparison flipped
    _, tests_file = _write(tmp_path, groups)
    tested = _promtool("test", "rules", str(tests_file))
    assert tested.returncode != 0
    assert "DscacheBlockHitRateLow" in tested.stdout + tested.stderr


def test_min_hit_rate_sets_the_floor_and_the_ratio_the_drop_alert(
    spec: DeepSeekCacheDeploymentSpec,
) -> None:
    def exprs(analysis: dict[str, Any]) -> dict[str, str]:
        s = parse_spec({**spec.model_dump(by_alias=True), "rollout": {"analysis": analysis}})
        return {
            r["alert"]: r["expr"] for r in prometheus_rule(OWNER, s)["spec"]["groups"][0]["rules"]
        }

    default = exprs({})
    assert all(default[a].endswith("< 0.85") for a in SERVER_ALERTS[:3])
    assert "< 0.95 * (" in default["DscacheHitRateDropped"]
    assert "[1h] offset 10m" in default["DscacheHitRateDropped"]
    tuned = exprs({"minHitRate": 0.6, "minHitRateRatio": 0.8})
    assert all(tuned[a].endswith("< 0.6") for a in SERVER_ALERTS[:3])
    assert "< 0.8 * (" in tuned["DscacheHitRateDropped"]
    scaled_to_zero = parse_spec({**spec.model_dump(by_alias=True), "replicas": 0})
    rules = prometheus_rule(OWNER, scaled_to_zero)["spec"]["groups"][0]["rules"]
    assert "DscacheSidecarAbsent" not in {r["alert"] for r in rules}


def test_the_charts_rule_template_is_generated_from_the_same_code() -> None:
    assert chartrules.main(["--check", "--root", str(ROOT)]) == 0, (
        "run python -m dscache_operator.chartrules"
    )


def test_the_charts_rules_pass_promtool_check(tmp_path: Path) -> None:
    """The cluster-wide scope's expressions (grouped by namespace, service) parse."""
    s = chartrules.CHART_SCOPE
    concrete = Scope(
        selector=s.selector,
        by=s.by,
        who=s.who,
        floor="0.85",
        ratio="0.95",
        lookup_p99="0.05",
        fallback_ratio="0.05",
        absent=s.absent,
    )
    rules_file = tmp_path / "chart-rules.yaml"
    group = {"name": "dscache", "rules": alert_rules(concrete) + chartrules._OPERATOR_RULES}
    rules_file.write_text(yaml.safe_dump({"groups": [group]}))
    checked = _promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.cluster  # the dev cluster's pinned helm renders the chart
def test_the_rendered_charts_rules_pass_promtool_check(tmp_path: Path) -> None:
    from dscache_tools.devcluster import ensure_built

    helm = str(ensure_built().helm)
    out = subprocess.run(
        [
            helm,
            "template",
            "t",
            str(ROOT / "charts" / "dscache"),
            "--set",
            "monitoring.prometheusRule.enabled=true",
            # --set makes 0.7 a string (the schema wants a number); --set-json does not.
            "--set-json",
            "monitoring.prometheusRule.minHitRate=0.7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert rules["DscacheHitRateLow"]["expr"].endswith("< 0.7")
    assert "{{ $labels.service }}" in rules["DscacheHitRateLow"]["annotations"]["summary"]
    rules_file = tmp_path / "rendered.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    checked = _promtool("check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
