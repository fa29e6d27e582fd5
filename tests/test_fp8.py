"""FP8 block-quantised checkpoints (tandem/model/fp8.py, the loader's dequantising path): the quantisation error
bound, the converter's on-disk layout (official Qwen3 / DeepSeek fp8 format), logits of the FP8 tandem-tiny against
the dequantised reference and the bf16 original, modules_to_not_convert, and clear errors for what is not read."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.config import ConfigError, EngineConfig, ModelConfig
from tandem.engine.engine import Engine
from tandem.engine.scheduler import ScheduledChunk
from tandem.model import fp8
from tandem.model.fp8 import convert_checkpoint, dequantize_block_fp8, is_quantized, quantize_block_fp8
from tandem.model.loader import CheckpointError, load_checkpoint
from admitted import admitted

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tandem-tiny")


def prompt_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    with open(os.path.join(MODEL, "heldout_prompts.json")) as f:
        messages = json.load(f)[0]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

# Measured FP8 vs the bf16 original on the first held-out prompt (22 tokens, fp32 compute): max |logit difference|
# 0.95 (logits span +-17.7, mean difference 0.05), max KL(orig || fp8) per row 0.042, argmax agreeing on every row.
# The bounds below sit about 2x above that.
BF16_TOL, KL_TOL = 2.0, 0.1


def check_bound(w, block):
    """Per element, in fp64: |dq - w| <= 2^-4 |w| + 2^-10 s (round to nearest e4m3: 3 mantissa bits give half an
    ulp <= 2^-4 of the value for normals; subnormal spacing is 2^-9 in units of the block scale s = amax/448), and
    so <= amax / 28 < 2^-4 amax per block; the block's amax itself comes back to fp32 accuracy."""
    q, s = quantize_block_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == fp8.scale_shape(w.shape, block)
    dq = dequantize_block_fp8(q, s, block).double()
    w64 = w.double()
    s_full = s.double().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    s_full = s_full[..., : w.shape[-2], : w.shape[-1]]
    err = (dq - w64).abs()
    slack = 1 + 2**-20  # fp32 arithmetic of the division and the dequantising product
    assert (err <= (2**-4 * w64.abs() + 2**-10 * s_full) * slack + 1e-30).all()
    amax = s_full * 448
    assert (err <= amax / 28 * slack).all() and (err <= 2**-4 * amax).all()
    nonzero = s > fp8.AMAX_FLOOR / 448
    m, n = w.shape[-2:]
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            blk = w64[..., i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            dblk = dq[..., i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            if nonzero[..., i, j].all() and blk.ndim == 2:
                k = blk.abs().argmax()
                assert abs(dblk.flatten()[k] - blk.flatten()[k]) <= blk.abs().max() * 2**-20
    return q, s


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 96), (128, 128)), ((3, 70, 50), (32, 16))])
def test_round_trip_error_bound(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-6, 2, shape[-1])  # blocks with very different magnitudes
    check_bound(w, block)


def test_zero_and_tiny_blocks_are_safe():
    w = torch.zeros(256, 256)
    w[128:, 128:] = torch.randn(128, 128) * 1e-3
    q, s = check_bound(w, (128, 128))
    assert torch.isfinite(s).all() and (s > 0).all()
    dq = dequantize_block_fp8(q, s)
    assert torch.equal(dq[:128], torch.zeros(128, 256)) and torch.isfinite(dq).all()
    big = torch.full((4, 4), 1e30)  # saturates to 448 * scale, never inf / nan
    qb, sb = quantize_block_fp8(big, (4, 4))
    assert torch.allclose(dequantize_block_fp8(qb, sb, (4, 4)), big, rtol=1e-6)


