"""The tuner in the running operator, against the API emulator and a stand-in engine pod.

The stand-in serves /metrics like holeblend-serve: it runs whatever ratio the runtime
ConfigMap holds (so the ratio travels the real path: decision -> status -> reconcile ->
ConfigMap), and each scrape adds proxy samples whose quality depends on that ratio.
"""

import http.server
import json
import math
import threading

import pytest

from holeblend_operator import metrics
from holeblend_operator.api import BlendDeployment
from holeblend_operator.tuning_loop import no_proxies
from tests.e2e.conftest import (
    BD,
    DEPLOYMENTS,
    FAST,
    NAME,
    condition,
    create,
    edit,
    example,
    running_operator,
    status_of,
)
from tests.serve.conftest import StandInHandler

PODS = "v1/pods"
CONFIGMAPS = "v1/configmaps"
SAMPLES_PER_SCRAPE = 10


def quality(ratio: float) -> float:
    return 1.0 - 0.35 * math.exp(-ratio / 0.08)


class EnginePod:
    """A ThreadingHTTPServer on 127.0.0.1 that answers /metrics for one engine pod."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.counts: dict[float, int] = {}
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def ratio(self) -> float:
        configmap = self.cluster.get(CONFIGMAPS, "default", f"{NAME}-runtime")
        return json.loads(configmap["data"]["blend.json"])["recomputeRatio"]

    def page(self) -> str:
        ratio = self.ratio()
        self.counts[ratio] = self.counts.get(ratio, 0) + SAMPLES_PER_SCRAPE
        lines = ["# TYPE holeblend_f1_proxy histogram"]
        for seen, count in self.counts.items():
            lines.append(f'holeblend_f1_proxy_sum{{ratio="{seen}"}} {quality(seen) * count}')
            lines.append(f'holeblend_f1_proxy_count{{ratio="{seen}"}} {count}')
        lines += ["# TYPE holeblend_recompute_ratio gauge", f"holeblend_recompute_ratio {ratio}"]
        return "\n".join(lines) + "\n"

    def _handler(self):
        pod = self

        class Handler(StandInHandler):
            def do_GET(self):
                self.reply(200, pod.page().encode(), "text/plain; version=0.0.4")

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.server.shutdown()
        self.server.server_close()


def add_ready_pod(cluster, labels: dict, name: str = NAME) -> None:
    pod = {"metadata": {"name": f"{name}-engine-0", "namespace": "default", "labels": labels}}
    cluster.call(cluster.api.put_object(PODS, pod))
    ready = {"type": "Ready", "status": "True"}
    status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [ready]}
    edit(cluster, PODS, pod["metadata"]["name"], {"status": status})


def tuned_example(port: int) -> dict:
    body = example()
    body["spec"]["engine"]["port"] = port
    body["spec"]["blend"]["recomputeRatio"] = 0.05
    body["spec"]["tuning"] = {
        "targetF1Proxy": 0.9,
        "band": 0.02,
        "minRatio": 0.05,
        "maxRatio": 0.6,
        "intervalSeconds": 5,
        "cooldownSeconds": 0,
        "minSamples": 5,
    }
    return body


def history(cluster, name: str = NAME) -> list[dict]:
    return (status_of(cluster, name).get("tuning") or {}).get("history") or []


def configmap_ratio(cluster) -> float:
    configmap = cluster.get(CONFIGMAPS, "default", f"{NAME}-runtime")
    return json.loads(configmap["data"]["blend.json"])["recomputeRatio"]


def decisions(direction: str) -> float:
    return sum(
        sample.value
        for family in metrics.TUNING_DECISIONS.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["direction"] == direction
    )


@pytest.mark.slow
def test_the_tuner_raises_the_ratio_through_the_configmap_clamps_and_lets_go(cluster):
    ups_before = decisions("up")
    with EnginePod(cluster) as pod, running_operator(FAST):
        create(cluster, tuned_example(pod.port))
        cluster.wait_for(lambda: status_of(cluster, NAME).get("phase") == "Ready", timeout=20)
        engine = cluster.get("apps/v1/deployments", "default", f"{NAME}-engine")
        add_ready_pod(cluster, engine["spec"]["selector"]["matchLabels"])

        # From 0.05 (quality 0.82) up by x1.5 until inside the band: 0.075, then 0.1125.
        cluster.wait_for(lambda: condition(cluster, NAME, "Tuned").get("status") == "True", 60)
        ups = [h for h in history(cluster) if h["direction"] == "up"]
        assert [(h["fromRatio"], h["toRatio"]) for h in ups] == [(0.05, 0.075), (0.075, 0.1125)]
        assert all(h["reason"].startswith("BelowTarget: ") for h in ups)
        assert ups[0]["inputs"]["numSamples"] >= 5
        assert condition(cluster, NAME, "Tuned")["reason"] == "InBand"
        assert configmap_ratio(cluster) == 0.1125 == status_of(cluster, NAME)["recomputeRatio"]
        assert status_of(cluster, NAME)["metrics"]["f1Proxy"] == pytest.approx(quality(0.1125))
        assert decisions("up") - ups_before == 2

        # A ratio patched by hand outside the bounds is clamped, with the reason in status.
        edit(cluster, BD, NAME, {"status": {"recomputeRatio": 0.95}})
        cluster.wait_for(lambda: "ClampedToBounds" in history(cluster)[-1]["reason"], 20)
        assert history(cluster)[-1]["toRatio"] == 0.6
        cluster.wait_for(lambda: configmap_ratio(cluster) == 0.6, timeout=10)

        # Tuning switched off: the spec's ratio comes back, in status and in the pods' file.
        edit(cluster, BD, NAME, {"spec": {"tuning": {"enabled": False}}})
        cluster.wait_for(lambda: configmap_ratio(cluster) == 0.05, timeout=10)
        cluster.wait_for(lambda: status_of(cluster, NAME)["recomputeRatio"] == 0.05, 10)
        assert condition(cluster, NAME, "Tuned")["reason"] == "Disabled"


class ConnectorPod(EnginePod):
    """A vLLM pod's connector metrics port: the proxies and the reuse counters."""

    def __init__(self, cluster, name: str):
        super().__init__(cluster)
        self.name, self.prompt_tokens = name, 0

    def ratio(self) -> float:
        configmap = self.cluster.get(CONFIGMAPS, "default", f"{self.name}-runtime")
        return json.loads(configmap["data"]["blend.json"])["recomputeRatio"]

    def page(self) -> str:
        self.prompt_tokens += 1000
        return super().page() + (
            "# TYPE holeblend_prompt_tokens_total counter\n"
            f"holeblend_prompt_tokens_total {self.prompt_tokens}\n"
            "# TYPE holeblend_reused_tokens_total counter\n"
            f"holeblend_reused_tokens_total {0.75 * self.prompt_tokens}\n"
        )


