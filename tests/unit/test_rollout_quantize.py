"""FP8 e4m3 rounding of the embedded engine (`rollout/quantize.py`, `rollout.quantize: fp8`).

The reference is an independent float64 e4m3 rounder written from the format's definition
(3 mantissa bits, exponent bias 7, subnormals down to 2^-9, largest finite 448, ties to even),
not torch's float8 cast the implementation uses; hand-computed cases pin it down first.
"""

import math

import pytest
import torch

from entr_megatron.config.rollout import RolloutConfig
from entr_megatron.config.validate import FieldError
from entr_megatron.rollout.embedded_protocol import EmbeddedEngineConfig
from entr_megatron.rollout.quantize import (
    Fp8Rounding,
    NoRounding,
    fp8_round_activation,
    fp8_round_weight,
    install_rounding,
    rounded_linears,
)
from entr_megatron.rollout.weights import WeightStage

transformers = pytest.importorskip("transformers")

E4M3_MIN_EXP = -6  # 1 - bias: the smallest normal binade; below it the spacing stays 2^-9
E4M3_MAX = 448.0


def e4m3(v: float) -> float:
    """v rounded to the nearest float8 e4m3fn value (ties to even), saturating at +-448."""
    if v == 0.0:
        return 0.0
    sign, a = math.copysign(1.0, v), abs(v)
    exp = max(math.frexp(a)[1] - 1, E4M3_MIN_EXP)  # floor(log2 a), exactly
    step = 2.0 ** (exp - 3)  # 3 mantissa bits
    return sign * min(round(a / step) * step, E4M3_MAX)  # Python's round: ties to even


def round_group(values: list[float]) -> list[float]:
    """One scale group: s = amax / 448 (float32, as scales are kept), then s * e4m3(v / s), in float64."""
    amax = max(abs(v) for v in values)
    s = float(torch.tensor(amax, dtype=torch.float32) / E4M3_MAX) if amax > 0 else 1.0
    return [s * e4m3(min(max(v / s, -E4M3_MAX), E4M3_MAX)) for v in values]


def ref_weight(w: torch.Tensor, scale: str, block: int = 128) -> torch.Tensor:
    """float64 reference of fp8_round_weight: groups formed by explicit loops."""
    rows = w.double().tolist()
    O, I = len(rows), len(rows[0])
    if scale == "per_tensor":
        groups = [[(i, j) for i in range(O) for j in range(I)]]
    elif scale == "per_channel":
        groups = [[(i, j) for j in range(I)] for i in range(O)]
    else:
        groups = [[(i, j) for i in range(r, min(r + block, O)) for j in range(c, min(c + block, I))]
                  for r in range(0, O, block) for c in range(0, I, block)]
    out = [[0.0] * I for _ in range(O)]
    for g in groups:
        for (i, j), v in zip(g, round_group([rows[i][j] for i, j in g])):
            out[i][j] = v
    return torch.tensor(out, dtype=torch.float64)


def test_e4m3_reference_against_hand_values():
    # normal grid, ties to even, subnormals, underflow, saturation
    assert [e4m3(v) for v in (1.0625, 1.1875, 6.4, -19.2, 2.5 * 2**-9, 2**-10, 3 * 2**-11, 460.0)] == \
        [1.0, 1.25, 6.5, -20.0, 2 * 2**-9, 0.0, 2**-9, 448.0]


# W: per-tensor amax 7 -> s = 1/64; row amaxes 7 and 0.4375 -> s = 1/64 and 1/1024 (powers of 2: exact in fp32 and fp64).
W = torch.tensor([[7.0, 1.0, 0.1, -4.25 / 64],
                  [0.4375, -0.2, 2.5 * 2**-15, 2**-16]])
W_PER_TENSOR = [[7.0, 1.0, 6.5 / 64, -4.0 / 64],           # 448; 64; 6.4 -> 6.5; 4.25 tie -> 4
                [0.4375, -13.0 / 64, 2**-14, 0.0]]          # 28; -12.8 -> -13; 2.5 * 2^-9 tie -> 2 * 2^-9; 2^-10 -> 0
