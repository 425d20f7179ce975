"""`retrieval`: answer a question from a local document set with `search(query)` (BM25) and
`answer(text)`. Built-in documents describe an invented archipelago (see `corpus`), so the
answers are not in any model's pretraining; `env_gateway.retrieval_docs_dir` swaps in your own.

A docs dir holds `*.txt`/`*.md` files (one document each: the first line is the title) and
`questions.jsonl`, one `{"question": ..., "answer": ...}` object per line.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arlo.jsonfields import loads_bounded
from arlo.regular_files import read_regular_text
from services.env_gateway.envs import corpus as builtin
from services.env_gateway.envs.answers import normalize_text
from services.env_gateway.envs.base import Message, ResetResult, check_range, describe_config, parse_config
from services.env_gateway.envs.bm25 import BM25Index
from services.env_gateway.envs.corpus import Doc, Question
from services.env_gateway.envs.tool_env import Played, ToolEnv
from services.env_gateway.tool_calls import ParsedTurn, ToolCall
from services.env_gateway.tool_schema import function_tool, tools_json

NAME = "retrieval"
MAX_TURNS = 32
MAX_DOCS = 100_000
MAX_DOC_BYTES = 1 << 20
TOOLS = (
    function_tool("search", "Search the documents; returns the best matches with their text.",
                  {"query": {"type": "string", "minLength": 1, "maxLength": 500}}),
    function_tool("answer", "Give the final answer (a short phrase) and end the episode.",
                  {"text": {"type": "string", "maxLength": 1000}}),
)


SPLITS = ("all", "train", "eval")
EVAL_SHARE = 4
"""About one question in EVAL_SHARE (by a hash of its id) belongs to the "eval" split."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RetrievalConfig:
    top_k: int = 3
    """Documents returned per search."""
    max_turns: int = 6
    max_doc_chars: int = 600
    """Each result's text is cut to this many characters."""
    split: str = "all"
    """"train" or "eval": ask only questions of that part of a fixed partition by question id."""

    def validate(self) -> None:
        check_range("top_k", self.top_k, 1, 20)
        check_range("max_turns", self.max_turns, 1, MAX_TURNS)
        check_range("max_doc_chars", self.max_doc_chars, 50, 100_000)
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {self.split!r}")


DESCRIPTION = ("Answer a question about a local document set using search(query) and answer(text); plain "
               f"text also counts as the answer. Config: {describe_config(RetrievalConfig)}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    docs: tuple[Doc, ...]
    questions: tuple[Question, ...]
    index: BM25Index
    splits: Mapping[str, tuple[Question, ...]]
    """"all", "train" and "eval" questions."""


def held_out(question: Question) -> bool:
    """Stable by id: adding questions to a docs dir moves none between the parts."""
    return zlib.crc32(question.id.encode()) % EVAL_SHARE == 0


def make_corpus(docs: tuple[Doc, ...], questions: tuple[Question, ...]) -> Corpus:
    if not docs or not questions:
        raise ValueError(f"a corpus needs documents and questions; got {len(docs)} and {len(questions)}")
    splits = {"all": questions, "train": tuple(q for q in questions if not held_out(q)),
              "eval": tuple(q for q in questions if held_out(q))}
    return Corpus(docs=docs, questions=questions, index=BM25Index([f"{d.title}\n{d.text}" for d in docs]),
                  splits=splits)


def load_corpus(docs_dir: str = "") -> Corpus:
    """The built-in corpus, or the one in `docs_dir`; ValueError (naming the file) when it is unusable."""
    if not docs_dir:
        return make_corpus(builtin.DOCS, builtin.QUESTIONS)
    root = Path(docs_dir)
    if not root.is_dir():
        raise ValueError(f"retrieval docs dir {root} does not exist")
    files = sorted(p for p in root.iterdir() if p.suffix in (".txt", ".md") and p.is_file())[:MAX_DOCS + 1]
    if len(files) > MAX_DOCS:
        raise ValueError(f"{root} has more than {MAX_DOCS} documents")
    docs = tuple(_read_doc(p) for p in files)
    return make_corpus(docs, _read_questions(root / "questions.jsonl"))


def _read_doc(path: Path) -> Doc:
    # A regular file only (a pipe swapped in after the listing would hang the gateway's start).
    content = read_regular_text(path, errors="replace", max_bytes=MAX_DOC_BYTES)
    title, _, text = content.strip().partition("\n")
    return Doc(id=path.stem, title=title.lstrip("# ").strip(), text=" ".join(text.split()))


def _read_questions(path: Path) -> tuple[Question, ...]:
    if not path.exists():  # a pipe or a device there is refused by read_regular_text, saying so
        raise ValueError(f"{path} is missing: write one {{\"question\": ..., \"answer\": ...}} object per line")
    out = []
    for n, line in enumerate(read_regular_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = loads_bounded(line)
            out.append(Question(id=str(item.get("id", f"q{n}")), question=str(item["question"]),
                                answer=str(item["answer"]), doc_id=str(item.get("doc", ""))))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: expected {{\"question\": ..., \"answer\": ...}}: {e}") from None
    return tuple(out)


class RetrievalEnv(ToolEnv):
    TOOLS = TOOLS

    def __init__(self, corpus: Corpus, *, tool_format: str = "auto") -> None:
        super().__init__(tool_format=tool_format)
        self._corpus = corpus
        self._cfg = RetrievalConfig()
        self._question: Question | None = None
        self._searches = 0

    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        self._cfg = parse_config(RetrievalConfig, config, NAME)
        questions = self._corpus.splits[self._cfg.split]
        if not questions:
            raise ValueError(f"split {self._cfg.split!r} holds no questions ({len(self._corpus.questions)} in all): "
                             "add questions to the docs dir, or use split 'all'")
        self._question = q = random.Random(seed).choice(questions)
        self._start(self._cfg.max_turns)
        self._searches = 0
        prompt = (f"Question: {q.question}\nUse the search tool to find the answer in the documents, then call "
                  "answer with a short phrase.")
        return ResetResult(observation=[Message(role="user", content=prompt)], task_id=f"{NAME}-{q.id}",
                           tools_json=tools_json(TOOLS))

    def _plain(self, parsed: ParsedTurn, action: str) -> Played:
        if parsed.text:
            return [], parsed.text
        return [Message(role="user", content="Search the documents or give your answer.")], None

    def _answer_call(self, call: ToolCall) -> str:
        return str(call.arguments["text"])

    def _call(self, call: ToolCall) -> Message:  # search(query)
        self._searches += 1
        query = call.arguments["query"]
        hits = self._corpus.index.search(query, self._cfg.top_k)
        if not hits:
            return Message(role="tool", name="search", content=f"no documents match {query!r}")
        limit = self._cfg.max_doc_chars
        parts = [f"[{rank}] {d.title} (doc {d.id})\n{d.text[:limit]}"
                 for rank, d in enumerate((self._corpus.docs[i] for i, _ in hits), start=1)]
        return Message(role="tool", name="search", content="\n\n".join(parts))

    def _judge(self, answer: str) -> tuple[str, str, bool]:
        assert self._question is not None
        # Both sides normalised the same way, so the reward service's exact_match agrees with ours.
        answer, reference = normalize_text(answer), normalize_text(self._question.answer)
        return answer, reference, bool(answer) and answer == reference

    def _info(self) -> dict[str, Any]:
        return {"turns": self._turns, "searches": self._searches}
