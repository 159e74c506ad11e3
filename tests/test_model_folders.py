"""Damaged transformers model folders, non-finite pretrained weights and flags that would be silently ignored: each
one line on stderr, exit code 2, no traceback, nothing on disk changed (the run folder not even created). The
folders are copies of tests/test_hf_models.py's tiny models (scripts/make_tiny_hf.py), damaged in tmp_path; most
runs stop in the start checks, before a step is trained."""
import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import assert_one_line_error, run_in_process, snapshot
from test_hf_models import offline, tiny  # noqa: F401 (fixtures)

QUICK = ["--max_steps", 1, "--eval_steps", 1, "--sample_tokens", 0, "--block_size", 16, "--batch_size", 4]


def lm(tiny, model, *extra):  # noqa: F811
    return ["--model_name_or_path", model, "--dataset", "text", "--train_file", tiny["text"], *QUICK, *extra]


def classify(tiny, model, *extra):  # noqa: F811
    return ["--model_name_or_path", model, "--dataset", "text_classification", "--train_file", tiny["bert"]["csv"],
            *QUICK, *extra]


def copied(tiny, tmp: Path, arch: str = "llama_bf16", part: str = "model") -> Path:  # noqa: F811
    """A copy of one of tiny's folders, to damage (the fixture's own stays as it is)."""
    return Path(shutil.copytree(tiny[arch][part], tmp / f"{arch}_{part}"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def cut(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


def header_end(path: Path) -> int:
    """Where a safetensors file's header ends: 8 bytes of length, then the JSON."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def sharded(tmp: Path, tiny) -> Path:  # noqa: F811
    """tiny's Llama saved again in 4 shards, with its tokenizer."""
    from transformers import AutoModelForCausalLM

    folder = tmp / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny["llama_bf16"]["model"]).save_pretrained(folder, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny["llama_bf16"]["model"] / name, folder / name)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    return folder


def non_finite(folder: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"][0, :5] = float("nan")
    state["lm_head.weight"][1, 1] = float("inf")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert not bool(torch.isfinite(state["lm_head.weight"]).all())


def in_index(folder: Path, change) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


def llama(damage):
    """(tmp, tiny) -> the args of a run on a copy of the Llama damaged by `damage(folder)`."""
    def make(t, tiny):  # noqa: F811
        folder = copied(tiny, t)
        damage(folder)
        return lm(tiny, folder)
    return make


def shards(damage):
    def make(t, tiny):  # noqa: F811
        folder = sharded(t, tiny)
        damage(folder)
        return lm(tiny, folder)
    return make


ST = "model.safetensors"
DAMAGED = {
    # the weights' safetensors headers
    "truncated weights": (llama(lambda f: cut(f / ST, lambda n: n // 2)), [ST, "damaged", "file not fully covered"]),
    "empty weights": (llama(lambda f: (f / ST).write_bytes(b"")), [ST, "damaged", "0 bytes"]),
    "garbage weights": (llama(lambda f: (f / ST).write_bytes(b"\x07" * 5000)), [ST, "damaged"]),
    "a broken header": (llama(lambda f: (f / ST).write_bytes(b"\x10" + b"\0" * 7 + b"{not json" + b" " * 7)),
                        [ST, "damaged", "JSON"]),
    "no weights": (llama(lambda f: (f / ST).unlink()), ["holds no weights", "--config_name"]),
    "a missing shard": (shards(lambda f: (f / "model-00002-of-00004.safetensors").unlink()),
                        ["model-00002-of-00004.safetensors", "model.safetensors.index.json", "missing"]),
    "a truncated shard": (shards(lambda f: cut(f / "model-00003-of-00004.safetensors", lambda n: n - 1)),
                          ["model-00003-of-00004.safetensors", "damaged"]),
    "an index that is not JSON": (shards(lambda f: (f / "model.safetensors.index.json").write_text("{oops")),
                                  ["model.safetensors.index.json", "weight_map"]),
    "an index without weight_map": (shards(lambda f: in_index(f, lambda i: i.pop("weight_map"))),
                                    ["model.safetensors.index.json", "weight_map"]),
    "an index that points at the wrong shard": (
        shards(lambda f: in_index(f, lambda i: i.update(weight_map={k: "model-00001-of-00004.safetensors"
                                                                    for k in i["weight_map"]}))),
        ["model.safetensors.index.json", "model-00001-of-00004.safetensors", "does not hold"]),
    # config.json
    "config.json a list": (llama(lambda f: (f / "config.json").write_text("[1, 2]")), ["config.json", "an array"]),
    "config.json a number": (llama(lambda f: (f / "config.json").write_text("3")), ["config.json", "a number"]),
    "config.json not JSON": (llama(lambda f: (f / "config.json").write_bytes(b"\xff{")), ["config.json", "not valid"]),
    "no model_type": (llama(lambda f: edit_config(f, model_type=None)), ["no model_type"]),
    "an unknown model_type": (llama(lambda f: edit_config(f, model_type="nosuchmodel")),
                              ["'nosuchmodel'", "upgrade transformers"]),
    "heads that do not divide the hidden size": (llama(lambda f: edit_config(f, num_attention_heads=3)),
                                                 ["config.json", "not a multiple of the number of attention heads"]),
    "no attention heads": (llama(lambda f: edit_config(f, num_attention_heads=0)), ["num_attention_heads 0",
                                                                                    "positive"]),
    "a negative hidden size": (llama(lambda f: edit_config(f, hidden_size=-64)), ["hidden_size -64", "positive"]),
    "a vocabulary of 0": (llama(lambda f: edit_config(f, vocab_size=0)), ["vocab_size 0"]),
    "a size that is not a number": (llama(lambda f: edit_config(f, hidden_size="wide")), ["hidden_size", "int"]),
    "a dtype that is not one": (llama(lambda f: edit_config(f, dtype="bfloat1x")), ["config.json", "bfloat1x"]),
    "an encoder as a causal LM": (lambda t, tiny: lm(tiny, tiny["bert"]["model"]),
                                  ["bert", "encoder", "--dataset text_classification"]),
    "no classification class": (lambda t, tiny: classify(tiny, _relabelled(t, tiny, "codegen")),
                                ["codegen", "sequence-classification"]),
    # config.json against the weights: only loading finds these
    "more layers than the weights": (llama(lambda f: edit_config(f, num_hidden_layers=3)),
                                     ["does not match its config.json", "lacks 9 weight(s)", "model.layers.2."]),
    "fewer layers than the weights": (llama(lambda f: edit_config(f, num_hidden_layers=1)),
                                      ["does not match its config.json", "holds 9 weight(s)", "model.layers.1."]),
    "a vocabulary the weights do not have": (llama(lambda f: edit_config(f, vocab_size=600)),
                                             ["shapes differ from its config.json"]),
    "a classifier without its body": (lambda t, tiny: classify(tiny, _without(t, tiny, "bert.encoder.layer.1.")),
                                      ["does not match its config.json", "lacks 16 weight(s)",
                                       "bert.encoder.layer.1."]),
    # the tokenizer
    "tokenizer.json garbage": (llama(lambda f: (f / "tokenizer.json").write_text("garbage{")),
                               ["tokenizer.json", "not valid JSON"]),
    "tokenizer.json truncated": (llama(lambda f: cut(f / "tokenizer.json", lambda n: n // 2)),
                                 ["tokenizer.json", "not valid JSON"]),
    "tokenizer_config.json not JSON": (llama(lambda f: (f / "tokenizer_config.json").write_text("not json")),
                                       ["tokenizer_config.json", "not valid JSON"]),
    "tokenizer_config.json a list": (llama(lambda f: (f / "tokenizer_config.json").write_text("[]")),
                                     ["tokenizer_config.json", "not a JSON object"]),
    "no tokenizer": (llama(lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")]),
                     ["--model_name_or_path", "has no tokenizer", "--tokenizer_name"]),
    "a tokenizer that does not load": (llama(lambda f: (f / "tokenizer.json").write_text('{"model": 1}')),
                                       ["--model_name_or_path", "tokenizer could not be loaded", "--tokenizer_name"]),
    "a damaged --tokenizer_name": (lambda t, tiny: ["--config_name", tiny["llama_bf16"]["config"], "--tokenizer_name",
                                                    _damaged_tokenizer(t, tiny), "--dataset", "text", "--train_file",
                                                    tiny["text"], *QUICK], ["--tokenizer_name", "tokenizer.json"]),
    "a damaged --config_name": (lambda t, tiny: ["--config_name", _damaged_config(t, tiny), "--tokenizer_name",
                                                 tiny["llama_bf16"]["tokenizer"], "--dataset", "text", "--train_file",
                                                 tiny["text"], *QUICK], ["--config_name", "hidden_size -1"]),
    # the weights themselves
    "NaN and inf in the weights": (llama(non_finite), [
        "holds non-finite weights: 6 values in 2 tensors (model.layers.0.mlp.up_proj.weight, lm_head.weight)",
        "repair the checkpoint or load another"]),
}


def _relabelled(t: Path, tiny, model_type: str) -> Path:  # noqa: F811
    folder = copied(tiny, t, "bert")
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def _without(t: Path, tiny, prefix: str) -> Path:  # noqa: F811
    from safetensors.torch import load_file, save_file

    folder = copied(tiny, t, "bert")
    state = load_file(folder / ST)
    save_file({k: v for k, v in state.items() if not k.startswith(prefix)}, folder / ST, metadata={"format": "pt"})
    return folder


def _damaged_tokenizer(t: Path, tiny) -> Path:  # noqa: F811
    folder = copied(tiny, t, part="tokenizer")
    cut(folder / "tokenizer.json", lambda n: n - 3)
    return folder


def _damaged_config(t: Path, tiny) -> Path:  # noqa: F811
    folder = copied(tiny, t, part="config")
    edit_config(folder, hidden_size=-1)
    return folder


def refused(args, tmp_path: Path, capsys, *words) -> str:
    """One line naming `words`, exit code 2, nothing under tmp_path changed, no run folder."""
    before = snapshot(tmp_path)
    line = assert_one_line_error(run_in_process([*args, "--output_dir", tmp_path / "run"], capsys), *words)
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()
    return line


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_folder_is_one_line_and_writes_nothing(name, tiny, offline, tmp_path, capsys):  # noqa: F811
    make, words = DAMAGED[name]
    sources = {k: snapshot(tiny[k]["model"]) for k in ("llama_bf16", "bert")}
    args = make(tmp_path, tiny)
    capsys.readouterr()  # what making the folder printed (save_pretrained's bar)
    refused(args, tmp_path, capsys, *words)
    assert sources == {k: snapshot(tiny[k]["model"]) for k in sources}  # the fixture's folders: untouched


def with_value_head(folder: Path) -> None:
    """A weight outside the model (TRL's value head): transformers leaves it, and so does the check."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(folder / ST)
    save_file({**state, "v_head.summary.weight": torch.ones(1, 64)}, folder / ST, metadata={"format": "pt"})


def test_whole_folders_train_a_sharded_one_an_extra_head_and_a_classifier_without_its_head(tiny, offline,  # noqa: F811
                                                                                          tmp_path, capsys):
    run = run_in_process([*lm(tiny, sharded(tmp_path, tiny)), "--output_dir", tmp_path / "a"], capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    extra = copied(tiny, tmp_path)
    with_value_head(extra)
    run = run_in_process([*lm(tiny, extra), "--output_dir", tmp_path / "c"], capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    run = run_in_process([*classify(tiny, _without(tmp_path, tiny, "classifier.")), "--output_dir", tmp_path / "b"],
                         capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "new head classifier.bias, classifier.weight (not in the checkpoint)" in run.stdout


MISAPPLIED = {
    "--bf16_update kahan without bf16 master weights": (lambda tiny: ["--bf16_update", "kahan"],
                                                        ["--bf16_update kahan", "--master_weights bf16"]),
    "--save_dtype on a built-in model": (lambda tiny: ["--model", "gpt_tiny", "--save_dtype", "bf16"],
                                         ["--save_dtype bf16", "--model gpt_tiny", "--model_name_or_path"]),
    "--save_dtype with an adapter-only export": (
        lambda tiny: lm(tiny, tiny["llama_bf16"]["model"], "--use_peft", "--mixed_precision", "bf16",
                        "--save_dtype", "fp32"), ["--save_dtype fp32", "--use_peft", "--merge_lora"]),
    "--model with a transformers model": (lambda tiny: lm(tiny, tiny["gpt2"]["model"], "--model", "gpt_tiny"),
                                          ["--model gpt_tiny", "--model_name_or_path"]),
    "--model_args with a transformers model": (
        lambda tiny: lm(tiny, tiny["gpt2"]["model"], "--model_args", "n_layer=4"), ["--model_args", "config.json"]),
    "--dataset_args block_size with a transformers model": (
        lambda tiny: lm(tiny, tiny["gpt2"]["model"], "--dataset_args", "block_size=8"),
        ["--dataset_args block_size", "--block_size N"]),
    "--dataset_args tokenizer with a transformers model": (
        lambda tiny: lm(tiny, tiny["gpt2"]["model"], "--dataset_args", "tokenizer=bytes"),
        ["--dataset_args tokenizer", "--tokenizer_name"]),
    "--model hf_causal_lm without its folder": (lambda tiny: ["--model", "hf_causal_lm", "--max_steps", 1],
                                                ["--model hf_causal_lm", "--model_name_or_path"]),
    "--model hf_classifier with --model_args, not --model_name_or_path": (  # its checks would be skipped
        lambda tiny: ["--model", "hf_classifier", "--model_args", f"name_or_path={tiny['bert']['model']}",
                      "--dataset", "text_classification", "--train_file", tiny["bert"]["csv"], "--dataset_args",
                      f"num_labels=5,tokenizer={tiny['bert']['model']}", "--max_steps", 1],
        ["--model hf_classifier", "give --model_name_or_path FOLDER"]),
    "a LoRA target that is not a linear layer": (
        lambda tiny: lm(tiny, tiny["llama_bf16"]["model"], "--use_peft", "--mixed_precision", "bf16",
                        "--lora_target_modules", "self_attn"),
        ["--lora_target_modules self_attn", "LlamaAttention, not a linear layer", "q_proj, up_proj, v_proj",
         "all-linear"]),
    "a text shorter than a block of a transformers model": (
        lambda tiny: ["--model_name_or_path", tiny["llama_bf16"]["model"], "--dataset", "text", "--train_file",
                      tiny["short"], *QUICK], ["shorter than one block", "smaller --block_size"]),
}


@pytest.mark.parametrize("name", sorted(MISAPPLIED))
def test_a_misapplied_flag_is_one_line_and_writes_nothing(name, tiny, offline, tmp_path, capsys):  # noqa: F811
    make, words = MISAPPLIED[name]
    short = tmp_path / "short.txt"
    short.write_text("def f():\n    return 1\n")
    line = refused(make({**tiny, "short": short}), tmp_path, capsys, *words)
    assert "Target module" not in line  # peft's own text, with a module's repr cut mid-line


def test_resuming_a_lora_run_without_peft_names_the_contract_not_an_untyped_flag(tiny, offline, tmp_path,  # noqa: F811
                                                                                 capsys):
    out = tmp_path / "run"
    args = [*lm(tiny, tiny["llama_bf16"]["model"]), "--use_peft", "--merge_lora", "--mixed_precision", "bf16",
            "--max_steps", 2, "--checkpointing_steps", 1, "--eval_steps", 2, "--output_dir", out]
    run = run_in_process(args, capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    before = snapshot(out)
    line = assert_one_line_error(run_in_process(["--resume_from_checkpoint", "latest", "--no-use_peft", "--max_steps",
                                                 3, "--output_dir", out], capsys), "peft:", "-> None",
                                 "cannot change within a run")
    assert "--merge_lora" not in line and snapshot(out) == before


def test_resuming_bf16_master_weights_as_fp32_names_the_contract_not_the_recorded_update(tmp_path, capsys):
    """The run recorded --bf16_update round; the resume types --master_weights fp32 only: the line is the
    contract's, not "--bf16_update round is for --master_weights bf16" (the user did not type it)."""
    out = tmp_path / "run"
    run = run_in_process(["--max_steps", 2, "--checkpointing_steps", 1, "--mixed_precision", "bf16",
                          "--master_weights", "bf16", "--bf16_update", "round", "--output_dir", out], capsys)
    assert run.returncode == 0, run.stderr[-3000:]
    (out / "checkpoints" / "latest").write_text("step_0000001")  # as if cut short after step 1
    before = snapshot(out)
    line = assert_one_line_error(run_in_process(["--resume_from_checkpoint", "latest", "--master_weights", "fp32",
                                                 "--output_dir", out], capsys), "master_weights: bf16 -> fp32")
    assert "is for --master_weights bf16" not in line and snapshot(out) == before


# byte-level damage to a copy of a tiny model's folder: the files and the parts of them drawn
TARGETS = {"config.json": None, "tokenizer.json": None, "tokenizer_config.json": None, ST: header_end}


def damage(folder: Path, name: str, kind: str, where: float, data: bytes) -> None:
    path = folder / name
    if kind == "delete":
        path.unlink()
        return
    raw = bytearray(path.read_bytes())
    span = TARGETS[name](path) if TARGETS[name] else len(raw)  # the safetensors header, or the whole file
    at = min(int(where * span), span - 1)
    path.write_bytes(bytes(raw[:at]) if kind == "truncate" else bytes(raw[:at] + data + raw[at + len(data):]))


def check_damage(tiny, tmp: Path, capsys, arch, name, kind, where, data) -> None:  # noqa: F811
    case = tmp / f"case{len(list(tmp.iterdir()))}"
    folder = copied(tiny, case, arch)
    damage(folder, name, kind, where, data)
    before, source = snapshot(case), snapshot(tiny[arch]["model"])
    args = classify(tiny, folder) if arch == "bert" else lm(tiny, folder)
    run = run_in_process([*args, "--output_dir", case / "run"], capsys)
    assert snapshot(tiny[arch]["model"]) == source
    if run.returncode == 0:
        return
    assert_one_line_error(run)
    assert snapshot(case) == before and not (case / "run").exists()


def damage_strategy():
    """(model, file, damage, where in it from 0 to 1, the bytes written): any bytes, or JSON's own characters, which
    leave a JSON file JSON more often (a changed number, a key renamed)."""
    json_bytes = st.text(alphabet='0123456789-.eE{}[],:" az', min_size=1, max_size=4).map(str.encode)
    return (st.sampled_from(["llama_bf16", "gpt2", "bert"]), st.sampled_from(sorted(TARGETS)),
            st.sampled_from(["truncate", "overwrite", "delete"]),
            st.floats(0, 1), st.one_of(json_bytes, st.binary(min_size=1, max_size=4)))


@pytest.mark.parametrize("examples", [pytest.param(8, id="quick"),
                                      pytest.param(150, id="more", marks=pytest.mark.slow)])
def test_byte_level_damage_is_refused_in_one_line_or_trains(examples, tiny, offline, tmp_path, capsys):  # noqa: F811
    """Exit 0, or one `error:` line with exit code 2 and nothing changed (the copy, the fixture's folder)."""
    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(*damage_strategy())
    def damaged(arch, name, kind, where, data):
        check_damage(tiny, tmp_path, capsys, arch, name, kind, where, data)

    damaged()
