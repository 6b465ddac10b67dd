"""The workload's data model: companies, knobs, one request, and JSONL files of them.

Contract:
    * A :class:`ChatRequest` is one JSONL line; ``to_json`` writes compact JSON
      with non-ASCII kept as is and a fixed key order, so a workload file is
      byte-identical for the same requests; ``from_json`` reads it back equal.
    * ``session_id`` is None on a request whose id the gateway dropped (it must
      then carry neither the header nor a cookie).
    * Nothing here draws random numbers or builds text; see
      :mod:`dscache_tools.workload.generate` for that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Completion length every request asks for (the demo keeps decoding short; the
#: prompt, not the answer, is what the cache saves).
DEFAULT_MAX_TOKENS = 24

#: The workload's variants (``WorkloadConfig.variant``).
VARIANTS = ("standard", "varied")

#: Roles a request's messages may have.
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Company:
    """A fictional listed company and the language of its filings."""

    ticker: str
    name: str
    exchange: str
    sector: str
    lang: str  # "en" or "zh"
    currency: str
    hq: str
    founded: int
    popularity: float  # relative weight of sessions about it
    segments: tuple[str, str, str]  # its reporting segments, in the filings' language


# English and Chinese filings alternate, so any first-N sample has both languages.
COMPANIES: tuple[Company, ...] = (
    Company("NWSC", "Northwind Semiconductor Corp.", "NASDAQ", "semiconductors", "en",
            "USD", "Austin, Texas", 1998, 3.0,
            ("Data-center accelerators", "Automotive MCUs", "Industrial analog")),
    Company("688417", "华澜新能源科技股份有限公司", "上交所科创板", "新能源电池", "zh",
            "人民币", "江苏常州", 2012, 2.8,
            ("动力电池系统", "储能电池", "电池材料回收")),
    Company("HBVL", "Harborview Logistics Inc.", "NYSE", "logistics", "en",
            "USD", "Savannah, Georgia", 1987, 1.5,
            ("Ocean freight forwarding", "Contract warehousing", "Last-mile delivery")),
    Company("600873", "景川医药集团股份有限公司", "上交所主板", "医药制造", "zh",
            "人民币", "浙江杭州", 1996, 1.6,
            ("创新药", "仿制药", "原料药及中间体")),
    Company("CRPH", "Cedar Ridge Pharmaceuticals Inc.", "NASDAQ", "pharmaceuticals", "en",
            "USD", "Cambridge, Massachusetts", 2004, 2.0,
            ("Oncology", "Immunology", "Contract manufacturing")),
    Company("02318", "鸿途物流控股有限公司", "港交所主板", "跨境物流", "zh",
            "港元", "广东深圳", 2003, 1.0,
            ("跨境电商物流", "国际货代", "海外仓储")),
    Company("ALTR", "Altamira Renewable Energy plc", "LSE", "renewable energy", "en",
            "GBP", "Edinburgh, Scotland", 2009, 1.2,
            ("Offshore wind", "Solar parks", "Grid storage services")),
    Company("300952", "星衡半导体股份有限公司", "深交所创业板", "功率半导体", "zh",
            "人民币", "上海浦东", 2010, 2.4,
            ("车规级IGBT模块", "碳化硅器件", "工业电源芯片")),
    Company("BFPY", "Bluefin Payments Inc.", "NYSE", "payments", "en",
            "USD", "Charlotte, North Carolina", 2011, 2.2,
            ("Merchant acquiring", "Issuer processing", "Cross-border payouts")),
    Company("601529", "瑞丰消费金融股份有限公司", "上交所主板", "消费金融", "zh",
            "人民币", "四川成都", 2008, 1.1,
            ("个人消费贷款", "信用卡分期", "助贷及科技服务")),
    Company("GPKM", "Granite Peak Mining Ltd.", "ASX", "mining", "en",
            "AUD", "Perth, Western Australia", 1979, 0.8,
            ("Iron ore", "Lithium concentrate", "Copper")),
    Company("603661", "青岚食品饮料股份有限公司", "上交所主板", "食品饮料", "zh",
            "人民币", "福建厦门", 1993, 0.9,
            ("茶饮料", "休闲食品", "餐饮渠道定制")),
)  # fmt: skip


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the finance workload.

    Attributes:
        sessions: number of conversations.
        seed: the only source of randomness.
        min_turns: fewest question-answer turns per session.
        max_turns: most turns per session (mean is about their midpoint).
        drop_id_share: share of requests whose session id the gateway drops (no
            header, no cookie).
        drop_mode: ``request``: each request independently loses its id with
            ``drop_id_share``; ``session``: that share of sessions loses the id on
            every request (a client behind the faulty gateway path), which leaves the
            same share of requests without id but keeps each session consistent.
        reconnect_share: share of sessions that reconnect under a new id once,
            at a random turn after the first.
        other_language_share: share of sessions asking in the other language than
            the company's filings.
        max_tokens: completion tokens each request asks for.
        companies: how many of the listed companies to use (the first N).
        variant: ``standard``: every session about a company opens with the same
            system prompt and dossier (they share a token prefix from the start);
            ``varied``: each session opens its own way (a dated opening line, one
            of several phrasings of the instructions, the dossier's sections in
            its own order, a greeting or not), so no two sessions share a prefix
            from the start. The other draws are the same as ``standard``'s for the
            seed: the same companies, questions, answers and ids.
    """

    sessions: int = 200
    seed: int = 0
    min_turns: int = 2
    max_turns: int = 8
    drop_id_share: float = 0.4
    drop_mode: Literal["request", "session"] = "request"
    reconnect_share: float = 0.1
    other_language_share: float = 0.15
    max_tokens: int = DEFAULT_MAX_TOKENS
    companies: int = len(COMPANIES)
    variant: Literal["standard", "varied"] = "standard"

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        for name in ("drop_id_share", "reconnect_share", "other_language_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.drop_mode not in ("request", "session"):
            raise ValueError(f"drop_mode must be 'request' or 'session', got {self.drop_mode!r}")
        if not 1 <= self.companies <= len(COMPANIES):
            raise ValueError(f"companies must be within [1, {len(COMPANIES)}]")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")


@dataclass(frozen=True)
class ChatRequest:
    """One request of the workload (one JSONL line).

    Attributes:
        session: the logical conversation (stable even when the id is lost).
        turn: 0-based turn within the conversation; turns are sent in order.
        company: ticker of the company the conversation is about.
        lang: language of the question ("en" or "zh").
        session_id: the ``X-Session-ID`` the client sends, or None (dropped).
        reconnected: whether the client had reconnected under a new id by now.
        messages: OpenAI chat messages.
        max_tokens: completion length asked for.
    """

    session: str
    turn: int
    company: str
    lang: str
    session_id: str | None
    reconnected: bool
    messages: list[dict[str, str]] = field(default_factory=list)
    max_tokens: int = DEFAULT_MAX_TOKENS

    def to_json(self) -> str:
        """One compact JSON line (non-ASCII kept as is)."""
        return json.dumps(
            {
                "session": self.session,
                "turn": self.turn,
                "company": self.company,
                "lang": self.lang,
                "session_id": self.session_id,
                "reconnected": self.reconnected,
                "max_tokens": self.max_tokens,
                "messages": self.messages,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> ChatRequest:
        """Parses one JSONL line; raises ValueError on a malformed one.

        Besides the fields' types it checks what a replay needs: at least one
        message, each a known role; a turn >= 0; max_tokens >= 1.
        """
        try:
            d = json.loads(line)
            req = cls(
                session=str(d["session"]),
                turn=int(d["turn"]),
                company=str(d["company"]),
                lang=str(d["lang"]),
                session_id=None if d["session_id"] is None else str(d["session_id"]),
                reconnected=bool(d.get("reconnected", False)),
                messages=[
                    {"role": str(m["role"]), "content": str(m["content"])} for m in d["messages"]
                ],
                max_tokens=int(d.get("max_tokens", DEFAULT_MAX_TOKENS)),
            )
        except KeyError as exc:
            raise ValueError(f"not a workload request: missing key {exc}") from exc
        except (TypeError, ValueError) as exc:
            # json.JSONDecodeError is a ValueError; so is int("x").
            raise ValueError(f"not a workload request: {exc}") from exc
        if not req.messages:
            raise ValueError("not a workload request: no messages")
        roles = {m["role"] for m in req.messages} - set(ROLES)
        if roles:
            raise ValueError(f"not a workload request: unknown role {sorted(roles)[0]!r}")
        if req.turn < 0 or req.max_tokens < 1:
            raise ValueError("not a workload request: turn must be >= 0 and max_tokens >= 1")
        return req


def write_jsonl(requests: Iterable[ChatRequest], path: Path) -> int:
    """Writes requests one per line; returns how many."""
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(r.to_json())
            fh.write("\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[ChatRequest]:
    """Reads a workload file; raises ValueError naming the bad line (``FILE:LINE: why``).

    Blank lines are skipped; a line that is not UTF-8 is a bad line too. An
    unreadable file raises OSError.
    """
    out = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                out.append(ChatRequest.from_json(line))
            except ValueError as exc:  # UnicodeDecodeError is one
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return out


def prompts_jsonl(requests: Iterable[ChatRequest]) -> str:
    """Only the messages of ``requests``, one chat per line: a prewarm Job's prompts."""
    return "".join(
        json.dumps({"messages": r.messages}, ensure_ascii=False) + "\n" for r in requests
    )


def sessions_of(requests: Iterable[ChatRequest]) -> dict[str, list[ChatRequest]]:
    """Requests grouped by session, in first-seen order, turns sorted."""
    groups: dict[str, list[ChatRequest]] = {}
    for r in requests:
        groups.setdefault(r.session, []).append(r)
    for turns in groups.values():
        turns.sort(key=lambda r: r.turn)
    return groups


def iter_turns(requests: Sequence[ChatRequest]) -> Iterator[list[ChatRequest]]:
    """Sessions in workload order, each as its ordered turns."""
    yield from sessions_of(requests).values()


def prewarm_requests(requests: Iterable[ChatRequest]) -> list[ChatRequest]:
    """One request per company of ``requests`` carrying only its shared prefix.

    The system prompt and the dossier, plus an empty user turn: what an operator's
    prewarm job sends so new sessions about a company start warm.
    """
    out: dict[str, ChatRequest] = {}
    for r in requests:
        if r.company in out:
            continue
        shared = [m for m in r.messages if m["role"] == "system"]
        out[r.company] = ChatRequest(
            session=f"prewarm-{r.company}",
            turn=0,
            company=r.company,
            lang=r.lang,
            session_id=None,
            reconnected=False,
            messages=[*shared, {"role": "user", "content": ""}],
            max_tokens=1,
        )
    return list(out.values())


def summary(requests: Sequence[ChatRequest]) -> dict[str, Any]:
    """Counts a person checks first: sessions, turns, languages, dropped ids."""
    sessions = sessions_of(requests)
    return {
        "requests": len(requests),
        "sessions": len(sessions),
        "companies": len({r.company for r in requests}),
        "zh_share": sum(r.lang == "zh" for r in requests) / max(1, len(requests)),
        "dropped_id_share": sum(r.session_id is None for r in requests) / max(1, len(requests)),
        "reconnected_sessions": sum(any(r.reconnected for r in t) for t in sessions.values()),
    }


def summary_line(info: dict[str, Any]) -> str:
    """:func:`summary` as the one line the CLI and the demo print."""
    return (
        f"{info['requests']} requests ({info['sessions']} sessions, {info['companies']} "
        f"companies, {100 * info['zh_share']:.0f}% Chinese, "
        f"{100 * info['dropped_id_share']:.0f}% without session id, "
        f"{info['reconnected_sessions']} reconnected sessions)"
    )
