"""The finance workload: multi-turn chats about listed companies, as JSONL requests.

The seed's service is a financial knowledge-base assistant: analysts open a
session about one company, the prompt carries a fixed system prompt plus that
company's background and three years of financial statements (a few thousand
tokens, identical for every session about the company), and they keep asking
follow-ups ("how did the key ratios change over three years?", "and the cash
flow?") with the whole history appended. Some requests lose their session id at
the gateway and some clients reconnect under a new id.

Where things are:
    * :mod:`.model`: companies, ``WorkloadConfig``, ``ChatRequest`` and JSONL files.
    * :mod:`.generate`: ``generate(config)``, the sessions and their turns.
    * :mod:`.text` builds the dossier and the answers from :mod:`.financials`
      (the figures) and :mod:`.languages` (the words, one column per language).
    * :mod:`.ideal`: the ideal token hit ratio, with the server's tokenizer.

Contract:
    * ``generate(config)`` is a pure function of its config: the same seed gives
      byte-identical requests in every process.
    * Turn ``t`` of a session sends the messages of turn ``t-1``, the canned
      assistant answer of turn ``t-1`` and one new question, so the chat template's
      tokens of turn ``t-1`` (up to its generation prompt) are an exact prefix of
      turn ``t``'s. The history is fixed in the workload rather than taken from the
      model's reply, so every run sends the same prompts and the ideal hit ratio is
      a property of the file.
    * ``variant="standard"`` (the default): every session about one company starts
      with the same two system messages (the assistant's instructions, then the
      company dossier). ``variant="varied"``: each session opens its own way (a
      dated opening line, one of several phrasings of the instructions, the
      dossier's sections in its own order, a greeting or not), so sessions share
      no prefix from the start; everything after the opening is ``standard``'s.
    * ``session_id`` is None on a request whose id the gateway dropped (it must then
      carry neither the header nor a cookie); a reconnected session switches to a
      new id from its reconnect turn on.
"""

from dscache_tools.workload.generate import generate
from dscache_tools.workload.ideal import (
    ChatTokenizer,
    IdealHit,
    ideal_hit_ratio,
    load_server_tokenizer,
    prompt_ids,
)
from dscache_tools.workload.languages import LANGUAGES, SYSTEM_PROMPT, Language
from dscache_tools.workload.model import (
    COMPANIES,
    DEFAULT_MAX_TOKENS,
    VARIANTS,
    ChatRequest,
    Company,
    WorkloadConfig,
    iter_turns,
    prewarm_requests,
    prompts_jsonl,
    read_jsonl,
    sessions_of,
    summary,
    summary_line,
    write_jsonl,
)
from dscache_tools.workload.text import dossier

__all__ = [
    "COMPANIES",
    "DEFAULT_MAX_TOKENS",
    "LANGUAGES",
    "SYSTEM_PROMPT",
    "VARIANTS",
    "ChatRequest",
    "ChatTokenizer",
    "Company",
    "IdealHit",
    "Language",
    "WorkloadConfig",
    "dossier",
    "generate",
    "ideal_hit_ratio",
    "iter_turns",
    "load_server_tokenizer",
    "prewarm_requests",
    "prompt_ids",
    "prompts_jsonl",
    "read_jsonl",
    "sessions_of",
    "summary",
    "summary_line",
    "write_jsonl",
]
