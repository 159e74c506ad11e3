"""The CNN and GPT models: shapes, the GPT-2 recipe (causal, tied, initialised, pre-LN), presets, options."""
import copy
import math

import pytest
import torch

from mixprec import config, models
from mixprec.training import speed
from mixprec.precision import policy
from mixprec.errors import UsageError

TEXT = {"task": "language_modeling", "vocab_size": 256, "block_size": 64}
DIGITS = {"task": "image_classification", "image_shape": [1, 32, 32], "num_classes": 10, "mean": [0.3], "std": [0.3]}


def gpt(name="gpt_tiny", info=None, **args):
    torch.manual_seed(0)
    return models.build(name, {**TEXT, **(info or {})}, args)


@pytest.mark.parametrize("name, vocab, low, high", [("gpt_small", 256, 10.0e6, 11.0e6), ("gpt2", 50257, 124e6, 125e6)])
def test_presets_have_the_advertised_sizes(name, vocab, low, high):
    block = models.setting(name, {}, "block_size")
    with torch.device("meta"):  # 124M parameters without allocating them
        model = models.build(name, {**TEXT, "vocab_size": vocab, "block_size": block})
    assert low < model.num_parameters(non_embedding=False) < high
    assert (block, model.n_layer, model.n_head, model.n_embd) == {"gpt_small": (256, 6, 6, 384),
                                                                 "gpt2": (1024, 12, 12, 768)}[name]
    if vocab > 256:
        assert model.wte.weight.shape[0] == 50304  # padded to a multiple of 64, as in nanoGPT


def test_other_sizes_by_config_alone(tmp_path):
    yml = tmp_path / "gpt_deep.yaml"
    yml.write_text("model: gpt\ndataset: stdlib\nmodel_args: {n_layer: 3, n_head: 2, n_embd: 64, block_size: 32}\n")
    cfg = config.parse_config(["--config", str(yml)])
    model = models.build(cfg.model, {**TEXT, "block_size": 32}, cfg.model_args)
    assert (len(model.h), model.n_head, model.n_embd, model.block_size) == (3, 2, 64, 32)
    assert models.setting("gpt", cfg.model_args, "block_size") == 32 and models.setting("mlp", {}, "block_size") is None


def test_gpt_is_causal_and_maps_tokens_to_vocabulary_logits():
    model = gpt().eval()
    ids = torch.randint(0, 256, (2, 64))
    changed = ids.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 256
    a, b = model(ids), model(changed)
    assert a.shape == (2, 64, 256)
    torch.testing.assert_close(a[:, :40], b[:, :40])  # the past does not see the future
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_input_and_output_embeddings_are_tied():
    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names) and "wte.weight" in names
    assert not any("lm_head" in k for k in model.state_dict())  # the output layer holds no weight of its own
    twin = copy.deepcopy(model)
    assert twin.lm_head.embedding is twin.wte and model.lm_head.embedding is model.wte
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the logits matmul is a module: --fp32_modules can name it
        assert model(torch.randint(0, 256, (1, 8))).dtype == torch.bfloat16
        policy.keep_fp32(twin, policy.names_of(policy.match(twin, ["lm_head"])))
        assert twin(torch.randint(0, 256, (1, 8))).dtype == torch.float32
    ids = torch.randint(0, 256, (1, 8))
    model(ids).sum().backward()
    # untied, only the 8 input rows of the embedding would get a gradient; tied, the output layer reaches all
    assert model.wte.weight.grad.abs().sum(1).gt(0).all()


def test_gpt2_initialisation():
    model = gpt("gpt_small")
    stds = {n: p.std().item() for n, p in model.named_parameters() if p.dim() == 2}
    assert stds["wte.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["h.0.attn.c_attn.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["h.3.mlp.c_proj.weight"] == pytest.approx(0.02 / math.sqrt(2 * 6), rel=0.05)  # residual projections
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("attn.c_attn.bias"))


def test_blocks_are_pre_layernorm():
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)): with the sublayers zeroed, a block is the identity."""
    block = gpt().h[0]
    for p in (block.attn.c_proj.weight, block.attn.c_proj.bias, block.mlp.c_proj.weight, block.mlp.c_proj.bias):
        torch.nn.init.zeros_(p)
    x = torch.randn(2, 8, 128) * 5
    torch.testing.assert_close(block(x), x)


def test_activation_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 256, (2, 64))
    grads = []
    for on in (False, True):
        model = gpt()
        model.activation_checkpointing = on
        model(ids).float().pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_generate_extends_the_prompt_deterministically():
    model = gpt().eval()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 70, generator=torch.Generator().manual_seed(1))  # past the context of 64
    b = model.generate(prompt, 70, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 73) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)


def test_cnn_classifies_raw_pixels_and_channels_last_changes_layout_not_results():
    torch.manual_seed(0)
    plain = models.build("cnn", DIGITS)
    torch.manual_seed(0)
    nhwc = models.build("cnn", DIGITS, {"channels_last": True})
    assert nhwc.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
    pixels = torch.randint(0, 256, (4, 1, 32, 32))
    plain.eval(), nhwc.eval()
    torch.testing.assert_close(plain(pixels), nhwc(pixels), rtol=1e-4, atol=1e-4)
    assert plain(pixels).shape == (4, 10)
    assert models.build("cnn", {**DIGITS, "image_shape": [3, 28, 28], "mean": [.5] * 3, "std": [.2] * 3})(
        torch.randint(0, 256, (2, 3, 28, 28))).shape == (2, 10)


@pytest.mark.parametrize("name, info, words", [
    ("gpt_tiny", DIGITS, ["language model", "stdlib"]),
    ("cnn", TEXT, ["images", "digits"]),
    ("mlp", TEXT, ["tables", "gpt"]),
    ("gpt_tiny", {**TEXT, "block_size": 128}, ["128", "context 64"]),
])
def test_a_model_on_the_wrong_data_is_a_usage_error(name, info, words):
    with pytest.raises(UsageError) as err:
        models.build(name, info)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_speed_options_on_cpu():
    model = gpt()
    keys = set(model.state_dict())
    cfg = config.parse_config(["--model", "gpt_tiny", "--compile", "--activation_checkpointing"])
    applied = speed.apply(cfg.speed, cfg, model, torch.device("cpu"))
    assert applied["compile"] and applied["activation_checkpointing"] and applied["fused_adamw"]  # CPU too
    assert model.activation_checkpointing and set(model.state_dict()) == keys  # compiled in place: same names
    with pytest.raises(UsageError, match="--tf32 is for fp32 training on CUDA"):
        tf32 = config.parse_config(["--tf32"])
        speed.apply(tf32.speed, tf32, gpt(), torch.device("cpu"))
    with pytest.raises(UsageError, match="--activation_checkpointing is for the gpt models"):
        checkpointed = config.parse_config(["--activation_checkpointing"])
        speed.apply(checkpointed.speed, checkpointed, models.build("cnn", DIGITS), torch.device("cpu"))
