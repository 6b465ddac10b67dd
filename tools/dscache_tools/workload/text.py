"""The texts of the workload: a company's dossier and the canned analyst answers.

One builder for every language: the figures come from
:mod:`dscache_tools.workload.financials`, the words from a column of
:mod:`dscache_tools.workload.languages`.

Contract:
    * ``dossier(company, seed)`` is a pure function: the background's random
      details come from ``random.Random(f"{seed}/{ticker}/text")``, drawn in one
      fixed order whatever the language, so a company's dossier is the same in
      every process and every workload that samples it. It is its
      ``dossier_sections`` (the header, then one section per heading) joined by
      blank lines.
    * ``answer_facts(f, lang)`` is pure; :func:`answer` draws from the caller's
      generator (the workload's), in a fixed order.
    * The statements always add up: every derived row is computed from the same
      :class:`Financials` the prose quotes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dscache_tools.workload.financials import YEARS, Financials, financials, pct
from dscache_tools.workload.languages import LANGUAGES, Language
from dscache_tools.workload.model import Company

#: Rows that are not a field or method of :class:`Financials` of the same name.
_DERIVED: dict[str, Callable[[Financials, int], float]] = {
    "tax": lambda f, i: f.pretax(i) * f.tax_rate,
    "eps": lambda f, i: f.net(i) / f.shares,
    "wc": lambda f, i: f.cfo(i) - f.net(i) - f.da[i],
    "capex": lambda f, i: -f.capex[i],  # cash out, as the cash flow statement shows it
    "dividends": lambda f, i: -f.dividends[i],
    "debt_change": lambda f, i: f.long_debt[i] - f.long_debt[i - 1] if i else 0.0,
    "gm": Financials.gross_margin,
    "om": Financials.operating_margin,
    "nm": lambda f, i: 100 * f.net(i) / f.revenue[i],
    "cr": Financials.current_ratio,
    "de": Financials.debt_to_equity,
    "roe": lambda f, i: 100 * f.net(i) / f.equity(i),
    "dso": lambda f, i: 365 * f.receivables[i] / f.revenue[i],
    "dio": lambda f, i: 365 * f.inventory[i] / f.cogs[i],
}

#: The statements: (heading label, row labels); the segment table has a row per segment.
_STATEMENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("h_income", ("revenue", "cogs", "gross", "rnd", "sga", "da", "operating", "interest",
                  "pretax", "tax", "net", "eps")),
    ("h_balance", ("cash", "receivables", "inventory", "other_current", "current_assets", "ppe",
                   "intangibles", "total_assets", "payables", "short_debt", "current_liab",
                   "long_debt", "other_liab", "total_liab", "equity")),
    ("h_cash", ("net", "da", "wc", "cfo", "capex", "fcf", "dividends", "debt_change")),
    ("h_segments", ()),
    ("h_ratios", ("gm", "om", "nm", "cr", "de", "roe", "dso", "dio")),
)  # fmt: skip


def _value(f: Financials, row: str, i: int) -> float:
    derived = _DERIVED.get(row)
    if derived is not None:
        return derived(f, i)
    item = getattr(f, row)
    return float(item(i) if callable(item) else item[i])


def _row(label: str, values: Iterable[float]) -> str:
    return f"| {label} | " + " | ".join(f"{v:,.1f}" for v in values) + " |"


def statements(f: Financials, labels: Mapping[str, str]) -> list[str]:
    """The statements as markdown tables, each under its heading and followed by a blank."""
    years = range(len(YEARS))
    fiscal_years = " | ".join(labels["fy"].format(y=y) for y in YEARS)
    head = f"| {labels['item']} | {fiscal_years} |"
    out: list[str] = []
    for heading, rows in _STATEMENTS:
        out += [labels[heading], head, "|---|" + "---:|" * len(YEARS)]
        if heading == "h_segments":
            out += [_row(name, vals) for name, vals in f.segments]
        out += [_row(labels[r], (_value(f, r, i) for i in years)) for r in rows]
        out.append("")
    return out


def _figures(f: Financials) -> dict[str, Any]:
    """The figures both the dossier's prose and the answers quote, by template name."""
    y0, y1, y2 = YEARS
    return {
        "y0": y0,
        "y1": y1,
        "y2": y2,
        "rev0": f.revenue[0],
        "rev2": f.revenue[2],
        "rev_change": pct(f.revenue[0], f.revenue[2]),
        "gm0": f.gross_margin(0),
        "gm1": f.gross_margin(1),
        "gm2": f.gross_margin(2),
        "cfo2": f.cfo(2),
        "net2": f.net(2),
        "capex0": f.capex[0],
        "capex2": f.capex[2],
        "fcf0": f.fcf(0),
        "fcf2": f.fcf(2),
    }


