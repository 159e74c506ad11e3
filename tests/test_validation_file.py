"""--validation_file for the table, text and image sources, and the banner's line saying where every source's
validation comes from.

With --validation_file, validation is that file's rows (read with --train_file's checks, every error naming
--validation_file) and training is every row of --train_file; without it, a share as before. Built through the
data layer (`data.build`), which is what the recipe calls; the recipe itself for the exit code, the run folder
that is not made, and the resume contract (slow)."""
import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import assert_one_line_error, run_in_process, snapshot
from mixprec import config, data
from mixprec.errors import UsageError
from mixprec.training import prepared

SOURCE = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()  # < 1,000 lines: one map batch
TABLE = "f0,f1,label\n"


def build(*argv):
    return data.build(config.parse_config(list(map(str, argv))))


def fill(text: str, files: dict) -> str:
    """'{val.csv}' -> the files fixture's path of val.csv."""
    for name, path in files.items():
        text = text.replace("{" + str(name) + "}", str(path))
    return text


def images(root: Path, classes, n: int, size: int = 28, mode: str = "RGB", seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for cls in classes:
        (root / cls).mkdir(parents=True)
        for i in range(n):
            shape = (size, size, 3) if mode == "RGB" else (size, size)
            Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Training and validation data of each source, and validation files that disagree with training."""
    root = tmp_path_factory.mktemp("validation")
    out = {"root": root}
    for name, text in {
        "train.csv": TABLE + "".join(f"{i},{-i},{i % 3}\n" for i in range(40)),
        "val.csv": "f1,f0,label\n" + "".join(f"{-i},{100 + i},{i % 3}\n" for i in range(7)),  # columns in another order
        "val.jsonl": "".join(json.dumps({"f0": 200 + i, "f1": i, "label": i % 2}) + "\n" for i in range(5)),
        "train.txt": SOURCE, "val.txt": SOURCE[:3000],
    }.items():
        out[name] = root / name
        out[name].write_text(text)
    out["images"] = images(root / "images", ["ants", "cats", "dogs"], 5)
    out["val_images"] = images(root / "val_images", ["cats", "dogs"], 3, seed=1)  # no ants: labels go by name
    out["split_images"] = images(root / "split_images" / "train", ["cats"], 4).parent
    images(out["split_images"] / "validation", ["cats"], 2)
    for split in ("validation", "test", None):  # what load_dataset reads as a Hub dataset's splits
        folder = root / f"hub-{split}"
        folder.mkdir()
        for part in ("train", split) if split else ("train",):
            rows = "".join(json.dumps({"text": line}) + "\n" for line in SOURCE.splitlines(keepends=True))
            (folder / f"{part}.jsonl").write_text(rows)
        out[f"hub-{split}"] = folder
    return out


def test_a_table_validation_file_is_validation_and_every_training_row_trains(files):
    b = build("--dataset", "file", "--train_file", files["train.csv"], "--validation_file", files["val.csv"])
    assert len(b.train) == 40 and sorted(b.train[:]["inputs"][:, 0].tolist()) == list(range(40))
    expected = [[100 + i, -i] for i in range(7)]  # f0, f1: training's column order, taken by name
    assert b.validation[:]["inputs"].tolist() == expected
    assert b.validation[:]["labels"].tolist() == [i % 3 for i in range(7)]
    assert b.info["num_features"] == 2 and b.info["num_classes"] == 3
    mixed = build("--dataset", "file", "--train_file", files["train.csv"], "--validation_file", files["val.jsonl"])
    assert mixed.validation[:]["inputs"][:, 0].tolist() == [200 + i for i in range(5)]  # a JSON-lines table too


def test_a_text_validation_file_is_validation_and_every_training_line_trains(files):
    b = build("--dataset", "text", "--model", "gpt_tiny", "--train_file", files["train.txt"],
              "--validation_file", files["val.txt"])
    assert len(b.train) == (len(SOURCE.encode()) - 1) // 64  # every line of --train_file, none held out
    assert len(b.validation) == (3000 - 1) // 64
    assert b.decode(b.validation[0]["inputs"]) == SOURCE[:64] and b.decode(b.train[0]["inputs"]) == SOURCE[:64]
    folder = files["root"] / "val_folder"
    folder.mkdir()
    (folder / "b.txt").write_text(SOURCE[1000:2000])
    (folder / "a.txt").write_text(SOURCE[:1000])
    from_folder = build("--dataset", "text", "--model", "gpt_tiny", "--train_file", files["train.txt"],
                        "--validation_file", folder)
    assert len(from_folder.validation) == (2000 - 1) // 64  # a folder's .txt files in order, as for --train_file
    assert from_folder.decode(from_folder.validation[0]["inputs"]) == SOURCE[:64]


def test_an_image_validation_folder_is_validation_with_labels_by_class_name(files):
    b = build("--dataset", "imagefolder", "--model", "cnn", "--train_file", files["images"],
              "--validation_file", files["val_images"])
    assert len(b.train) == 15 and len(b.validation) == 6 and b.info["class_names"] == ["ants", "cats", "dogs"]
    assert b.validation[:]["labels"].tolist() == [1, 1, 1, 2, 2, 2]  # cats and dogs, though it has no ants
    first = np.asarray(Image.open(files["val_images"] / "cats" / "0.png")).transpose(2, 0, 1)
    assert np.array_equal(b.validation[0]["inputs"].numpy(), first)


def text(files, *more):
    return ["--dataset", "text", "--model", "gpt_tiny", "--train_file", files["train.txt"], *more]


def hub(files, split):
    return ["--dataset", "hub", "--model", "gpt_tiny", "--dataset_name", files[f"hub-{split}"]]


BLOCKS = (len(SOURCE.encode()) - 1) // 64
# source -> (its arguments, the banner's phrase, validation rows, tokens); {x} is the files fixture's path x
BANNER = {
    "synthetic": (lambda f: [], "a seeded 20% share", 1600, None),
    "lesson": (lambda f: ["--dataset", "lesson"], "num_val rows drawn after the training rows", 100, None),
    "file": (lambda f: ["--dataset", "file", "--train_file", f["train.csv"]],
             "a seeded 20% share of --train_file's rows (--dataset_args val_fraction)", 8, None),
    "file, --validation_file": (lambda f: ["--dataset", "file", "--train_file", f["train.csv"], "--validation_file",
                                           f["val.csv"]], "--validation_file '{val.csv}'", 7, None),
    "digits": (lambda f: ["--dataset", "digits", "--dataset_args", "image_size=8"],
               "a seeded 20% share (--dataset_args val_fraction)", 360, None),
    "imagefolder": (lambda f: ["--dataset", "imagefolder", "--train_file", f["images"]],
                    "a seeded 20% share of --train_file's images (--dataset_args val_fraction)", 3, None),
    "imagefolder, its validation/": (lambda f: ["--dataset", "imagefolder", "--train_file", f["split_images"]],
                                     "the folder's validation/ sub-folder", 2, None),
    "imagefolder, --validation_file": (lambda f: ["--dataset", "imagefolder", "--train_file", f["images"],
                                                  "--validation_file", f["val_images"]],
                                       "--validation_file '{val_images}'", 6, None),
    "text": (lambda f: text(f), "the last 5% of --train_file's lines (--dataset_args val_fraction)", 10, 640),
    "text, max_val_samples": (lambda f: text(f, "--dataset_args", "max_val_samples=3"),
                              "the last 5% of --train_file's lines (--dataset_args val_fraction), its first 3 "
                              "blocks (--dataset_args max_val_samples)", 3, 192),
    "text, --validation_file": (lambda f: text(f, "--validation_file", f["val.txt"]), "--validation_file '{val.txt}'",
                                46, 46 * 64),
    "stdlib": (lambda f: ["--dataset", "stdlib", "--model", "gpt_tiny", "--dataset_args", "max_val_samples=50"],
               "files whose path hash falls in the first 5% (--dataset_args val_fraction), its first 50 blocks "
               "(--dataset_args max_val_samples)", 50, 3200),
    "random_tokens": (lambda f: ["--dataset", "random_tokens", "--model", "gpt_tiny", "--dataset_args", "num_val=5"],
                      "seeded random tokens (--dataset_args num_val)", 5, 320),
    "hub, validation split": (lambda f: hub(f, "validation"),
                              "the validation split of --dataset_name '{hub-validation}'", BLOCKS, BLOCKS * 64),
    "hub, test split": (lambda f: hub(f, "test"), "the test split of --dataset_name '{hub-test}'", BLOCKS, BLOCKS * 64),
    "hub, a share": (lambda f: hub(f, None), "a seeded 5% share of the train split of --dataset_name '{hub-None}' "
                                             "(--dataset_args val_fraction)", None, None),
}


@pytest.mark.parametrize("name", list(BANNER))
def test_the_banner_says_where_each_source_takes_validation_from(name, files):
    args, phrase, rows, tokens = BANNER[name]
    b = build(*args(files))
    phrase = fill(phrase, files)
    if rows is None:  # a seeded 5% of the train split's lines, cut into blocks: as many as the rows hold
        rows, tokens = len(b.validation), len(b.validation) * 64
        assert 0 < rows < len(b.train) / 10
    assert prepared.validation_line(b) == f"{phrase}: {rows:,} rows" + (f", {tokens:,} tokens" if tokens else "")
    assert len(b.validation) == rows


def bad(files, name: str, text: str, binary: bool = False) -> Path:
    path = files["root"] / "bad" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(text) if binary else path.write_text(text)
    return path


def bad_images(files, name: str, classes, **kwargs) -> Path:
    root = files["root"] / "bad" / name
    shutil.rmtree(root, ignore_errors=True)
    return images(root, classes, 2, **kwargs)


def table_case(text: str, suffix: str = "csv"):
    return lambda f: (["--dataset", "file", "--train_file", f["train.csv"]], bad(f, f"v.{suffix}", text))


def text_case(content, binary: bool = False):
    return lambda f: (text(f), bad(f, "v.txt", content, binary))


def image_case(make):
    return lambda f: (["--dataset", "imagefolder", "--model", "cnn", "--train_file", f["images"]], make(f))


def damaged(f) -> Path:
    root = bad_images(f, "damaged", ["cats"])
    (root / "cats" / "1.png").write_bytes((root / "cats" / "1.png").read_bytes()[:100])
    return root


def no_images(f) -> Path:
    root = bad_images(f, "empty", [])
    (root / "cats").mkdir(parents=True)
    return root


# case -> (arguments and the validation file made from the files fixture, words the one line holds besides the
# flag and the file)
BAD = {
    "other columns": (table_case("f0,f2,label\n1,2,0\n"), ["feature columns f0, f2", "column 'f2'", "same columns"]),
    "a class only in validation": (table_case(TABLE + "1,2,0\n3,4,5\n"), ["row 2 has the label 5", "0, 1, 2"]),
    "no label column": (table_case("f0,f1\n1,2\n"), ["no 'label' column"]),
    "a text column": (table_case(TABLE + "1,a,0\n"), ["column 'f1' is not numeric"]),
    "labels that are not classes": (table_case(TABLE + "1,2,0.5\n"), ["integer labels"]),
    "NaN in a row": (table_case(TABLE + "1,2,0\n3,nan,1\n"), ["row 2 (line 3), column 'f1'", "--allow_nonfinite_data"]),
    "no rows": (table_case(TABLE), ["no rows"]),
    "a broken JSON line": (table_case('{"f0": 1, "f1": 2, "label": 0}\n{"f0": \n', "jsonl"),
                           ["line 2 is not valid JSON"]),
    "not a table": (table_case("f0 f1 label\n", "tsv"), [".csv, .json or .jsonl"]),
    "an empty text": (text_case(""), ["has no text"]),
    "a binary text": (text_case(b"abc\n\0", binary=True), ["NUL byte"]),
    "a text not UTF-8": (text_case(b"abc\n\xff\n", binary=True), ["not UTF-8"]),
    "a text shorter than a block": (text_case("abc\n"), ["shorter than one block of 65 tokens"]),
    "a class folder only in validation": (image_case(lambda f: bad_images(f, "birds", ["birds", "cats"])),
                                          ["class folder 'birds'", "ants, cats, dogs"]),
    "images of another size": (image_case(lambda f: bad_images(f, "small", ["cats"], size=16)),
                               ["3x16x16", "3x28x28", "image_size=N"]),
    "grey images": (image_case(lambda f: bad_images(f, "grey", ["cats"], mode="L")), ["1x28x28", "3x28x28"]),
    "split sub-folders": (image_case(lambda f: f["split_images"]), ["train, validation", "validation'"]),
    "a damaged image": (image_case(damaged), ["'cats/1.png' cannot be read", "replace or remove it"]),
    "a file for a folder": (image_case(lambda f: f["val.csv"]), ["must be a folder"]),
    "no images": (image_case(lambda f: no_images(f)), ["holds no images"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_validation_file_is_one_line_naming_it(name, files):
    make, words = BAD[name]
    args, path = make(files)
    with pytest.raises(UsageError) as err:
        build(*args, "--validation_file", path)
    line = str(err.value)
    assert "\n" not in line and f"--validation_file '{path}'" in line, line
    assert "--train_file '" not in line or name in ("other columns", "a class only in validation",
                                                     "a class folder only in validation"), line
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize("argv, words", [
    (["--validation_file", "no/such.csv"], ["--validation_file", "not by --dataset synthetic"]),
    (["--dataset", "file", "--train_file", "{train.csv}", "--validation_file", "no/such.csv"],
     ["--validation_file 'no/such.csv' not found"]),
    (["--dataset", "file", "--train_file", "{train.csv}", "--validation_file", "{val.csv}", "--dataset_args",
      "val_fraction=0.3"], ["val_fraction=0.3", "--validation_file '{val.csv}'", "drop one"]),
    (["--dataset", "imagefolder", "--train_file", "{split_images}", "--validation_file", "{val_images}"],
     ["--train_file '{split_images}' has its own validation/ sub-folder", "{split_images}/train"]),
])
def test_validation_file_settings_that_contradict_are_one_line(argv, words, files):
    with pytest.raises(UsageError) as err:
        build(*[fill(a, files) for a in argv])
    assert "\n" not in str(err.value)
    for word in words:
        assert fill(word, files) in str(err.value), (word, str(err.value))


BASE = ["--batch_size", "8", "--mixed_precision", "no", "--cpu_threads", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["other columns", "a text shorter than a block", "a class folder only in validation"])
def test_a_bad_validation_file_stops_the_recipe_in_one_line_before_the_run_folder(name, files, tmp_path, capsys,
                                                                                  fresh_accelerate_state):
    args, path = BAD[name][0](files)
    out = tmp_path / "run"
    run = run_in_process([*BASE, *args, "--validation_file", path, "--max_steps", "2", "--output_dir", out], capsys)
    assert_one_line_error(run, f"--validation_file '{path}'", *BAD[name][1][:1])
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_resume_with_another_validation_file_is_refused_and_with_the_same_one_resumes(files, tmp_path, capsys,
                                                                                         fresh_accelerate_state):
    val = tmp_path / "val.csv"
    shutil.copy(files["val.csv"], val)
    out = tmp_path / "run"
    common = [*BASE, "--model_args", "hidden=[8]", "--dataset", "file", "--train_file", files["train.csv"],
              "--validation_file", val, "--output_dir", out, "--checkpointing_steps", "2"]
    first = run_in_process([*common, "--max_steps", "4"], capsys)
    assert first.returncode == 0, first.stderr
    assert f"validation     --validation_file '{val}': 7 rows" in first.stdout  # the banner
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["config"]["validation_file"] == str(val)
    assert recorded["derived"]["validation"] == f"--validation_file '{val}': 7 rows"
    before = snapshot(out)
    val.write_text(val.read_text().replace("100,0", "101,0"))  # one value changed, the same size
    refused = run_in_process([*common, "--max_steps", "6", "--resume_from_checkpoint", "latest"], capsys)
    assert_one_line_error(refused, "validation_file:", "validation_file cannot change within a run")
    assert snapshot(out) == before
    shutil.copy(files["val.csv"], val)  # the same content again: the same run
    resumed = run_in_process([*common, "--max_steps", "6", "--resume_from_checkpoint", "latest"], capsys)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr
    assert math.isfinite(json.loads((out / "summary.json").read_text())["val_loss"])
