"""Three fiscal years of made-up financial statements for one company, from a seed.

Contract:
    * ``financials(company, seed)`` is a pure function: the same company and seed
      give the same figures in every process (``random.Random`` seeded with the
      seed and the ticker, so a company's figures do not depend on which other
      companies or sessions a workload samples).
    * Figures are in millions of the reporting currency, rounded to 0.1; derived
      lines (gross profit, operating income, cash flow, ...) are methods, so the
      statements always add up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dscache_tools.workload.model import Company

#: The fiscal years every dossier reports.
YEARS = (2022, 2023, 2024)


@dataclass(frozen=True)
class Financials:
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

    def gross_margin(self, i: int) -> float:
        """Gross profit / revenue, in percent."""
        return 100 * self.gross(i) / self.revenue[i]

    def operating_margin(self, i: int) -> float:
        """Operating income / revenue, in percent."""
        return 100 * self.operating(i) / self.revenue[i]

    def current_ratio(self, i: int) -> float:
        """Current assets / current liabilities."""
        return self.current_assets(i) / self.current_liab(i)

    def debt_to_equity(self, i: int) -> float:
        """Total debt (short and long) / shareholders' equity."""
        return (self.short_debt[i] + self.long_debt[i]) / self.equity(i)


def _series(rng: random.Random, start: float, growth: float, noise: float) -> tuple[float, ...]:
    out = [start]
    for _ in range(len(YEARS) - 1):
        out.append(out[-1] * (1 + growth + rng.uniform(-noise, noise)))
    return tuple(round(v, 1) for v in out)


def financials(company: Company, seed: int) -> Financials:
    """The company's statements for :data:`YEARS`, a pure function of its seed."""
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
    names = company.segments
    weights = [rng.uniform(0.2, 1.0) for _ in names]
    seg_growth = [rng.uniform(-0.1, 0.45) for _ in names]
    segs = []
    for j, name in enumerate(names):
        share = weights[j] / sum(weights)
        vals = [revenue[0] * share]
        for _i in range(1, len(YEARS)):
            vals.append(vals[-1] * (1 + seg_growth[j]))
        segs.append((name, vals))
    # Rescale segments so they add up to reported revenue each year.
    segments = []
    for name, vals in segs:
        fixed = tuple(
            round(v * revenue[i] / sum(s[1][i] for s in segs), 1) for i, v in enumerate(vals)
        )
        segments.append((name, fixed))
    return Financials(
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


def pct(a: float, b: float) -> float:
    """Change from ``a`` to ``b`` in percent of ``a`` (0 when ``a`` is 0)."""
    return 100.0 * (b - a) / abs(a) if a else 0.0
