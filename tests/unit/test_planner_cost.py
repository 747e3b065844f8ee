"""The one layer cost model (src/loomtrain/planner/cost.py), shared by the emulated pipeline of
``--simulate.device`` and the planner's time model.

Sources: NVIDIA "Matrix Multiplication Background User's Guide" (DU-09799-001) ch. 2 (math-or-memory bound)
and ch. 5 (wave quantization); the NVIDIA A100 and H100 datasheets (the device table); Narayanan et al.
SC 2021 §5.1 (GPT's forward FLOPs 24bsh² + 4bs²h per layer).
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from loomtrain.config import ModelConfig
from loomtrain.distributed.pipeline import emulated
from loomtrain.planner import cost
from loomtrain.planner.arch import from_model_config, gpt
from loomtrain.planner.memory import Layout
from loomtrain.planner.time import DGX_A100, elementwise_bytes, layer_seconds

LLAMA = ModelConfig(dim=1024, n_heads=16, n_kv_heads=4, ffn_hidden_dim=2816, n_layers=8, vocab_size=32000,
                    max_seq_len=2048)  # fmt: skip


def test_emulated_pipeline_prices_with_the_planners_cost_model():
    """Catches: a second copy of the cost model or device table drifting back into distributed/ (the two
    users would disagree on a layer's time): emulated.py must hand out the planner's own objects."""
    assert emulated.DEVICES is cost.DEVICES and emulated.device is cost.device
    assert emulated.stage_times is cost.stage_times and emulated.layer_gemms is cost.layer_gemms
    assert emulated.Gemm is cost.Gemm and emulated.attention_kernels is cost.attention_kernels


def test_planner_block_time_is_the_emulated_layer_time_plus_elementwise_and_waves():
    """Catches: the planner's block pricing diverging from the emulated one on the same GEMMs: with wave
    quantization off and the datasheet peak, the planner's forward GEMM time at tp 1 must equal the
    emulated stage's per-layer forward; the difference is only the elementwise kernels it adds."""
    arch, dev = from_model_config(LLAMA), cost.DEVICES["a100"]
    plain = replace(DGX_A100, gemm_efficiency=1.0, device=replace(dev, sms=0))
    layout = Layout(seq_len=2048, micro_batch=2)
    forward, _, _ = layer_seconds(arch, layout, plain)
    emulated_layer = emulated.stage_times(LLAMA, 1, False, 2048, 2, dev).forward
    assert forward == pytest.approx(emulated_layer + elementwise_bytes(arch, layout) / dev.memory_rate(0))


def test_gpt_fuses_qkv_and_llama_launches_its_own_linears():
    """Catches: one family's GEMM list used for the other: Megatron's GPT has one fused QKV GEMM and
    unfused attention (two batched GEMMs per head), loomtrain's Llama block separate wq/wk/wv/w1/w3 and
    one fused attention kernel; both sum to the FLOPs their formulas give."""
    g = gpt(4, 1024, 16)
    assert [x.n for x in cost.layer_gemms(g, 128, 1, 2)] == [3 * 512, 1024, 2048, 1024]
    assert len(cost.attention_gemms(g, 128, 1, 2)) == 2 and cost.attention_kernels(g, 128, 1, 2)[0].flops == 0
    assert cost.block_forward_flops(g, 128, 1) == pytest.approx(24 * 128 * 1024**2 + 4 * 128**2 * 1024)
    arch = from_model_config(LLAMA)
    assert len(cost.layer_gemms(arch, 128, 1)) == 7 and cost.attention_gemms(arch, 128, 1) == []


def test_device_table_gives_datasheet_peaks_per_dtype_and_capacity():
    """Catches: a device kind whose per-dtype peak or memory does not come from the datasheet table the MFU
    figures use (loomtrain.hardware.GPU_PEAKS), or a misspelt kind passing silently."""
    h100 = cost.device("H100", field="hosts[0].device")
    assert h100.peak("bf16") == 989.4e12 and h100.peak("fp32") == 67e12 and h100.memory_bytes == 80 * 2**30
    assert h100.sms == 132 and cost.DEVICES["a100"].sms == 108
    with pytest.raises(ValueError, match=r"hosts\[0\].device='v100' is unknown; choose one of a100, h100"):
        cost.device("v100", field="hosts[0].device")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        h100.peak("fp8")


def _loomtrain_imports(module: str, seen: set[str]) -> set[str]:
    """Every loomtrain module importing ``module`` loads, directly or through other loomtrain modules: the
    module-level imports, read statically (a function's own import runs only when it is called)."""
    spec = importlib.util.find_spec(module)
    for node in ast.parse(Path(spec.origin).read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name.startswith("loomtrain") and name not in seen:
                seen.add(name)
                _loomtrain_imports(name, seen)
    return seen


def test_distributed_does_not_import_model_classes():
    """Catches: the emulated pipeline loading the model package when imported, directly or through the cost
    model (distributed/ may use the planner's pure cost functions, never loomtrain.models' classes)."""
    found = _loomtrain_imports("loomtrain.distributed.pipeline.emulated", set())
    assert "loomtrain.planner.cost" in found
    assert not [m for m in found if m.startswith("loomtrain.models")]
