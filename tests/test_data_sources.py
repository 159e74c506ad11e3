"""Images and text through HF datasets: digits, the standard-library corpus, local files and folders, the Hub
code path (fed a local folder, which `load_dataset` reads exactly like a Hub name), and their errors."""
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mixprec import config, data
from mixprec.data import text
from mixprec.errors import UsageError


def build(*argv):
    return data.build(config.parse_config(list(map(str, argv))))


@pytest.fixture(scope="module")
def stdlib_tiny():
    return build("--dataset", "stdlib", "--model", "gpt_tiny")


def test_stdlib_corpus_blocks_are_next_token_pairs(stdlib_tiny):
    b = stdlib_tiny
    assert b.info == {"task": "language_modeling", "vocab_size": 256, "block_size": 64, "tokenizer": "bytes",
                      "validation_from": "files whose path hash falls in the first 5% (--dataset_args val_fraction)"}
    assert len(b.train) * 64 > 10_000_000 and len(b.validation) > 1000  # ~12 MB of source
    first, second = b.train[0], b.train[1]
    assert first["inputs"].shape == (64,) and first["inputs"].dtype == torch.int64
    assert torch.equal(first["inputs"][1:], first["labels"][:-1])  # labels are the inputs shifted by one
    assert second["inputs"][0] == first["labels"][-1]  # blocks overlap by one token: each is predicted once
    root = Path(sysconfig.get_paths()["stdlib"])
    first_file = next(p for p in text.stdlib_files(root)
                      if not text.in_validation(p.relative_to(root).as_posix(), 0.05))
    assert bytes(first["inputs"].tolist()) == first_file.read_bytes()[:64]  # byte tokens, files in sorted order


def test_stdlib_split_is_by_file_and_deterministic():
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in text.stdlib_files(root)]
    val = {r for r in rel if text.in_validation(r, 0.05)}
    assert 0.01 < len(val) / len(rel) < 0.1
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/")[:-1])
    assert val == {r for r in rel if text.in_validation(r, 0.05)}  # the same split every time


def test_text_block_size_follows_the_model_or_is_asked_for(stdlib_tiny):
    small = build("--dataset", "stdlib", "--model", "gpt_tiny", "--dataset_args", "block_size=16,max_val_samples=7")
    assert small.info["block_size"] == 16 and small.train[0]["inputs"].shape == (16,) and len(small.validation) == 7
    wide = build("--dataset", "stdlib", "--model", "gpt", "--model_args", "block_size=96,n_layer=1")
    assert wide.train[0]["inputs"].shape == (96,)
    with pytest.raises(UsageError, match="block_size=128 must be between 1 and the model's context 64"):
        build("--dataset", "stdlib", "--model", "gpt_tiny", "--dataset_args", "block_size=128")
    with pytest.raises(UsageError, match="does not read text"):
        build("--dataset", "stdlib")


def test_digits_are_32px_uint8_images_with_their_statistics():
    b = build("--dataset", "digits", "--model", "cnn")
    assert (len(b.train), len(b.validation)) == (1437, 360)
    x = b.train[0]["inputs"]
    assert x.shape == (1, 32, 32) and 0 <= x.min() and x.max() <= 255 and x.max() > 100
    assert b.info["num_classes"] == 10 and b.info["image_shape"] == [1, 32, 32]
    assert 0.1 < b.info["mean"][0] < 0.5 and 0.1 < b.info["std"][0] < 0.5
    assert set(b.validation[:]["labels"].tolist()) == set(range(10))
    native = build("--dataset", "digits", "--dataset_args", "image_size=8")
    assert native.train[0]["inputs"].shape == (1, 8, 8)


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory):
    """train/ and validation/ folders, one sub-folder per class, 28x28 RGB images."""
    root = tmp_path_factory.mktemp("pets")
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("validation", 4)):
        for cls in ("cats", "dogs"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8)).save(root / split / cls / f"{i}.png")
    return root


def test_image_folders_locally_and_through_the_hub_code_path(image_tree):
    for argv in (["--dataset", "imagefolder", "--train_file", image_tree],
                 ["--dataset", "hub", "--dataset_name", image_tree]):
        b = build(*argv, "--model", "cnn")
        assert (len(b.train), len(b.validation)) == (24, 8)  # the folder's own validation split
        assert b.info["image_shape"] == [3, 28, 28] and b.info["class_names"] == ["cats", "dogs"]
    split = build("--dataset", "imagefolder", "--train_file", image_tree / "train", "--dataset_args",
                  "image_size=32,val_fraction=0.25")
    assert (len(split.train), len(split.validation)) == (18, 6) and split.train[0]["inputs"].shape == (3, 32, 32)


