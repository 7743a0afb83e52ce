"""A bf16 load of the default model holds no float32 copy of it: measured in a fresh process with
bench/load_model.py's `load_once` (the peak RSS above the imports)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOAT32_MB = 135e6 * 4 / 2**20  # SmolLM2-135M's weights in float32 (~515 MiB)


def _bench():
    spec = importlib.util.spec_from_file_location("load_model_bench", ROOT / "bench" / "load_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bf16_load_peak_is_below_one_float32_copy(tmp_path):
    bench = _bench()
    cold = bench.load_once(ROOT, tmp_path, None, "cpu", "bfloat16")  # dequantizes, writes the bf16 cache
    cached = bench.load_once(ROOT, tmp_path, None, "cpu", "bfloat16")
    assert cold["dtype"] == cached["dtype"] == "bfloat16"
    assert [p.name.rsplit("-", 2)[1] for p in tmp_path.glob("*.safetensors")] == ["bfloat16"]
    # the model in bf16 is half the float32 size; before, a cached bf16 load peaked at +866 MB
    assert cached["load_peak_mb"] < 0.8 * FLOAT32_MB, cached
    assert cold["load_peak_mb"] < 1.2 * FLOAT32_MB, cold
