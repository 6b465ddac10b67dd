"""The operator's settings: peering (which replica acts) and its environment variables."""

from __future__ import annotations

import pytest
from dscache_operator.handlers import kopf_settings
from dscache_operator.settings import OperatorSettings, peering_priority
from pydantic import ValidationError


def test_standalone_unless_a_peering_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OperatorSettings().standalone  # a shell run needs no peering object
    monkeypatch.setenv("DSCACHE_OPERATOR_PEERING", "dscache")
    monkeypatch.setenv("DSCACHE_OPERATOR_PEERING_LIFETIME_SECONDS", "12")
    s = OperatorSettings()
    assert (s.standalone, s.peering, s.peering_lifetime_seconds) == (False, "dscache", 12)
    ks = kopf_settings(s)
    assert ks.peering.lifetime == 12 and ks.peering.stealth
    with pytest.raises(ValidationError):
        OperatorSettings(peering="Not A Name")
    with pytest.raises(ValidationError):
        OperatorSettings(peering_lifetime_seconds=1)


def test_the_older_replica_has_the_higher_priority() -> None:
    t = 1_800_000_000.0
    old, new = peering_priority(t, 999_999), peering_priority(t + 1, 0)
    assert old > new  # a replica started later never preempts the active one
    # Replicas started within the same second are told apart by the low digits.
    assert peering_priority(t, 1) != peering_priority(t + 0.5, 2)
    # Positive, and exact through JSON (the peering status) for centuries.
    for when in (0.0, t, 4_900_000_000.0):
        assert 0 < peering_priority(when) < 2**53
    assert len({peering_priority(t) for _ in range(50)}) > 40
