"""Result files that survive crashes: whole synced lines, torn tails found, atomic replacement."""

from __future__ import annotations

import json

import pytest

from executor.offline.durable_io import (
    CorruptLineError,
    LineAppender,
    OutputWriteError,
    atomic_write_text,
    drop_torn_tail,
    read_jsonl,
)


def test_appended_lines_read_back_in_order(tmp_path):
    appender = LineAppender(tmp_path / "o.jsonl", sync=True)
    appender.append({"id": "a", "text": "café"})
    appender.append({"id": "b"})
    appender.close()
    contents = read_jsonl(tmp_path / "o.jsonl")
    assert contents.lines == [{"id": "a", "text": "café"}, {"id": "b"}] and contents.torn_tail == b""


@pytest.mark.parametrize("tail", [b'{"id": "c", "te', b'{"id": "c"}', b"\xff\xfe", b'{"id": "c", "te\n'])
def test_a_cut_or_unparsable_last_line_is_a_torn_tail_and_can_be_dropped(tmp_path, tail):
    path = tmp_path / "o.jsonl"
    whole = b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(whole + tail)
    contents = read_jsonl(path)
    assert [line["id"] for line in contents.lines] == ["a", "b"]
    assert contents.torn_tail == tail and contents.good_size == len(whole)
    drop_torn_tail(path, contents)
    assert path.read_bytes() == whole


def test_a_bad_line_before_the_last_is_corruption_not_a_crash(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_bytes(b'{"id": "a"}\nnot json\n{"id": "c"}\n')
    with pytest.raises(CorruptLineError, match="o.jsonl:2"):
        read_jsonl(path)


def test_a_missing_file_reads_as_empty(tmp_path):
    contents = read_jsonl(tmp_path / "absent.jsonl")
    assert contents.lines == [] and contents.torn_tail == b""


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    atomic_write_text(path, json.dumps({"new": True}))
    assert json.loads(path.read_text()) == {"new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failed_atomic_write_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    (tmp_path / ".summary.json.tmp").mkdir()  # the temporary cannot be opened
    with pytest.raises(OutputWriteError, match="cannot write .*summary.json"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"


def test_an_appender_that_cannot_open_its_file_names_it(tmp_path):
    with pytest.raises(OutputWriteError, match="cannot write .*missing/o.jsonl"):
        LineAppender(tmp_path / "missing" / "o.jsonl", sync=False)
