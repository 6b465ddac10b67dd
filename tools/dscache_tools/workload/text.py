"""The finance workload: multi-turn chats about listed companies, as JSONL requests.

The seed's service is a financial knowledge-base assistant: analysts open a
session about one company, the prompt carries a fixed system prompt plus that
company's background and three years of financial statements (a few thousand
tokens, identical for every session about the company), and they keep asking
follow-ups ("how did the key ratios change over three years?", "and the cash
flow?") with the whole history appended. Some requests lose their session id at
the gateway and some clients reconnect under a new id.

Contract:
    * ``generate(config)`` is a pure function of its config: the same seed gives
      byte-identical requests in every process (``random.Random(seed)`` only, no
      global state, no clock).
    * Turn ``t`` of a session sends the messages of turn ``t-1``, the canned
      assistant answer of turn ``t-1`` and one new question, so the chat template's
      tokens of turn ``t-1`` (up to its generation prompt) are an exact prefix of
      turn ``t``'s. The history is fixed in the workload rather than taken from the
      model's reply, so every run sends the same prompts and the ideal hit ratio is
      a property of the file.
    * Every session about one company starts with the same two system messages
      (the assistant's instructions, then the company dossier).
    * ``session_id`` is None on a request whose id the gateway dropped (it must then
      carry neither the header nor a cookie); a reconnected session switches to a
      new id from its reconnect turn on.

The ideal token hit ratio is what an infinite prefix cache of ``block_tokens``
blocks could reuse: every full block whose chained key was seen in an earlier
request is a hit. Only the set of distinct block keys matters, so the figure does
not depend on the order in which sessions interleave (as long as each session's
turns stay in order).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

#: Completion length every request asks for (the demo keeps decoding short; the
#: prompt, not the answer, is what the cache saves).
DEFAULT_MAX_TOKENS = 24


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


# English and Chinese filings alternate, so any first-N sample has both languages.
COMPANIES: tuple[Company, ...] = (
    Company("NWSC", "Northwind Semiconductor Corp.", "NASDAQ", "semiconductors", "en",
            "USD", "Austin, Texas", 1998, 3.0),
    Company("688417", "华澜新能源科技股份有限公司", "上交所科创板", "新能源电池", "zh",
            "人民币", "江苏常州", 2012, 2.8),
    Company("HBVL", "Harborview Logistics Inc.", "NYSE", "logistics", "en",
            "USD", "Savannah, Georgia", 1987, 1.5),
    Company("600873", "景川医药集团股份有限公司", "上交所主板", "医药制造", "zh",
            "人民币", "浙江杭州", 1996, 1.6),
    Company("CRPH", "Cedar Ridge Pharmaceuticals Inc.", "NASDAQ", "pharmaceuticals", "en",
            "USD", "Cambridge, Massachusetts", 2004, 2.0),
    Company("02318", "鸿途物流控股有限公司", "港交所主板", "跨境物流", "zh",
            "港元", "广东深圳", 2003, 1.0),
    Company("ALTR", "Altamira Renewable Energy plc", "LSE", "renewable energy", "en",
            "GBP", "Edinburgh, Scotland", 2009, 1.2),
    Company("300952", "星衡半导体股份有限公司", "深交所创业板", "功率半导体", "zh",
            "人民币", "上海浦东", 2010, 2.4),
    Company("BFPY", "Bluefin Payments Inc.", "NYSE", "payments", "en",
            "USD", "Charlotte, North Carolina", 2011, 2.2),
    Company("601529", "瑞丰消费金融股份有限公司", "上交所主板", "消费金融", "zh",
            "人民币", "四川成都", 2008, 1.1),
    Company("GPKM", "Granite Peak Mining Ltd.", "ASX", "mining", "en",
            "AUD", "Perth, Western Australia", 1979, 0.8),
    Company("603661", "青岚食品饮料股份有限公司", "上交所主板", "食品饮料", "zh",
            "人民币", "福建厦门", 1993, 0.9),
)  # fmt: skip

SYSTEM_PROMPT = (
    "You are FinSight, the financial knowledge-base assistant of an investment research "
    "desk. You answer questions about listed companies using only the company dossier "
    "provided below (background, segment data and audited financial statements for the "
    "last three fiscal years). Rules: quote figures exactly as they appear in the "
    "dossier and name the fiscal year; show the formula when you compute a ratio "
    "(gross margin = gross profit / revenue; current ratio = current assets / current "
    "liabilities; debt-to-equity = total debt / shareholders' equity; free cash flow = "
    "operating cash flow - capital expenditure); say so plainly when the dossier does "
    "not contain the answer; never give investment advice or price targets; answer in "
    "the language of the question.\n"
    "你是投研部门的财务知识库助手 FinSight。只依据下方提供的公司资料(公司背景、分部数据及"
    "最近三个财年经审计的财务报表)回答问题:引用数字须与资料一致并注明财年;计算比率时写出"
    "公式;资料中没有的信息须明确说明;不提供投资建议或目标价;使用提问所用的语言作答。"
)

_YEARS = (2022, 2023, 2024)

QUESTIONS_EN: tuple[str, ...] = (
    "Give me a short overview of the company and its main business segments.",
    "How did revenue and gross margin develop over the three years?",
    "How did the key ratios change over three years?",
    "And the cash flow?",
    "What drove the change in operating margin in {y2}?",
    "Compare net income with operating cash flow. Is earnings quality improving?",
    "How much did capital expenditure grow, and how was it funded?",
    "What does the balance sheet say about leverage? Compute debt-to-equity for each year.",
    "Which segment grew fastest, and what share of revenue does it have now?",
    "What was free cash flow in {y2}, and how does it compare with {y0}?",
    "Summarise the main risks management mentions.",
    "Did working capital improve? Look at receivables and inventory days.",
    "What is the dividend policy and how much was paid out in {y2}?",
    "How does R&D spending compare with revenue over the period?",
    "Put the last three answers into a short note for the investment committee.",
)

QUESTIONS_ZH: tuple[str, ...] = (
    "请简要介绍这家公司及其主要业务分部。",
    "近三年营业收入和毛利率是如何变化的?",
    "近三年主要财务比率有什么变化?",
    "那现金流呢?",
    "{y2}年营业利润率变化的主要原因是什么?",
    "对比净利润和经营活动现金流,盈利质量是否在改善?",
    "资本开支增长了多少?资金来源是什么?",
    "从资产负债表看杠杆水平如何?请逐年计算资产负债率和有息负债权益比。",
    "哪个业务分部增长最快?目前占收入的比重是多少?",
    "{y2}年的自由现金流是多少?与{y0}年相比如何?",
    "管理层提到的主要风险有哪些?请概括。",
    "营运资金是否改善?请看应收账款和存货周转天数。",
    "公司的分红政策是什么?{y2}年派发了多少现金股利?",
    "研发投入占收入的比例在这三年里怎么变化?",
    "把上面几个回答整理成一段给投资委员会的简要说明。",
)


class ChatTokenizer(Protocol):
    """What the ideal-hit computation needs: the server's chat template."""

    def apply_chat_template(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a rendered conversation."""
        ...


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
        """Parses one JSONL line; raises ValueError on a malformed one."""
        try:
            d = json.loads(line)
            return cls(
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
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a workload request: {exc}") from exc


# -- the company dossier ---------------------------------------------------------


@dataclass(frozen=True)
class _Financials:
    """Three fiscal years of statements, in millions of the reporting currency."""

    revenue: tuple[float, ...]
    cogs: tuple[float, ...]
    rnd: tuple[float, ...]
    sga: tuple[float, ...]
    da: tuple[float, ...]
    interest: tuple[float, ...]
    tax_rate: float
    shares: float
    cash: tuple[float, ...]
    receivables: tuple[float, ...]
    inventory: tuple[float, ...]
    other_current: tuple[float, ...]
    ppe: tuple[float, ...]
    intangibles: tuple[float, ...]
    payables: tuple[float, ...]
    short_debt: tuple[float, ...]
    long_debt: tuple[float, ...]
    other_liab: tuple[float, ...]
    capex: tuple[float, ...]
    dividends: tuple[float, ...]
    segments: tuple[tuple[str, tuple[float, ...]], ...]

    def gross(self, i: int) -> float:
        return self.revenue[i] - self.cogs[i]

    def operating(self, i: int) -> float:
        return self.gross(i) - self.rnd[i] - self.sga[i] - self.da[i]

    def pretax(self, i: int) -> float:
        return self.operating(i) - self.interest[i]

    def net(self, i: int) -> float:
        return self.pretax(i) * (1 - self.tax_rate)

    def current_assets(self, i: int) -> float:
        return self.cash[i] + self.receivables[i] + self.inventory[i] + self.other_current[i]

    def total_assets(self, i: int) -> float:
        return self.current_assets(i) + self.ppe[i] + self.intangibles[i]

    def current_liab(self, i: int) -> float:
        return self.payables[i] + self.short_debt[i]

    def total_liab(self, i: int) -> float:
        return self.current_liab(i) + self.long_debt[i] + self.other_liab[i]

    def equity(self, i: int) -> float:
        return self.total_assets(i) - self.total_liab(i)

    def cfo(self, i: int) -> float:
        wc = 0.0
        if i > 0:
            wc = (
                (self.receivables[i] - self.receivables[i - 1])
                + (self.inventory[i] - self.inventory[i - 1])
                - (self.payables[i] - self.payables[i - 1])
            )
        return self.net(i) + self.da[i] - wc

    def fcf(self, i: int) -> float:
        return self.cfo(i) - self.capex[i]


_SEGMENTS_EN = {
    "semiconductors": ("Data-center accelerators", "Automotive MCUs", "Industrial analog"),
    "logistics": ("Ocean freight forwarding", "Contract warehousing", "Last-mile delivery"),
    "pharmaceuticals": ("Oncology", "Immunology", "Contract manufacturing"),
    "renewable energy": ("Offshore wind", "Solar parks", "Grid storage services"),
    "payments": ("Merchant acquiring", "Issuer processing", "Cross-border payouts"),
    "mining": ("Iron ore", "Lithium concentrate", "Copper"),
}
_SEGMENTS_ZH = {
    "新能源电池": ("动力电池系统", "储能电池", "电池材料回收"),
    "医药制造": ("创新药", "仿制药", "原料药及中间体"),
    "跨境物流": ("跨境电商物流", "国际货代", "海外仓储"),
    "功率半导体": ("车规级IGBT模块", "碳化硅器件", "工业电源芯片"),
    "消费金融": ("个人消费贷款", "信用卡分期", "助贷及科技服务"),
    "食品饮料": ("茶饮料", "休闲食品", "餐饮渠道定制"),
}


def _series(rng: random.Random, start: float, growth: float, noise: float) -> tuple[float, ...]:
    out = [start]
    for _ in range(len(_YEARS) - 1):
        out.append(out[-1] * (1 + growth + rng.uniform(-noise, noise)))
    return tuple(round(v, 1) for v in out)


def _financials(company: Company, seed: int) -> _Financials:
    # Seeded per company (not per workload position) so a company's dossier is the
    # same whatever sessions or companies are sampled around it.
    rng = random.Random(f"{seed}/{company.ticker}")
    scale = rng.choice((850.0, 1_600.0, 3_200.0, 7_400.0, 12_800.0))
    growth = rng.uniform(-0.04, 0.28)
    revenue = _series(rng, scale, growth, 0.06)
    margin = rng.uniform(0.22, 0.62)
    cogs = tuple(round(r * (1 - margin + rng.uniform(-0.03, 0.03)), 1) for r in revenue)
    rnd = tuple(round(r * rng.uniform(0.02, 0.16), 1) for r in revenue)
    sga = tuple(round(r * rng.uniform(0.06, 0.15), 1) for r in revenue)
    da = tuple(round(r * rng.uniform(0.03, 0.07), 1) for r in revenue)
    debt0 = scale * rng.uniform(0.1, 0.9)
    long_debt = _series(rng, debt0, rng.uniform(-0.1, 0.25), 0.05)
    short_debt = tuple(round(d * rng.uniform(0.1, 0.3), 1) for d in long_debt)
    interest = tuple(
        round((a + b) * rng.uniform(0.03, 0.06), 1)
        for a, b in zip(long_debt, short_debt, strict=True)
    )
    names = (_SEGMENTS_EN if company.lang == "en" else _SEGMENTS_ZH)[company.sector]
    weights = [rng.uniform(0.2, 1.0) for _ in names]
    seg_growth = [rng.uniform(-0.1, 0.45) for _ in names]
    segs = []
    for j, name in enumerate(names):
        share = weights[j] / sum(weights)
        vals = [revenue[0] * share]
        for _i in range(1, len(_YEARS)):
            vals.append(vals[-1] * (1 + seg_growth[j]))
        segs.append((name, vals))
    # Rescale segments so they add up to reported revenue each year.
    segments = []
    for name, vals in segs:
        fixed = tuple(
            round(v * revenue[i] / sum(s[1][i] for s in segs), 1) for i, v in enumerate(vals)
        )
        segments.append((name, fixed))
    return _Financials(
        revenue=revenue,
        cogs=cogs,
        rnd=rnd,
        sga=sga,
        da=da,
        interest=interest,
        tax_rate=round(rng.uniform(0.12, 0.27), 3),
        shares=round(scale * rng.uniform(0.2, 1.2), 1),
        cash=_series(rng, scale * rng.uniform(0.1, 0.5), rng.uniform(-0.1, 0.3), 0.1),
        receivables=_series(rng, scale * rng.uniform(0.08, 0.25), growth, 0.08),
        inventory=_series(rng, scale * rng.uniform(0.05, 0.3), growth, 0.1),
        other_current=_series(rng, scale * rng.uniform(0.02, 0.08), 0.05, 0.05),
        ppe=_series(rng, scale * rng.uniform(0.4, 1.6), rng.uniform(0.0, 0.2), 0.04),
        intangibles=_series(rng, scale * rng.uniform(0.05, 0.4), 0.02, 0.03),
        payables=_series(rng, scale * rng.uniform(0.06, 0.2), growth, 0.08),
        short_debt=short_debt,
        long_debt=long_debt,
        other_liab=_series(rng, scale * rng.uniform(0.03, 0.12), 0.03, 0.04),
        capex=_series(rng, scale * rng.uniform(0.05, 0.2), rng.uniform(-0.05, 0.35), 0.1),
        dividends=_series(rng, scale * rng.uniform(0.0, 0.06), 0.05, 0.05),
        segments=tuple(segments),
    )


def _pct(a: float, b: float) -> float:
    return 100.0 * (b - a) / abs(a) if a else 0.0


def _row(label: str, values: Iterable[float]) -> str:
    return f"| {label} | " + " | ".join(f"{v:,.1f}" for v in values) + " |"


def dossier(company: Company, seed: int = 0) -> str:
    """The company's background and financial statements (the shared document)."""
    f = _financials(company, seed)
    rng = random.Random(f"{seed}/{company.ticker}/text")
    years = range(len(_YEARS))
    if company.lang == "en":
        return _dossier_en(company, f, rng, years)
    return _dossier_zh(company, f, rng, years)


def _statements(f: _Financials, labels: dict[str, str], years: range) -> list[str]:
    head = (
        "| " + labels["item"] + " | " + " | ".join(labels["fy"].format(y=y) for y in _YEARS) + " |"
    )
    sep = "|---|" + "---:|" * len(_YEARS)
    income = [
        head,
        sep,
        _row(labels["revenue"], f.revenue),
        _row(labels["cogs"], f.cogs),
        _row(labels["gross"], (f.gross(i) for i in years)),
        _row(labels["rnd"], f.rnd),
        _row(labels["sga"], f.sga),
        _row(labels["da"], f.da),
        _row(labels["operating"], (f.operating(i) for i in years)),
        _row(labels["interest"], f.interest),
        _row(labels["pretax"], (f.pretax(i) for i in years)),
        _row(labels["tax"], (f.pretax(i) * f.tax_rate for i in years)),
        _row(labels["net"], (f.net(i) for i in years)),
        _row(labels["eps"], (f.net(i) / f.shares for i in years)),
    ]
    balance = [
        head,
        sep,
        _row(labels["cash"], f.cash),
        _row(labels["receivables"], f.receivables),
        _row(labels["inventory"], f.inventory),
        _row(labels["other_current"], f.other_current),
        _row(labels["current_assets"], (f.current_assets(i) for i in years)),
        _row(labels["ppe"], f.ppe),
        _row(labels["intangibles"], f.intangibles),
        _row(labels["total_assets"], (f.total_assets(i) for i in years)),
        _row(labels["payables"], f.payables),
        _row(labels["short_debt"], f.short_debt),
        _row(labels["current_liab"], (f.current_liab(i) for i in years)),
        _row(labels["long_debt"], f.long_debt),
        _row(labels["other_liab"], f.other_liab),
        _row(labels["total_liab"], (f.total_liab(i) for i in years)),
        _row(labels["equity"], (f.equity(i) for i in years)),
    ]
    cash = [
        head,
        sep,
        _row(labels["net"], (f.net(i) for i in years)),
        _row(labels["da"], f.da),
        _row(labels["wc"], (f.cfo(i) - f.net(i) - f.da[i] for i in years)),
        _row(labels["cfo"], (f.cfo(i) for i in years)),
        _row(labels["capex"], (-c for c in f.capex)),
        _row(labels["fcf"], (f.fcf(i) for i in years)),
        _row(labels["dividends"], (-d for d in f.dividends)),
        _row(
            labels["debt_change"], (0.0, *(f.long_debt[i] - f.long_debt[i - 1] for i in years[1:]))
        ),
    ]
    segments = [head, sep] + [_row(name, vals) for name, vals in f.segments]
    ratios = [
        head,
        sep,
        _row(labels["gm"], (100 * f.gross(i) / f.revenue[i] for i in years)),
        _row(labels["om"], (100 * f.operating(i) / f.revenue[i] for i in years)),
        _row(labels["nm"], (100 * f.net(i) / f.revenue[i] for i in years)),
        _row(labels["cr"], (f.current_assets(i) / f.current_liab(i) for i in years)),
        _row(labels["de"], ((f.short_debt[i] + f.long_debt[i]) / f.equity(i) for i in years)),
        _row(labels["roe"], (100 * f.net(i) / f.equity(i) for i in years)),
        _row(labels["dso"], (365 * f.receivables[i] / f.revenue[i] for i in years)),
        _row(labels["dio"], (365 * f.inventory[i] / f.cogs[i] for i in years)),
    ]
    out = [labels["h_income"], *income, "", labels["h_balance"], *balance, ""]
    out += [labels["h_cash"], *cash, "", labels["h_segments"], *segments, ""]
    out += [labels["h_ratios"], *ratios, ""]
    return out


_LABELS_EN = {
    "item": "Item",
    "fy": "FY{y}",
    "revenue": "Revenue",
    "cogs": "Cost of revenue",
    "gross": "Gross profit",
    "rnd": "Research and development",
    "sga": "Selling, general and administrative",
    "da": "Depreciation and amortisation",
    "operating": "Operating income",
    "interest": "Net interest expense",
    "pretax": "Income before tax",
    "tax": "Income tax",
    "net": "Net income",
    "eps": "Diluted EPS",
    "cash": "Cash and equivalents",
    "receivables": "Trade receivables",
    "inventory": "Inventories",
    "other_current": "Other current assets",
    "current_assets": "Total current assets",
    "ppe": "Property, plant and equipment",
    "intangibles": "Goodwill and intangibles",
    "total_assets": "Total assets",
    "payables": "Trade payables",
    "short_debt": "Short-term borrowings",
    "current_liab": "Total current liabilities",
    "long_debt": "Long-term debt",
    "other_liab": "Other non-current liabilities",
    "total_liab": "Total liabilities",
    "equity": "Shareholders' equity",
    "wc": "Change in working capital",
    "cfo": "Net cash from operating activities",
    "capex": "Capital expenditure",
    "fcf": "Free cash flow",
    "dividends": "Dividends paid",
    "debt_change": "Net change in long-term debt",
    "gm": "Gross margin (%)",
    "om": "Operating margin (%)",
    "nm": "Net margin (%)",
    "cr": "Current ratio (x)",
    "de": "Debt-to-equity (x)",
    "roe": "Return on equity (%)",
    "dso": "Receivable days",
    "dio": "Inventory days",
    "h_income": "### Consolidated income statement (millions)",
    "h_balance": "### Consolidated balance sheet at fiscal year end (millions)",
    "h_cash": "### Consolidated cash flow statement (millions)",
    "h_segments": "### Revenue by segment (millions)",
    "h_ratios": "### Key ratios (derived)",
}

_LABELS_ZH = {
    "item": "项目",
    "fy": "{y}财年",
    "revenue": "营业收入",
    "cogs": "营业成本",
    "gross": "毛利",
    "rnd": "研发费用",
    "sga": "销售及管理费用",
    "da": "折旧与摊销",
    "operating": "营业利润",
    "interest": "财务费用净额",
    "pretax": "利润总额",
    "tax": "所得税费用",
    "net": "净利润",
    "eps": "稀释每股收益",
    "cash": "货币资金",
    "receivables": "应收账款",
    "inventory": "存货",
    "other_current": "其他流动资产",
    "current_assets": "流动资产合计",
    "ppe": "固定资产及在建工程",
    "intangibles": "商誉及无形资产",
    "total_assets": "资产总计",
    "payables": "应付账款",
    "short_debt": "短期借款",
    "current_liab": "流动负债合计",
    "long_debt": "长期借款及应付债券",
    "other_liab": "其他非流动负债",
    "total_liab": "负债合计",
    "equity": "归属于母公司股东权益",
    "wc": "营运资金变动",
    "cfo": "经营活动产生的现金流量净额",
    "capex": "购建固定资产等支付的现金",
    "fcf": "自由现金流",
    "dividends": "分配股利支付的现金",
    "debt_change": "长期借款净增加额",
    "gm": "毛利率(%)",
    "om": "营业利润率(%)",
    "nm": "净利率(%)",
    "cr": "流动比率(倍)",
    "de": "有息负债权益比(倍)",
    "roe": "净资产收益率(%)",
    "dso": "应收账款周转天数",
    "dio": "存货周转天数",
    "h_income": "### 合并利润表(单位:百万元)",
    "h_balance": "### 合并资产负债表(期末,单位:百万元)",
    "h_cash": "### 合并现金流量表(单位:百万元)",
    "h_segments": "### 分部收入(单位:百万元)",
    "h_ratios": "### 主要财务指标(推算)",
}

_RISKS_EN = (
    "customer concentration: the five largest customers account for {p:.0f}% of revenue",
    "foreign-exchange exposure, with {p:.0f}% of costs denominated in other currencies",
    "supply constraints for key inputs and the pass-through of higher input prices",
    "regulatory changes in its main markets, including export-control rules",
    "the refinancing of {d:,.0f} million of debt maturing within three years",
    "execution risk on the capacity expansion announced for FY{y}",
    "pricing pressure from larger competitors in its second-largest segment",
    "cybersecurity incidents and the cost of remediation and fines",
)
_RISKS_ZH = (
    "客户集中度较高:前五大客户收入占比约{p:.0f}%",
    "汇率波动风险,约{p:.0f}%的成本以外币计价",
    "关键原材料供应紧张及价格上涨向下游传导不畅",
    "主要市场监管政策变化,包括出口管制相关规定",
    "未来三年内到期的{d:,.0f}百万元债务的再融资安排",
    "{y}财年新增产能项目的建设与爬坡进度",
    "第二大业务分部面临头部竞争对手的价格压力",
    "网络安全事件可能带来的整改成本与处罚",
)


def _dossier_en(c: Company, f: _Financials, rng: random.Random, years: range) -> str:
    seg_names = ", ".join(name for name, _ in f.segments)
    y0, y2 = _YEARS[0], _YEARS[-1]
    risks = rng.sample(_RISKS_EN, 5)
    lines = [
        f"## Company dossier: {c.name} ({c.exchange}: {c.ticker})",
        "",
        "### Background",
        f"{c.name} was founded in {c.founded} and is headquartered in {c.hq}. It operates "
        f"in {c.sector} through three reporting segments: {seg_names}. The company reports "
        f"in {c.currency}; fiscal years end on 31 December. Headcount at the end of FY{y2} "
        f"was {rng.randint(1800, 42000):,}, of whom {rng.randint(8, 35)}% work in research, "
        f"engineering and product roles. Its shares have been listed on the {c.exchange} "
        f"since {rng.randint(c.founded + 3, 2016)}; the founding family and management hold "
        f"{rng.uniform(4, 31):.1f}% of the shares and the free float is "
        f"{rng.uniform(55, 92):.1f}%.",
        "",
        f"Over FY{y0}-FY{y2} revenue moved from {f.revenue[0]:,.1f} to {f.revenue[2]:,.1f} "
        f"million ({_pct(f.revenue[0], f.revenue[2]):+.1f}%). Management attributes the change "
        f"to volume in {f.segments[0][0].lower()}, pricing in {f.segments[1][0].lower()}, and "
        f"the ramp of new capacity commissioned in FY{_YEARS[1]}. The board's capital "
        f"allocation framework targets net debt below {rng.uniform(1.5, 3.0):.1f}x EBITDA, a "
        f"dividend pay-out of {rng.randint(20, 45)}% of net income, and capital expenditure "
        f"of {rng.randint(6, 14)}-{rng.randint(15, 22)}% of revenue during the expansion "
        f"phase.",
        "",
        "### Segment notes",
    ]
    for name, vals in f.segments:
        lines.append(
            f"- {name}: revenue {vals[0]:,.1f} (FY{y0}), {vals[1]:,.1f} (FY{_YEARS[1]}), "
            f"{vals[2]:,.1f} (FY{y2}) million; segment margin about "
            f"{rng.uniform(8, 38):.1f}% in FY{y2}; {rng.randint(3, 60)} customers above "
            f"10 million of annual revenue; order backlog {rng.uniform(0.3, 1.8):.2f}x of "
            f"FY{y2} segment revenue."
        )
    lines += ["", *_statements(f, _LABELS_EN, years)]
    lines += [
        "### Management discussion (extract)",
        f"Gross margin was {100 * f.gross(0) / f.revenue[0]:.1f}% in FY{y0} and "
        f"{100 * f.gross(2) / f.revenue[2]:.1f}% in FY{y2}. Operating expenses grew "
        f"{_pct(f.rnd[0] + f.sga[0], f.rnd[2] + f.sga[2]):+.1f}% over the period, with R&D "
        f"at {100 * f.rnd[2] / f.revenue[2]:.1f}% of revenue in FY{y2}. Operating cash flow "
        f"was {f.cfo(2):,.1f} million in FY{y2} against net income of {f.net(2):,.1f} "
        f"million; capital expenditure of {f.capex[2]:,.1f} million left free cash flow of "
        f"{f.fcf(2):,.1f} million. The effective tax rate was {100 * f.tax_rate:.1f}%.",
        "",
        "### Principal risks",
    ]
    for r in risks:
        lines.append("- " + r.format(p=rng.uniform(18, 55), d=f.long_debt[2] * 0.6, y=y2 + 1))
    lines += [
        "",
        "### Auditor",
        f"The FY{y2} financial statements received an unqualified opinion. Key audit "
        "matters: revenue recognition on multi-element contracts, impairment testing of "
        "goodwill, and the valuation of inventories.",
    ]
    return "\n".join(lines)


def _dossier_zh(c: Company, f: _Financials, rng: random.Random, years: range) -> str:
    seg_names = "、".join(name for name, _ in f.segments)
    y0, y2 = _YEARS[0], _YEARS[-1]
    risks = rng.sample(_RISKS_ZH, 5)
    lines = [
        f"## 公司资料:{c.name}({c.exchange}:{c.ticker})",
        "",
        "### 公司背景",
        f"{c.name}成立于{c.founded}年,总部位于{c.hq},主营{c.sector},设有三个报告分部:"
        f"{seg_names}。公司以{c.currency}为记账本位币,财年截至每年12月31日。截至{y2}财年末,"
        f"公司员工{rng.randint(1800, 42000):,}人,其中研发及工程技术人员占比{rng.randint(8, 35)}%。"
        f"公司于{rng.randint(c.founded + 3, 2016)}年在{c.exchange}上市,实际控制人及管理层合计持股"
        f"{rng.uniform(4, 31):.1f}%,流通股占比{rng.uniform(55, 92):.1f}%。",
        "",
        f"{y0}至{y2}财年,营业收入由{f.revenue[0]:,.1f}百万元变为{f.revenue[2]:,.1f}百万元"
        f"({_pct(f.revenue[0], f.revenue[2]):+.1f}%)。管理层将变化归因于{f.segments[0][0]}销量"
        f"变化、{f.segments[1][0]}价格调整,以及{_YEARS[1]}财年投产的新产能逐步释放。董事会的资本"
        f"配置框架要求净负债/EBITDA低于{rng.uniform(1.5, 3.0):.1f}倍,现金分红比例为净利润的"
        f"{rng.randint(20, 45)}%,扩张期资本开支占收入的{rng.randint(6, 14)}%至"
        f"{rng.randint(15, 22)}%。",
        "",
        "### 分部说明",
    ]
    for name, vals in f.segments:
        lines.append(
            f"- {name}:收入{vals[0]:,.1f}({y0}财年)、{vals[1]:,.1f}({_YEARS[1]}财年)、"
            f"{vals[2]:,.1f}({y2}财年)百万元;{y2}财年分部利润率约{rng.uniform(8, 38):.1f}%;"
            f"年收入过千万元的客户{rng.randint(3, 60)}家;在手订单为{y2}财年分部收入的"
            f"{rng.uniform(0.3, 1.8):.2f}倍。"
        )
    lines += ["", *_statements(f, _LABELS_ZH, years)]
    lines += [
        "### 管理层讨论与分析(节选)",
        f"{y0}财年毛利率为{100 * f.gross(0) / f.revenue[0]:.1f}%,{y2}财年为"
        f"{100 * f.gross(2) / f.revenue[2]:.1f}%。期间费用累计变动"
        f"{_pct(f.rnd[0] + f.sga[0], f.rnd[2] + f.sga[2]):+.1f}%,{y2}财年研发费用占收入"
        f"{100 * f.rnd[2] / f.revenue[2]:.1f}%。{y2}财年经营活动现金流净额{f.cfo(2):,.1f}百万元,"
        f"净利润{f.net(2):,.1f}百万元;资本开支{f.capex[2]:,.1f}百万元,自由现金流"
        f"{f.fcf(2):,.1f}百万元。实际所得税率{100 * f.tax_rate:.1f}%。",
        "",
        "### 主要风险",
    ]
    for r in risks:
        lines.append("- " + r.format(p=rng.uniform(18, 55), d=f.long_debt[2] * 0.6, y=y2 + 1))
    lines += [
        "",
        "### 审计意见",
        f"{y2}财年财务报表获标准无保留意见。关键审计事项:多要素合同的收入确认、商誉减值测试、"
        "存货跌价准备的计提。",
    ]
    return "\n".join(lines)


# -- canned answers --------------------------------------------------------------


def _answer(company: Company, f: _Financials, lang: str, q: int, rng: random.Random) -> str:
    """A plausible analyst answer to question ``q`` built from the dossier's figures."""
    y0, y1, y2 = _YEARS
    gm = [100 * f.gross(i) / f.revenue[i] for i in range(3)]
    om = [100 * f.operating(i) / f.revenue[i] for i in range(3)]
    de = [(f.short_debt[i] + f.long_debt[i]) / f.equity(i) for i in range(3)]
    cr = [f.current_assets(i) / f.current_liab(i) for i in range(3)]
    top = max(f.segments, key=lambda s: s[1][2] / s[1][0])
    if lang == "en":
        facts = [
            f"Revenue went from {f.revenue[0]:,.1f} million in FY{y0} to {f.revenue[2]:,.1f} "
            f"million in FY{y2} ({_pct(f.revenue[0], f.revenue[2]):+.1f}%).",
            f"Gross margin = gross profit / revenue: {gm[0]:.1f}% (FY{y0}), {gm[1]:.1f}% "
            f"(FY{y1}), {gm[2]:.1f}% (FY{y2}).",
            f"Operating margin moved from {om[0]:.1f}% to {om[2]:.1f}%.",
            f"Current ratio = current assets / current liabilities: {cr[0]:.2f}x, {cr[1]:.2f}x, "
            f"{cr[2]:.2f}x.",
            f"Debt-to-equity = total debt / equity: {de[0]:.2f}x, {de[1]:.2f}x, {de[2]:.2f}x.",
            f"Operating cash flow was {f.cfo(2):,.1f} million in FY{y2} against net income of "
            f"{f.net(2):,.1f} million; free cash flow = OCF - capex = {f.fcf(2):,.1f} million "
            f"(FY{y0}: {f.fcf(0):,.1f}).",
            f"The fastest-growing segment is {top[0]}, up {_pct(top[1][0], top[1][2]):+.1f}% "
            f"to {100 * top[1][2] / f.revenue[2]:.1f}% of FY{y2} revenue.",
            f"Capital expenditure went from {f.capex[0]:,.1f} to {f.capex[2]:,.1f} million, "
            f"funded by operating cash flow and {f.long_debt[2] - f.long_debt[0]:+,.1f} "
            "million of net long-term borrowing.",
        ]
        closing = "All figures are from the dossier; this is not investment advice."
    else:
        facts = [
            f"营业收入由{y0}财年的{f.revenue[0]:,.1f}百万元变为{y2}财年的{f.revenue[2]:,.1f}百万元"
            f"({_pct(f.revenue[0], f.revenue[2]):+.1f}%)。",
            f"毛利率=毛利/营业收入:{gm[0]:.1f}%({y0})、{gm[1]:.1f}%({y1})、{gm[2]:.1f}%({y2})。",
            f"营业利润率由{om[0]:.1f}%变为{om[2]:.1f}%。",
            f"流动比率=流动资产/流动负债:{cr[0]:.2f}倍、{cr[1]:.2f}倍、{cr[2]:.2f}倍。",
            f"有息负债权益比=有息负债/股东权益:{de[0]:.2f}倍、{de[1]:.2f}倍、{de[2]:.2f}倍。",
            f"{y2}财年经营活动现金流净额{f.cfo(2):,.1f}百万元,净利润{f.net(2):,.1f}百万元;"
            f"自由现金流=经营现金流-资本开支={f.fcf(2):,.1f}百万元({y0}财年:{f.fcf(0):,.1f})。",
            f"增长最快的分部是{top[0]},增长{_pct(top[1][0], top[1][2]):+.1f}%,占{y2}财年收入的"
            f"{100 * top[1][2] / f.revenue[2]:.1f}%。",
            f"资本开支由{f.capex[0]:,.1f}百万元增至{f.capex[2]:,.1f}百万元,资金来自经营现金流及"
            f"{f.long_debt[2] - f.long_debt[0]:+,.1f}百万元的长期借款净变动。",
        ]
        closing = "以上数字均来自公司资料,不构成投资建议。"
    # Lead with the fact the question is about, then one or two supporting ones.
    lead = facts[q % len(facts)]
    extra = rng.sample([x for x in facts if x != lead], rng.randint(1, 2))
    return " ".join([lead, *extra, closing])


# -- generation ------------------------------------------------------------------


def _new_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


def generate(config: WorkloadConfig) -> list[ChatRequest]:
    """All requests of the workload, grouped by session, turns in order."""
    rng = random.Random(config.seed)
    companies = COMPANIES[: config.companies]
    weights = [c.popularity for c in companies]
    docs = {c.ticker: dossier(c, config.seed) for c in companies}
    fins = {c.ticker: _financials(c, config.seed) for c in companies}
    out: list[ChatRequest] = []
    for s in range(config.sessions):
        company = rng.choices(companies, weights=weights)[0]
        lang = company.lang
        if rng.random() < config.other_language_share:
            lang = "zh" if lang == "en" else "en"
        questions = QUESTIONS_EN if lang == "en" else QUESTIONS_ZH
        turns = rng.randint(config.min_turns, config.max_turns)
        # Conversations start with an overview or a trend question and then wander.
        first = rng.choice((0, 1, 2))
        order = [first, *rng.sample([q for q in range(len(questions)) if q != first], turns - 1)]
        reconnect_at = (
            rng.randint(1, turns - 1)
            if turns > 1 and rng.random() < config.reconnect_share
            else None
        )
        session_id = _new_id(rng)
        # Drawn only in session mode, so request mode keeps its bytes for a seed.
        session_drops = config.drop_mode == "session" and rng.random() < config.drop_id_share
        history: list[dict[str, str]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "system", "content": docs[company.ticker]},
        ]
        name = f"s{s:05d}-{company.ticker}"
        for t, q in enumerate(order):
            if reconnect_at is not None and t == reconnect_at:
                session_id = _new_id(rng)
            question = questions[q].format(y0=_YEARS[0], y2=_YEARS[-1])
            history.append({"role": "user", "content": question})
            if config.drop_mode == "session":
                dropped = session_drops
            else:
                dropped = rng.random() < config.drop_id_share
            out.append(
                ChatRequest(
                    session=name,
                    turn=t,
                    company=company.ticker,
                    lang=lang,
                    session_id=None if dropped else session_id,
                    reconnected=reconnect_at is not None and t >= reconnect_at,
                    messages=[dict(m) for m in history],
                    max_tokens=config.max_tokens,
                )
            )
            history.append(
                {
                    "role": "assistant",
                    "content": _answer(company, fins[company.ticker], lang, q, rng),
                }
            )
    return out


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
    """Reads a workload file; raises ValueError naming the bad line."""
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(ChatRequest.from_json(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    return out


def sessions_of(requests: Iterable[ChatRequest]) -> dict[str, list[ChatRequest]]:
    """Requests grouped by session, in first-seen order, turns sorted."""
    groups: dict[str, list[ChatRequest]] = {}
    for r in requests:
        groups.setdefault(r.session, []).append(r)
    for turns in groups.values():
        turns.sort(key=lambda r: r.turn)
    return groups


# -- the ideal hit ratio ---------------------------------------------------------


@dataclass(frozen=True)
class IdealHit:
    """What an infinite prefix cache of full blocks could reuse.

    Attributes:
        requests: requests counted.
        prompt_tokens: prompt tokens over all of them.
        hit_tokens: tokens in full blocks seen in an earlier request.
        token_hit_ratio: hit_tokens / prompt_tokens.
        mean_prompt_tokens: average prompt length.
        max_prompt_tokens: longest prompt.
    """

    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_ratio: float
    mean_prompt_tokens: float
    max_prompt_tokens: int


def load_server_tokenizer() -> ChatTokenizer:
    """The model server's DeepSeek tokenizer and chat template (the 'server' extra)."""
    try:
        from dscache_server.tokenizer import DeepSeekTokenizer
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            "counting prompt tokens needs the model server's tokenizer: "
            f"pip install 'dscache[server]' ({exc})"
        ) from exc

    class _Memo(DeepSeekTokenizer):
        """The server's tokenizer with plain-text encodings memoised.

        The template encodes message by message, and a workload repeats each
        message in every later turn of its session, so this turns quadratic work
        into linear work without touching the template itself.
        """

        def __init__(self) -> None:
            super().__init__()
            self._memo: dict[str, list[int]] = {}

        def encode(self, text: str) -> list[int]:
            ids = self._memo.get(text)
            if ids is None:
                ids = super().encode(text)
                self._memo[text] = ids
            return list(ids)

    return _Memo()


def prompt_ids(tokenizer: ChatTokenizer, request: ChatRequest) -> list[int]:
    """Token ids the server prefills for ``request`` (its chat template)."""
    from dscache_server.tokenizer import ChatMessage

    return tokenizer.apply_chat_template(
        [ChatMessage(m["role"], m["content"]) for m in request.messages]
    )


def ideal_hit_ratio(
    requests: Iterable[ChatRequest],
    tokenizer: ChatTokenizer,
    *,
    block_tokens: int = 256,
    min_tokens: int = 0,
    warm: Iterable[ChatRequest] = (),
) -> IdealHit:
    """Infinite-cache, prefix-semantics token hit ratio of ``requests``.

    Block keys come from ``dscache.keys`` (the contract), so two prompts share a
    block exactly when the server would. Prompts shorter than ``min_tokens`` are
    neither cached nor counted as hits (the server's admission threshold).
    ``warm`` requests fill the cache first and are not counted (a prewarm).
    """
    from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint

    layout = KVLayout(
        LayoutKind.GQA, num_layers=1, dtype="float32", num_kv_heads=1, head_dim=1, v_head_dim=1
    )
    chain = KeyChain(ModelFingerprint("ideal", "0", layout, block_tokens=block_tokens), b"")
    seen: set[bytes] = set()
    for r in warm:
        seen.update(chain.keys(prompt_ids(tokenizer, r)))
    n = total = hit = longest = 0
    for r in requests:
        ids = prompt_ids(tokenizer, r)
        n += 1
        total += len(ids)
        longest = max(longest, len(ids))
        if len(ids) < min_tokens:
            continue
        keys = chain.keys(ids)
        leading = 0
        for k in keys:
            if k not in seen:
                break
            leading += 1
        # The server always recomputes the last prompt token (it needs its logits).
        hit += min(leading * block_tokens, len(ids) - 1)
        seen.update(keys)
    return IdealHit(
        requests=n,
        prompt_tokens=total,
        hit_tokens=hit,
        token_hit_ratio=hit / total if total else 0.0,
        mean_prompt_tokens=total / n if n else 0.0,
        max_prompt_tokens=longest,
    )


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


def iter_turns(requests: Sequence[ChatRequest]) -> Iterator[list[ChatRequest]]:
    """Sessions in workload order, each as its ordered turns."""
    yield from sessions_of(requests).values()
