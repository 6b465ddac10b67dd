"""``dscache bench codec``: bytes per token, speed and quality of each KV codec.

Everything is measured on the same KV, in one run: the KV of held-out text under
small models *trained* here (:mod:`dscache_tools.training`; random weights would
make any quality loss meaningless), one of each architecture (GQA: ``mini-gqa``,
MLA: ``tiny-deepseek-v3``).

Variants (``name``: what is stored; quality compared with):

* ``fp32``: the float32 engine's KV, raw (the reference).
* ``bf16``: the bfloat16 engine's KV (the same checkpoint in bfloat16), raw; its
  blocks are the very bytes a bfloat16 recompute gives; quality vs ``fp32``.
* ``int8``: ``fp32``'s KV through the int8 codec, dequantized on load; vs ``fp32``.
* ``int8-bf16``: ``bf16``'s KV through the int8 codec; vs ``bf16``.
* ``zstd``: ``fp32``'s KV through zstd (byte-shuffled), as stored where the
  adaptive policy's per-block sample enables it; vs ``fp32`` (lossless).
* ``zstd-bf16``: the same for ``bf16``'s KV.

Quality: each held-out window's prefix (whole blocks) is restored from the
variant's blocks into a fresh sequence, then

* perplexity of the window's next tokens, teacher-forced, relative to the
  reference variant's (``perplexity_delta`` 0.01 = +1%);
* greedy agreement: the reference generates 256 tokens greedily after the
  prefix (64 with ``--quick``); the variant is fed the same tokens and its argmax
  compared at every position with the reference's own argmax there (share equal;
  a free-running comparison would count every token after the first difference
  as lost).

Both are one forward over every position of the window (teacher forcing), for
the reference and each variant alike; only the reference's greedy tokens are
generated a token at a time.

The top-level ``codecs`` list holds each variant's worst case over the models
(largest ``perplexity_delta``, smallest ``greedy_agreement``, largest
``bytes_ratio``), ``bytes_ratio`` against float32 KV of the same model; ``models``
has each model's figures. ``working_set``: token hit ratio of the finance workload
replayed through the store's eviction policy with a cache of 25% of its working set
(in float32 bytes), per variant, so "int8 fits 3.8x the blocks" becomes a hit ratio.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dscache_tools.bench import Doc, report

log = logging.getLogger(__name__)

#: Models measured: one per architecture.
PRESETS = ("mini-gqa", "tiny-deepseek-v3")
#: Variants: name -> (engine dtype, codec, reference variant).
VARIANTS: dict[str, tuple[str, str, str]] = {
    "fp32": ("float32", "raw", "fp32"),
    "bf16": ("bfloat16", "raw", "fp32"),
    "int8": ("float32", "int8", "fp32"),
    "int8-bf16": ("bfloat16", "int8", "bf16"),
    "zstd": ("float32", "zstd", "fp32"),
    "zstd-bf16": ("bfloat16", "zstd", "bf16"),
}
#: Names the command contract promises in ``codecs``.
CONTRACT_NAMES = ("fp32", "bf16", "int8", "zstd")
#: Training steps of the quick run's models (the full run trains each recipe's own).
QUICK_STEPS_GQA = 40
QUICK_STEPS_MLA = 30
WORKING_SET_FRACTION = 0.25


@dataclass(frozen=True)
class Profile:
    """Sizes of one run.

    Attributes:
        train_steps: optimizer steps of each preset's model (trained once, then
            cached); a preset not named trains its recipe's steps.
        windows: held-out windows per model.
        prefix_blocks: blocks restored per window.
        block_tokens: tokens per block.
        scored_tokens: teacher-forced tokens scored per window.
        greedy_tokens: greedy tokens compared per window and variant.
        sessions: finance workload sessions of the working-set replay.
    """

    train_steps: Mapping[str, int]
    windows: int
    prefix_blocks: int
    block_tokens: int
    scored_tokens: int
    greedy_tokens: int
    sessions: int


# The models were trained on 256-token windows: prefixes and scored tokens stay
# near that length (the greedy run goes 256 tokens past the prefix).
# The quick run trains shorter models (the same recipe otherwise): enough for the
# quality figures to mean something (held-out perplexity far below the untrained
# model's), at a fraction of the full recipe's steps.
QUICK = Profile(
    train_steps={"mini-gqa": QUICK_STEPS_GQA, "tiny-deepseek-v3": QUICK_STEPS_MLA},
    windows=1,
    prefix_blocks=4,
    block_tokens=32,
    scored_tokens=96,
    greedy_tokens=64,
    sessions=60,
)
FULL = Profile(
    train_steps={},
    windows=8,
    prefix_blocks=2,
    block_tokens=64,
    scored_tokens=128,
    greedy_tokens=256,
    sessions=300,
)


# -- codecs


def _encode(blocks: Sequence[np.ndarray], dtype: str, codec: str) -> list[bytes]:
    from dscache_sidecar.codec import Encoding, encode

    c = Encoding.named(codec).codec
    assert c is not None, "the codec bench measures fixed codecs"
    return [bytes(encode(b, c, dtype=dtype, level=1)) for b in blocks]


def _decode(
    payloads: Sequence[bytes], dtype: str, codec: str, shape: tuple[int, ...]
) -> list[np.ndarray]:
    from dscache_sidecar.codec import Encoding, decode

    c = Encoding.named(codec).codec
    assert c is not None, "the codec bench measures fixed codecs"
    return [decode(p, c, dtype, shape) for p in payloads]


def _median_s(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def disk_read_bytes_per_s(path: Path, size: int) -> float:
    """Sequential read speed of a file written here, bypassing the page cache (O_DIRECT)."""
    chunk = 1 << 20
    size = max(chunk, (size // chunk) * chunk)
    buf = mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT needs
    with open(path, "wb") as f:
        block = os.urandom(chunk)
        for _ in range(size // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < size:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            done += n
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return done / max(elapsed, 1e-9)


# -- quality


@dataclass
class _Scores:
    nll: float = 0.0
    scored: int = 0
    agree: int = 0
    compared: int = 0

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll / max(1, self.scored)))

    @property
    def agreement(self) -> float:
        return self.agree / max(1, self.compared)


def _restored(engine: Any, blocks: Sequence[np.ndarray]) -> Any:
    seq = engine.new_sequence()
    engine.adapter.restore(seq, list(blocks))
    return seq


def _generate(engine: Any, blocks: Sequence[np.ndarray], first: int, n: int) -> list[int]:
    """``n`` greedy tokens after the restored prefix and ``first``, one decode step each."""
    import torch

    seq = _restored(engine, blocks)
    token, made = first, []
    for _ in range(n):
        token = int(torch.argmax(engine.decode([seq], [token])[0]))
        made.append(token)
    return made


def _score_nll(
    engine: Any, blocks: Sequence[np.ndarray], cont: Sequence[int], scores: _Scores
) -> None:
    """Adds the teacher-forced NLL of ``cont[1:]`` after the restored prefix to
    ``scores`` (one forward over every position)."""
    import torch

    logits = engine.forward_all(_restored(engine, blocks), list(cont[:-1])).float()
    target = torch.tensor(list(cont[1:]), dtype=torch.long).unsqueeze(1)
    scores.nll += float((torch.logsumexp(logits, 1) - logits.gather(1, target)[:, 0]).sum())
    scores.scored += len(cont) - 1


def _argmax_along(
    engine: Any, blocks: Sequence[np.ndarray], first: int, path: Sequence[int]
) -> list[int]:
    """The argmax at each step of ``path`` (a reference's greedy tokens) fed after
    the restored prefix and ``first`` (one forward over every position)."""
    fed = [first, *path[:-1]]
    best: list[int] = engine.forward_all(_restored(engine, blocks), fed).argmax(1).tolist()
    return best


def _speed(
    blocks: Sequence[np.ndarray], payloads: Sequence[bytes], dtype: str, codec: str
) -> dict[str, float]:
    """Median encode and decode seconds of one window's blocks, and their raw bytes."""
    shape = blocks[0].shape
    return {
        "enc": _median_s(lambda: _encode(blocks, dtype, codec)),
        "dec": _median_s(lambda: _decode(payloads, dtype, codec, shape)),
        "bytes": float(sum(b.nbytes for b in blocks)),
    }


def _windows(held: Sequence[int], profile: Profile, preset: str) -> list[int]:
    """Start positions of the held-out windows, spread over the text."""
    span = profile.prefix_blocks * profile.block_tokens + profile.scored_tokens + 1
    if len(held) < span:
        raise RuntimeError(f"held-out text of {preset} has {len(held)} tokens, need {span}")
    step = max(1, (len(held) - span) // max(1, profile.windows - 1))
    return [min(i * step, len(held) - span) for i in range(profile.windows)]


@dataclass
class _Totals:
    """One variant's sums over the windows."""

    scores: _Scores
    stored: int = 0
    raw: int = 0
    speed: dict[str, float] | None = None


def measure_model(preset: str, profile: Profile, work: Path) -> dict[str, Any]:
    """Every variant of one trained model: bytes, speed, quality."""
    from dscache_server.loading import load_engine

    from dscache_tools.training import trained_model

    trained = trained_model(preset, steps=profile.train_steps.get(preset))
    bt, n_blocks = profile.block_tokens, profile.prefix_blocks
    engines = {
        d: load_engine(str(trained.path), block_tokens=bt, dtype=d) for d in ("float32", "bfloat16")
    }
    prefix_tokens = n_blocks * bt
    held = [int(t) for t in trained.heldout]
    starts = _windows(held, profile, preset)
    totals = {name: _Totals(_Scores()) for name in VARIANTS}
    fp32_bytes = 0
    kv_equal = True
    for start in starts:
        prefix = held[start : start + prefix_tokens]
        cont = held[start + prefix_tokens : start + prefix_tokens + profile.scored_tokens + 1]
        exported: dict[str, list[np.ndarray]] = {}
        for dtype, engine in engines.items():
            seq = engine.new_sequence()
            engine.extend(seq, prefix)
            exported[dtype] = [engine.adapter.export(seq, i) for i in range(n_blocks)]
        # A bfloat16 block is the very bytes a bfloat16 recompute of its prefix gives.
        half = engines["bfloat16"]
        again = half.new_sequence()
        half.extend(again, prefix)
        kv_equal &= all(
            np.array_equal(half.adapter.export(again, i), b)
            for i, b in enumerate(exported["bfloat16"])
        )
        fp32_bytes += sum(b.nbytes for b in exported["float32"])
        # Each reference's greedy tokens, and its own argmax along them in the path
        # every variant is scored on (a forward over every position): a variant
        # agrees where its argmax is the reference's.
        paths = {
            name: _generate(
                engines[VARIANTS[name][0]],
                exported[VARIANTS[name][0]],
                cont[0],
                profile.greedy_tokens,
            )
            for name in ("fp32", "bf16")
        }
        ref_best = {
            name: _argmax_along(
                engines[VARIANTS[name][0]], exported[VARIANTS[name][0]], cont[0], path
            )
            for name, path in paths.items()
        }
        for name, (dtype, codec, ref) in VARIANTS.items():
            blocks = exported[dtype]
            payloads = _encode(blocks, dtype, codec)
            t = totals[name]
            t.stored += sum(len(p) for p in payloads)
            t.raw += sum(b.nbytes for b in blocks)
            if t.speed is None:
                t.speed = _speed(blocks, payloads, dtype, codec)
            # A reference is scored too: its agreement with itself is 1.0 unless
            # the restored path is not deterministic.
            decoded = _decode(payloads, dtype, codec, blocks[0].shape)
            _score_nll(engines[dtype], decoded, cont, t.scores)
            best = _argmax_along(engines[dtype], decoded, cont[0], paths[ref])
            t.scores.agree += sum(b == r for b, r in zip(best, ref_best[ref], strict=True))
            t.scores.compared += len(best)
    disk_bps = disk_read_bytes_per_s(work / f"disk-{preset}.bin", 256 << 20)
    tokens = len(starts) * prefix_tokens
    variants = {
        name: _variant_report(
            name,
            totals,
            fp32_bytes=fp32_bytes,
            tokens=tokens,
            disk_bps=disk_bps,
            windows=len(starts),
        )
        for name in VARIANTS
    }
    return {
        "preset": preset,
        "layout": engines["float32"].layout.to_dict(),
        "block_tokens": bt,
        "windows": len(starts),
        "prefix_tokens": prefix_tokens,
        "scored_tokens_per_window": profile.scored_tokens,
        "greedy_tokens": profile.greedy_tokens,
        "trained": {
            "path": str(trained.path),
            "steps": trained.steps,
            "seconds": round(trained.seconds, 1),
            "vocab_size": trained.vocab_size,
            "initial_heldout_perplexity": trained.initial_perplexity,
            "heldout_perplexity": trained.heldout_perplexity,
        },
        "bf16_kv_equals_bf16_recompute": bool(kv_equal),
        "disk_read_gbps": disk_bps / 1e9,
        "variants": variants,
    }


def _variant_report(
    name: str,
    totals: dict[str, _Totals],
    *,
    fp32_bytes: int,
    tokens: int,
    disk_bps: float,
    windows: int,
) -> dict[str, Any]:
    dtype, codec, ref = VARIANTS[name]
    t, r = totals[name], totals[ref]
    speed = t.speed or {"enc": 0.0, "dec": 0.0, "bytes": 0.0}
    enc, dec, nbytes = speed["enc"], speed["dec"], speed["bytes"]
    entry: dict[str, Any] = {
        "name": name,
        "kv_dtype": dtype,
        "codec": codec,
        "reference": ref,
        "bytes_ratio": t.stored / fp32_bytes,
        "compression_ratio": t.stored / t.raw,
        "bytes_per_token": t.stored / tokens,
        "perplexity": t.scores.perplexity,
        "perplexity_delta": t.scores.perplexity / r.scores.perplexity - 1.0,
        "greedy_agreement": t.scores.agreement,
        "encode_gbps": nbytes / enc / 1e9 if enc else None,
        "decode_gbps": nbytes / dec / 1e9 if dec else None,
    }
    if codec == "zstd":
        # Per window (one window's blocks were timed): reading the stored bytes from
        # disk (O_DIRECT, no page cache) against decoding them; and the whole load,
        # read + decode, against reading the raw bytes.
        stored, raw = t.stored / windows, t.raw / windows
        entry["decode_s"] = dec
        entry["stored_bytes_read_s"] = stored / disk_bps
        entry["raw_bytes_read_s"] = raw / disk_bps
        entry["decode_not_slower_than_reading_stored_bytes"] = dec <= stored / disk_bps
        entry["read_and_decode_faster_than_raw_read"] = stored / disk_bps + dec <= raw / disk_bps
    return entry


# -- working set


def working_set(profile: Profile, ratios: dict[str, float], seed: int = 0) -> dict[str, Any]:
    """Token hit ratio of the finance workload with a cache of 25% of its working set.

    The cache holds ``capacity`` float32 blocks; a variant whose blocks take
    ``ratio`` of the bytes holds ``capacity / ratio`` of them (extents included).
    """
    from dscache_sidecar.eviction import CLOCKED, DEFAULT_POLICY, make_policy
    from dscache_sidecar.segments import extent_bytes

    from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint
    from dscache_tools.replay.simulate import TraceClock, simulate, simulate_ideal
    from dscache_tools.replay.trace import Request, build_trace
    from dscache_tools.workload import WorkloadConfig, generate, load_server_tokenizer
    from dscache_tools.workload.ideal import prompt_ids

    bt = 256
    tokenizer = load_server_tokenizer()
    requests = generate(WorkloadConfig(sessions=profile.sessions, seed=seed))
    layout = KVLayout(
        LayoutKind.GQA, num_layers=1, dtype="float32", num_kv_heads=1, head_dim=1, v_head_dim=1
    )
    chain = KeyChain(ModelFingerprint("ws", "0", layout, block_tokens=bt), b"")
    intern: dict[bytes, int] = {}
    reqs = []
    for r in requests:
        ids = prompt_ids(tokenizer, r)
        keys = chain.keys(ids)
        if not keys:
            continue
        blocks = [intern.setdefault(k, len(intern)) for k in keys]
        reqs.append(Request(blocks, bt, bt, len(ids)))
    trace = build_trace("finance", reqs)
    distinct = len(intern)
    # DeepSeek-V3's MLA: 61 layers x 576 values per token, 256-token blocks.
    fp32_block = 61 * 576 * 4 * bt
    capacity_bytes = WORKING_SET_FRACTION * distinct * extent_bytes(fp32_block)
    out: dict[str, Any] = {
        "sessions": profile.sessions,
        "requests": len(reqs),
        "working_set_blocks": distinct,
        "capacity_fraction": WORKING_SET_FRACTION,
        "block_bytes_fp32": fp32_block,
        "policy": DEFAULT_POLICY,
        "ideal_token_hit_ratio": simulate_ideal(trace).token_hit_ratio,
        "variants": {},
    }
    for name, ratio in ratios.items():
        blocks_fit = int(capacity_bytes // extent_bytes(round(fp32_block * ratio)))
        clock = TraceClock()  # the replay's time, as dscache replay gives a clocked policy
        timed = clock if DEFAULT_POLICY in CLOCKED else None
        policy = make_policy(DEFAULT_POLICY, blocks_fit, timed)
        hit = simulate(trace, policy, blocks_fit, clock=clock)
        out["variants"][name] = {
            "blocks_fit": blocks_fit,
            "token_hit_ratio": hit.token_hit_ratio,
        }
    base = out["variants"]["fp32"]
    for v in out["variants"].values():
        v["blocks_over_fp32"] = v["blocks_fit"] / base["blocks_fit"]
        v["hit_over_fp32"] = (
            v["token_hit_ratio"] / base["token_hit_ratio"] if base["token_hit_ratio"] else None
        )
    return out


# -- the run


def run_bench(args: argparse.Namespace) -> Doc:
    """The whole measurement; returns the JSON document."""
    profile = QUICK if args.quick else FULL
    tmp = tempfile.TemporaryDirectory(prefix="dscache-codec-")
    work = Path(tmp.name)
    try:
        models = [measure_model(p, profile, work) for p in PRESETS]
    finally:
        tmp.cleanup()
    codecs = []
    for name in VARIANTS:
        entries = [m["variants"][name] for m in models]
        codecs.append(
            {
                "name": name,
                "bytes_ratio": max(e["bytes_ratio"] for e in entries),
                "perplexity_delta": max(e["perplexity_delta"] for e in entries),
                "greedy_agreement": min(e["greedy_agreement"] for e in entries),
                "encode_gbps": min(e["encode_gbps"] or 0.0 for e in entries),
                "decode_gbps": min(e["decode_gbps"] or 0.0 for e in entries),
            }
        )
    ratios = {c["name"]: c["bytes_ratio"] for c in codecs if c["name"] in ("fp32", "bf16", "int8")}
    doc: Doc = {
        "benchmark": "codec",
        "quick": bool(args.quick),
        "profile": profile.__dict__,
        "codecs": codecs,
        "models": models,
        "working_set": working_set(profile, ratios),
    }
    if args.png_out:
        write_png(doc, Path(args.png_out))
        doc["png"] = str(args.png_out)
    return doc


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(doc: Doc) -> str:
    """The printed table."""
    lines = [
        f"{'codec':<10} {'bytes':>6} {'ppl delta':>10} {'greedy':>7} {'enc GB/s':>9} "
        f"{'dec GB/s':>9}   (worst of {', '.join(m['preset'] for m in doc['models'])})"
    ]
    for c in doc["codecs"]:
        lines.append(
            f"{c['name']:<10} {c['bytes_ratio']:>5.3f}x {c['perplexity_delta']:>+10.4f} "
            f"{c['greedy_agreement']:>7.3f} {_f(c['encode_gbps'], '.2f'):>9} "
            f"{_f(c['decode_gbps'], '.2f'):>9}"
        )
    for m in doc["models"]:
        t = m["trained"]
        z = m["variants"]["zstd"], m["variants"]["zstd-bf16"]
        lines.append(
            f"{m['preset']}: trained {t['steps']} steps in {t['seconds']} s, held-out "
            f"perplexity {t['initial_heldout_perplexity']:.1f} -> {t['heldout_perplexity']:.2f}; "
            f"fp32 perplexity {m['variants']['fp32']['perplexity']:.3f}; bf16 KV = bf16 "
            f"recompute: {m['bf16_kv_equals_bf16_recompute']}; zstd {z[0]['compression_ratio']:.3f}"
            f"x of fp32, {z[1]['compression_ratio']:.3f}x of bf16; disk "
            f"{m['disk_read_gbps']:.2f} GB/s; zstd decode not slower than reading its bytes "
            f"(fp32, bf16): {z[0]['decode_not_slower_than_reading_stored_bytes']}, "
            f"{z[1]['decode_not_slower_than_reading_stored_bytes']}; read + decode beats a raw "
            f"read: {z[0]['read_and_decode_faster_than_raw_read']}, "
            f"{z[1]['read_and_decode_faster_than_raw_read']}"
        )
    ws = doc["working_set"]
    parts = [
        f"{name} {v['token_hit_ratio']:.3f} ({v['blocks_over_fp32']:.2f}x blocks)"
        for name, v in ws["variants"].items()
    ]
    lines.append(
        f"finance workload, cache = {ws['capacity_fraction']:.0%} of its working set "
        f"({ws['working_set_blocks']} blocks), token hit ratio: {'; '.join(parts)}; "
        f"ideal {ws['ideal_token_hit_ratio']:.3f}"
    )
    return "\n".join(lines)


def write_png(doc: Doc, path: Path) -> None:
    """Bytes ratio and perplexity change of each codec, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(VARIANTS)
    width = 0.8 / len(doc["models"])
    for i, m in enumerate(doc["models"]):
        xs = [j + i * width for j in range(len(names))]
        left.bar(xs, [m["variants"][n]["bytes_ratio"] for n in names], width, label=m["preset"])
        right.bar(
            xs,
            [100 * m["variants"][n]["perplexity_delta"] for n in names],
            width,
            label=m["preset"],
        )
    for ax, title in ((left, "bytes vs float32 KV"), (right, "perplexity change (%)")):
        ax.set_xticks([j + width / 2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench codec``: the runs, the table, the JSON."""
    return report("codec", lambda: run_bench(args), table, args.json_out, (RuntimeError,))
