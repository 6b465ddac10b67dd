"""Small trained models: they learn, they load in the engine, and they are cached.

The tests read the mini-gqa model of the quick codec bench (``dscache bench codec
--quick`` trains the same recipe): one training for both, about a minute on an idle
machine, longer on a busy one (the step count, not the clock, decides the model),
kept in the models cache like any other. The cache's own behaviour (reuse,
concurrent callers, a new recipe) is tested in a temporary cache.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from dscache_server.loading import load_engine
from dscache_tools import training
from dscache_tools.bench.codec import QUICK_STEPS_GQA
from dscache_tools.traincli import parse_duration
from dscache_tools.training import (
    BOS_ID,
    EOS_ID,
    META_FILE,
    UNK_ID,
    TrainedModel,
    trained_model,
)

pytestmark = pytest.mark.slow

STEPS = QUICK_STEPS_GQA


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def trained() -> TrainedModel:
    return trained_model("mini-gqa", steps=STEPS, seed=0, threads=2)


def test_training_lowers_heldout_perplexity_by_a_clear_factor(trained: TrainedModel) -> None:
    assert trained.steps == STEPS
    # The untrained init is close to uniform over the vocabulary.
    assert trained.initial_perplexity > 0.5 * trained.vocab_size
    assert trained.heldout_perplexity < trained.initial_perplexity / 3
    meta = json.loads((trained.path / META_FILE).read_text())
    assert meta["preset"] == "mini-gqa" and meta["vocab_size"] == trained.vocab_size
    assert meta["losses"]["train_final"] < meta["losses"]["train_initial"]
    assert meta["versions"]["torch"] == torch.__version__


def test_heldout_and_vocabulary_are_in_the_models_ids(trained: TrainedModel) -> None:
    held = trained.heldout
    assert held.dtype == np.int64 and held.ndim == 1 and len(held) > 4 * 256
    assert held.min() >= 0 and held.max() < trained.vocab_size
    assert (held == BOS_ID).any() and (held == EOS_ID).any()
    assert np.mean(held == UNK_ID) < 0.05
    assert trained.vocab[BOS_ID] == 0 and trained.vocab[EOS_ID] == 1 and trained.vocab[UNK_ID] == -1
    assert len(trained.vocab) == trained.vocab_size
    ids = trained.encode("The if statement is used for conditional execution")
    assert UNK_ID not in ids
    back = trained.deepseek_ids(ids)
    assert np.array_equal(trained.model_ids(back), ids)
    assert trained.model_ids([trained.vocab.max() + 1])[0] == UNK_ID  # never seen: UNK


def test_checkpoint_loads_and_engine_matches_transformers(trained: TrainedModel) -> None:
    engine = load_engine(str(trained.path), threads=2)
    assert engine.vocab_size == trained.vocab_size
    prefix = [int(i) for i in trained.heldout[:96]]
    reference = engine.reference_logits(prefix)
    seq = engine.new_sequence()
    engine.extend(seq, prefix[:40])  # the KV path: a cached prefix, then the rest
    logits = engine.forward(seq, prefix[40:])
    assert logits.shape == (trained.vocab_size,)
    assert torch.allclose(logits, reference, atol=1e-4, rtol=1e-4)
    whole = engine.forward(engine.new_sequence(), prefix)
    assert torch.allclose(whole, reference, atol=1e-4, rtol=1e-4)


def test_a_second_call_returns_the_cached_model(
    trained: TrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached recipe was trained again")

    monkeypatch.setattr(training, "_train_into", no_training)
    again = trained_model("mini-gqa", steps=STEPS, seed=0)
    assert again.path == trained.path
    assert again.steps == trained.steps and again.seconds == trained.seconds
    assert again.heldout_perplexity == trained.heldout_perplexity
    assert np.array_equal(again.heldout, trained.heldout)


def test_concurrent_callers_share_one_training_and_a_new_recipe_trains_anew(
    trained: TrainedModel, cache_root: Path
) -> None:
    results: list[TrainedModel] = []

    def call() -> None:  # a wall-clock budget: another recipe, so another directory
        results.append(trained_model("mini-gqa", budget_s=1.0, seed=0, cache_root=cache_root))

    # A recipe's directory name carries its hash: never the quick bench's model.
    assert (cache_root / trained.path.name).exists() is False

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 2
    assert results[0].path == results[1].path != trained.path
    assert results[0].steps == results[1].steps
    # The budget stops the loop (a step that began before it ends may finish).
    assert results[0].seconds >= 1.0 and results[0].steps >= 1
    assert results[0].path.name.startswith("mini-gqa-")
    models = sorted(p for p in cache_root.iterdir() if not p.name.startswith("."))
    assert models == [results[0].path]
    assert not list(cache_root.glob(".tmp-*"))  # nothing half-written left behind


@pytest.mark.parametrize(
    ("text", "seconds"), [("180", 180.0), ("180s", 180.0), ("2.5m", 150.0), ("1h", 3600.0)]
)
def test_budget_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5s", "3 days"])
def test_bad_budgets_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_steps_or_budget_not_both_and_never_zero(cache_root: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        trained_model("mini-gqa", steps=5, budget_s=5.0, cache_root=cache_root)
    with pytest.raises(ValueError, match="steps"):
        trained_model("mini-gqa", steps=0, cache_root=cache_root)