W_PER_CHANNEL = [W_PER_TENSOR[0],
                 [0.4375, -208.0 / 1024, 2.5 * 2**-15, 2**-16]]  # 448; -204.8 -> -208; 0.078125 and 2^-6 exact


@pytest.mark.parametrize("scale,expected", [("per_tensor", W_PER_TENSOR), ("per_channel", W_PER_CHANNEL)])
def test_weight_rounding_hand_computed(scale, expected):
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.equal(ref_weight(W, scale), expected)
    assert torch.equal(fp8_round_weight(W, scale).double(), expected)


@pytest.mark.parametrize("scale,block", [("per_tensor", 128), ("per_channel", 128), ("block", 4), ("block", 3)])
def test_weight_rounding_matches_reference(scale, block):
    torch.manual_seed(0)
    w = torch.randn(10, 7) * torch.logspace(-5, 1, 10)[:, None]  # rows of very different magnitude
    got = fp8_round_weight(w, scale, block=block)
    assert got.dtype == w.dtype
    assert torch.equal(got.double(), ref_weight(w, scale, block).float().double())
    if scale != "per_tensor":  # finer scales keep the small rows; one scale flushes them to 0
        assert (fp8_round_weight(w, "per_tensor")[0] == 0).all() and (got[0] != 0).all()


def test_weight_rounding_bf16_and_zero_rows():
    w = torch.tensor([[0.0, 0.0], [0.3, -0.7]])
    got = fp8_round_weight(w.bfloat16(), "per_channel")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), ref_weight(w.bfloat16().float(), "per_channel").float().bfloat16().float())
    assert torch.equal(got[0].float(), torch.zeros(2))


@pytest.mark.parametrize("scale", ["per_tensor", "per_channel", "block"])
def test_activation_rounding_matches_reference(scale):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5) * torch.tensor([1.0, 1e-3, 10.0])[None, :, None]
    got = fp8_round_activation(x, scale, block=2)
    flat = x.reshape(-1, 5).double().tolist()
    if scale == "per_tensor":
        ref = round_group([v for row in flat for v in row])
        ref = [ref[i * 5:(i + 1) * 5] for i in range(len(flat))]
    elif scale == "per_channel":  # per token
        ref = [round_group(row) for row in flat]
    else:  # groups of 2 features, the last one a single feature
        ref = [round_group(row[0:2]) + round_group(row[2:4]) + round_group(row[4:5]) for row in flat]
    assert torch.equal(got.reshape(-1, 5).double(), torch.tensor(ref, dtype=torch.float64).float().double())


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2)


def qwen3(seed: int, tied: bool = True):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**TINY, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("tied", [True, False])
def test_rounds_projections_only(tied):
    model = qwen3(0, tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sorted(rounded_linears(model)) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    rounding = install_rounding(model, "fp8", "per_channel")
    assert rounding.refresh() == 14
    for name, t in model.state_dict().items():
        if name.removesuffix(".weight") in rounded_linears(model):
            assert torch.equal(t.double(), ref_weight(before[name], "per_channel").float().double()), name
            assert not torch.equal(t, before[name])
        else:  # embeddings, norms, lm_head
            assert torch.equal(t, before[name]), name


def test_rerounded_after_every_weight_update():
    """Weights arrive through the stage's swap (storage exchanged, the new values unrounded); two
    versions swapped in back to back (an idle engine runs no forward between them) end rounded."""
    model = qwen3(0)
    rounding = install_rounding(model, "fp8", "per_tensor")
    stage = WeightStage(model)
    for version in (1, 2):
        new = qwen3(version).state_dict()
        stage.begin(version)
        for name, t in new.items():
            stage.write(name, t)
        stage.finish()
        assert stage.swap_into() == version
        rounding.refresh()
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    got = model.state_dict()[q_proj]
    assert not torch.equal(got, new[q_proj])
    assert torch.equal(got.double(), ref_weight(new[q_proj], "per_tensor").float().double())
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], new["model.embed_tokens.weight"])


