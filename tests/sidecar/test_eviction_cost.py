"""``dscache bench store``'s eviction figures: per block access, each policy against LRU.

It opens real stores (LMDB, segment files) and replays a stream twice per policy:
marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dscache_tools.bench import evictioncost

pytestmark = pytest.mark.slow


def test_eviction_cost_reports_each_policy_in_the_store_and_alone(tmp_path: Path) -> None:
    out = evictioncost.measure(tmp_path, repeat=1)
    assert out["store_blocks"] == evictioncost.STORE_BLOCKS
    assert set(out["policies"]) == {"lru", "chain"}
    lru, chain = out["policies"]["lru"], out["policies"]["chain"]
    assert lru["store_access_vs_lru"] == 1.0 and lru["policy_access_vs_lru"] == 1.0
    for v in (lru, chain):
        assert v["store_access_us"] > 0 and v["policy_access_ns"] > 0
    # Generous: the figure itself is the benchmark's, a busy machine moves it.
    assert chain["store_access_vs_lru"] < 10
    # Every run filled its store: evictions happened, the stores were closed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evict-chain-0", "evict-lru-0"]


def test_the_stream_outgrows_the_store_and_goes_on_conversations() -> None:
    stream = evictioncost._stream(600)
    keys = {k for chain in stream for k in chain}
    assert len(keys) > 2 * evictioncost.STORE_BLOCKS
    # Later requests resend their conversation's earlier keys as a prefix.
    earlier = {tuple(chain) for chain in stream}
    goes_on = sum(1 for chain in stream if any(tuple(chain[:-k]) in earlier for k in range(1, 7)))
    assert goes_on > len(stream) // 3
