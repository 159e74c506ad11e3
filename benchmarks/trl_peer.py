#!/usr/bin/env python
"""The recipe against TRL's SFTTrainer on the same chat data, the same model and the same batches, step by step.

    python benchmarks/trl_peer.py                                  # 40 steps, 3 interleaved rounds, fp32 and bf16
    python benchmarks/trl_peer.py --steps 12 --repeats 1 --precisions fp32 --out runs/trl-peer-quick

Builds, offline, in --out: a tiny Llama from a config (scripts/make_tiny_hf.py: 2 layers, hidden 64, fp32, no
dropout) whose tokenizer gets ChatML's markers as special tokens (the embeddings grow from 512 to 514 rows, seeded)
and a ChatML template with {% generation %} tags; --rows deterministic conversations (1 to 3 turns, an optional
system message; the assistant reverses, sorts or counts the user's words) of varying lengths, so that
micro-batches hold different numbers of target tokens; each fits the block (128 tokens): neither runner cuts one.
Then, per round, for each precision (fp32; bf16 = autocast on fp32 weights on both sides):

- the recipe, `python recipes/train.py --model_name_or_path M --dataset chat --train_file D --validation_file V
  ...` with its defaults (lr 1e-3, cosine to 0.1, weight decay 0.01, clipping at 1.0, fused AdamW, its threads)
  except what must match: --warmup_steps 0 (the two warm-ups differ by a step: the recipe's first step has
  lr/W, the Trainer's 0), --batch_size, --gradient_accumulation_steps, --max_steps, --log_every 1, no sample;
- TRL's SFTTrainer (benchmarks/peers/trl_sft.py, run by --trl_python) with the same settings, on a file of the
  conversations in the recipe's batch order (mixprec.data.batches.TrainBatches(...).order(epoch), the whole
  windows of each epoch), read sequentially; with OMP_WAIT_POLICY=PASSIVE, which the recipe sets for itself
  (--trl_omp_default: without it), and without SFTConfig's default gradient checkpointing (the recipe's
  default and the Trainer's; --gradient_checkpointing: on both).

The runners alternate within a round (recipe first in odd rounds, TRL first in even ones). Compared: the loss of
every step (the largest absolute and relative difference, against TOLERANCE), the grad norm and learning rate,
and the token masks (TRL's labels of every row trained against the recipe's). Step time: from the end of one
step to the end of the next (the recipe's metrics.jsonl step_time_s with --log_every 1; TRL's from on_step_end
to on_step_end), the median over the steps after --warmup and the 10th percentile; per round the ratio TRL's
step time / the recipe's (the recipe's speed / TRL's). The load average is recorded before each run, and the
uncommitted edits to mixprec/ (others may edit the working tree while this runs).

Writes --out/trl_peer.json and trl_peer.md (benchmarks/trl_peer_report.py; rewritten after every run), the runs
under --out/runs/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}"
            "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "self return def None if for in not is and or with as".split()  # one token each in the tiny tokenizer
BLOCK = 128  # the tiny Llama's positions
from trl_peer_report import TOLERANCE, markdown, summarize  # noqa: E402  (beside this script)

DEFAULT_TRL = os.environ.get("MIXPREC_TRL_PYTHON", "/tmp/trl-venv/bin/python")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time median")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--batch_size", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2,
                   help="micro-batches per step (2: the step's loss is token-weighted over two micro-batches)")
    p.add_argument("--rows", type=int, default=400, help="training conversations")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of both runners (default: each its own; the recipe's --cpu_threads, torch's for TRL)")
    p.add_argument("--out", default=None, help="a new folder (default runs/trl-peer-<date>-<time>)")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="both recompute each layer in the backward (TRL's SFTConfig default; off: the recipe's)")
    p.add_argument("--trl_omp_default", action="store_true",
                   help="run TRL without OMP_WAIT_POLICY=PASSIVE, which the recipe sets for itself (and TRL gets "
                        "by default here)")
    p.add_argument("--trl_python", default=DEFAULT_TRL, help="a Python with TRL installed (env MIXPREC_TRL_PYTHON)")
    args = p.parse_args(argv)
    args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    bad = [x for x in args.precisions if x not in TOLERANCE]
    if bad or args.steps <= args.warmup or args.repeats < 1:
        p.error(f"--precisions of fp32, bf16 (not {bad}); --steps ({args.steps}) above --warmup ({args.warmup}); "
                f"--repeats at least 1")
    if not Path(args.trl_python).exists():
        p.error(f"--trl_python {args.trl_python} does not exist: give a Python with TRL installed "
                f"(or set MIXPREC_TRL_PYTHON)")
    return args


# the model and the data --------------------------------------------------------------------------------------

def make_model(root: Path, seed: int) -> Path:
    """scripts/make_tiny_hf.py's Llama (fp32, no dropout), its tokenizer given ChatML's two markers as special
    tokens (as chat models have them; the embeddings and head grow from 512 to 514 rows, seeded) and TEMPLATE."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "scripts" / "make_tiny_hf.py")
    make_tiny_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_hf)
    made = make_tiny_hf.make(root / "tiny", "llama", "float32", seed=seed)
    tok = AutoTokenizer.from_pretrained(made["model"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(made["model"], dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


def conversation(rng: random.Random) -> dict:
    """1 to 3 turns of 1 to 8 words; the assistant reverses, sorts or counts them."""
    messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.3 else []
    for _ in range(rng.choice((1, 1, 2, 3))):
        words = rng.choices(WORDS, k=rng.randint(1, 8))
        task = rng.choice(("reverse", "sort", "count"))
        answer = {"reverse": " ".join(reversed(words)), "sort": " ".join(sorted(words)), "count": str(len(words))}
        messages += [{"role": "user", "content": f"{task}: {' '.join(words)}"},
                     {"role": "assistant", "content": answer[task]}]
    return {"messages": messages}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_data(root: Path, model: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """--rows training and 16 validation conversations, each at most BLOCK tokens rendered (longer ones are drawn
    again), so that neither runner cuts one."""
    from transformers import AutoTokenizer

    tok, rng, made = AutoTokenizer.from_pretrained(model), random.Random(seed), []
    while len(made) < rows + 16:
        row = conversation(rng)
        if len(tok.apply_chat_template(row["messages"])["input_ids"]) <= BLOCK:
            made.append(row)
    return write_jsonl(root / "chat.jsonl", made[:rows]), write_jsonl(root / "val.jsonl", made[rows:])


def recipe_args(model: Path, train: Path, val: Path, args, precision: str, out: Path) -> list[str]:
    return [str(a) for a in (
        "--model_name_or_path", model, "--dataset", "chat", "--train_file", train, "--validation_file", val,
        "--block_size", BLOCK, "--batch_size", args.batch_size,
        "--gradient_accumulation_steps", args.gradient_accumulation_steps, "--max_steps", args.steps, "--seed", args.seed,
        "--warmup_steps", 0, "--log_every", 1, "--sample_tokens", 0,
        "--mixed_precision", "no" if precision == "fp32" else "bf16", "--output_dir", out,
        *(("--cpu_threads", args.threads) if args.threads else ()),
        *(("--gradient_checkpointing",) if args.gradient_checkpointing else ()))]


def recipe_order(model: Path, train: Path, val: Path, args, root: Path) -> tuple[list[int], object]:
    """The training rows' indices in the recipe's batch order for args.steps steps, and the recipe's train table
    (built as the run builds it)."""
    import torch

    from mixprec import config, data
    from mixprec.data.batches import Layout, TrainBatches

    cfg = config.parse_config(recipe_args(model, train, val, args, "fp32", root / "unused"))
    bundle = data.build(cfg)
    if len(bundle.train) != args.rows or bundle.info["dropped_rows"]["train"]:
        raise SystemExit(f"the recipe kept {len(bundle.train)} of {args.rows} rows: the data must fit the block")
    batches = TrainBatches(bundle.train, Layout(cfg.batch_size, cfg.gradient_accumulation_steps), cfg.seed,
                           torch.device("cpu"), variable_targets=True)
    order, epoch = [], 0
    while len(order) < args.steps * cfg.batch_size * cfg.gradient_accumulation_steps:
        order += batches.order(epoch)[:len(batches) * cfg.batch_size].tolist()
        epoch += 1
    return order, bundle.train


def check_masks(trl_tokens: Path, order: list[int], table) -> dict:
    """TRL's prepared rows against the recipe's: TRL row j is recipe row order[j]; the recipe's inputs are the
    ids without the last, its labels TRL's labels without the first (the model shifts TRL's)."""
    rows = [json.loads(line) for line in trl_tokens.read_text().splitlines()]
    bad = []
    for j, row in enumerate(rows[:len(order)]):
        ours = table[order[j]]
        ids, labels = row["input_ids"], row["labels"]
        n = len(ids) - 1
        same = (ours["inputs"][:n].tolist() == ids[:-1] and ours["labels"][:n].tolist() == labels[1:]
                and set(ours["labels"][n:].tolist()) <= {-100})
        if not same:
            bad.append(j)
    targets = sum(sum(1 for x in row["labels"] if x != -100) for row in rows[:len(order)])
    return {"rows_checked": min(len(rows), len(order)), "rows_differing": len(bad), "first_differing": bad[:5],
            "targets_checked": targets}


# the runs ------------------------------------------------------------------------------------------------------

def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_recipe(model, train, val, args, precision: str, out: Path) -> dict:
    cmd = [sys.executable, str(REPO / "recipes" / "train.py"), *recipe_args(model, train, val, args, precision, out)]
    log = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if log.returncode:
        raise SystemExit(f"the recipe failed ({log.returncode}):\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}")
    (out / "run.log").write_text(log.stdout + log.stderr)
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and "step" in r and "val_loss" not in r]
    import yaml

    effective = yaml.safe_load((out / "config.yaml").read_text()).get("effective", {})
    threads = (effective.get("cpu_threads") or {}).get("threads")
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "lr": [r["lr"] for r in steps], "step_time_s": [r.get("step_time_s") for r in steps],
            "threads": threads, "command": " ".join(cmd[1:])}


def run_trl(model, ordered: Path, args, precision: str, out: Path) -> dict:
    cmd = [args.trl_python, str(REPO / "benchmarks" / "peers" / "trl_sft.py"), "--model", str(model),
           "--train_file", str(ordered), "--out", str(out), "--precision", precision, "--steps", str(args.steps),
           "--batch_size", str(args.batch_size), "--gradient_accumulation_steps",
           str(args.gradient_accumulation_steps), "--max_length", str(BLOCK), "--seed", str(args.seed),
           *(("--threads", str(args.threads)) if args.threads else ()),
           *(("--activation_checkpointing",) if args.gradient_checkpointing else ())]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    if not args.trl_omp_default:  # the recipe's own setting (mixprec.devices.threads.quiet_waiting)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    log = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, env=env)
    if log.returncode:
        raise SystemExit(f"the TRL runner failed ({log.returncode}):\n{log.stdout[-3000:]}\n{log.stderr[-3000:]}")
    (out / "run.log").write_text(log.stdout + log.stderr)
    steps = read_metrics(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "lr": [r["learning_rate"] for r in steps], "step_time_s": [r["step_time_s"] for r in steps],
            "compute_s": [r["compute_s"] for r in steps], "threads": summary["threads"], "summary": summary,
            "command": " ".join(cmd[1:])}


def step_times(run: dict, warmup: int) -> dict:
    """The median step time after the warm-up, and its 10th percentile (less moved by other processes' load)."""
    times = sorted(t for t in run["step_time_s"][warmup:] if t is not None)
    return {"median_step_s": statistics.median(times), "p10_step_s": times[len(times) // 10]}


def compare(recipe: dict, trl: dict) -> dict:
    """Per step: both losses, their absolute and relative difference; the largest of each over the run."""
    if len(recipe["loss"]) != len(trl["loss"]):
        raise SystemExit(f"the recipe logged {len(recipe['loss'])} steps, TRL {len(trl['loss'])}")
    diff = [abs(a - b) for a, b in zip(recipe["loss"], trl["loss"])]
    rel = [d / abs(a) for d, a in zip(diff, recipe["loss"])]
    gdiff = [abs(a - b) / abs(a) for a, b in zip(recipe["grad_norm"], trl["grad_norm"])]
    ldiff = [abs(a - b) / a for a, b in zip(recipe["lr"], trl["lr"])]
    at = max(range(len(rel)), key=rel.__getitem__)
    return {"max_abs": max(diff), "max_rel": max(rel), "at_step": at + 1, "grad_norm_max_rel": max(gdiff),
            "lr_max_rel": max(ldiff),
            "trl_loss_rounded_to_4": all(round(x, 4) == x for x in trl["loss"])}


# the report ----------------------------------------------------------------------------------------------------

def git(*cmd) -> str:
    done = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "?"


def edits() -> list[str]:
    """Uncommitted edits to the code the recipe runs (others may edit the working tree while this runs)."""
    return git("status", "--short", "mixprec", "recipes/train.py").splitlines()


def machine() -> dict:
    import platform

    import torch
    import transformers

    from mixprec.devices import hardware

    return {"line": hardware.machine_line(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": git("rev-parse", "HEAD")}


def save(report: dict, args, out: Path) -> None:
    summarize(report, args)
    (out / "trl_peer.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "trl_peer.md").write_text(markdown(report, args))


def one(kind: str, model, train, val, ordered, args, precision: str, out: Path) -> dict:
    load = os.getloadavg()
    started = time.perf_counter()
    run = (run_recipe(model, train, val, args, precision, out) if kind == "recipe"
           else run_trl(model, ordered, args, precision, out))
    run.update(load=load, load_after=os.getloadavg(), wall_s=time.perf_counter() - started,
               **step_times(run, args.warmup), edits=edits() if kind == "recipe" else None)
    print(f"  {kind:6s} {precision}: median step {run['median_step_s'] * 1e3:.1f} ms, final loss "
          f"{run['loss'][-1]:.6f}, load {load[0]:.2f}", flush=True)
    return run


def main(argv=None) -> dict:
    args = parse(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    out = Path(args.out or f"runs/trl-peer-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (out / "trl_peer.json").exists():
        raise SystemExit(f"--out {out} holds a trl_peer.json already: give a new folder")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    model = make_model(out, args.seed)
    train, val = make_data(out, model, args.rows, args.seed)
    order, table = recipe_order(model, train, val, args, out)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    ordered = write_jsonl(out / "chat_in_batch_order.jsonl", [rows[i] for i in order])
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "block": BLOCK, "argv": sys.argv[1:] if argv is None
              else list(argv), "complete": False, "rounds": [], "masks": {}}
    for r in range(args.repeats):
        for precision in args.precisions:
            kinds = ("recipe", "trl") if r % 2 == 0 else ("trl", "recipe")
            entry = {"round": r + 1, "precision": precision, "order": " then ".join(kinds)}
            report["rounds"].append(entry)
            for kind in kinds:
                entry[kind] = one(kind, model, train, val, ordered, args, precision,
                                  out / "runs" / f"{kind}-{precision}-r{r + 1}")
                if kind == "trl" and not report["masks"]:
                    report["masks"] = check_masks(out / "runs" / f"trl-{precision}-r{r + 1}" / "tokens.jsonl",
                                                  order, table)
                    report["trl_version"] = entry["trl"]["summary"]["trl"]
                if "recipe" in entry and "trl" in entry:
                    entry["compare"] = compare(entry["recipe"], entry["trl"])
                save(report, args, out)
    report["complete"] = True
    save(report, args, out)
    print(markdown(report, args).split("\n| round |")[0])
    return report


if __name__ == "__main__":
    main()