def test_activations_rounded_before_the_matmul():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4)).requires_grad_(False)
    w, b = model[0].weight.clone(), model[0].bias.clone()
    x = torch.randn(3, 6)
    rounding = install_rounding(model, "fp8", "per_channel", activations=True)
    expected = torch.nn.functional.linear(fp8_round_activation(x, "per_channel"), fp8_round_weight(w, "per_channel"), b)
    assert torch.equal(model(x), expected)
    assert not torch.equal(model(x), torch.nn.functional.linear(x, fp8_round_weight(w, "per_channel"), b))
    rounding.remove()
    assert torch.equal(model(x), torch.nn.functional.linear(x, fp8_round_weight(w, "per_channel"), b))


def test_fp8_logprobs_move_greedy_mostly_agrees():
    """The mismatch is real but small: log-probs move by a measurable amount, argmax mostly stays."""
    ref, q = qwen3(0), qwen3(0)
    install_rounding(q, "fp8", "per_channel")
    ids = torch.randint(0, TINY["vocab_size"], (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp_ref, lp_q = ref(input_ids=ids).logits.log_softmax(-1), q(input_ids=ids).logits.log_softmax(-1)
    p = lp_ref.exp()
    mean_abs = float((p * (lp_q - lp_ref).abs()).sum(-1).mean())  # E over tokens sampled from the reference
    agree = float((lp_q.argmax(-1) == lp_ref.argmax(-1)).float().mean())
    assert 0.02 < mean_abs < 0.5, mean_abs  # 0.126 measured
    assert agree > 0.75, agree  # 0.848 measured (near-uniform random model: close top logits)
    with torch.no_grad():  # 'none' leaves the model exactly as it was
        assert isinstance(install_rounding(ref, "none"), NoRounding)
        assert torch.equal(ref(input_ids=ids).logits.log_softmax(-1), lp_ref)


def test_config_validation():
    cfg = RolloutConfig(quantize="fp8", quantize_scale="block", quantize_activations=True)
    e = EmbeddedEngineConfig.from_config(cfg, model_dir="m", max_model_len=None, seed=0)
    assert (e.quantize, e.quantize_scale, e.quantize_activations) == ("fp8", "block", True)
    assert RolloutConfig().quantize == "none" and RolloutConfig().quantize_scale == "per_channel"
    with pytest.raises(FieldError, match=r"rollout\.quantize='int8' is not valid; allowed: none, fp8"):
        RolloutConfig(quantize="int8")
    with pytest.raises(FieldError, match=r"rollout\.quantize_scale='per_row' .*allowed: per_tensor, per_channel, block"):
        RolloutConfig(quantize="fp8", quantize_scale="per_row")
    with pytest.raises(FieldError, match=r"rollout\.quantize_activations=True is not valid with quantize='none'"):
        RolloutConfig(quantize_activations=True)
    with pytest.raises(FieldError, match=r"rollout\.quantize='fp8' is not valid with engine='sglang'; must be 'none'"):
        RolloutConfig(engine="sglang", dtype="bfloat16", quantize="fp8")
    with pytest.raises(ValueError, match=r"EmbeddedEngineConfig\.quantize must be one of \('none', 'fp8'\)"):
        EmbeddedEngineConfig(model_dir="m", quantize="fp4")
    with pytest.raises(ValueError, match=r"EmbeddedEngineConfig\.quantize_activations needs quantize 'fp8'"):
        EmbeddedEngineConfig(model_dir="m", quantize_activations=True)
    with pytest.raises(ValueError, match=r"quantize must be one of"):
        install_rounding(torch.nn.Linear(2, 2), "fp4")
    with pytest.raises(ValueError, match=r"scale must be one of"):
        Fp8Rounding(torch.nn.Linear(2, 2), "per_row")
