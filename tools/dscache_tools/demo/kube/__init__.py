"""``dscache demo kubernetes``: the cache-warmth-aware canary against a blind rolling update.

Everything runs for real on a Kubernetes cluster whose nodes run pods (the dev
cluster with a real node by default): the operator installed by Helm as a pod,
a CPU-sized ``DeepSeekCacheDeployment`` (``examples/04-dev-cluster``), model
server + sidecar pods, the NGINX router, a prewarm Job, and Prometheus beside
the cluster scraping the pods. The finance workload is driven through the
router's Service while:

1. **warm canary**: ``spec.model.revision`` changes; the operator deploys the
   new track, prewarms it, and ramps 10 -> 25 -> 50 -> 100% on the real hit
   rate and TTFT until it promotes;
2. **bad revision**: a revision that cannot hit (the cache admits nothing) is
   rolled out; the gate must roll it back at the first step;
3. **blind rolling update**: the stable track's Deployment gets a new model
   revision directly (``kubectl patch``), and Kubernetes replaces its pods one by
   one as a plain rolling update does, blind to what their caches hold. The
   operator keeps the router's pod list current meanwhile; it owns the
   Deployment and puts its template back afterwards, where the window ends.

``--engine vllm`` runs the same three parts on vLLM pods (vLLM's CPU build with
the dscache connector, ``examples/07-vllm-dev-cluster``, one pod per track): the
gates then read vLLM's own figures, and the bad revision is vLLM's (blocks
longer than any prompt and vLLM's prefix cache off: nothing is reused).

Contract:
    * Warm canary and blind rolling update replay sessions of one workload
      (same documents, same shape, disjoint sessions) at the same concurrency;
      each is measured from its revision change until its rollout is complete
      and the same number of seconds after, so both windows cover a whole
      rollout and its aftermath.
    * The load sends back the answers it was served, as a chat client does
      (``LoadConfig.answers="served"``), so a turn's history holds the previous
      answer the model generated, whose KV the model server cached.
    * Figures come from what the client saw (``usage`` of each streamed
      response and the time to its first token): recomputed prompt tokens are
      prompt tokens minus cached tokens.
    * Each part also gives the steady state of the same traffic (the second
      half of the warm-up just before its change: ``steady_recomputed_share``) and what the
      rollout cost beyond it (``excess_recomputed_tokens`` / ``_share``):
      new sessions and each turn's new question are recomputed with or
      without a rollout.
    * The JSON has ``warm_canary`` and ``blind_rolling`` (each with
      ``recomputed_tokens``, ``prompt_tokens``, ``ttft_p99_s``, ``errors``),
      ``promoted``, ``bad_revision_rolled_back`` and
      ``router_weight_latency_s`` (the slowest time from a weight change
      recorded in the resource's status to the router answering with it).
    * A cluster started here is stopped on exit; an existing one
      (``--kubeconfig``) keeps what was installed, in its own namespaces.

Where things are: :mod:`.options` (knobs, paths), :mod:`.cluster` (the cluster,
kubectl, helm, polling), :mod:`.watch` (the load and the watcher while a rollout
runs), :mod:`.scenarios` (the three parts in turn), :mod:`.report` (figures and
table) and :mod:`.plot` (the PNG).
"""

from dscache_tools.demo.kube.options import EXAMPLE, KubeDemoOptions
from dscache_tools.demo.kube.plot import write_png
from dscache_tools.demo.kube.scenarios import main, run_kubernetes_demo

__all__ = ["EXAMPLE", "KubeDemoOptions", "main", "run_kubernetes_demo", "write_png"]
