"""The support matrix: every model on every engine in every precision, as tests/test_matrix.py runs it on CPUs,
and the table README.md shows (`table()`; tests/test_docs.py keeps README's copy equal to it).

Each model runs small (a few optimizer steps; the CNN and the GPT shrunk) so that every cell, fp16 and bf16
included, stays quick on CPUs that emulate 16-bit matmuls. The global batch is the same for every engine:
one process takes 2b rows, two processes b each. The transformers models (hf_llama: a causal LM, hf_bert: a
classifier) are tiny models that scripts/make_tiny_hf.py builds from configs into a folder the test makes once
(`HF` in their flags stands for it)."""
from __future__ import annotations

from dataclasses import dataclass

from helpers import CONFIGS, REPO

RECIPES = REPO / "recipes" / "configs"
STEPS, CHECKPOINT, KILL = 12, 6, 9  # optimizer steps; a checkpoint at step 6; SIGKILL after step 9
# fp16: a loss scale well below the overflow of either engine (each of 2 processes averages its loss over half
# the rows, so its fp16 activation gradients are twice one process's: at 65536 the two overflow at different steps)
COMMON = ["--max_steps", STEPS, "--checkpointing_steps", CHECKPOINT, "--log_every", 3, "--eval_steps", CHECKPOINT,
          "--checkpoints_total_limit", 3, "--init_scale", 4096]
MODELS = {  # model -> (flags, per-process batch b)
    "mlp": ([], 16),
    "cnn": (["--config", RECIPES / "cnn_digits.yaml", "--model_args", "widths=[8,16],blocks=[1,1]",
             "--dataset_args", "image_size=16"], 8),
    "gpt_tiny": (["--config", RECIPES / "gpt_tiny.yaml", "--model_args", "n_embd=64,n_head=2,block_size=32",
                  "--dataset_args", "max_val_samples=32", "--sample_tokens", 16], 4),
    "hf_llama": (["--model_name_or_path", "HF/llama/model", "--dataset", "text", "--train_file", "HF/corpus.txt",
                  "--block_size", 32, "--dataset_args", "max_val_samples=32", "--sample_tokens", 8], 4),
    "hf_bert": (["--model_name_or_path", "HF/bert/model", "--dataset", "text_classification", "--train_file",
                 "HF/bert/classify.csv", "--block_size", 16, "--lr", 3e-3], 8),
}
ENGINES = {  # engine -> (accelerate config, processes)
    "one process": (CONFIGS / "cpu.yaml", 1),
    "DDP": (CONFIGS / "multi_cpu.yaml", 2),
    "ZeRO-2": (CONFIGS / "deepspeed_zero2.yaml", 2),
    "ZeRO-3": (CONFIGS / "deepspeed_zero3.yaml", 2),
}
PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
# Agreement with the one-process run at the same global batch: the largest relative difference allowed in any
# logged loss and the final validation loss. DDP all-reduces fp32 gradients (only the summation order differs);
# ZeRO keeps fp32 master weights but, in bf16, runs the model itself in bf16 where one process runs autocast, a
# different computation. The CNN's BatchNorm normalizes each process's half of the batch, not the whole batch.
AGREEMENT = {("DDP", "no"): 1e-5, ("DDP", "bf16"): 1e-3, ("DDP", "fp16"): 1e-3,
             ("ZeRO-2", "no"): 1e-5, ("ZeRO-3", "no"): 1e-5, ("ZeRO-2", "bf16"): 5e-2, ("ZeRO-3", "bf16"): 5e-2,
             # where DeepSpeed has fp16 on a CPU (oneDNN fp16, e.g. an Intel Xeon with AVX512-FP16): the cells
             # pass within these bounds there (the largest difference not recorded); as bf16
             ("ZeRO-2", "fp16"): 5e-2, ("ZeRO-3", "fp16"): 5e-2}
BATCH_NORM = 1e-2  # the CNN on two processes, any engine (measured: 1.5e-3)


