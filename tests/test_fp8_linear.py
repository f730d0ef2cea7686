"""`run.fp8_linear`: the drafter's linear layers through torchao's float8 training.

On the CPU torchao emulates the fp8 matmuls (operands rounded to fp8 with the recipe's scales,
then multiplied in fp32), so these tests check the arithmetic against a reference written from
the recipes' definitions, the conversion (same parameters, state dict, checkpoint and export),
a short training run against `run.dtype=mixed` without fp8, the resume rules and the refusals.
What they cannot check: torch._scaled_mm's GPU kernels and their speed (a GPU session's job).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from store_factory import FactorySpec, build_store
from torch import nn

from common.config import build_config
from dflash_offline.cli import main as cli
from stage2_train.config import TrainConfig
from stage2_train.export import expected_keys, load_export
from stage2_train.fp8 import check_fp8_device, convert_to_fp8, plain_twin
from stage2_train.model import DFlashDrafter, DrafterShape
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# every dim a multiple of 16 (the factory store's sizes): all 15 linear layers are swapped
SHAPE = DrafterShape(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_tapped=2,
    block_size=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    vocab_size=48,
    mask_token_id=3,
)


def fp8_round(x: torch.Tensor, reduce_dim: int | None, dtype: torch.dtype, pow2: bool):
    """`x` as the fp8 operand of a scaled matmul sees it: scale = fp8 max / amax (over
    `reduce_dim`, else the whole tensor; rounded down to a power of 2 if `pow2`), x * scale
    rounded to fp8 (saturated), divided back."""
    absx = x.abs()
    amax = absx.amax() if reduce_dim is None else absx.amax(reduce_dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fp8_max = torch.finfo(dtype).max
    return (x * scale).clamp(-fp8_max, fp8_max).to(dtype).float() / scale


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_rounds_every_operand_as_its_recipe_says(recipe: str) -> None:
    """out = x W^T, grad_x = g W, grad_W = g^T x, each with both operands rounded to fp8.
    tensorwise: one scale per tensor, e4m3, gradients e5m2. rowwise: e4m3, power-of-2 scales
    per row of each operand along the contracted dim."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = DFlashDrafter(SHAPE)
    convert_to_fp8(model, recipe, CPU, (32, 32))
    fc = model.fc  # 128 -> 64

    def spread(rows: int, cols: int) -> torch.Tensor:
        """Rows and columns of different magnitudes: every choice of scale axis differs."""
        gen = torch.Generator().manual_seed(rows * cols)
        row_C, col_C = torch.logspace(-2, 1, rows), torch.logspace(1, -2, cols)
        return torch.randn(rows, cols, generator=gen) * row_C[:, None] * col_C[None, :]

    with torch.no_grad():
        fc.weight.copy_(spread(64, 128) * 0.02)
    x = spread(24, 128).requires_grad_(True)
    g = spread(24, 64)
    out = fc(x)
    out.backward(g)
    W, xd = fc.weight.detach(), x.detach()
    if recipe == "tensorwise":
        q = {k: (None, E4M3, False) for k in ("x_f", "w_f", "w_b", "x_b")}
        q |= {"g_i": (None, E5M2, False), "g_w": (None, E5M2, False)}
    else:  # reduce over the contracted dim of each matmul
        q = {"x_f": (1, E4M3, True), "w_f": (1, E4M3, True), "g_i": (1, E4M3, True)}
        q |= {"w_b": (0, E4M3, True), "g_w": (0, E4M3, True), "x_b": (0, E4M3, True)}
    want_out = fp8_round(xd, *q["x_f"]) @ fp8_round(W, *q["w_f"]).T
    want_grad_x = fp8_round(g, *q["g_i"]) @ fp8_round(W, *q["w_b"])
    want_grad_w = fp8_round(g, *q["g_w"]).T @ fp8_round(xd, *q["x_b"])
    torch.testing.assert_close(out.detach(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, want_grad_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fc.weight.grad, want_grad_w, rtol=1e-5, atol=1e-6)
    # and it is not the plain matmul: e4m3 rounds each operand by up to 2^-4 relative
    plain = xd @ W.T
    error = float((out.detach() - plain).norm() / plain.norm())
    assert 1e-3 < error < 2**-3, error


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_keeps_parameters_names_and_state_dict(recipe: str) -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = DFlashDrafter(SHAPE)
    reference = DFlashDrafter(SHAPE)
    reference.load_state_dict(model.state_dict())
    before = list(model.named_parameters())
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    swapped = convert_to_fp8(model, recipe, CPU, (32, 32))
    assert swapped == linears and len(swapped) == 7 * SHAPE.num_layers + 1
    assert all(type(model.get_submodule(n)) is Float8Linear for n in swapped)
    # the very same Parameter objects under the same names: optimizer, DDP, checkpoints and
    # the export see what they see without fp8
    after = list(model.named_parameters())
    assert [(n, id(p)) for n, p in after] == [(n, id(p)) for n, p in before]
    assert all(type(p) is nn.Parameter for _, p in after)
    state = model.state_dict()
    assert set(state) == expected_keys(SHAPE.num_layers)
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    # evaluations run the twin: plain nn.Linear over the same parameters, the served arithmetic
    twin = plain_twin(model)
    assert not any(isinstance(m, Float8Linear) for m in twin.modules())
    assert [(n, id(p)) for n, p in twin.named_parameters()] == [(n, id(p)) for n, p in after]
    with torch.no_grad():
        model.fc.weight.mul_(2.0)  # an optimizer step, in place: the twin sees it
        reference.fc.weight.mul_(2.0)
    features, tokens = torch.randn(20, 2, 64), torch.randn(16, 64)
    positions = torch.arange(20), torch.arange(16)

    def attention(q, k, v):
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    want = reference(features, tokens, *positions, attention)
    torch.testing.assert_close(twin(features, tokens, *positions, attention), want)
    assert not torch.equal(model(features, tokens, *positions, attention), want)


def test_layers_whose_dims_are_not_multiples_of_16_stay_plain() -> None:
    pytest.importorskip("torchao")
    shape = DrafterShape(**{**SHAPE.__dict__, "intermediate_size": 40})
    model = DFlashDrafter(shape)
    swapped = convert_to_fp8(model, "rowwise", CPU, (32, 32))
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert kept == [f"layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]
    assert len(swapped) == 15 - 6 and not set(swapped) & set(kept)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_token_counts_off_multiples_of_16_train_on_a_gpu(recipe: str) -> None:
    """On a GPU torch._scaled_mm contracts the weight gradient over the tokens, so their count
    must be a multiple of 16 (the meta device runs CUDA's shape checks; the CPU's emulation
    has none): a micro-batch whose context or block tokens are not gets them zero-padded."""
    pytest.importorskip("torchao")
    meta = torch.device("meta")
    for tokens, padded in (((64, 32), False), ((24, 32), True), ((64, 40), True)):
        with meta:
            model = DFlashDrafter(SHAPE).to(torch.bfloat16)
        convert_to_fp8(model, recipe, meta, num_tokens=tokens)
        assert model.fc.config.pad_inner_dim is padded  # no copies when none is needed
        for layer, rows in ((model.fc, tokens[0]), (model.layers[0].self_attn.k_proj, sum(tokens))):
            x = torch.empty(rows, layer.in_features, device=meta, dtype=torch.bfloat16)
            layer(x.requires_grad_()).sum().backward()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("fp8") / "store", FactorySpec(num_sequences=13))


# 2 epochs of 11 steps, bf16 compute over fp32 master weights (the GPU default)
RUN = ["optim.epochs=2", "run.eval_every=11", "run.dtype=mixed"]


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mixed_run(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fp8") / "mixed"
    return out, train(store, out, *RUN)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_tracks_mixed_and_exports_plain_weights(
    store: Path, tmp_path: Path, mixed_run: tuple[Path, list[dict]], recipe: str
) -> None:
    pytest.importorskip("torchao")
    mixed_out, mixed = mixed_run
    out = tmp_path / "run"
    rows = train(store, out, *RUN, f"run.fp8_linear={recipe}")
    assert [r["step"] for r in rows] == [r["step"] for r in mixed] == list(range(1, 23))
    # Step 1 has the same weights and batch: only the fp8 rounding of the matmul operands
    # differs. At init the linear layers' outputs are small next to the residual stream, so
    # the loss moves by ~2e-4 relative (measured; bf16 vs fp32 compute: the same order) and its
    # gradient norm by < 1%: tolerances of 1% and 3%.
    assert rows[0]["loss"] == pytest.approx(mixed[0]["loss"], rel=1e-2)
    assert rows[0]["grad_norm"] == pytest.approx(mixed[0]["grad_norm"], rel=3e-2)
    # Later steps drift apart (each step's rounding perturbs the weights): measured at most
    # 1% (tensorwise) and 4.4% (rowwise) over these 22 steps, while the loss falls 8.9 -> 3.3;
    # 15% would flag fp8 training that diverges or stalls, not the drift of a rounding.
    for a, b in zip(rows, mixed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.15), (a["step"], a["loss"], b["loss"])
    assert any(a["loss"] != b["loss"] for a, b in zip(rows, mixed, strict=True))  # fp8 ran
    first, last = (sum(r["loss"] for r in part) / 4 for part in (rows[:4], rows[-4:]))
    assert last < 0.6 * first, (first, last)
    assert rows[-1]["eval_tau"] >= 1.0
    # checkpoint: the same names, fp32 master weights and AdamW states as without fp8
    ckpt, mixed_ckpt = out / "step-000022", mixed_out / "step-000022"
    weights = torch.load(ckpt / "model.pt", weights_only=True)
    mixed_weights = torch.load(mixed_ckpt / "model.pt", weights_only=True)
    assert list(weights) == list(mixed_weights)
    assert {v.dtype for v in weights.values()} == {torch.float32}
    states = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in states.values()} == {torch.float32}
    # export: plain bf16 tensors under the DFlash names, the same config.json as without fp8
    exported = load_file(out / "export" / "model.safetensors")
    assert set(exported) == expected_keys(SHAPE.num_layers)
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert all(torch.equal(exported[k], v.bfloat16()) for k, v in weights.items())
    config = json.loads((out / "export" / "config.json").read_text())
    assert config == json.loads((mixed_out / "export" / "config.json").read_text())
    drafter = load_export(out / "export")  # what `dflash evaluate` and a server load
    assert {type(m) for m in drafter.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_fp8_resumes_exactly_and_changing_it_needs_the_flag(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    out = tmp_path / "run"
    sets = ["optim.max_steps=4", "run.checkpoint_every=2", "run.keep_checkpoints=3"]
    sets += ["run.eval_every=0", "run.fp8_linear=rowwise"]
    full = train(store, out, *sets)
    shutil.rmtree(out / "step-000004")  # "killed" after step 3: resumes from step 2
    shutil.rmtree(out / "export")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:3]))
    resumed = train(store, out, *sets)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # the emulation is exact
    # switching fp8 changes the arithmetic, not the saved state: allowed with the flag only
    off = [*sets[:-1], "run.fp8_linear=null"]
    with pytest.raises(ValueError, match=r"run.fp8_linear: 'rowwise' -> None; rerun with"):
        train(store, out, *off, "optim.max_steps=6")
    rows = train(store, out, *off, "optim.max_steps=6", "run.allow_config_change=true")
    assert [r["step"] for r in rows] == list(range(1, 7))
    meta = json.loads((out / "step-000006" / "meta.json").read_text())
    assert meta["config"]["run"]["fp8_linear"] is None


def test_missing_torchao_is_named_with_the_install(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # find_spec("torchao") -> None
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(tmp_path)]
    result = CliRunner().invoke(cli, [*args, "--set", "run.fp8_linear=tensorwise"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "run.fp8_linear=tensorwise needs torchao" in message
    assert "pip install 'dflash-offline[fp8]'" in message and "run.fp8_linear=null" in message
    assert not (tmp_path / "metrics.jsonl").exists()


def test_gpus_without_fp8_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError) as err:
        check_fp8_device("rowwise", torch.device("cuda", 0))
    message = str(err.value)
    assert "run.fp8_linear=rowwise needs a GPU of compute capability >= 8.9" in message
    assert "cuda:0 (NVIDIA A100) has 8.0" in message and "set run.fp8_linear=null" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("rowwise", torch.device("cuda", 0))  # H100/H200
    check_fp8_device("rowwise", CPU)  # emulated


def test_help_config_lists_the_recipes() -> None:
    result = CliRunner().invoke(cli, ["train", "--help-config"])
    assert result.exit_code == 0
    assert "run.fp8_linear (one of: tensorwise, rowwise, or null; default None)" in result.output
