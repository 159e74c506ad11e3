"""Text-classification input files (`--dataset text_classification`, mixprec/data/tokenized.py): a bad
`--train_file` (or `--dataset_name` folder) is one line on stderr starting `error: `, exit code 2, nothing written
(not even the run folder); odd but valid shapes (a BOM, CRLF or CR line ends, blank lines, a text 'NA', brackets
in the name, a JSON list) build. A table of cases through recipes/train.py's main, and files drawn by Hypothesis
(byte-level damage, ragged rows, odd label values) whose data is built without training; a refused draw is run
through main as well, for the one line and the empty folder. The tiny BERT is tests/test_hf_models.py's."""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from helpers import assert_one_line_error, run_in_process, snapshot
from test_hf_models import classify, offline, parsed, tiny  # noqa: F401 (fixtures)

ROWS = "".join(f"the report {i},{i % 2}\n" for i in range(10))  # labels 0, 1, 0, 1, ...
FOLDER, FIFO = object(), object()  # what --train_file is, where it is not a file


def jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def pairs(n: int = 10, **changed) -> list[dict]:
    """n JSON rows {'text', 'label': i % 2}, row i replaced by changed['r<i>'] where given."""
    return [changed.get(f"r{i}", {"text": f"the report {i}", "label": i % 2}) for i in range(n)]


# name: (file name, content, words of the one line)
BAD = {
    "label beyond int64": ("data.csv", "text,label\n" + ROWS + "x,99999999999999999999\n",
                           ["99999999999999999999 on line 12", "number the classes 0..2"]),
    "a row with a field more": ("data.csv", "text,label\n" + ROWS + "x,1,3\n",
                                ["line 12 has 3 fields, the header 2", "quote a field"]),
    "a row with a field less": ("data.csv", "text,label\n" + ROWS + "x\n", ["line 12 has 1 field, the header 2"]),
    "an unclosed quote": ("data.csv", "text,label\n" + ROWS + '"x,1\ny,0\n', ["1 field", "close every quote"]),
    "only a header": ("data.csv", "text,label\n\n", ["has a header but no rows"]),
    "an empty file": ("data.csv", "", ["is empty", "header line"]),
    "only blank lines": ("data.jsonl", "\n  \n", ["is empty", "one JSON object per line"]),
    "not UTF-8": ("data.csv", "text,label\n".encode() + "café,0\n".encode("latin-1") + ROWS.encode(),
                  ["line 2 is not UTF-8", "0xe9", "save the file as UTF-8"]),
    "a UTF-16 file": ("data.csv", ("text,label\n" + ROWS).encode("utf-16"), ["line 1 is not UTF-8"]),
    "a column named twice": ("data.csv", "text,label,label\n" + ROWS.replace("\n", ",0\n"),
                             ["names the column 'label' more than once"]),
    "no text column": ("data.csv", "sentence_a,label\n" + ROWS, ["has no 'text' column", "sentence_a, label"]),
    "an empty text": ("data.csv", "text,label\n" + ROWS + ",1\n", ["column 'text' is empty on line 12 (1 of 11"]),
    "a JSON line that is not JSON": ("data.jsonl", jsonl(pairs()) + "{oops\n", ["line 11 is not JSON"]),
    "a JSON row that is not an object": ("data.jsonl", jsonl(pairs()) + "[1, 2]\n",
                                         ["line 11 is not a JSON object", "[1, 2]"]),
    "a JSON list item that is not an object": ("data.json", json.dumps(pairs() + ["x"]), ["item 11 of its list"]),
    "a JSON column of two kinds": ("data.jsonl", jsonl(pairs(r3={"text": "x", "label": 1, "id": "a"},
                                                            r4={"text": "y", "label": 0, "id": 7})),
                                   ["column 'id' holds text (line 4) and numbers (line 5)", "one kind of value"]),
    "a JSON text that is a list": ("data.jsonl", jsonl(pairs(r2={"text": ["a", "b"], "label": 0})),
                                   ["the text [\"a\", \"b\"] on line 3 is a list", "give text"]),
    "a JSON text that is a number": ("data.jsonl", jsonl(pairs(r0={"text": 3, "label": 0})),
                                     ["the text 3 on line 1 is a number"]),
    "one word among class numbers": ("data.csv", "text,label\n" + ROWS + "x,pos\n",
                                     ["column 'label' holds words", "'pos'", "line 12", "and class numbers (0 on "
                                      "line 2)", "give one kind"]),
    "a quoted number in JSON": ("data.jsonl", jsonl(pairs(r4={"text": "x", "label": "1"})),
                                ["holds words", "'1'", "and class numbers"]),
    "a null label": ("data.jsonl", jsonl(pairs(r3={"text": "x", "label": None})),
                     ["column 'label' is empty on line 4 (1 of 10 rows)"]),
    "a row without a label": ("data.jsonl", jsonl(pairs(r5={"text": "x"})), ["column 'label' is empty on line 6"]),
    "an empty label field": ("data.csv", "text,label\n" + ROWS + "x,\n", ["column 'label' is empty on line 12"]),
    "a label column all empty": ("data.csv", "text,label\n" + "a,\nb,\n" * 5,
                                 ["column 'label' is empty on line 2 (10 of 10 rows)"]),
    "a negative label": ("data.csv", "text,label\n" + ROWS + "x,-1\n", ["label -1 (on line 12)", "start at 0"]),
    "a decimal label": ("data.csv", "text,label\n" + ROWS.replace(",1\n", ",0.5\n"),
                        ["label 0.5 on line 3", "regression is not supported"]),
    "a JSON 1.0": ("data.jsonl", jsonl(pairs(r1={"text": "x", "label": 1.0})),
                   ["label 1.0 on line 2", "regression is not supported"]),
    "a boolean label": ("data.csv", "text,label\n" + "a,true\nb,false\n" * 5, ["label true on line 2 is a boolean"]),
    "a JSON boolean": ("data.jsonl", jsonl(pairs(r0={"text": "x", "label": False})), ["label false on line 1"]),
    "one class": ("data.csv", "text,label\n" + "a b,1\n" * 10,
                  ["every training row has the label 1", "two or more classes"]),
    "the other class only at the end": ("data.csv", "text,label\n" + "a,0\n" * 8 + "b,1\n" * 2,
                                        ["every training row has the label 0", "shuffle the file"]),
    "classes far apart": ("data.csv", "text,label\n" + "a,0\nb,1000000\nc,2000000\n" * 4,
                          ["3 classes numbered up to 2000000 (0, 1000000, 2000000", "2,000,001 outputs",
                           "number the classes 0..2"]),
    "a folder": ("data.csv", FOLDER, ["is a folder", "--dataset_name FOLDER"]),
    "a named pipe": ("data.csv", FIFO, ["is a named pipe (FIFO), not a file or a folder", "regular file"]),
    "a text file": ("data.txt", ROWS, ["must be .csv, .json or .jsonl"]),
}


