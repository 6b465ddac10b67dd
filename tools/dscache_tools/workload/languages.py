"""The workload's words, per language: one table a row per phrase, a column per language.

Every phrase the builders in :mod:`dscache_tools.workload.text` use stands here
once, with its English and its Chinese side by side, so the two languages cannot
drift apart and a third is a new column. Templates are ``str.format`` strings;
the names they use are the figures :mod:`dscache_tools.workload.text` passes.

Contract:
    * ``LANGUAGES[code]`` is the :class:`Language` of ``"en"`` or ``"zh"``; every
      table has both columns for every row (their types say so).
    * Changing a phrase changes the bytes every seed generates: the workload files
      of earlier runs no longer match (their ideal hit ratios stay comparable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The assistant's instructions, the first system message of every session (both
#: languages in one prompt, so it is the same for every session).
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

#: ``variant="varied"``: the instructions of :data:`SYSTEM_PROMPT` as other desks
#: phrase them (both languages in each); a session draws one, after its opening line.
SYSTEM_PROMPT_PHRASINGS: tuple[str, ...] = (
    SYSTEM_PROMPT,
    "Role: research assistant (FinSight) for buy-side analysts. Source of truth: the "
    "company dossier attached below, which holds the background, the segment data and "
    "three fiscal years of audited statements; use nothing else. When you cite a number, "
    "copy it from the dossier and give its fiscal year. When you derive a ratio, write "
    "the formula first (gross margin = gross profit / revenue; current ratio = current "
    "assets / current liabilities; debt-to-equity = total debt / shareholders' equity; "
    "free cash flow = operating cash flow - capital expenditure). If the dossier is "
    "silent, say that it is. No investment advice, no price targets. Reply in the "
    "language the analyst writes in.\n"
    "角色:面向买方分析师的研究助手 FinSight。唯一依据是下方附上的公司资料(背景、分部数据、"
    "三个财年经审计的报表),不得使用其他信息。引用数字须照抄资料并注明财年;推算比率须先写"
    "公式;资料未涉及的内容须直说;不给投资建议或目标价;用分析师提问的语言回答。",
    "FinSight answers questions from the investment research desk about one listed "
    "company at a time. Everything it says must come from the dossier that follows: "
    "company background, segment figures, and the audited financial statements of the "
    "last three fiscal years. Quote figures verbatim with their fiscal year; for any "
    "ratio, state the formula you used (gross margin, current ratio, debt-to-equity, "
    "free cash flow as operating cash flow less capital expenditure); if something is "
    "not in the dossier, say so rather than guess; do not recommend trades or give "
    "price targets; use the language of the question.\n"
    "FinSight 为投研部门解答关于单一上市公司的问题,所有内容均须出自下方的公司资料"
    "(公司背景、分部数据及最近三个财年经审计的财务报表)。数字照录并注明财年;比率须写明"
    "所用公式;资料中没有的不要猜测并明确说明;不推荐交易、不给目标价;以提问语言作答。",
    "Instructions for this session. You are a financial knowledge-base assistant. Work "
    "only from the company dossier below (background, segments, audited statements for "
    "three fiscal years). 1) Figures: exactly as in the dossier, with the fiscal year. "
    "2) Ratios: show the formula (gross margin = gross profit / revenue; current ratio "
    "= current assets / current liabilities; debt-to-equity = total debt / equity; free "
    "cash flow = operating cash flow - capex). 3) Gaps: say plainly that the dossier "
    "does not cover it. 4) No investment advice or price targets. 5) Answer in the "
    "question's language.\n"
    "本次会话说明:你是财务知识库助手,只能依据下方公司资料(背景、分部、三个财年经审计报表)"
    "作答。1)数字与资料一致并注明财年;2)比率写出公式;3)资料未覆盖的须明确说明;"
    "4)不提供投资建议或目标价;5)用提问的语言回答。",
)

#: The questions analysts ask, one row per question: (English, Chinese).
_QUESTIONS: tuple[tuple[str, str], ...] = (
    (
        "Give me a short overview of the company and its main business segments.",
        "请简要介绍这家公司及其主要业务分部。",
    ),
    (
        "How did revenue and gross margin develop over the three years?",
        "近三年营业收入和毛利率是如何变化的?",
    ),
    ("How did the key ratios change over three years?", "近三年主要财务比率有什么变化?"),
    ("And the cash flow?", "那现金流呢?"),
    ("What drove the change in operating margin in {y2}?", "{y2}年营业利润率变化的主要原因是什么?"),
    (
        "Compare net income with operating cash flow. Is earnings quality improving?",
        "对比净利润和经营活动现金流,盈利质量是否在改善?",
    ),
    (
        "How much did capital expenditure grow, and how was it funded?",
        "资本开支增长了多少?资金来源是什么?",
    ),
    (
        "What does the balance sheet say about leverage? Compute debt-to-equity for each year.",
        "从资产负债表看杠杆水平如何?请逐年计算资产负债率和有息负债权益比。",
    ),
    (
        "Which segment grew fastest, and what share of revenue does it have now?",
        "哪个业务分部增长最快?目前占收入的比重是多少?",
    ),
    (
        "What was free cash flow in {y2}, and how does it compare with {y0}?",
        "{y2}年的自由现金流是多少?与{y0}年相比如何?",
    ),
    ("Summarise the main risks management mentions.", "管理层提到的主要风险有哪些?请概括。"),
    (
        "Did working capital improve? Look at receivables and inventory days.",
        "营运资金是否改善?请看应收账款和存货周转天数。",
    ),
    (
        "What is the dividend policy and how much was paid out in {y2}?",
        "公司的分红政策是什么?{y2}年派发了多少现金股利?",
    ),
    (
        "How does R&D spending compare with revenue over the period?",
        "研发投入占收入的比例在这三年里怎么变化?",
    ),
    (
        "Put the last three answers into a short note for the investment committee.",
        "把上面几个回答整理成一段给投资委员会的简要说明。",
    ),
)

#: Row labels and section headings of the statements: name -> (English, Chinese).
_LABELS: dict[str, tuple[str, str]] = {
    "item": ("Item", "项目"),
    "fy": ("FY{y}", "{y}财年"),
    "revenue": ("Revenue", "营业收入"),
    "cogs": ("Cost of revenue", "营业成本"),
    "gross": ("Gross profit", "毛利"),
    "rnd": ("Research and development", "研发费用"),
    "sga": ("Selling, general and administrative", "销售及管理费用"),
    "da": ("Depreciation and amortisation", "折旧与摊销"),
    "operating": ("Operating income", "营业利润"),
    "interest": ("Net interest expense", "财务费用净额"),
    "pretax": ("Income before tax", "利润总额"),
    "tax": ("Income tax", "所得税费用"),
    "net": ("Net income", "净利润"),
    "eps": ("Diluted EPS", "稀释每股收益"),
    "cash": ("Cash and equivalents", "货币资金"),
    "receivables": ("Trade receivables", "应收账款"),
    "inventory": ("Inventories", "存货"),
    "other_current": ("Other current assets", "其他流动资产"),
    "current_assets": ("Total current assets", "流动资产合计"),
    "ppe": ("Property, plant and equipment", "固定资产及在建工程"),
    "intangibles": ("Goodwill and intangibles", "商誉及无形资产"),
    "total_assets": ("Total assets", "资产总计"),
    "payables": ("Trade payables", "应付账款"),
    "short_debt": ("Short-term borrowings", "短期借款"),
    "current_liab": ("Total current liabilities", "流动负债合计"),
    "long_debt": ("Long-term debt", "长期借款及应付债券"),
    "other_liab": ("Other non-current liabilities", "其他非流动负债"),
    "total_liab": ("Total liabilities", "负债合计"),
    "equity": ("Shareholders' equity", "归属于母公司股东权益"),
    "wc": ("Change in working capital", "营运资金变动"),
    "cfo": ("Net cash from operating activities", "经营活动产生的现金流量净额"),
    "capex": ("Capital expenditure", "购建固定资产等支付的现金"),
    "fcf": ("Free cash flow", "自由现金流"),
    "dividends": ("Dividends paid", "分配股利支付的现金"),
    "debt_change": ("Net change in long-term debt", "长期借款净增加额"),
    "gm": ("Gross margin (%)", "毛利率(%)"),
    "om": ("Operating margin (%)", "营业利润率(%)"),
    "nm": ("Net margin (%)", "净利率(%)"),
    "cr": ("Current ratio (x)", "流动比率(倍)"),
    "de": ("Debt-to-equity (x)", "有息负债权益比(倍)"),
    "roe": ("Return on equity (%)", "净资产收益率(%)"),
    "dso": ("Receivable days", "应收账款周转天数"),
    "dio": ("Inventory days", "存货周转天数"),
    "h_income": ("### Consolidated income statement (millions)", "### 合并利润表(单位:百万元)"),
    "h_balance": (
        "### Consolidated balance sheet at fiscal year end (millions)",
        "### 合并资产负债表(期末,单位:百万元)",
    ),
    "h_cash": (
        "### Consolidated cash flow statement (millions)",
        "### 合并现金流量表(单位:百万元)",
    ),
    "h_segments": ("### Revenue by segment (millions)", "### 分部收入(单位:百万元)"),
    "h_ratios": ("### Key ratios (derived)", "### 主要财务指标(推算)"),
}

#: Principal risks a dossier names five of: (English, Chinese).
_RISKS: tuple[tuple[str, str], ...] = (
    (
        "customer concentration: the five largest customers account for {p:.0f}% of revenue",
        "客户集中度较高:前五大客户收入占比约{p:.0f}%",
    ),
    (
        "foreign-exchange exposure, with {p:.0f}% of costs denominated in other currencies",
        "汇率波动风险,约{p:.0f}%的成本以外币计价",
    ),
    (
        "supply constraints for key inputs and the pass-through of higher input prices",
        "关键原材料供应紧张及价格上涨向下游传导不畅",
    ),
    (
        "regulatory changes in its main markets, including export-control rules",
        "主要市场监管政策变化,包括出口管制相关规定",
    ),
    (
        "the refinancing of {d:,.0f} million of debt maturing within three years",
        "未来三年内到期的{d:,.0f}百万元债务的再融资安排",
    ),
    (
        "execution risk on the capacity expansion announced for FY{y}",
        "{y}财年新增产能项目的建设与爬坡进度",
    ),
    (
        "pricing pressure from larger competitors in its second-largest segment",
        "第二大业务分部面临头部竞争对手的价格压力",
    ),
    (
        "cybersecurity incidents and the cost of remediation and fines",
        "网络安全事件可能带来的整改成本与处罚",
    ),
)

#: Dossier and answer templates: name -> (English, Chinese).
_TEXT: dict[str, tuple[str, str]] = {
    "header": (
        "## Company dossier: {name} ({exchange}: {ticker})",
        "## 公司资料:{name}({exchange}:{ticker})",
    ),
    "h_background": (
        "### Background",
        "### 公司背景",
    ),
    "background": (
        "{name} was founded in {founded} and is headquartered in {hq}. It operates "
        "in {sector} through three reporting segments: {segs}. The company reports "
        "in {currency}; fiscal years end on 31 December. Headcount at the end of FY{y2} "
        "was {headcount:,}, of whom {rnd_staff}% work in research, "
        "engineering and product roles. Its shares have been listed on the {exchange} "
        "since {listed}; the founding family and management hold "
        "{insiders:.1f}% of the shares and the free float is "
        "{free_float:.1f}%.",
        "{name}成立于{founded}年,总部位于{hq},主营{sector},设有三个报告分部:"
        "{segs}。公司以{currency}为记账本位币,财年截至每年12月31日。截至{y2}财年末,"
        "公司员工{headcount:,}人,其中研发及工程技术人员占比{rnd_staff}%。"
        "公司于{listed}年在{exchange}上市,实际控制人及管理层合计持股"
        "{insiders:.1f}%,流通股占比{free_float:.1f}%。",
    ),
    "history": (
        "Over FY{y0}-FY{y2} revenue moved from {rev0:,.1f} to {rev2:,.1f} "
        "million ({rev_change:+.1f}%). Management attributes the change "
        "to volume in {seg0_lower}, pricing in {seg1_lower}, and "
        "the ramp of new capacity commissioned in FY{y1}. The board's capital "
        "allocation framework targets net debt below {net_debt:.1f}x EBITDA, a "
        "dividend pay-out of {payout}% of net income, and capital expenditure "
        "of {capex_lo}-{capex_hi}% of revenue during the expansion "
        "phase.",
        "{y0}至{y2}财年,营业收入由{rev0:,.1f}百万元变为{rev2:,.1f}百万元"
        "({rev_change:+.1f}%)。管理层将变化归因于{seg0}销量"
        "变化、{seg1}价格调整,以及{y1}财年投产的新产能逐步释放。董事会的资本"
        "配置框架要求净负债/EBITDA低于{net_debt:.1f}倍,现金分红比例为净利润的"
        "{payout}%,扩张期资本开支占收入的{capex_lo}%至"
        "{capex_hi}%。",
    ),
    "h_segment_notes": (
        "### Segment notes",
        "### 分部说明",
    ),
    "segment_note": (
        "- {segment}: revenue {v0:,.1f} (FY{y0}), {v1:,.1f} (FY{y1}), "
        "{v2:,.1f} (FY{y2}) million; segment margin about "
        "{margin:.1f}% in FY{y2}; {customers} customers above "
        "10 million of annual revenue; order backlog {backlog:.2f}x of "
        "FY{y2} segment revenue.",
        "- {segment}:收入{v0:,.1f}({y0}财年)、{v1:,.1f}({y1}财年)、"
        "{v2:,.1f}({y2}财年)百万元;{y2}财年分部利润率约{margin:.1f}%;"
        "年收入过千万元的客户{customers}家;在手订单为{y2}财年分部收入的"
        "{backlog:.2f}倍。",
    ),
    "h_discussion": (
        "### Management discussion (extract)",
        "### 管理层讨论与分析(节选)",
    ),
    "discussion": (
        "Gross margin was {gm0:.1f}% in FY{y0} and "
        "{gm2:.1f}% in FY{y2}. Operating expenses grew "
        "{opex_change:+.1f}% over the period, with R&D "
        "at {rnd_share:.1f}% of revenue in FY{y2}. Operating cash flow "
        "was {cfo2:,.1f} million in FY{y2} against net income of {net2:,.1f} "
        "million; capital expenditure of {capex2:,.1f} million left free cash flow of "
        "{fcf2:,.1f} million. The effective tax rate was {tax:.1f}%.",
        "{y0}财年毛利率为{gm0:.1f}%,{y2}财年为"
        "{gm2:.1f}%。期间费用累计变动"
        "{opex_change:+.1f}%,{y2}财年研发费用占收入"
        "{rnd_share:.1f}%。{y2}财年经营活动现金流净额{cfo2:,.1f}百万元,"
        "净利润{net2:,.1f}百万元;资本开支{capex2:,.1f}百万元,自由现金流"
        "{fcf2:,.1f}百万元。实际所得税率{tax:.1f}%。",
    ),
    "h_risks": (
        "### Principal risks",
        "### 主要风险",
    ),
    "h_auditor": (
        "### Auditor",
        "### 审计意见",
    ),
    "auditor": (
        "The FY{y2} financial statements received an unqualified opinion. Key audit "
        "matters: revenue recognition on multi-element contracts, impairment testing of "
        "goodwill, and the valuation of inventories.",
        "{y2}财年财务报表获标准无保留意见。关键审计事项:多要素合同的收入确认、商誉减值测试、"
        "存货跌价准备的计提。",
    ),
    "closing": (
        "All figures are from the dossier; this is not investment advice.",
        "以上数字均来自公司资料,不构成投资建议。",
    ),
    "list_sep": (", ", "、"),
    "greeting_reply": (
        "Of course. I have the dossier of {name} ({ticker}); what would you like to know?",
        "好的。我这里有{name}({ticker})的公司资料,请问想了解哪些方面?",
    ),
}

#: ``variant="varied"``: a session's first line, one drawn per session, in the
#: language of its questions: (English, Chinese).
_OPENINGS: tuple[tuple[str, str], ...] = (
    (
        "Today is {date}, {time}. You are assisting {analyst} of the {desk} desk.",
        "今天是{date},{time}。你正在协助{desk}的{analyst}。",
    ),
    (
        "Session opened by {analyst} ({desk}) on {date} at {time}.",
        "{analyst}({desk})于{date} {time}开启本次会话。",
    ),
    (
        "Analyst: {analyst}. Desk: {desk}. Local time: {date} {time}.",
        "分析师:{analyst}。所属团队:{desk}。当地时间:{date} {time}。",
    ),
)

#: Who opens a varied session: (English, Chinese).
_ANALYSTS: tuple[tuple[str, str], ...] = (
    ("Alex Morgan", "王磊"),
    ("Priya Shah", "李静"),
    ("Daniel Kim", "张伟"),
    ("Sofia Rossi", "陈晨"),
    ("Tom Becker", "刘洋"),
    ("Hannah Lee", "赵敏"),
    ("Marcus Webb", "周婷"),
    ("Yuki Tanaka", "孙浩"),
)

#: Their desks: (English, Chinese).
_DESKS: tuple[tuple[str, str], ...] = (
    ("equity research", "股票研究部"),
    ("credit research", "信用研究部"),
    ("portfolio management", "投资组合管理部"),
    ("risk", "风险管理部"),
    ("ESG research", "ESG研究组"),
)

#: A greeting some varied sessions open with, before the first question; the
#: assistant's reply is ``text["greeting_reply"]``: (English, Chinese).
_GREETINGS: tuple[tuple[str, str], ...] = (
    ("Hi! I'd like to go through the filings of {name} today.", "你好!今天想看看{name}的财报。"),
    ("Hello, can you help me with {name}?", "你好,能帮我分析一下{name}吗?"),
    ("Good morning. {name} is on my list today.", "早上好,今天要研究{name}。"),
)

_FACTS: tuple[tuple[str, str], ...] = (
    (
        "Revenue went from {rev0:,.1f} million in FY{y0} to {rev2:,.1f} "
        "million in FY{y2} ({rev_change:+.1f}%).",
        "营业收入由{y0}财年的{rev0:,.1f}百万元变为{y2}财年的{rev2:,.1f}百万元"
        "({rev_change:+.1f}%)。",
    ),
    (
        "Gross margin = gross profit / revenue: {gm0:.1f}% (FY{y0}), {gm1:.1f}% "
        "(FY{y1}), {gm2:.1f}% (FY{y2}).",
        "毛利率=毛利/营业收入:{gm0:.1f}%({y0})、{gm1:.1f}%({y1})、{gm2:.1f}%({y2})。",
    ),
    (
        "Operating margin moved from {om0:.1f}% to {om2:.1f}%.",
        "营业利润率由{om0:.1f}%变为{om2:.1f}%。",
    ),
    (
        "Current ratio = current assets / current liabilities: {cr0:.2f}x, {cr1:.2f}x, {cr2:.2f}x.",
        "流动比率=流动资产/流动负债:{cr0:.2f}倍、{cr1:.2f}倍、{cr2:.2f}倍。",
    ),
    (
        "Debt-to-equity = total debt / equity: {de0:.2f}x, {de1:.2f}x, {de2:.2f}x.",
        "有息负债权益比=有息负债/股东权益:{de0:.2f}倍、{de1:.2f}倍、{de2:.2f}倍。",
    ),
    (
        "Operating cash flow was {cfo2:,.1f} million in FY{y2} against net income of "
        "{net2:,.1f} million; free cash flow = OCF - capex = {fcf2:,.1f} million "
        "(FY{y0}: {fcf0:,.1f}).",
        "{y2}财年经营活动现金流净额{cfo2:,.1f}百万元,净利润{net2:,.1f}百万元;"
        "自由现金流=经营现金流-资本开支={fcf2:,.1f}百万元({y0}财年:{fcf0:,.1f})。",
    ),
    (
        "The fastest-growing segment is {top}, up {top_growth:+.1f}% "
        "to {top_share:.1f}% of FY{y2} revenue.",
        "增长最快的分部是{top},增长{top_growth:+.1f}%,占{y2}财年收入的{top_share:.1f}%。",
    ),
    (
        "Capital expenditure went from {capex0:,.1f} to {capex2:,.1f} million, "
        "funded by operating cash flow and {debt_change:+,.1f} "
        "million of net long-term borrowing.",
        "资本开支由{capex0:,.1f}百万元增至{capex2:,.1f}百万元,资金来自经营现金流及"
        "{debt_change:+,.1f}百万元的长期借款净变动。",
    ),
)


@dataclass(frozen=True)
class Language:
    """One column of the tables above.

    Attributes:
        code: ``"en"`` or ``"zh"`` (``Company.lang``, ``ChatRequest.lang``).
        questions: what analysts ask, in workload order; ``{y0}``/``{y2}`` are years.
        labels: statement row labels and section headings by name.
        risks: principal-risk lines (``{p}`` percent, ``{d}`` debt, ``{y}`` year).
        text: dossier and answer templates by name.
        facts: the answer sentences, one per kind of question.
        openings: first lines of a varied session (``{date}``, ``{time}``,
            ``{analyst}``, ``{desk}``).
        analysts: names for ``{analyst}``.
        desks: names for ``{desk}``.
        greetings: a varied session's optional first user message (``{name}``).
    """

    code: str
    questions: tuple[str, ...]
    labels: Mapping[str, str]
    risks: tuple[str, ...]
    text: Mapping[str, str]
    facts: tuple[str, ...]
    openings: tuple[str, ...]
    analysts: tuple[str, ...]
    desks: tuple[str, ...]
    greetings: tuple[str, ...]


def _column(code: str, i: int) -> Language:
    return Language(
        code=code,
        questions=tuple(row[i] for row in _QUESTIONS),
        labels={name: row[i] for name, row in _LABELS.items()},
        risks=tuple(row[i] for row in _RISKS),
        text={name: row[i] for name, row in _TEXT.items()},
        facts=tuple(row[i] for row in _FACTS),
        openings=tuple(row[i] for row in _OPENINGS),
        analysts=tuple(row[i] for row in _ANALYSTS),
        desks=tuple(row[i] for row in _DESKS),
        greetings=tuple(row[i] for row in _GREETINGS),
    )


#: Every language a company files in or an analyst asks in.
LANGUAGES: dict[str, Language] = {"en": _column("en", 0), "zh": _column("zh", 1)}


def other(code: str) -> str:
    """The other language than ``code`` (an analyst asking about a foreign filing)."""
    return "zh" if code == "en" else "en"
