"""``dscache demo kubernetes``'s knobs and the files it applies.

Contract:
    * Paths point into this checkout (the example resource and the Helm chart);
      the demo runs from a source tree, not from an installed wheel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

#: The checkout (``tools/dscache_tools/demo/kube/`` is four levels below it).
ROOT = Path(__file__).resolve().parents[4]


EXAMPLE = ROOT / "examples" / "04-dev-cluster" / "deepseekcachedeployment.yaml"
#: The same service on vLLM (``--engine vllm``): one pod per track.
EXAMPLE_VLLM = ROOT / "examples" / "07-vllm-dev-cluster" / "deepseekcachedeployment.yaml"
#: The example each engine's demo applies.
EXAMPLES = {"reference": EXAMPLE, "vllm": EXAMPLE_VLLM}

Engine = Literal["reference", "vllm"]
#: The images a started dev cluster's node gets for each engine's demo (the other
#: engine's model image is several GB the demo never runs).
IMAGES = {
    "reference": ("pause", "router", "core", "server"),
    "vllm": ("pause", "router", "core", "vllm"),
}


CHART = ROOT / "charts" / "dscache"


NAME = "finance"


#: ``spec.cache.minTokens`` of the bad revision: the schema's maximum, nothing is admitted.
NO_CACHE_MIN_TOKENS = 1 << 20
#: The bad revision on vLLM: ``spec.cache.blockTokens`` at the schema's maximum, longer
#: than any prompt of the workload (so no block is ever whole: dscache stores and
#: loads nothing), and vLLM's own prefix cache off; nothing is reused.
NO_CACHE_BLOCK_TOKENS = 8192
NO_PREFIX_CACHING = "--no-enable-prefix-caching"


@dataclass(frozen=True)
class KubeDemoOptions:
    """Knobs of ``dscache demo kubernetes``.

    Attributes:
        quick: the ~15-minute profile (shorter steps and settling).
        engine: ``reference`` (the dscache model server, two pods per track) or
            ``vllm`` (vLLM's CPU build with the dscache connector, one pod per
            track; ``examples/07-vllm-dev-cluster``).
        kubeconfig: use this cluster (its nodes must run pods and hold the
            dscache images); None starts a dev cluster with a real node.
        prometheus_url: Prometheus the operator queries (None: the dev
            cluster's, or ``$DSCACHE_PROMETHEUS_URL``).
        namespace: where the demo's resource runs (deleted at the end).
        operator_namespace: the Helm release's namespace.
        concurrency: live sessions (users in a conversation at once).
        think_s: mean pause of a user between an answer and the next question.
        seed: workload seed.
        interval_s: rollout step interval (None: the profile's).
        settle_s: seconds measured after each rollout completes (None: profile).
        workdir: where logs and the load reports go (None: a temp dir).
        max_ttft_p99_ratio: the rollout gate's latency bound, canary P99 TTFT over
            stable's (None: the example's 2.0). A test that checks the gate's
            behaviour on a shared machine widens it: the hit-rate gate is what
            tells a cold revision from a warm one, and a noisy 2-core host can
            double a P99 by itself.
        min_hit_rate_ratio: the rollout gate's hit-rate bound, canary hit rate over
            stable's (None: the example's 0.9). A test of the gate's behaviour on a
            shared machine lowers it: a cold revision reads 0.0, a warm one on a
            loaded 2-core host once read 0.78 against stable's 0.94 in its first
            10% window.
        router_replicas: router pods (``spec.routing.replicas``); the load spreads
            each request over all of them, as a Service spreads connections.
        temperature: the users' sampling temperature (OpenAI's default, 1): two
            users who open alike get different answers, as chat users do, and
            their next turns are two conversations a router can tell apart. 0:
            greedy, the same answer to the same opening; a turn that lost its
            session id is then the same request as its twin's, which no router
            tells apart (the report counts those moves as indistinguishable).
    """

    quick: bool = False
    engine: Engine = "reference"
    kubeconfig: Path | None = None
    prometheus_url: str | None = None
    namespace: str = "dscache-demo"
    operator_namespace: str = "dscache-system"
    concurrency: int = 48
    think_s: float = 15.0
    seed: int = 0
    interval_s: int | None = None
    settle_s: float | None = None
    workdir: Path | None = None
    max_ttft_p99_ratio: float | None = None
    min_hit_rate_ratio: float | None = None
    router_replicas: int = 2
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.router_replicas <= 8:
            raise ValueError("router replicas must be between 1 and 8")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")

    @property
    def step_interval_s(self) -> int:
        """Seconds per rollout step."""
        return self.interval_s or (40 if self.quick else 90)

    @property
    def settle(self) -> float:
        """Seconds measured after a rollout completed."""
        return self.settle_s if self.settle_s is not None else (30.0 if self.quick else 60.0)

    @property
    def warmup_s(self) -> float:
        """Seconds of traffic before each measured rollout."""
        return 45.0 if self.quick else 90.0


def options_report(opts: KubeDemoOptions) -> dict[str, Any]:
    return {
        "quick": opts.quick,
        "engine": opts.engine,
        "concurrency": opts.concurrency,
        "think_s": opts.think_s,
        "seed": opts.seed,
        "interval_s": opts.step_interval_s,
        "settle_s": opts.settle,
        "warmup_s": opts.warmup_s,
        "max_ttft_p99_ratio": opts.max_ttft_p99_ratio,
        "min_hit_rate_ratio": opts.min_hit_rate_ratio,
        "router_replicas": opts.router_replicas,
        "temperature": opts.temperature,
    }
