"""The NetworkPolicy controller's host changes are taken back (its ipsets; its KUBE-* chains
go with kube-proxy's). Needs root and the ipset tool, as the real nodes do."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from dscache_tools.devcluster import hostnet, hostrecord
from dscache_tools.devcluster.hostrecord import HostRecord, run
from needs import missing, need_binary


@pytest.mark.slow  # changes the host (ipsets), and undoes it
def test_ipsets_made_after_the_record_are_destroyed_and_older_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        missing("needs root, as the real nodes do")
    need_binary("ipset", "ipset")
    # The record is this test's, not a cluster's: the host ledger (which cluster holds
    # the host; a dev cluster may be running beside the tests) stays untouched.
    monkeypatch.setattr(hostrecord, "LEDGER_DIR", tmp_path / "ledger")
    monkeypatch.setattr(hostrecord, "LEDGER", tmp_path / "ledger" / "ledger.json")
    older, newer = f"dscache-old-{uuid.uuid4().hex[:6]}", f"KUBE-SRC-{uuid.uuid4().hex[:6]}"
    run("ipset", "create", older, "hash:ip")
    try:
        record = HostRecord(state_dir=str(tmp_path))
        hostnet.remember_ipsets(record)
        run("ipset", "create", newer, "hash:ip")
        hostnet.undo(record, log=lambda line: None)
        names = run("ipset", "list", "-n").stdout.split()
        assert newer not in names and older in names
    finally:
        run("ipset", "destroy", older, check=False)
        run("ipset", "destroy", newer, check=False)