def write(folder: Path, name: str, content) -> Path:
    path = folder / name
    if content is FOLDER:
        path.mkdir()
    elif content is FIFO:
        os.mkfifo(path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def refused_in_one_line(tiny, path: Path, capsys, *words) -> str:
    """recipes/train.py's main on `path`: exit 2, one line naming the file, nothing written next to it."""
    before = snapshot(path.parent)
    out = path.parent / "run"
    run = run_in_process([*classify(tiny, path), "--max_steps", 1, "--batch_size", 4, "--eval_steps", 1,
                          "--sample_tokens", 0, "--output_dir", out], capsys)
    line = assert_one_line_error(run, f"--train_file '{path}'", *words)
    assert snapshot(path.parent) == before and not out.exists()
    return line


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_file_is_one_line_and_writes_nothing(name, tiny, offline, tmp_path, capsys):
    file, content, words = BAD[name]
    refused_in_one_line(tiny, write(tmp_path, file, content), capsys, *words)


AFTER_THE_FIRST = ROWS[ROWS.index("\n") + 1:]
GOOD = {  # name: (file name, content); each holds the rows of ROWS, labels 0, 1, 0, 1, ...
    "a BOM and CRLF line ends": ("data.csv", "\ufefftext,label\r\n" + ROWS.replace("\n", "\r\n")),
    "CR line ends": ("data.csv", ("text,label\n" + ROWS).replace("\n", "\r")),
    "blank lines": ("data.csv", "\ntext,label\n\n" + ROWS.replace("\n", "\n  \n")),
    "texts NA and None": ("data.csv", "text,label\n" + "NA,0\nNone,1\n" * 5),
    "brackets in the name": ("data[1]*.csv", "text,label\n" + ROWS),
    "a text beyond csv's field limit": ("data.csv", "text,label\n" + "word " * 30000 + ",0\n" + AFTER_THE_FIRST),
    "a comma, a quote and a newline in a text": ("data.csv", 'text,label\n"a, ""b""\nc",0\n' + AFTER_THE_FIRST),
    "spaces and a sign around a label": ("data.csv", "text,label\n" + ROWS.replace(",1\n", ", +1 \n")),
    "a pandas index column": ("data.csv", ",text,label\n" + "".join(f"{i},{row}\n"
                                                                     for i, row in enumerate(ROWS.splitlines()))),
    "a JSON list": ("data.json", json.dumps(pairs(), indent=1)),
    "JSON lines with a BOM, a blank line and another key": (
        "data.jsonl", "\ufeff" + jsonl(pairs(r3={"text": "x", "label": 1, "id": "a"},
                                             r4={"text": "y", "label": 0, "id": None})) + "\n"),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_odd_but_valid_files_build(name, tiny, offline, tmp_path):
    from mixprec import data

    path = write(tmp_path, *GOOD[name])
    before = snapshot(tmp_path)
    bundle = data.build(parsed([*classify(tiny, path), "--output_dir", tmp_path / "run"]))
    labels = [int(y) for part in (bundle.train, bundle.validation) for y in part["labels"]]
    assert labels == [i % 2 for i in range(10)]
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("checkpoint, labels, words", [
    (1, [0, 1] * 5, 2),  # transformers' regression head in the checkpoint: replaced by the data's 2 classes
    (2000001, [0, 1000000, 2000000] * 4, ["3 classes numbered up to 2000000", "number the classes 0..2"]),
    (2, [0, 9] * 5, 10),  # a few class numbers unused (8 of 10): allowed, the head takes 10 outputs
    (3, [0, 1] * 5, 3),  # a checkpoint's head larger than the data's classes is kept (its classes are numbers)
    (11, [0, 10] * 5, ["2 classes numbered up to 10 (0, 10; 10 on line 3)", "11 outputs"]),  # 9 unused: refused
])
def test_the_class_numbers_against_the_checkpoints_head(checkpoint, labels, words, tiny, offline, tmp_path):
    """num_labels as a model's config.json gives it (hf_flags.apply): the head takes the data's classes (the
    highest number + 1), or the checkpoint's size where that is larger; class numbers far apart are refused
    whatever the head's size, but a few unused numbers are not."""
    from mixprec import data
    from mixprec.errors import UsageError

    path = write(tmp_path, "data.csv", "text,label\n" + "".join(f"row {i},{y}\n" for i, y in enumerate(labels)))
    cfg = parsed([*classify(tiny, path), "--output_dir", tmp_path / "run"])
    cfg.dataset_args["num_labels"] = checkpoint
    if isinstance(words, int):
        assert data.build(cfg).info["num_classes"] == words
        return
    with pytest.raises(UsageError) as refused:
        data.build(cfg)
    assert all(word in str(refused.value) for word in words), str(refused.value)


@pytest.mark.parametrize("labels, words", [
    (["pos", "neg"] * 5 + ["pos", "neutral"], ["--dataset_name", "the label 'neutral' (row 2 of the validation rows, "
                                               "the dataset's validation split)", "training rows' labels ('neg', 'pos')"]),
    ([0.5, 1.0] * 6, ["--dataset_name", "neither class numbers nor class names (float64)", "regression"]),
    ([1] * 12, ["--dataset_name", "every training row has the label 1"]),
    ([0, 1000000, 2000000] * 4, ["--dataset_name", "3 classes numbered up to 2000000",
                                 "2000000 on row 3 of its train split"]),
    ([0, 1] * 5 + [-1, 0], ["--dataset_name", "label -1 (on row 1 of its validation split)"]),
])
def test_a_dataset_folder_is_checked_as_a_file_is(labels, words, tiny, offline, tmp_path, capsys):
    """--dataset_name FOLDER (load_dataset's path, with the folder's own validation split): the labels' type and
    classes are refused in one line as for --train_file."""
    folder = tmp_path / "mrpc"
    folder.mkdir()
    for name, part in (("train", labels[:10]), ("validation", labels[10:])):
        (folder / f"{name}.csv").write_text("text,label\n" + "".join(f"row {i},{y}\n" for i, y in enumerate(part)))
    before = snapshot(tmp_path)
    args = ["--model_name_or_path", tiny["bert"]["model"], "--dataset", "text_classification", "--dataset_name",
            folder, "--block_size", 16, "--output_dir", tmp_path / "run"]
    assert_one_line_error(run_in_process(args, capsys), *words)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


# Hypothesis: a valid file (CSV or JSON lines), damaged. An `expect` of True or False is the outcome the damage
# must have; None (bytes damaged) says only: built, or refused in one line.
TEXTS = ["the report", "urgent", "a, b", 'say "hi"', "two\nlines", "NA", "café", "\t", "1"]
CSV_LABELS = ["0", "1", " 0 ", "+1", "", " ", "-1", "2", "99999999999999999999", "0.5", "1.0", "1e3", "nan", "true",
              "False", "pos", "NA", "١", "0x1", "1_0", "[1]"]
CSV_VALID = {"0": 0, "1": 1, " 0 ": 0, "+1": 1, "2": 2}  # 2: a third class (the head takes 3 outputs)
JSON_LABELS = [0, 1, None, -1, 2, 99999999999999999999, 0.5, 1.0, True, "pos", "1", [1], {"a": 1}]
JSON_TEXTS = ["x", "", 3, 1.5, None, ["a"], {"a": "b"}, True]
DAMAGES = st.sampled_from([0, 0, 1, 1, 2])  # how many rows a draw damages
QUICK, SLOW = 40, 400  # examples (measured: 150 in 5 s)


def one_class(labels: list[int]) -> bool:
    """The training rows (all but the last 20%, tokenized.tail_split) hold one class."""
    cut = len(labels) - max(1, round(len(labels) * 0.2))
    return len(set(labels[:cut])) < 2


def damage_bytes(draw, content: bytes) -> bytes:
    at = draw(st.integers(0, len(content)))
    how = draw(st.sampled_from(["insert", "delete", "truncate", "nul", "invalid utf-8"]))
    if how == "insert":
        return content[:at] + draw(st.binary(min_size=1, max_size=3)) + content[at:]
    if how == "delete":
        return content[:at] + content[at + draw(st.integers(1, 4)):]
    return content[:at] + {"truncate": b"", "nul": b"\0", "invalid utf-8": b"\xff"}[how] + (
        b"" if how == "truncate" else content[at:])


@st.composite
def csv_files(draw):
    n = draw(st.integers(5, 12))
    rows = [[f"{draw(st.sampled_from(TEXTS))} {i}", str(i % 2)] for i in range(n)]
    expect = True
    for _ in range(draw(DAMAGES)):
        i = draw(st.integers(0, n - 1))
        if draw(st.booleans()):
            rows[i][1] = draw(st.sampled_from(CSV_LABELS))
        else:
            rows[i] = rows[i] + ["extra"] if draw(st.booleans()) else rows[i][:1]
            expect = False
    if expect:
        valid = [CSV_VALID.get(label) for _, label in rows]
        expect = None not in valid and not one_class(valid)
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator=draw(st.sampled_from(["\n", "\r\n"]))).writerows([["text", "label"], *rows])
    content = draw(st.sampled_from([b"", b"\xef\xbb\xbf"])) + buffer.getvalue().encode()
    if draw(st.integers(0, 3)) == 0:
        content, expect = damage_bytes(draw, content), None
    return "data.csv", content, expect


@st.composite
def jsonl_files(draw):
    n = draw(st.integers(5, 12))
    rows = pairs(n)
    for _ in range(draw(DAMAGES)):
        i = draw(st.integers(0, n - 1))
        field = draw(st.sampled_from(["label", "text", "drop"]))
        if field == "drop":
            dropped = draw(st.sampled_from(["text", "label"]))
            rows[i] = {k: v for k, v in rows[i].items() if k != dropped}
        else:
            rows[i] = {**rows[i], field: draw(st.sampled_from(JSON_LABELS if field == "label" else JSON_TEXTS))}
    valid = [row.get("label") if type(row.get("label")) is int and row["label"] in (0, 1, 2) else None for row in rows]
    expect = None not in valid and not one_class(valid) and all(isinstance(row.get("text"), str) for row in rows)
    lines = [json.dumps(row) for row in rows]
    if draw(st.integers(0, 4)) == 0:  # a line that is not JSON, or not an object
        lines[draw(st.integers(0, n - 1))] = draw(st.sampled_from(["{oops", "[1, 2]", "3", '"text"', "null"]))
        expect = False
    content = ("\n".join(lines) + "\n").encode()
    if draw(st.integers(0, 3)) == 0:
        content, expect = damage_bytes(draw, content), None
    return "data.jsonl", content, expect


def built_or_refused(tiny, capsys, folder: Path, drawn) -> None:
    """The property: the data of the drawn file builds (exactly when `expect` is True), or its refusal is one line
    through main, exit 2, nothing written. Never another exception."""
    from mixprec import data
    from mixprec.errors import UsageError

    name, content, expect = drawn
    path = write(Path(tempfile.mkdtemp(dir=folder)), name, content)
    before = snapshot(path.parent)
    try:
        bundle = data.build(parsed([*classify(tiny, path), "--output_dir", path.parent / "run"]))
    except UsageError as err:
        assert expect is not True, (err, content[:300])
        refused_in_one_line(tiny, path, capsys)
        return
    assert expect is not False, content[:300]
    assert len(bundle.train) + len(bundle.validation) >= 1
    assert snapshot(path.parent) == before and not (path.parent / "run").exists()


def drawn_files(examples: int):
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.generate])  # no shrinking: each try builds data


@drawn_files(QUICK)
@given(drawn=st.one_of(csv_files(), jsonl_files()))
def test_a_drawn_file_builds_or_is_refused_in_one_line(drawn, tiny, offline, tmp_path, capsys):
    built_or_refused(tiny, capsys, tmp_path, drawn)


@pytest.mark.slow
@drawn_files(SLOW)
@given(drawn=st.one_of(csv_files(), jsonl_files()))
def test_many_drawn_files_build_or_are_refused_in_one_line(drawn, tiny, offline, tmp_path, capsys):
    built_or_refused(tiny, capsys, tmp_path, drawn)
