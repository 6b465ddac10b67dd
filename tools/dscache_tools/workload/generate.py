"""Generation of the finance workload: sessions, their turns, ids dropped and changed.

Contract:
    * ``generate(config)`` is a pure function of its config: the same seed gives
      byte-identical requests in every process (``random.Random`` seeded from the
      config only, no global state, no clock). The draws happen in one fixed order
      per session (company, language, turns, questions, reconnect, id, then per
      turn), so a change here changes every workload file: compare against one
      generated before the change.
    * Turn ``t`` of a session sends the messages of turn ``t-1``, the canned
      assistant answer of turn ``t-1`` and one new question.
    * ``variant="standard"``: every session about one company starts with the
      same two system messages (the assistant's instructions, then the company
      dossier).
    * ``variant="varied"``: each session opens its own way: its first system
      message is a dated opening line (analyst, desk, date and time) and one of
      several phrasings of the instructions, its second the dossier with every
      section but the header in its own order, and half the sessions then greet
      (a user greeting and the assistant's reply) before the first question. These
      draws come from a generator of their own per session
      (``Random(f"{seed}/{session}/opening")``), so the shared stream, and with
      it every company, question, answer and id, is the same as ``standard``'s.
    * A reconnected session switches to a new id from its reconnect turn on.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

from dscache_tools.workload.financials import YEARS, financials
from dscache_tools.workload.languages import (
    LANGUAGES,
    SYSTEM_PROMPT,
    SYSTEM_PROMPT_PHRASINGS,
    other,
)
from dscache_tools.workload.model import COMPANIES, ChatRequest, Company, WorkloadConfig
from dscache_tools.workload.text import answer, answer_facts, dossier_sections


def _new_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


@dataclass(frozen=True)
class _Plan:
    """What one session's first draws decided."""

    company: Company
    lang: str
    order: list[int]  # question indices, one per turn
    reconnect_at: int | None
    session_id: str
    session_drops: bool


def _plan(rng: random.Random, config: WorkloadConfig, companies: tuple[Company, ...]) -> _Plan:
    company = rng.choices(companies, weights=[c.popularity for c in companies])[0]
    lang = company.lang
    if rng.random() < config.other_language_share:
        lang = other(lang)
    questions = LANGUAGES[lang].questions
    turns = rng.randint(config.min_turns, config.max_turns)
    # Conversations start with an overview or a trend question and then wander.
    first = rng.choice((0, 1, 2))
    order = [first, *rng.sample([q for q in range(len(questions)) if q != first], turns - 1)]
    reconnect_at = (
        rng.randint(1, turns - 1) if turns > 1 and rng.random() < config.reconnect_share else None
    )
    session_id = _new_id(rng)
    # Drawn only in session mode, so request mode keeps its bytes for a seed.
    session_drops = config.drop_mode == "session" and rng.random() < config.drop_id_share
    return _Plan(company, lang, order, reconnect_at, session_id, session_drops)


class _Texts:
    """Each company's dossier and answer sentences, built once per workload."""

    def __init__(self, companies: tuple[Company, ...], seed: int) -> None:
        self.sections = {c.ticker: dossier_sections(c, seed) for c in companies}
        self.docs = {t: "\n\n".join(s) for t, s in self.sections.items()}
        self._fins = {c.ticker: financials(c, seed) for c in companies}
        self._facts: dict[tuple[str, str], tuple[str, ...]] = {}

    def facts(self, ticker: str, lang: str) -> tuple[str, ...]:
        key = (ticker, lang)
        if key not in self._facts:
            self._facts[key] = answer_facts(self._fins[ticker], LANGUAGES[lang])
        return self._facts[key]


def generate(config: WorkloadConfig) -> list[ChatRequest]:
    """All requests of the workload, grouped by session, turns in order."""
    rng = random.Random(config.seed)
    companies = COMPANIES[: config.companies]
    texts = _Texts(companies, config.seed)
    out: list[ChatRequest] = []
    for s in range(config.sessions):
        plan = _plan(rng, config, companies)
        name = f"s{s:05d}-{plan.company.ticker}"
        opening = _opening(config, plan, texts, name)
        out += _session(rng, config, plan, texts, opening, name=name)
    return out


def _opening(config: WorkloadConfig, plan: _Plan, texts: _Texts, name: str) -> list[dict[str, str]]:
    """The messages a session starts with, before its first question."""
    ticker = plan.company.ticker
    if config.variant == "standard":
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "system", "content": texts.docs[ticker]},
        ]
    rng = random.Random(f"{config.seed}/{name}/opening")
    lang = LANGUAGES[plan.lang]
    # Drawn in this order: the opening line and its fields, the phrasing, the
    # sections, the greeting.
    template = rng.choice(lang.openings)
    analyst, desk = rng.choice(lang.analysts), rng.choice(lang.desks)
    # A day of the year after the last fiscal year the dossier covers.
    day = datetime.date(YEARS[-1] + 1, 1, 1) + datetime.timedelta(days=rng.randrange(365))
    time = f"{rng.randint(7, 19):02d}:{rng.randrange(60):02d}"
    line = template.format(date=day.isoformat(), time=time, analyst=analyst, desk=desk)
    instructions = rng.choice(SYSTEM_PROMPT_PHRASINGS)
    header, *rest = texts.sections[ticker]
    rng.shuffle(rest)
    out = [
        {"role": "system", "content": f"{line}\n{instructions}"},
        {"role": "system", "content": "\n\n".join([header, *rest])},
    ]
    if rng.random() < 0.5:
        company = {"name": plan.company.name, "ticker": ticker}
        out.append({"role": "user", "content": rng.choice(lang.greetings).format(**company)})
        out.append({"role": "assistant", "content": lang.text["greeting_reply"].format(**company)})
    return out


def _session(
    rng: random.Random,
    config: WorkloadConfig,
    plan: _Plan,
    texts: _Texts,
    opening: list[dict[str, str]],
    *,
    name: str,
) -> list[ChatRequest]:
    """The turns of one planned session after ``opening``, drawing ids and answers from ``rng``."""
    lang = LANGUAGES[plan.lang]
    facts = texts.facts(plan.company.ticker, plan.lang)
    session_id = plan.session_id
    history = [dict(m) for m in opening]
    out: list[ChatRequest] = []
    for t, q in enumerate(plan.order):
        if t == plan.reconnect_at:
            session_id = _new_id(rng)
        history.append(
            {"role": "user", "content": lang.questions[q].format(y0=YEARS[0], y2=YEARS[-1])}
        )
        if config.drop_mode == "session":
            dropped = plan.session_drops
        else:
            dropped = rng.random() < config.drop_id_share
        out.append(
            ChatRequest(
                session=name,
                turn=t,
                company=plan.company.ticker,
                lang=plan.lang,
                session_id=None if dropped else session_id,
                reconnected=plan.reconnect_at is not None and t >= plan.reconnect_at,
                messages=[dict(m) for m in history],
                max_tokens=config.max_tokens,
            )
        )
        history.append({"role": "assistant", "content": answer(facts, lang, q, rng)})
    return out
