"""FLOPs per sample, peak FLOP/s (table or measured), and the throughput arithmetic."""
import pytest
import torch

from mixprec import metrics, models

TEXT = {"task": "language_modeling", "vocab_size": 256, "block_size": 64}


def test_counted_flops_of_the_mlp_are_six_per_weight_less_the_unneeded_input_gradient():
    mlp = models.build("mlp", {"num_features": 100, "num_classes": 10})
    macs = [100 * 256, 256 * 128, 128 * 10]
    # forward 2 per multiply-add, backward 4 (input and weight gradients), but no gradient for the input data
    assert metrics.count_flops(mlp, torch.randn(100)) == 6 * sum(macs) - 2 * macs[0]
    cost = metrics.training_cost(mlp, torch.randn(100), {"task": "classification"})
    assert cost["tokens_per_sample"] == 1 and "counted" in cost["flops_method"]


def test_gpt_flops_follow_palm_and_agree_with_the_counter():
    model = models.build("gpt_tiny", TEXT)
    n_matrix = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "wpe.weight")
    T, L, H, Q = 64, 2, 4, 32
    cost = metrics.training_cost(model, torch.zeros(T, dtype=torch.long), TEXT)
    assert cost["tokens_per_sample"] == T
    assert cost["flops_per_sample"] == T * (6 * model.num_parameters() + 12 * L * H * Q * T)
    # the counter sees the Linear layers (6 per weight per token), not the tied output layer (a functional call
    # on the embedding's weight) nor the attention: why the GPT models count with the formula
    counted = metrics.count_flops(model, torch.zeros(T, dtype=torch.long))
    assert counted == 6 * (n_matrix - model.wte.weight.numel()) * T


def test_count_flops_leaves_the_model_untouched():
    torch.manual_seed(0)
    cnn = models.build("cnn", {"task": "image_classification", "image_shape": [1, 8, 8], "num_classes": 10,
                               "mean": [0.3], "std": [0.3]})
    before = {k: v.clone() for k, v in cnn.state_dict().items()}
    assert metrics.count_flops(cnn, torch.randint(0, 256, (1, 8, 8))) > 0
    assert all(torch.equal(before[k], v) for k, v in cnn.state_dict().items())  # batch-norm statistics too
    assert all(p.grad is None for p in cnn.parameters())


@pytest.mark.parametrize("name, precision, tf32, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989e12),
    ("NVIDIA H200", "fp16", False, 989e12),
    ("NVIDIA H100 80GB HBM3", "no", True, 495e12),
    ("NVIDIA H100 80GB HBM3", "fp8", False, 1979e12),
    ("NVIDIA H100 PCIe", "bf16", False, 756e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312e12),
    ("NVIDIA A100-SXM4-40GB", "no", True, 156e12),
    ("NVIDIA A100 80GB PCIe", "no", False, 19.5e12),
    ("NVIDIA L40S", "bf16", False, 362e12),
    ("NVIDIA L4", "bf16", False, 121e12),
    ("NVIDIA A10", "fp16", False, 125e12),
    ("Tesla T4", "fp16", False, 65e12),
])
def test_peak_table(name, precision, tf32, expected):
    key = {"no": "tf32" if tf32 else "fp32"}.get(precision, precision)
    value, source = metrics.table_peak(name, key)
    assert value == expected and "datasheet" in source


def test_unlisted_gpus_and_missing_precisions_are_not_in_the_table():
    assert metrics.table_peak("NVIDIA GeForce RTX 9090", "bf16") is None
    assert metrics.table_peak("Tesla T4", "bf16") is None  # no bf16 on Turing: measured instead


def test_cpu_peak_is_measured_and_an_unknown_device_never_crashes(monkeypatch):
    peak = metrics.peak_flops(torch.device("cpu"), "no")
    assert peak["peak_flops"] > 1e9 and peak["peak_flops_source"].startswith("measured at start-up")
    assert "fp32" in peak["peak_flops_source"]
    from mixprec.devices import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    peak = metrics.peak_flops(torch.device("cpu"), "bf16")
    assert peak["peak_flops"] > 0 and "best bf16 matmul" in peak["peak_flops_source"]
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2"})  # bf16 emulated: no peak, no MFU
    peak = metrics.peak_flops(torch.device("cpu"), "bf16")
    assert peak["peak_flops"] is None and "bf16 is emulated on this CPU" in peak["peak_flops_source"]
    assert metrics.peak_flops(torch.device("cpu"), "no", override=5e12) == {"peak_flops": 5e12,
                                                                           "peak_flops_source": "--peak_flops"}

    def broken(*args):
        raise RuntimeError("no such device")

    monkeypatch.setattr(metrics, "measure_peak", broken)
    peak = metrics.peak_flops(torch.device("cpu"), "no")
    assert peak["peak_flops"] is None and "no such device" in peak["peak_flops_source"]
    assert "unknown" in metrics.describe_peak({"flops_per_sample": 1e9, "flops_method": "x"}, peak)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_throughput_windows_totals_data_wait_and_pauses(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    cost = {"flops_per_sample": 1e9, "tokens_per_sample": 64}
    meter = metrics.Throughput(cost, {"peak_flops": 1e12}, world_size=2)

    def loader(n, wait):
        for i in range(n):
            clock.now += wait  # the loader takes `wait` seconds to produce a batch
            yield i

    for _ in meter.timed(loader(4, 0.25)):
        clock.now += 0.75  # the step takes 0.75 s
        meter.add(32, step=True)
    first = meter.report()  # 4 steps of 1 s, 128 samples
    assert first["samples_per_s"] == pytest.approx(32) and first["tokens_per_s"] == pytest.approx(32 * 64)
    assert first["step_time_s"] == pytest.approx(1.0) and first["data_wait_frac"] == pytest.approx(0.25)
    assert first["mfu"] == pytest.approx(32 * 1e9 / (1e12 * 2)) and first["peak_memory_bytes"] > 0
    clock.now += 50  # evaluation and a checkpoint
    meter.exclude_pause()
    for _ in meter.timed(loader(2, 0.0)):
        clock.now += 0.5
        meter.add(32, step=False)  # accumulation: one optimizer step for two micro-batches
    meter.add(0, step=True)
    second = meter.report()
    assert second["samples_per_s"] == pytest.approx(64) and second["step_time_s"] == pytest.approx(1.0)
    total = meter.summary()  # 192 samples in 5 s of training; the 50 s pause is not counted
    assert total["samples_per_s"] == pytest.approx(192 / 5) and total["data_wait_frac"] == pytest.approx(0.2)
    assert set(metrics.TIMING_FIELDS) >= set(total) - {"peak_memory_kind"}
