"""Memory for one training step in fp32, fp16, bf16 and int8, measured on a copy of the model.

Each row runs one real step on one real batch (forward, backward, one AdamW step) and adds up the bytes of
the storages actually allocated: the parameters, their gradients, the AdamW state, and the activations
autograd saved for the backward pass (caught with `torch.autograd.graph.saved_tensors_hooks`, parameters
left out, each storage counted once). The same method on every device: no allocator statistics are used
(a CPU has none). Temporaries freed during the step are not counted; on CUDA, the caching allocator's
reserve comes on top.

- fp32, fp16, bf16: the whole model and its inputs cast to that type ("pure" low precision).
- fp16/bf16 autocast: what the recipe trains with: fp32 master weights, gradients and AdamW state, with
  autocast's low-precision activations (and the low-precision weight copies it keeps for the backward).
- int8: the weights quantized per tensor (int8 values and one fp32 scale each), as stored for inference;
  int8 is not a training format here, so it has no gradients, optimizer state or activations.
"""
from __future__ import annotations

import contextlib
import copy

import torch

ROWS = ["fp32", "fp16", "bf16", "int8", "fp16 autocast", "bf16 autocast"]
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _cast_inputs(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _step(model, batch, loss_fn, device, dtype: torch.dtype, autocast: torch.dtype | None) -> dict:
    model = copy.deepcopy(model).to(dtype)
    params = list(model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs and st.nbytes():
            saved[st.data_ptr()] = st.nbytes()
        return t

    batch = _cast_inputs(batch, dtype)
    amp = torch.autocast(device_type=device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        loss = loss_fn(model(batch["inputs"]), batch["labels"])
    loss.backward()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
            "optimizer_state": storage_bytes(state), "activations": sum(saved.values())}


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor int8: w ~ q * scale, q in [-127, 127]."""
    scale = (w.detach().abs().max().float() / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8), scale


def measure(model: torch.nn.Module, batch: dict, loss_fn, device: torch.device) -> list[dict]:
    rows = []
    for name in ROWS:
        if name == "int8":
            tensors = [t for p in model.parameters() for t in quantize_int8(p)]
            row = {"parameters": storage_bytes(tensors), "gradients": None, "optimizer_state": None,
                   "activations": None}
        elif name.endswith("autocast"):
            row = _step(model, batch, loss_fn, device, torch.float32, _DTYPES[name.split()[0]])
        else:
            row = _step(model, batch, loss_fn, device, _DTYPES[name], None)
        row["total"] = sum(v for v in row.values() if v is not None)
        rows.append({"format": name, **row})
    return rows
