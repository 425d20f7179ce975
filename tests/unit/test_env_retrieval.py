"""`retrieval`: the built-in corpus, BM25 search, the episode, and a user docs dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.env_gateway.envs import corpus
from services.env_gateway.envs.answers import normalize_text
from services.env_gateway.envs.bm25 import BM25Index, tokenize
from services.env_gateway.envs.retrieval import RetrievalEnv, load_corpus


def search(query: str) -> str:
    return f'<tool_call>{{"name": "search", "arguments": {{"query": {json.dumps(query)}}}}}</tool_call>'


def answer(text: str) -> str:
    return f'<tool_call>{{"name": "answer", "arguments": {{"text": {json.dumps(text)}}}}}</tool_call>'


def test_builtin_corpus_is_consistent() -> None:
    docs = {d.id: d for d in corpus.DOCS}
    assert 20 <= len(docs) == len(corpus.DOCS) <= 50
    assert len({q.id for q in corpus.QUESTIONS}) == len(corpus.QUESTIONS) >= 20
    for q in corpus.QUESTIONS:
        assert q.answer in docs[q.doc_id].text, q  # the answer is written in its document


def test_bm25_finds_each_questions_document_in_the_top_three() -> None:
    built = load_corpus()
    misses = []
    for q in corpus.QUESTIONS:
        top = [built.docs[i].id for i, _ in built.index.search(q.question, 3)]
        if q.doc_id not in top:
            misses.append((q.id, top))
    assert not misses


def test_bm25_scoring_basics() -> None:
    index = BM25Index(["the cat sat", "a dog ran far away", "cat cat cat"])
    assert tokenize("The Cat, sat!") == ["cat", "sat"]
    hits = index.search("cat", 5)
    assert [i for i, _ in hits] == [2, 0] and hits[0][1] > hits[1][1] > 0
    assert index.search("zebra", 5) == [] and index.search("the", 5) == []


def test_search_then_answer_scores_one_with_normalised_strings() -> None:
    env = RetrievalEnv(load_corpus())
    reset = env.reset(0, {"top_k": 2})
    question = reset.observation[0].content.splitlines()[0].removeprefix("Question: ")
    q = next(q for q in corpus.QUESTIONS if q.question == question)
    step = env.step(search(question))
    (reply,) = step.observation
    assert reply.role == "tool" and reply.name == "search" and reply.content.startswith("[1] ")
    assert reply.content.count("(doc ") == 2 and f"(doc {q.doc_id})" in reply.content
    final = env.step(answer(f"  The {q.answer.upper()}! "))
    assert final.done and final.reward == 1.0
    assert final.answer == final.reference == normalize_text(q.answer)
    assert final.info == {"turns": 2, "searches": 1, "correct": True, "out_of_turns": False}


def test_plain_text_is_the_answer_and_wrong_scores_zero() -> None:
    env = RetrievalEnv(load_corpus())
    env.reset(1, {})
    final = env.step("Atlantis")
    assert final.done and final.reward == 0.0 and final.answer == "atlantis"


def test_no_match_bad_call_and_running_out() -> None:
    env = RetrievalEnv(load_corpus())
    env.reset(2, {"max_turns": 3})
    assert env.step(search("zzzz qqqq")).observation[0].content == "no documents match 'zzzz qqqq'"
    bad = env.step('<tool_call>{"name": "search", "arguments": {"query": ""}}</tool_call>')
    assert "has 0 characters; at least 1 needed" in bad.observation[0].content and not bad.done
    last = env.step(search("Ostry"))
    assert last.done and last.reward == 0.0 and last.info["out_of_turns"]


def test_docs_dir_overrides_the_builtin_set(tmp_path: Path) -> None:
    (tmp_path / "moon.md").write_text("# The Moon\nThe Moon's dust is called regolith.\n")
    (tmp_path / "sun.txt").write_text("The Sun\nThe Sun is a G-type star.\n")
    (tmp_path / "notes.json").write_text("ignored")
    (tmp_path / "questions.jsonl").write_text(json.dumps({"question": "What is moon dust called?",
                                                          "answer": "regolith"}) + "\n\n")
    built = load_corpus(str(tmp_path))
    assert [d.id for d in built.docs] == ["moon", "sun"] and built.docs[0].title == "The Moon"
    env = RetrievalEnv(built)
    assert env.reset(0, {}).observation[0].content.startswith("Question: What is moon dust called?")
    assert "regolith" in env.step(search("moon dust")).observation[0].content
    assert env.step("Regolith.").reward == 1.0


@pytest.mark.parametrize(("files", "fragment"), [
    ({"a.md": "A\ntext"}, "questions.jsonl is missing"),
    ({"a.md": "A\ntext", "questions.jsonl": "{\"question\": \"q\"}"}, "questions.jsonl:1"),
    ({"questions.jsonl": "{\"question\": \"q\", \"answer\": \"a\"}"}, "needs documents and questions"),
])
def test_unusable_docs_dir_says_why(tmp_path: Path, files: dict[str, str], fragment: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))


def test_bad_config_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"retrieval config: top_k must be in \[1, 20\]"):
        RetrievalEnv(load_corpus()).reset(0, {"top_k": 50})


def test_held_out_split_never_asks_a_training_question() -> None:
    from services.env_gateway.envs.retrieval import RetrievalEnv, load_corpus

    corpus = load_corpus()
    env = RetrievalEnv(corpus)
    asked = {split: {env.reset(s, {"split": split}).task_id for s in range(300)} for split in ("train", "eval")}
    assert asked["train"].isdisjoint(asked["eval"]) and asked["eval"]
    assert len(asked["train"]) + len(asked["eval"]) == len(corpus.questions)
