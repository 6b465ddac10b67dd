"""Generation of the finance workload: sessions, their turns, ids dropped and changed.

Contract:
    * ``generate(config)`` is a pure function of its config: the same seed gives
      byte-identical requests in every process (``random.Random(seed)`` only, no
      global state, no clock). The draws happen in one fixed order per session
      (company, language, turns, questions, reconnect, id, then per turn), so a
      change here changes every workload file: compare against one generated
      before the change.
    * Turn ``t`` of a session sends the messages of turn ``t-1``, the canned
      assistant answer of turn ``t-1`` and one new question.
    * Every session about one company starts with the same two system messages
      (the assistant's instructions, then the company dossier).
    * A reconnected session switches to a new id from its reconnect turn on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dscache_tools.workload.financials import YEARS, financials
from dscache_tools.workload.languages import LANGUAGES, SYSTEM_PROMPT, other
from dscache_tools.workload.model import COMPANIES, ChatRequest, Company, WorkloadConfig
from dscache_tools.workload.text import answer, answer_facts, dossier


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
        self.docs = {c.ticker: dossier(c, seed) for c in companies}
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
        out += _session(rng, config, plan, texts, name=f"s{s:05d}-{plan.company.ticker}")
    return out


def _session(
    rng: random.Random, config: WorkloadConfig, plan: _Plan, texts: _Texts, *, name: str
) -> list[ChatRequest]:
    """The turns of one planned session, drawing ids and answers from ``rng``."""
    lang = LANGUAGES[plan.lang]
    facts = texts.facts(plan.company.ticker, plan.lang)
    session_id = plan.session_id
    history: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "system", "content": texts.docs[plan.company.ticker]},
    ]
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