def test_naming_rule_and_modules_to_not_convert():
    p = "model.language_model.layers.0."
    for name in ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "self_attn.q_proj",
                 "self_attn.o_proj", "mlp.experts.3.gate_proj", "mlp.experts.3.down_proj", "mlp.shared_expert.up_proj"]:
        assert is_quantized(p + name + ".weight"), name
    for name in ["linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.conv1d", "linear_attn.norm",
                 "mlp.gate", "mlp.shared_expert_gate", "input_layernorm", "self_attn.q_norm"]:
        assert not is_quantized(p + name + ".weight"), name
    assert not is_quantized(p + "linear_attn.A_log") and not is_quantized(p + "linear_attn.dt_bias")
    for name in ["lm_head.weight", "model.language_model.embed_tokens.weight", "mtp.fc.weight",
                 "model.visual.blocks.0.attn.q_proj.weight"]:
        assert not is_quantized(name), name
    assert not is_quantized(p + "self_attn.q_proj.weight", ["model.layers.0.self_attn"])  # prefix-free match
    assert not is_quantized(p + "self_attn.q_proj.weight", ["model.layers.*.self_attn.q_proj"])
    assert is_quantized(p + "mlp.shared_expert.gate_proj.weight", ["mlp.gate"])  # whole components only
    assert is_quantized("model.layers.10.self_attn.q_proj.weight", ["model.layers.1.self_attn"])


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("fp8") / "tandem-tiny-fp8")
    from tandem.model.fp8 import main

    main([MODEL, dst])  # the CLI entry point
    return dst