def dossier(company: Company, seed: int = 0) -> str:
    """The company's background and financial statements (the shared document)."""
    return "\n\n".join(dossier_sections(company, seed))


def dossier_sections(company: Company, seed: int = 0) -> list[str]:
    """The dossier's sections in their order: the header first, then one per heading.

    Joined with a blank line they are :func:`dossier`; the varied workload reorders
    all but the header.
    """
    f = financials(company, seed)
    rng = random.Random(f"{seed}/{company.ticker}/text")
    lang = LANGUAGES[company.lang]
    t = lang.text
    risks = rng.sample(lang.risks, 5)
    seg0, seg1 = f.segments[0][0], f.segments[1][0]
    v: dict[str, Any] = {
        **_figures(f),
        "name": company.name,
        "exchange": company.exchange,
        "ticker": company.ticker,
        "founded": company.founded,
        "hq": company.hq,
        "sector": company.sector,
        "currency": company.currency,
        "segs": t["list_sep"].join(name for name, _ in f.segments),
        "seg0": seg0,
        "seg1": seg1,
        "seg0_lower": seg0.lower(),
        "seg1_lower": seg1.lower(),
        "opex_change": pct(f.rnd[0] + f.sga[0], f.rnd[2] + f.sga[2]),
        "rnd_share": 100 * f.rnd[2] / f.revenue[2],
        "tax": 100 * f.tax_rate,
        # Drawn in this order for every language (the background, then the history).
        "headcount": rng.randint(1800, 42000),
        "rnd_staff": rng.randint(8, 35),
        "listed": rng.randint(company.founded + 3, 2016),
        "insiders": rng.uniform(4, 31),
        "free_float": rng.uniform(55, 92),
        "net_debt": rng.uniform(1.5, 3.0),
        "payout": rng.randint(20, 45),
        "capex_lo": rng.randint(6, 14),
        "capex_hi": rng.randint(15, 22),
    }
    sections = [
        t["header"].format(**v),
        "\n".join([t["h_background"], t["background"].format(**v), "", t["history"].format(**v)]),
    ]
    notes = [t["h_segment_notes"]]
    for name, vals in f.segments:
        notes.append(
            t["segment_note"].format(
                **v,
                segment=name,
                v0=vals[0],
                v1=vals[1],
                v2=vals[2],
                margin=rng.uniform(8, 38),
                customers=rng.randint(3, 60),
                backlog=rng.uniform(0.3, 1.8),
            )
        )
    sections.append("\n".join(notes))
    # statements() closes every table with a blank line: one section per table.
    table: list[str] = []
    for line in statements(f, lang.labels):
        if line:
            table.append(line)
        else:
            sections.append("\n".join(table))
            table = []
    sections.append("\n".join([t["h_discussion"], t["discussion"].format(**v)]))
    risk_lines = [t["h_risks"]]
    for r in risks:
        risk_lines.append(
            "- " + r.format(p=rng.uniform(18, 55), d=f.long_debt[2] * 0.6, y=v["y2"] + 1)
        )
    sections.append("\n".join(risk_lines))
    sections.append("\n".join([t["h_auditor"], t["auditor"].format(**v)]))
    return sections


def answer_facts(f: Financials, lang: Language) -> tuple[str, ...]:
    """The sentences an answer is made of, one per kind of question, in ``lang``."""
    top = max(f.segments, key=lambda s: s[1][2] / s[1][0])
    v = {
        **_figures(f),
        "om0": f.operating_margin(0),
        "om2": f.operating_margin(2),
        **{f"cr{i}": f.current_ratio(i) for i in range(3)},
        **{f"de{i}": f.debt_to_equity(i) for i in range(3)},
        "top": top[0],
        "top_growth": pct(top[1][0], top[1][2]),
        "top_share": 100 * top[1][2] / f.revenue[2],
        "debt_change": f.long_debt[2] - f.long_debt[0],
    }
    return tuple(fact.format(**v) for fact in lang.facts)


def answer(facts: tuple[str, ...], lang: Language, q: int, rng: random.Random) -> str:
    """A plausible analyst answer to question ``q`` from the dossier's ``facts``."""
    # Lead with the fact the question is about, then one or two supporting ones.
    lead = facts[q % len(facts)]
    extra = rng.sample([x for x in facts if x != lead], rng.randint(1, 2))
    return " ".join([lead, *extra, lang.text["closing"]])