@pytest.mark.slow
def test_the_tuner_reads_vllm_pods_on_the_connectors_metrics_port(cluster):
    """vLLM's own /metrics, on the HTTP port, has no holeblend series: the tuner scrapes
    the connector's metricsPort, fills in the hit rate and acts on the proxies there."""
    name = "llama-8b"
    with ConnectorPod(cluster, name) as pod, running_operator(FAST):
        body = example("nvidia.yaml")
        body["metadata"]["namespace"] = "default"
        del body["spec"]["accelerator"]["nodeSelector"]  # the emulated node fits it as is
        body["spec"]["engine"]["metricsPort"] = pod.port
        # No opt-in: the quality proxies are on by default (spec.tuning.qualityProxies).
        body["spec"]["tuning"] = {"intervalSeconds": 5, "minSamples": 5, "targetF1Proxy": 0.99}
        create(cluster, body)
        cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "default", f"{name}-engine"), 20)
        engine = cluster.get(DEPLOYMENTS, "default", f"{name}-engine")
        add_ready_pod(cluster, engine["spec"]["selector"]["matchLabels"], name)

        # quality(0.15) = 0.946 is below 0.99 - 0.03: raised x1.5 to 0.225.
        cluster.wait_for(lambda: any(h["direction"] == "up" for h in history(cluster, name)), 30)
        up = next(h for h in history(cluster, name) if h["direction"] == "up")
        assert (up["fromRatio"], up["toRatio"]) == (0.15, 0.225)
        assert up["inputs"]["f1Proxy"] == pytest.approx(quality(0.15))
        assert up["inputs"]["hitPercent"] == 75.0
        assert up["inputs"]["proxySignal"] == "shadow"
        cluster.wait_for(lambda: pod.ratio() == 0.225, timeout=10)


class InlineOnlyPod(EnginePod):
    """A pod whose shadow gives nothing (a busy engine): only the inline proxy comes."""

    def page(self) -> str:
        return super().page().replace("holeblend_f1_proxy", "holeblend_inline_f1_proxy")


@pytest.mark.slow
def test_without_shadow_samples_the_tuner_acts_on_the_inline_proxy_and_says_so(cluster):
    with InlineOnlyPod(cluster) as pod, running_operator(FAST):
        create(cluster, tuned_example(pod.port))
        cluster.wait_for(lambda: status_of(cluster, NAME).get("phase") == "Ready", timeout=20)
        engine = cluster.get("apps/v1/deployments", "default", f"{NAME}-engine")
        add_ready_pod(cluster, engine["spec"]["selector"]["matchLabels"])

        # quality(0.05) = 0.82, below 0.9 - 0.02 on the inline proxy: raised x1.5.
        cluster.wait_for(lambda: any(h["direction"] == "up" for h in history(cluster)), 30)
        up = next(h for h in history(cluster) if h["direction"] == "up")
        assert (up["fromRatio"], up["toRatio"]) == (0.05, 0.075)
        assert "(inline proxy: 0 shadow samples in the window)" in up["reason"]
        assert up["inputs"]["proxySignal"] == "inline"
        assert up["inputs"]["f1Proxy"] == pytest.approx(quality(0.05))


def test_the_law_is_told_why_no_proxies_can_come():
    """The proxies are on by default on vLLM pods; the law holds and says why only when the
    user turned them off or nothing is blended."""
    body = example("nvidia.yaml")
    assert no_proxies(BlendDeployment.model_validate(body)) is None
    body["spec"]["tuning"] = {"qualityProxies": False}
    assert "spec.tuning.qualityProxies is false" in no_proxies(BlendDeployment.model_validate(body))
    body["spec"]["tuning"] = {"qualityProxies": True}
    assert no_proxies(BlendDeployment.model_validate(body)) is None
    # A spec from before the field, with the old opt-in, still tunes.
    body["spec"]["engine"]["env"] = [{"name": "HOLEBLEND_ENGINE_URL", "value": "http://x:1"}]
    assert no_proxies(BlendDeployment.model_validate(body)) is None
    assert no_proxies(BlendDeployment.model_validate(example("cpu.yaml"))) is None
    body["spec"]["blend"]["mode"] = "off"
    assert "blend.mode is off" in no_proxies(BlendDeployment.model_validate(body))
