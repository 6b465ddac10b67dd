"""The picker follows a real sidecar's KV events: exact holdings within a batch window.

No filter is ever fetched here (no refresher runs): what the picker knows of the
pod comes from the events alone. A stored prompt becomes a prefix choice, a
deleted block stops counting, a restarted sidecar's announcement is taken as the
new baseline, and a feed that is not in sync leaves the answer to the filter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dscache_router.eventfeed import EventFeed
from dscache_router.picker import Picker, PickerSettings
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_sidecar import kvevents
from dscache_sidecar.client import BlockData, SidecarClient
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.daemon import create_server
from dscache_sidecar.holdings import HoldingsFilter
from dscache_tools.net import free_port
from dscache_tools.polling import wait_until
from dscache_tools.sidecarproc import SidecarProcess
from test_picker import BT, DOC, ROOT, chat, keys_of, query

pytestmark = pytest.mark.slow  # a sidecar child process

POD = "127.0.0.1:8000"


@pytest.fixture(params=["", "internal-token"], ids=["open", "token"])
def sidecar(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[SidecarProcess, int, int, str]]:
    """A sidecar with KV events; with a token, subscribers must log in with it."""
    token: str = request.param
    monkeypatch.setenv("DSCACHE_SIDECAR_INTERNAL_TOKEN", token)
    pub, replay = free_port(), free_port()
    proc = SidecarProcess(
        tmp_path / "store",
        "--capacity", "64MiB", "--segment-size", "16MiB", "--segment-init", "sparse",
        "--holdings-refresh", "0",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
    )  # fmt: skip
    proc.start()
    yield proc, pub, replay, token
    proc.stop()


def _store(proc: SidecarProcess, keys: list[bytes]) -> None:
    arr = np.zeros((2, 8), dtype=np.float32)
    blocks = [BlockData(k, keys[i - 1] if i else b"", arr) for i, k in enumerate(keys)]
    with SidecarClient(proc.socket) as client:
        client.store("t", blocks)


def picker_gauge(picker: Picker) -> float:
    """``dscache_picker_event_pods``: pods whose feed is in sync."""
    value = picker.metrics.registry.get_sample_value("dscache_picker_event_pods")
    return 0.0 if value is None else value


def test_the_picker_knows_what_the_events_announce(
    sidecar: tuple[SidecarProcess, int, int, str],
) -> None:
    proc, pub, replay, token = sidecar
    tokenizer = DeepSeekTokenizer()
    settings = PickerSettings(memory_s=0.0, events_port=pub, events_replay_port=replay)
    picker = Picker(settings, tokenizer)
    picker.know([POD])
    picker.set_keyinfo(POD, ROOT, BT)
    feed = EventFeed(picker, pub, replay, token, check_s=0.1)
    feed.start()
    try:
        wait_until("the feed in sync", lambda: picker_gauge(picker) == 1, timeout=20)
        keys = keys_of(tokenizer, chat(DOC))
        assert len(keys) >= 4

        def held() -> int:
            choice = picker.pick(query(chat(DOC), pods=f"{POD}/0"))
            return choice.blocks if choice.reason == "prefix" else 0

        assert held() == 0
        _store(proc, keys)
        wait_until("the stored prompt a prefix choice", lambda: held() == len(keys), timeout=20)
        with SidecarClient(proc.socket) as client:
            assert client.delete("t", [keys[2]]) == len(keys) - 2
        wait_until("the deleted blocks no longer held", lambda: held() == 2, timeout=20)

        # A filter that claims everything is not believed while the feed is in sync.
        picker.set_holdings(POD, HoldingsFilter.of(keys, capacity=1024))
        assert held() == 2

        # A restarted sidecar announces what survived: a new baseline, then changes
        # (the filter now claims nothing, so only the events can say so).
        picker.set_holdings(POD, HoldingsFilter.of([], capacity=1024))
        proc.stop()
        proc.start()
        _store(proc, keys)
        wait_until(
            "the restarted sidecar's blocks held",
            lambda: picker_gauge(picker) == 1 and held() == len(keys),
            timeout=30,
        )

        # Out of sync (here: the feed says so), the filter answers again.
        picker.set_holdings(POD, HoldingsFilter.of(keys, capacity=1024))
        picker.events_lost(POD)
        assert held() == len(keys)  # the filter holds them all
    finally:
        feed.stop()


def test_a_picker_joining_late_takes_holdings_of_many_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A picker that starts beside a sidecar whose first batches left its buffer gets
    the holdings from the replay, in several batches of one number, and uses them all."""
    monkeypatch.setattr(kvevents, "MAX_BATCH_EVENTS", 1)  # one chain per batch
    pub, replay = free_port(), free_port()
    settings = SidecarSettings(
        data_dir=tmp_path / "store",
        capacity_bytes=1 << 20,
        segment_bytes=256 << 10,
        segment_init="sparse",
        metrics_port=None,
        holdings_refresh_s=0,
        kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
        kv_events_buffer_batches=1,
        kv_events_batch_s=0.01,
    )
    running = create_server(settings)
    tokenizer = DeepSeekTokenizer()
    texts = [DOC.replace("Revenue", word) for word in ("Cost", "Margin", "Debt", "Cash")]
    try:
        arr = np.zeros((2, 8), dtype=np.float32)
        with SidecarClient(running.socket_path) as client:
            for text in texts:
                keys = keys_of(tokenizer, chat(text))
                client.store(
                    "t", [BlockData(k, keys[i - 1] if i else b"", arr) for i, k in enumerate(keys)]
                )
        wait_until(
            "the start's batch out of the buffer",
            lambda: (
                running.metrics.registry.get_sample_value(
                    "dscache_sidecar_kv_event_batches_total", {"how": "publish"}
                )
                >= 3
            ),
            timeout=20,
        )
        picker = Picker(
            PickerSettings(memory_s=0.0, events_port=pub, events_replay_port=replay), tokenizer
        )
        picker.know([POD])
        picker.set_keyinfo(POD, ROOT, BT)
        feed = EventFeed(picker, pub, replay, check_s=0.1)
        feed.start()
        try:
            wait_until("the feed in sync", lambda: picker_gauge(picker) == 1, timeout=20)
            for text in texts:
                want = len(keys_of(tokenizer, chat(text)))
                choice = picker.pick(query(chat(text), pods=f"{POD}/0"))
                assert (choice.reason, choice.blocks) == ("prefix", want), text[:20]
        finally:
            feed.stop()
    finally:
        running.stop(grace_s=1)