def test_layout_matches_the_official_format(fp8_dir):
    with open(os.path.join(fp8_dir, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(MODEL, "config.json")) as f:
        src = json.load(f)
    q = raw.pop("quantization_config")
    assert raw == src  # nothing else changed
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["activation_scheme"] == "dynamic"
    assert q["weight_block_size"] == [128, 128]
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert open(os.path.join(fp8_dir, name), "rb").read() == open(os.path.join(MODEL, name), "rb").read()
    cfg = ModelConfig.from_hf(src)
    with safe_open(os.path.join(MODEL, "model.safetensors"), "pt") as f:
        orig = {k: f.get_slice(k).get_shape() for k in f.keys()}
    with safe_open(os.path.join(fp8_dir, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        # experts per expert, in the official naming; no fused expert tensors left
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
        I, H = cfg.moe_intermediate_size, cfg.hidden_size
        for e in range(cfg.num_experts):
            for which, shape in [("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))]:
                n = f"model.language_model.layers.0.mlp.experts.{e}.{which}.weight"
                assert f.get_slice(n).get_shape() == list(shape) and f.get_slice(n).get_dtype() == "F8_E4M3"
        for n in names:
            sl = f.get_slice(n)
            if n.endswith("_scale_inv"):
                w = n.removesuffix("_scale_inv")
                assert w in names and sl.get_dtype() == "F32"
                assert tuple(sl.get_shape()) == fp8.scale_shape(f.get_slice(w).get_shape())
            elif is_quantized(n):
                assert sl.get_dtype() == "F8_E4M3" and n + "_scale_inv" in names, n
            else:
                assert sl.get_dtype() == "BF16" and n + "_scale_inv" not in names, n
                assert orig[n] == sl.get_shape()
                if n.endswith(".weight") and len(sl.get_shape()) >= 2:
                    assert n.removesuffix(".weight") in q["modules_to_not_convert"], n
    assert "lm_head" in q["modules_to_not_convert"]
    assert "model.language_model.layers.0.mlp.gate" in q["modules_to_not_convert"]
    assert "model.language_model.layers.0.linear_attn.in_proj_b" in q["modules_to_not_convert"]
    assert len({n for n in names if not n.endswith("_scale_inv") and "experts." not in n}) == \
        len({n for n in orig if "experts." not in n})


def dequantised_reference(cfg):
    """The original checkpoint in fp32 with every quantised weight replaced by dequantize(quantize(w)): experts per
    expert (gate and up rows separately), other projections by the naming rule."""
    model = load_checkpoint(MODEL, cfg, "cpu", torch.float32, progress=False)
    I = cfg.moe_intermediate_size
    rt = lambda t: dequantize_block_fp8(*quantize_block_fp8(t))  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                for e in range(p.shape[0]):
                    p.data[e, :I] = rt(p.data[e, :I])
                    p.data[e, I:] = rt(p.data[e, I:])
            elif name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    p.data[e] = rt(p.data[e])
            elif is_quantized(name):
                p.data.copy_(rt(p.data))
    return model


def logits(cfg, model, ids):
    eng = Engine(cfg, model, EngineConfig(block_size=16, max_num_seqs=1, max_model_len=128))
    seq = admitted(eng, "a", ids, max_tokens=1)
    return eng.runner.run([ScheduledChunk(seq, len(ids))], all_rows=True)


def test_fp8_tandem_tiny_logits(fp8_dir):
    cfg = ModelConfig.from_dir(fp8_dir)
    model = load_checkpoint(fp8_dir, cfg, "cpu", torch.float32, progress=False)
    assert hasattr(model, "mtp")
    ref = dequantised_reference(cfg)
    a, b = model.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same weights, bit for bit
    ids = prompt_ids()
    got, want = logits(cfg, model, ids), logits(cfg, ref, ids)
    assert (got - want).abs().max() <= 1e-4
    orig = logits(cfg, load_checkpoint(MODEL, cfg, "cpu", torch.float32, progress=False), ids)
    diff = (got - orig).abs().max().item()
    assert 0 < diff <= BF16_TOL, diff
    lp, lq = orig.log_softmax(-1), got.log_softmax(-1)
    assert (lp.exp() * (lp - lq)).sum(-1).max() <= KL_TOL
    assert (got.argmax(-1) == orig.argmax(-1)).float().mean() >= 0.9


def rewrite(src, dst, tensors=None, quant=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, os.path.join(dst, "model.safetensors"))
    if quant is not None:
        with open(os.path.join(dst, "config.json")) as f:
            raw = json.load(f)
        raw["quantization_config"] = quant
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(raw, f)
    return str(dst)


def read_all(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load(path):
    return load_checkpoint(path, ModelConfig.from_dir(path), "cpu", torch.float32, progress=False)


@pytest.mark.parametrize("quant,msg", [
    ({"quant_method": "awq", "bits": 4}, "quant_method: 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt: 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "'static'"),
    ({"quant_method": "fp8"}, "weight_block_size: missing; per-tensor"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: expected two positive"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size: expected two positive"),
])
def test_bad_quantization_config_is_a_clear_error(fp8_dir, tmp_path, quant, msg):
    bad = rewrite(fp8_dir, tmp_path / "bad", quant=quant)
    with pytest.raises(ConfigError, match=msg):  # reading the config already fails, before any tensor is read
        ModelConfig.from_dir(bad)


def test_missing_misshaped_and_orphan_scales_are_listed(fp8_dir, tmp_path):
    t = read_all(fp8_dir)
    l0 = "model.language_model.layers.0."
    del t[l0 + "linear_attn.in_proj_z.weight_scale_inv"]
    t[l0 + "linear_attn.out_proj.weight_scale_inv"] = torch.ones(3, 3)
    del t[l0 + "mlp.shared_expert.up_proj.weight"]
    t[l0 + "mlp.gate.weight_scale_inv"] = torch.ones(1, 2)
    bad = rewrite(fp8_dir, tmp_path / "bad", tensors=t)
    with pytest.raises(CheckpointError) as e:
        load(bad)
    msg = str(e.value)
    assert f"missing scale tensor {l0}linear_attn.in_proj_z.weight_scale_inv" in msg
    assert f"mis-shaped scale tensor {l0}linear_attn.out_proj.weight_scale_inv" in msg
    assert f"unexpected tensor {l0}mlp.shared_expert.up_proj.weight_scale_inv" in msg
    assert "missing tensor model.layers.0.mlp.shared_expert.up_proj.weight" in msg
    assert f"{l0}mlp.gate.weight: has a _scale_inv but is not float8" in msg


def test_modules_to_not_convert_are_honoured(tmp_path):
    dst = str(tmp_path / "fp8")
    skip = ["model.layers.*.self_attn", "mlp.shared_expert.down_proj"]
    q = convert_checkpoint(MODEL, dst, exclude=skip)
    assert all(s in q["modules_to_not_convert"] for s in skip)
    t = read_all(dst)
    for n, v in t.items():
        if (n.startswith("model.") and ".self_attn." in n) or "shared_expert.down_proj" in n:
            assert v.dtype == torch.bfloat16 and not n.endswith("_scale_inv"), n
    assert t["mtp.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # `model.layers.*` only
    assert t["model.language_model.layers.0.mlp.shared_expert.up_proj.weight"].dtype == torch.float8_e4m3fn
    model = load(dst)
    orig = load(MODEL)
    k = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[k], orig.state_dict()[k])
    # an FP8 tensor the config says is not converted is an error
    t["model.language_model.layers.3.self_attn.q_proj.weight"], t[
        "model.language_model.layers.3.self_attn.q_proj.weight_scale_inv"] = quantize_block_fp8(
        t["model.language_model.layers.3.self_attn.q_proj.weight"])
    bad = rewrite(dst, tmp_path / "bad", tensors=t)
    with pytest.raises(CheckpointError, match="self_attn.q_proj.weight: stored as float8 but"):
        load(bad)


def test_sharded_fp8_checkpoint_with_scales_in_other_shards(fp8_dir, tmp_path):
    t = read_all(fp8_dir)
    d = tmp_path / "sharded"
    shutil.copytree(fp8_dir, d)
    os.remove(d / "model.safetensors")
    weights = sorted(n for n in t if not n.endswith("_scale_inv"))
    scales = sorted(n for n in t if n.endswith("_scale_inv"))
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for fname, names in shards.items():
        save_file({n: t[n] for n in names}, d / fname)
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fn for fn, ns in shards.items() for n in ns}}, f)
    a, b = load(str(d)).state_dict(), load(fp8_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------- W8A8

def load_w8a8(path):
    return load_checkpoint(path, ModelConfig.from_dir(path), "cpu", torch.float32, progress=False, fp8_compute=True)


# Measured W8A8 (e4m3 weights, activations quantised per token and 128-group, torch reference path) against the
# dequantised load on the first held-out prompt (fp32 compute): max |logit difference| 1.07 (logits span +-17.7),
# max KL per row 0.052, argmax agreeing on every row. The bounds sit about 2x above that.
W8A8_TOL, W8A8_KL_TOL = 2.0, 0.1


def test_w8a8_load_keeps_the_checkpoint_bytes(fp8_dir):
    model = load_w8a8(fp8_dir)
    params = dict(model.named_parameters())
    t = read_all(fp8_dir)
    l0 = "model.language_model.layers.0."
    for name in ["linear_attn.in_proj_qkv.weight", "linear_attn.out_proj.weight", "mlp.shared_expert.down_proj.weight"]:
        ours = "model.layers.0." + name
        assert params[ours].dtype == torch.float8_e4m3fn
        assert torch.equal(params[ours].view(torch.uint8), t[l0 + name].view(torch.uint8))
        assert torch.equal(params[ours + "_scale_inv"], t[l0 + name + "_scale_inv"])
    for name in ["linear_attn.in_proj_a.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight"]:
        assert params["model.layers.0." + name].dtype == torch.float32 and "model.layers.0." + name + "_scale_inv" \
            not in params
    experts = "model.layers.0.mlp.experts"
    gu, gus = params[f"{experts}.gate_up_proj"], params[f"{experts}.gate_up_proj_scale_inv"]
    inter, half = gu.shape[1] // 2, gus.shape[1] // 2
    for e in (0, 5):
        p = f"{l0}mlp.experts.{e}."
        assert torch.equal(gu[e, :inter].view(torch.uint8), t[p + "gate_proj.weight"].view(torch.uint8))
        assert torch.equal(gu[e, inter:].view(torch.uint8), t[p + "up_proj.weight"].view(torch.uint8))
        assert torch.equal(gus[e, :half], t[p + "gate_proj.weight_scale_inv"])
        assert torch.equal(gus[e, half:], t[p + "up_proj.weight_scale_inv"])
        down = params["model.layers.0.mlp.experts.down_proj_scale_inv"][e]
        assert torch.equal(down, t[p + "down_proj.weight_scale_inv"])


def test_w8a8_logits_against_the_dequantised_model(fp8_dir):
    cfg = ModelConfig.from_dir(fp8_dir)
    ids = prompt_ids()
    got = logits(cfg, load_w8a8(fp8_dir), ids)
    want = logits(cfg, load_checkpoint(fp8_dir, cfg, "cpu", torch.float32, progress=False), ids)  # dequantised
    diff = (got - want).abs().max().item()
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).max().item()
    print(f"W8A8 vs dequantised: max |logit diff| {diff:.3f}, max KL {kl:.4f}")
    assert 0 < diff <= W8A8_TOL and kl <= W8A8_KL_TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_w8a8_kernel_path_quantises_in_the_producers_cpu_interpreter(fp8_dir, monkeypatch):
    """The whole W8A8 model on the kernel path (every op's Triton dispatch switched on for CPU tensors, under the
    interpreter): the e4m3 groups the norms and the attention output gate write give the logits of separate
    quantiser launches bit for bit, only the experts' SwiGLU outputs are then quantised by a launch of their own,
    and the logits keep the W8A8 bounds against the dequantised model (its torch reference path: the oracle)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case runs where there is no GPU")
    from tandem.model.qwen3_5 import DecoderLayer
    from tandem.ops import attention, gdn, linear, moe, norm, pointwise, rope
    from tandem.ops import fp8 as fp8_ops

    cfg = ModelConfig.from_dir(fp8_dir)
    ids = prompt_ids()[:12]
    want = logits(cfg, load_checkpoint(fp8_dir, cfg, "cpu", torch.float32, progress=False), ids)  # dequantised
    for module in (attention, fp8_ops, gdn, linear, moe, norm, pointwise, rope):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    launches = []
    quantize = fp8_ops.quantize_activations_triton

    def counted(x, group, rows=None):
        launches.append(rows is not None)  # rows on the device: the experts' SwiGLU output
        return quantize(x, group, rows)

    monkeypatch.setattr(fp8_ops, "quantize_activations_triton", counted)
    monkeypatch.setattr(moe, "quantize_activations_triton", counted)
    model = load_w8a8(fp8_dir)
    fused = logits(cfg, model, ids)
    assert launches and all(launches), "a norm or output gate left its FP8 GEMM input to the quantiser"
    n_fused = len(launches)
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            layer.quantize_in_producers(False)
    assert torch.equal(logits(cfg, model, ids), fused)
    assert len(launches) - n_fused > n_fused  # the separate launches were there to save
    lp, lq = want.log_softmax(-1), fused.log_softmax(-1)
    assert (fused - want).abs().max() <= W8A8_TOL and (lp.exp() * (lp - lq)).sum(-1).max() <= W8A8_KL_TOL


def test_w8a8_layout_mismatch_is_a_clear_error(fp8_dir, tmp_path):
    t = read_all(fp8_dir)
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    t[name] = dequantize_block_fp8(t[name], t.pop(name + "_scale_inv")).to(torch.bfloat16)  # stored unquantised
    bad = rewrite(fp8_dir, tmp_path / "bad", tensors=t)
    load(bad)  # dequantising: a high-precision tensor is read as it is
    with pytest.raises(CheckpointError, match="in_proj_z.weight: the checkpoint stores it not as float8"):
        load_w8a8(bad)


def test_fp8_preset_off_the_gpu_is_its_w8a8_weights_dequantised():
    from tandem.model.presets import preset_config, random_model

    cfg = preset_config("tiny-moe-fp8")
    dq = dict(random_model(cfg, "cpu", torch.float32, seed=1).named_parameters())
    w8 = dict(random_model(cfg, "cpu", torch.float32, seed=1, fp8_compute=True).named_parameters())
    block = cfg.quantization.weight_block_size
    assert set(w8) - set(dq) == {n for n in w8 if n.endswith("_scale_inv")}
    for name, p in dq.items():
        q = w8[name]
        if q.dtype != torch.float8_e4m3fn:
            assert torch.equal(p, q), name
        elif name.endswith("experts.gate_up_proj"):
            s, inter, half = w8[name + "_scale_inv"], q.shape[1] // 2, w8[name + "_scale_inv"].shape[1] // 2
            assert torch.equal(p[:, :inter], dequantize_block_fp8(q[:, :inter], s[:, :half], block))
            assert torch.equal(p[:, inter:], dequantize_block_fp8(q[:, inter:], s[:, half:], block))
        else:
            scale = w8[name + "_scale_inv" if name.endswith("experts.down_proj") else
                       name.removesuffix(".weight") + ".weight_scale_inv"]
            assert torch.equal(p, dequantize_block_fp8(q, scale, block)), name
