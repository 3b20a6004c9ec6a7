"""Calibration data: documents, JSONL prompts and chat conversations become deterministic token rows."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf.calibration.data import calibration_batches, read_calibration_files, token_batches


class CharTokenizer:
    """One id per character, EOS = 0, and a toy chat template."""

    eos_token_id = 0
    chat_template = "toy"

    def __call__(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return {"input_ids": [1 + ord(ch) % 100 for ch in text]}

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_text_files_are_documents_and_gutenberg_boilerplate_is_stripped(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("licence\r\n*** START OF THE BOOK ***\r\nCall me Ishmael.\r\n*** END OF THE BOOK ***\r\nlicence")
    plain = tmp_path / "plain.txt"
    plain.write_text("just text")
    texts = read_calibration_files([book, plain])
    assert texts.documents == ["Call me Ishmael.", "just text"] and texts.prompts == []


def test_jsonl_prompts_plain_and_with_the_chat_template(tmp_path):
    data = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question": "2+2?"},
            {"problem": "x=1?"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        ],
    )
    plain = read_calibration_files([data], CharTokenizer())
    assert plain.prompts == ["2+2?", "x=1?", "<user>hi</user><assistant>hello</assistant>"]
    chat = read_calibration_files([data], CharTokenizer(), chat=True)
    assert chat.prompts[0] == "<user>2+2?</user>"


def test_bad_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibration file not found"):
        read_calibration_files([tmp_path / "missing.txt"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2 is not valid JSON"):
        read_calibration_files([broken])
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"answer": "4"}])
    with pytest.raises(ValueError, match="none of the fields"):
        read_calibration_files([odd])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="chat template"):
        read_calibration_files([chat])


def test_prompts_are_separate_rows_and_the_budget_is_exact(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"text": "a" * n} for n in (5, 7, 9, 11)])
    texts = read_calibration_files([data])
    rows = calibration_batches(CharTokenizer(), texts, budget=20, seq_len=8, seed=1)
    assert sum(r.numel() for r in rows) == 20 and all(r.shape[1] <= 8 for r in rows)
    assert all(r.dtype == torch.long for r in rows)
    again = calibration_batches(CharTokenizer(), texts, budget=20, seq_len=8, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(rows, again))
    other = calibration_batches(CharTokenizer(), texts, budget=20, seq_len=8, seed=2)
    assert any(not torch.equal(a, b) for a, b in zip(rows, other))


def test_documents_are_joined_with_eos_and_windowed():
    whole = token_batches(CharTokenizer(), ["a" * 50, "b" * 40, "c" * 30], budget=10_000, seq_len=200)
    stream = whole[0][0].tolist()
    assert len(whole) == 1 and len(stream) == 122 and stream.count(0) == 2  # EOS between texts only
    rows = token_batches(CharTokenizer(), ["a" * 50, "b" * 40, "c" * 30], budget=45, seq_len=20, seed=3)
    assert sum(r.numel() for r in rows) == 45


def test_short_data_warns_and_returns_what_there_is(caplog):
    rows = token_batches(CharTokenizer(), ["abc"], budget=100, seq_len=8)
    assert sum(r.numel() for r in rows) == 3
    assert "only 3 of the 100" in caplog.text