@dataclass(frozen=True)
class Cell:
    model: str
    engine: str
    precision: str

    @property
    def refused(self) -> str | None:
        """Why this cell stops before training on a CPU, or None when it trains."""
        if self.engine.startswith("ZeRO") and self.precision == "fp16":
            return "DeepSpeed's CPU accelerator has fp16 only with oneDNN fp16 (AVX512-FP16 or AMX-FP16)"
        return None

    @property
    def killed(self) -> bool:
        """Whether this cell is also killed (SIGKILL) and resumed in its own folder: one cell per engine x
        precision that trains, the models in rotation, so that every model is killed on two engines and
        precisions. (A resume in every cell would add 40 launches, a third of the matrix's time: the suite must
        stay under 35 minutes on 2 cores.)"""
        trains = [(e, p) for e in ENGINES for p in PRECISIONS if not Cell("mlp", e, p).refused]
        turn = trains.index((self.engine, self.precision)) if (self.engine, self.precision) in trains else -1
        return turn >= 0 and list(MODELS)[turn % len(MODELS)] == self.model

    @property
    def fp16_trained(self) -> bool:
        """Whether this refused cell is trained where DeepSpeed has fp16 after all (oneDNN fp16: AVX512-FP16 or
        AMX-FP16): one model per ZeRO stage (the BatchNorm CNN on ZeRO-2, the transformers causal LM on ZeRO-3).
        The refusal elsewhere is decided from the engine and precision alone, before the model or data is built
        (precision.choose, before training.start), and every model's refusal is tested where it applies."""
        return self.refused is not None and (self.engine, self.model) in (("ZeRO-2", "cnn"), ("ZeRO-3", "hf_llama"))

    @property
    def id(self) -> str:
        return f"{self.model}-{self.engine.replace(' ', '_')}-{PRECISIONS[self.precision]}"

    def args(self, hf_folder=None) -> list:
        """The recipe's flags; `hf_folder`: the folder of the tiny transformers models (HF in their flags)."""
        flags, batch = MODELS[self.model]
        processes = ENGINES[self.engine][1]
        flags = [str(f).replace("HF/", f"{hf_folder}/", 1) if str(f).startswith("HF/") else f for f in flags]
        return [*flags, *COMMON, "--mixed_precision", self.precision, "--batch_size", batch * (2 // processes)]


CELLS = [Cell(m, e, p) for m in MODELS for e in ENGINES for p in PRECISIONS]


def table() -> str:
    """The README's support matrix: one row per engine (models with the same results share it); CPU cells as
    tests/test_matrix.py runs them, GPU ones as scripts/gpu_checks.sh prepares them."""
    rows = ["| engine | models | fp32 | bf16 | fp16 | fp8 |", "|---|---|---|---|---|---|"]
    for engine in ENGINES:
        marks = {}
        for model in MODELS:
            cells = [Cell(model, engine, p) for p in PRECISIONS]
            marks.setdefault(tuple("refused (1)" if c.refused else "tested" for c in cells), []).append(model)
        for mark, models in marks.items():
            named = "all" if len(models) == len(MODELS) else ", ".join(models)
            rows.append(f"| {engine}, CPU | {named} | {' | '.join(mark)} | refused (3) |")
    rows.append("| FSDP2, CPU | all | refused (2) | refused (2) | refused (2) | refused (3) |")
    rows.append("| one GPU, DDP, FSDP2, DeepSpeed, multi-node on GPUs | all | prepared, not run | prepared, not run "
                "| prepared, not run | prepared, not run |")
    notes = ["", f"all: {', '.join(MODELS)} (hf_: transformers). "
             "tested: tests/test_matrix.py trains the cell through `accelerate launch` with the repository's config: "
             "the loss falls, model.safetensors reproduces the validation loss, the cell agrees with one process at "
             "the same global batch, and (one model per cell, in rotation) a SIGKILL and `--resume_from_checkpoint "
             "latest` end bitwise where the uninterrupted run ends.",
             "(1) DeepSpeed's CPU accelerator has fp16 only where oneDNN does (AVX512-FP16 or AMX-FP16); elsewhere "
             "the recipe stops before training with one line.",
             "(2) Accelerate (1.15, 1.16) sets up DDP instead of FSDP on CPU processes: the recipe refuses "
             "accelerate_configs/fsdp.yaml there.",
             "(3) fp8 needs fp8 tensor cores (compute capability 8.9+): one line, exit code 2. On a CPU, "
             "recipes/precision_report.py and precision_diff.py simulate fp8's numerics, not its speed.",
             "prepared, not run: scripts/gpu_checks.sh; no GPU was available to this project yet."]
    return "\n".join(rows + notes)


if __name__ == "__main__":
    print(table())
