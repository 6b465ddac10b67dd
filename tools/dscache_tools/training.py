"""Small models of each preset's architecture, trained for a few minutes on CPU.

The random-weight presets (``dscache_server.presets``) are enough to test that a
cache hit reproduces a full prefill bit for bit, but not to measure what a lossy
KV codec (int8, ...) costs in quality: on random weights no figure means
anything. This module trains each architecture briefly on real English text so
that held-out perplexity and greedy agreement do mean something.

Contract:
    * ``trained_model(preset)`` returns a checkpoint directory that
      ``dscache_server.loading.load_engine(str(path))`` loads, with its held-out
      token ids (already in the model's vocabulary) and its perplexity before and
      after training. A second call with the same recipe returns the cached
      directory without training.
    * The architecture is the preset's (layers, heads, MLA latent dims, MoE),
      except for its recipe's overrides (:data:`RECIPES`: ``tiny-deepseek-v3`` is
      trained at half width by default, with the preset's KV layout) and the
      vocabulary. The vocabulary is COMPACT: the DeepSeek-tokenizer ids that occur
      at least :data:`MIN_COUNT` times in the training part of the corpus,
      remapped to ``3..V-1`` in increasing DeepSeek-id order, plus BOS ``0`` and
      EOS ``1`` (DeepSeek's ids 0 and 1 too) and UNK ``2`` for every other id.
      The full 129 280-row output layer would dominate every step and is far too
      slow to train on two cores. ``vocab.npy`` in the checkpoint maps model ids
      back to DeepSeek ids (UNK: -1); :meth:`TrainedModel.model_ids` maps
      forwards. The checkpoint has no tokenizer of its own: serving it behind the
      DeepSeek tokenizer would produce ids outside its vocabulary.
    * The corpus is real text shipped with Python (``pydoc_data.topics``, the
      language reference, one document per topic in key order) and the distinct
      message texts of a finance workload (:data:`FINANCE_SESSIONS` sessions of
      ``dscache_tools.workload.generate``, seed 0: dossiers in English and
      Chinese, questions, answers), each document ``BOS text EOS``. The held-out
      part is the last :data:`HELDOUT_SHARE` of each source's token stream, never
      trained on and never used to choose the vocabulary.
    * Training is float32 AdamW, seeded (init, window order), on windows of
      :data:`SEQ_LEN` tokens, for a number of optimizer steps (the recipe's, or
      ``steps``) with linear warmup and a cosine decay over them: the same recipe
      gives the same model on a busy machine and an idle one, only slower. A
      wall-clock budget (``budget_s``) instead stops at the budget and decays over
      it; how many steps fit then depends on the machine. The checkpoint records
      what was done (``dscache-training.json``). MoE presets also nudge each
      router's ``e_score_correction_bias`` towards balanced expert load
      (DeepSeek-V3's auxiliary-loss-free balancing).
    * The cache lives under ``${DSCACHE_MODELS_CACHE}`` or else
      ``${XDG_CACHE_HOME:-~/.cache}/dscache/models``; a directory's name carries a
      hash of the recipe (preset, overrides, steps or budget, seed, hyper-parameters, the
      corpus text, the tokenizer file and :data:`CODE_VERSION`), so a changed
      recipe trains anew. A model is written to a temporary directory and renamed
      into place under an exclusive file lock: a concurrent caller waits and then
      reuses it, and a crashed one leaves no partial model behind.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Bumped whenever a change here changes what a recipe trains (part of the hash).
CODE_VERSION = 2
#: Tokens per training window (and per held-out evaluation window).
SEQ_LEN = 256
#: Model ids of the reserved tokens; BOS and EOS equal their DeepSeek ids.
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
#: A token must occur this often in the training part to get its own id.
MIN_COUNT = 2
#: Share of each source's token stream held out (its tail).
HELDOUT_SHARE = 0.1
#: Sessions of the finance workload whose distinct message texts join the corpus.
FINANCE_SESSIONS = 48
#: File names inside a checkpoint directory.
META_FILE = "dscache-training.json"
HELDOUT_FILE = "heldout.npy"
VOCAB_FILE = "vocab.npy"
#: Config keys recorded in ``dscache-training.json`` as the architecture trained.
_ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "n_shared_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class Recipe:
    """How one preset is trained (besides the seed).

    Attributes:
        overrides: config keys replacing the preset's (the vocabulary is always
            replaced by the compact one).
        batch: windows per step.
        peak_lr: AdamW learning rate after warmup.
        warmup_steps: steps of linear warmup.
        steps: optimizer steps of a training run (unless a wall-clock budget is given).
        weight_decay: AdamW weight decay.
        balance_rate: step of the MoE router-bias update (0: none).
    """

    overrides: dict[str, Any] = field(default_factory=dict)
    batch: int = 4
    peak_lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    balance_rate: float = 0.0
    steps: int = 300


#: tiny-deepseek-v3 at half width: hidden 256 (MLP 512, experts 128, query latent 128)
#: and 4 heads. Its KV layout is the preset's (6 layers, latent ``kv_lora_rank`` 128 plus
#: ``qk_rope_head_dim`` 32 per token and layer), and so is the MoE (one shared and 8
#: routed experts, top 2 in 1 of 2 groups). Measured on two cores: at full width a step
#: costs about twice as much, and 180 s left it near unigram quality (held-out perplexity
#: 450; the unigram model's is 572) against 255 at half width; the full width needs about
#: 600 s (perplexity 104; ``trained_model(..., overrides={}, budget_s=600)``).
HALF_WIDTH_DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "q_lora_rank": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}

#: The recipe of each trainable preset.
#: Their step counts are about three minutes each on two idle cores.
RECIPES: dict[str, Recipe] = {
    "mini-gqa": Recipe(batch=4, peak_lr=4e-3, steps=500),
    "tiny-deepseek-v3": Recipe(
        overrides=HALF_WIDTH_DEEPSEEK_V3, batch=4, peak_lr=3e-3, balance_rate=1e-3, steps=200
    ),
}


@dataclass(frozen=True, eq=False)
class TrainedModel:
    """A trained checkpoint and what it was measured at.

    Attributes:
        path: the checkpoint directory (``load_engine(str(path))`` loads it).
        preset: the preset whose architecture it has.
        vocab_size: rows of its (compact) vocabulary.
        heldout: 1-D int64 held-out token ids in the model's vocabulary.
        heldout_perplexity: perplexity on ``heldout`` after training.
        initial_perplexity: perplexity on ``heldout`` of the same init, untrained.
        steps: optimizer steps taken.
        seconds: wall-clock seconds of the training loop.
        vocab: model id -> DeepSeek-tokenizer id (UNK: -1), ``vocab_size`` long.
    """

    path: Path
    preset: str
    vocab_size: int
    heldout: np.ndarray
    heldout_perplexity: float
    initial_perplexity: float
    steps: int
    seconds: float
    vocab: np.ndarray

    def model_ids(self, deepseek_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Maps DeepSeek-tokenizer ids to this model's ids (unknown ones to UNK)."""
        return to_model_ids(self.vocab, deepseek_ids)

    def encode(self, text: str) -> np.ndarray:
        """This model's ids of ``text`` (the DeepSeek tokenizer, then :meth:`model_ids`)."""
        return self.model_ids(_tokenizer().encode(text))

    def deepseek_ids(self, model_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Maps this model's ids back to DeepSeek ids (UNK to -1), e.g. to decode."""
        return np.asarray(self.vocab[np.asarray(model_ids, dtype=np.int64)], dtype=np.int64)


def to_model_ids(vocab: np.ndarray, deepseek_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Maps DeepSeek ids to compact ids through ``vocab`` (model id -> DeepSeek id).

    Args:
        vocab: the checkpoint's ``vocab.npy``.
        deepseek_ids: ids from the DeepSeek tokenizer.

    Returns:
        int64 ids; an id outside the vocabulary becomes :data:`UNK_ID`.
    """
    ids = np.asarray(deepseek_ids, dtype=np.int64)
    known = vocab >= 0
    size = max(int(vocab.max()) + 1, int(ids.max()) + 1 if ids.size else 0)
    lookup = np.full(size, UNK_ID, dtype=np.int64)
    lookup[vocab[known]] = np.flatnonzero(known)
    return lookup[ids] if ids.size else ids


def default_cache_root() -> Path:
    """``${DSCACHE_MODELS_CACHE}``, else ``${XDG_CACHE_HOME:-~/.cache}/dscache/models``."""
    override = os.environ.get("DSCACHE_MODELS_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dscache" / "models"


def trained_model(
    preset: str,
    *,
    steps: int | None = None,
    budget_s: float | None = None,
    seed: int = 0,
    cache_root: Path | None = None,
    threads: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> TrainedModel:
    """The cached model of ``preset``'s recipe, trained first when missing.

    Args:
        preset: ``mini-gqa`` or ``tiny-deepseek-v3`` (see :data:`RECIPES`).
        steps: optimizer steps (default: the recipe's); part of the recipe.
        budget_s: train for this many wall-clock seconds instead of a step count
            (tokenizing, evaluating and saving come on top); part of the recipe.
        seed: seeds the init and the window order.
        cache_root: directory of cached models (default :func:`default_cache_root`).
        threads: torch intra-op threads while training (default: torch's choice);
            not part of the recipe.
        overrides: config keys replacing the preset's instead of the recipe's
            (``{}``: the preset's exact architecture); part of the recipe.

    Returns:
        The trained model; the cached one (no training) when its directory exists.

    Raises:
        ValueError: an unknown preset, both ``steps`` and ``budget_s``, or a step
            count or budget that is not positive.
    """
    if preset not in RECIPES:
        raise ValueError(f"no training recipe for {preset!r}; known: {', '.join(sorted(RECIPES))}")
    if steps is not None and budget_s is not None:
        raise ValueError("give a step count or a wall-clock budget, not both")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be positive, not {budget_s}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    recipe = RECIPES[preset]
    if overrides is not None:
        recipe = dataclasses.replace(recipe, overrides=dict(overrides))
    if steps is not None:
        recipe = dataclasses.replace(recipe, steps=steps)
    root = (cache_root or default_cache_root()).expanduser()
    texts = _corpus_texts()
    key = _recipe_hash(preset, recipe, budget_s, seed, texts)
    final = root / f"{preset}-{key}"
    if (final / META_FILE).is_file():  # renamed into place only when complete
        return load_trained(final)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if (final / META_FILE).is_file():  # another process trained it meanwhile
            log.info("%s was trained by another process", final)
            return load_trained(final)
        for stale in root.glob(f".tmp-{final.name}-*"):  # a crashed run's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        try:
            _train_into(
                tmp,
                preset,
                recipe,
                budget_s=budget_s,
                seed=seed,
                texts=texts,
                key=key,
                threads=threads,
            )
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_trained(final)


def load_trained(path: Path) -> TrainedModel:
    """Reads a checkpoint directory written by :func:`trained_model`."""
    meta = json.loads((path / META_FILE).read_text())
    return TrainedModel(
        path=path,
        preset=str(meta["preset"]),
        vocab_size=int(meta["vocab_size"]),
        heldout=np.load(path / HELDOUT_FILE, allow_pickle=False).astype(np.int64),
        heldout_perplexity=float(meta["heldout"]["perplexity"]),
        initial_perplexity=float(meta["heldout"]["initial_perplexity"]),
        steps=int(meta["training"]["steps"]),
        seconds=float(meta["training"]["seconds"]),
        vocab=np.load(path / VOCAB_FILE, allow_pickle=False).astype(np.int64),
    )


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- corpus -------------------------------------------------------------------------------


def _corpus_texts() -> dict[str, list[str]]:
    """The documents of each source, in a fixed order (cheap: no tokenizing)."""
    from pydoc_data.topics import topics

    from dscache_tools.workload import WorkloadConfig, generate

    pydoc = [str(topics[name]) for name in sorted(topics)]
    finance: dict[str, None] = {}  # distinct texts in order of first appearance
    for request in generate(WorkloadConfig(sessions=FINANCE_SESSIONS, seed=0)):
        for message in request.messages:
            finance.setdefault(str(message["content"]), None)
    return {"pydoc": pydoc, "finance": list(finance)}


def _tokenizer() -> Any:
    from dscache_server.tokenizer import DeepSeekTokenizer

    return DeepSeekTokenizer()


@dataclass(frozen=True)
class _Corpus:
    """The tokenized corpus in model ids."""

    train: np.ndarray  # int64, model ids
    heldout: np.ndarray
    heldout_sources: dict[str, tuple[int, int]]  # source -> [start, end) in heldout
    vocab: np.ndarray  # model id -> DeepSeek id (UNK -1)
    description: dict[str, Any]


def _build_corpus(texts: dict[str, list[str]]) -> _Corpus:
    tok = _tokenizer()
    train_parts: list[np.ndarray] = []
    held_parts: list[np.ndarray] = []
    sources: dict[str, Any] = {}
    for name, docs in texts.items():
        stream = np.fromiter(
            (i for doc in docs for i in (BOS_ID, *tok.encode(doc), EOS_ID)), dtype=np.int64
        )
        cut = int(len(stream) * (1.0 - HELDOUT_SHARE))
        train_parts.append(stream[:cut])
        held_parts.append(stream[cut:])
        sources[name] = {
            "documents": len(docs),
            "characters": sum(len(d) for d in docs),
            "train_tokens": cut,
            "heldout_tokens": len(stream) - cut,
        }
    train_ds = np.concatenate(train_parts)
    counts = np.bincount(train_ds)
    frequent = np.flatnonzero(counts >= MIN_COUNT)
    frequent = frequent[frequent > EOS_ID]  # BOS and EOS have their own reserved rows
    vocab = np.concatenate([np.array([BOS_ID, EOS_ID, -1], dtype=np.int64), frequent])
    held_ds = np.concatenate(held_parts)
    held = to_model_ids(vocab, held_ds)
    spans: dict[str, tuple[int, int]] = {}
    start = 0
    for name, part in zip(texts, held_parts, strict=True):
        spans[name] = (start, start + len(part))
        start += len(part)
    train = to_model_ids(vocab, train_ds)
    description = {
        "sources": {
            "pydoc": "pydoc_data.topics.topics (Python's language reference), one document "
            "per topic in key order",
            "finance": f"distinct message texts of dscache_tools.workload.generate("
            f"WorkloadConfig(sessions={FINANCE_SESSIONS}, seed=0)) in order of first appearance",
        },
        "document": "BOS text EOS, tokenized by the DeepSeek tokenizer without special tokens",
        "split": f"held-out = the last {HELDOUT_SHARE:.0%} of each source's token stream",
        "python": platform.python_version(),
        "per_source": sources,
        "train_tokens": len(train),
        "heldout_tokens": len(held),
        "train_unk_share": float(np.mean(train == UNK_ID)),
        "heldout_unk_share": float(np.mean(held == UNK_ID)),
    }
    return _Corpus(train, held, spans, vocab, description)


def _recipe_hash(
    preset: str, recipe: Recipe, budget_s: float | None, seed: int, texts: dict[str, list[str]]
) -> str:
    from dscache_server.tokenizer import default_tokenizer_path

    h = hashlib.sha256()
    for name, docs in texts.items():
        h.update(name.encode())
        for doc in docs:
            h.update(hashlib.sha256(doc.encode()).digest())
    h.update(hashlib.sha256(default_tokenizer_path().read_bytes()).digest())
    spec = {
        "code_version": CODE_VERSION,
        "preset": preset,
        "recipe": _recipe_dict(recipe, budget_s),
        "seed": seed,
        "seq_len": SEQ_LEN,
        "min_count": MIN_COUNT,
        "heldout_share": HELDOUT_SHARE,
        "finance_sessions": FINANCE_SESSIONS,
        "corpus": h.hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _recipe_dict(recipe: Recipe, budget_s: float | None) -> dict[str, Any]:
    """The recipe as hashed and recorded: its step count, or the wall-clock budget."""
    stop: dict[str, Any] = (
        {"budget_s": float(budget_s)} if budget_s is not None else {"steps": recipe.steps}
    )
    return {
        "overrides": recipe.overrides,
        "batch": recipe.batch,
        "peak_lr": recipe.peak_lr,
        "warmup_steps": recipe.warmup_steps,
        "weight_decay": recipe.weight_decay,
        "balance_rate": recipe.balance_rate,
        **stop,
    }


# --- model and training ---------------------------------------------------------------------


def _build_model(preset: str, overrides: Mapping[str, Any], vocab_size: int, seed: int) -> Any:
    """The preset's architecture with the compact vocabulary and transformers' init."""
    from dscache_server.presets import PRESETS
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = PRESETS[preset]
    # A deep copy: transformers may adjust nested dicts (rope_parameters) in place.
    kwargs = copy.deepcopy(spec.config)
    kwargs.update(copy.deepcopy(dict(overrides)))
    kwargs["vocab_size"] = vocab_size
    kwargs["bos_token_id"], kwargs["eos_token_id"] = BOS_ID, EOS_ID
    config = AutoConfig.for_model(spec.model_type, **kwargs)
    auto: Any = AutoModelForCausalLM  # transformers is untyped here
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model


def _windows(stream: np.ndarray, length: int) -> torch.Tensor:
    """Consecutive windows of ``length + 1`` tokens overlapping by one (full ones only)."""
    n = (len(stream) - 1) // length
    idx = np.arange(n)[:, None] * length + np.arange(length + 1)[None, :]
    return torch.from_numpy(stream[idx])


@torch.no_grad()
def _mean_nll(model: Any, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token negative log-likelihood over ``windows`` ``(n, L + 1)``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += chunk[:, 1:].numel()
    return total / max(count, 1)


def _heldout_windows(corpus: _Corpus) -> dict[str, torch.Tensor]:
    out = {"all": _windows(corpus.heldout, SEQ_LEN)}
    for name, (a, b) in corpus.heldout_sources.items():
        out[name] = _windows(corpus.heldout[a:b], SEQ_LEN)
    return out


def _perplexities(model: Any, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: math.exp(_mean_nll(model, w)) for name, w in windows.items() if len(w)}


def _lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 as ``progress``
    (the share of the steps or of the budget done) goes from 0 to 1."""
    warm = min(1.0, (step + 1) / warmup)
    return warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class _Balancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing of each MoE router.

    Counts the experts each router picks during a step, then moves its
    ``e_score_correction_bias`` by ``rate`` towards the under-used experts.
    """

    def __init__(self, model: Any, rate: float) -> None:
        self.rate = rate
        self.routers = [
            m for m in model.modules() if hasattr(m, "e_score_correction_bias") and rate > 0
        ]
        self.counts = [torch.zeros(int(r.num_experts)) for r in self.routers]
        self.totals = [torch.zeros(int(r.num_experts)) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, index: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            picked = output[2].detach().reshape(-1)
            self.counts[index] += torch.bincount(picked, minlength=len(self.counts[index])).float()

        return hook

    @torch.no_grad()
    def update(self) -> None:
        for router, counts, totals in zip(self.routers, self.counts, self.totals, strict=True):
            load = counts / counts.sum().clamp(min=1.0)
            router.e_score_correction_bias += self.rate * torch.sign(1.0 / len(load) - load)
            totals.add_(counts)
            counts.zero_()

    def close(self) -> list[float]:
        """Removes the hooks; returns each router's busiest expert's share of picks."""
        for handle in self.handles:
            handle.remove()
        return [float(t.max() / t.sum().clamp(min=1.0)) for t in self.totals]


def _train_into(
    out: Path,
    preset: str,
    recipe: Recipe,
    *,
    budget_s: float | None,
    seed: int,
    texts: dict[str, list[str]],
    key: str,
    threads: int | None,
) -> None:
    """Trains ``preset``'s recipe and writes the checkpoint directory ``out``."""
    import transformers

    before_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        corpus = _build_corpus(texts)
        vocab_size = len(corpus.vocab)
        log.info(
            "%s: corpus %d train / %d held-out tokens, vocabulary %d",
            preset,
            len(corpus.train),
            len(corpus.heldout),
            vocab_size,
        )
        model = _build_model(preset, recipe.overrides, vocab_size, seed)
        held = _heldout_windows(corpus)
        probe = _windows(corpus.train, SEQ_LEN)
        probe = probe[np.linspace(0, len(probe) - 1, 16).astype(np.int64)]
        initial_ppl = _perplexities(model, held)
        initial_train = _mean_nll(model, probe)
        log.info(
            "%s: initial held-out perplexity %.1f, train loss %.3f",
            preset,
            initial_ppl["all"],
            initial_train,
        )
        steps, seconds, curve, balance = _train_loop(model, corpus.train, recipe, budget_s, seed)
        final_ppl = _perplexities(model, held)
        final_train = _mean_nll(model, probe)
        log.info(
            "%s: %d steps in %.1f s; held-out perplexity %.1f -> %.1f, train loss %.3f -> %.3f",
            preset,
            steps,
            seconds,
            initial_ppl["all"],
            final_ppl["all"],
            initial_train,
            final_train,
        )
        out.mkdir(parents=True)
        model.eval()
        model.save_pretrained(str(out))
        np.save(out / HELDOUT_FILE, corpus.heldout)
        np.save(out / VOCAB_FILE, corpus.vocab)
        meta = {
            "format": 1,
            "code_version": CODE_VERSION,
            "recipe_hash": key,
            "preset": preset,
            "model_type": model.config.model_type,
            "architecture_overrides": recipe.overrides,
            "architecture": {
                k: getattr(model.config, k) for k in _ARCH_KEYS if hasattr(model.config, k)
            },
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": vocab_size,
            "vocab": {
                "file": VOCAB_FILE,
                "meaning": "model id -> DeepSeek-tokenizer id; -1 for UNK",
                "bos": BOS_ID,
                "eos": EOS_ID,
                "unk": UNK_ID,
                "min_count": MIN_COUNT,
            },
            "corpus": corpus.description,
            "training": {
                **_recipe_dict(recipe, budget_s),
                "seed": seed,
                "seq_len": SEQ_LEN,
                "threads": torch.get_num_threads(),
                "steps": steps,
                "seconds": seconds,
                "tokens": steps * recipe.batch * SEQ_LEN,
                "epochs": steps * recipe.batch * SEQ_LEN / max(len(corpus.train), 1),
                "optimizer": "AdamW betas (0.9, 0.95), grad-norm clip 1.0, float32",
                "schedule": "linear warmup, cosine decay to 0 over the "
                + ("wall-clock budget" if budget_s is not None else "steps"),
                "busiest_expert_share": balance,
                "total_seconds": time.perf_counter() - started,
            },
            "losses": {
                "train_initial": initial_train,
                "train_final": final_train,
                "train_probe": "mean NLL of 16 fixed training windows",
                "curve": curve,
            },
            "heldout": {
                "file": HELDOUT_FILE,
                "tokens": len(corpus.heldout),
                "initial_perplexity": initial_ppl["all"],
                "perplexity": final_ppl["all"],
                "per_source_initial": {k: v for k, v in initial_ppl.items() if k != "all"},
                "per_source": {k: v for k, v in final_ppl.items() if k != "all"},
                "spans": corpus.heldout_sources,
                "windows": f"consecutive windows of {SEQ_LEN} predicted tokens",
            },
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
        }
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    finally:
        torch.set_num_threads(before_threads)


def _train_loop(
    model: Any, train: np.ndarray, recipe: Recipe, budget_s: float | None, seed: int
) -> tuple[int, float, list[list[float]], list[float]]:
    """Trains ``model`` in place for ``recipe.steps`` steps, or for ``budget_s`` seconds
    when given; returns steps, seconds, the loss curve, MoE balance."""
    windows = _windows(train, SEQ_LEN)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=recipe.peak_lr,
        betas=(0.9, 0.95),
        weight_decay=recipe.weight_decay,
    )
    balancer = _Balancer(model, recipe.balance_rate)
    model.train()
    curve: list[list[float]] = []
    order: np.ndarray = np.empty(0, dtype=np.int64)
    step, recent = 0, 0.0
    started = time.perf_counter()

    def progress(elapsed: float) -> float:
        return elapsed / budget_s if budget_s is not None else step / recipe.steps

    next_log = 0.1
    while (done := progress(elapsed := time.perf_counter() - started)) < 1.0:
        if len(order) < recipe.batch:
            order = np.concatenate([order, rng.permutation(len(windows))])
        batch, order = windows[order[: recipe.batch]], order[recipe.batch :]
        for group in optimizer.param_groups:
            group["lr"] = recipe.peak_lr * _lr_factor(step, done, recipe.warmup_steps)
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.update()
        step += 1
        value = float(loss.detach())
        recent = value if step == 1 else 0.9 * recent + 0.1 * value
        if step % 10 == 0:
            curve.append([step, round(time.perf_counter() - started, 2), round(value, 4)])
        if done >= next_log:
            log.info("step %d, %.0f s: train loss %.3f (smoothed)", step, elapsed, recent)
            next_log += 0.1
    seconds = time.perf_counter() - started
    model.eval()
    return step, seconds, curve, balancer.close()