@pytest.fixture(scope="module")
def text_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    (root / "train.txt").write_text(source)
    # what a Hub text dataset looks like (wikitext): a split per file, one row per line, line breaks kept
    (root / "hub").mkdir()
    for split, part in (("train", source), ("validation", source[:4000])):
        rows = [json.dumps({"text": line}) for line in part.splitlines(keepends=True)]
        (root / "hub" / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return root


def test_local_text_and_the_hub_text_path(text_tree):
    whole = "".join((text_tree / "train.txt").read_text())
    b = build("--dataset", "text", "--train_file", text_tree / "train.txt", "--model", "gpt_tiny")
    stream = b.decode(b.train[0]["inputs"]) + b.decode(b.train[1]["inputs"])
    assert whole.startswith(stream)  # lines concatenated with their line breaks, in order
    assert len(b.validation) >= 1 and b.info["vocab_size"] == 256
    hub = build("--dataset", "hub", "--dataset_name", text_tree / "hub", "--model", "gpt_tiny")
    assert hub.decode(hub.validation[0]["inputs"]) == whole[:64] and len(hub.train) > len(hub.validation)


def test_a_hugging_face_tokenizer_from_a_folder(text_tree, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train([str(text_tree / "train.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    b = build("--dataset", "text", "--train_file", text_tree / "train.txt", "--model", "gpt_tiny",
              "--dataset_args", f"tokenizer={tmp_path / 'tok'},block_size=16")
    assert b.info["vocab_size"] == 300 and b.info["tokenizer"] == str(tmp_path / "tok")
    assert (text_tree / "train.txt").read_text().startswith(b.decode(b.train[0]["inputs"]))
    assert b.train[0]["inputs"].max() >= 256  # merged tokens, not bytes


@pytest.mark.parametrize("argv, words", [
    (["--dataset", "hub", "--model", "cnn"], ["--dataset_name"]),
    (["--dataset_name", "mnist"], ["--dataset hub"]),
    (["--dataset", "text", "--model", "gpt_tiny"], ["--train_file"]),
    (["--dataset", "text", "--train_file", "no/such.txt", "--model", "gpt_tiny"], ["no/such.txt", "not found"]),
    (["--dataset", "imagefolder", "--train_file", __file__], ["must be a folder"]),
    (["--dataset", "digits", "--dataset_args", "colour=1"], ["colour", "image_size"]),
])
def test_data_errors_name_the_value_and_the_fix(argv, words):
    """(An unreachable Hub is tested through the recipe, offline: tests/test_scale_runs.py.)"""
    with pytest.raises(UsageError) as err:
        build(*argv)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_paths_with_glob_characters_are_taken_literally(tmp_path):
    """'[1]' and '**' in a --train_file path name that file, not a pattern (`datasets` reads data_files as globs)."""
    folder = tmp_path / "[1]" / "**"
    folder.mkdir(parents=True)
    table = folder / "a[1].csv"
    table.write_text("f0,f1,label\n" + "".join(f"{i},{-i},{i % 2}\n" for i in range(20)))
    (folder / "t[1].txt").write_text("".join(f"line {i} of the text\n" for i in range(40)))
    bundle = data.build(config.parse_config(["--dataset", "file", "--train_file", str(table)]))
    assert len(bundle.train) + len(bundle.validation) == 20
    lines = data.build(config.parse_config(["--dataset", "text", "--model", "gpt_tiny", "--train_file",
                                            str(folder / "t[1].txt"), "--dataset_args", "block_size=16"]))
    assert len(lines.train) > 0


def test_image_folders_with_glob_characters_are_taken_literally_and_a_damaged_image_is_named(image_tree, tmp_path):
    """Found by tests/test_generated_input.py: `imagefolder` read the folder as a glob pattern ('imgs [1]' held
    no data), and a truncated image failed later, in a traceback."""
    import shutil

    literal = tmp_path / "imgs [1]" / "**"
    shutil.copytree(image_tree, literal)
    b = build("--dataset", "imagefolder", "--train_file", literal, "--model", "cnn")
    assert (len(b.train), len(b.validation)) == (24, 8) and b.info["class_names"] == ["cats", "dogs"]
    cut = literal / "train" / "dogs" / "3.png"
    cut.write_bytes(cut.read_bytes()[:200])
    with pytest.raises(UsageError) as err:
        build("--dataset", "imagefolder", "--train_file", literal, "--model", "cnn")
    assert "train/dogs/3.png" in str(err.value) and "replace or remove it" in str(err.value)


def test_a_train_file_that_does_not_exist_is_named_for_a_dataset_that_reads_none():
    """Found by tests/test_generated_input.py: --train_file with --dataset synthetic was fingerprinted for the
    resume contract and raised FileNotFoundError."""
    from mixprec.run_folder import resume

    with pytest.raises(UsageError) as err:
        resume.fingerprint("no/such.csv")
    assert "no/such.csv" in str(err.value) and "not found" in str(err.value)
