"""``--dtype``: the option's sources and values, and one-line start-up errors for what cannot run."""

from __future__ import annotations

import pytest
import torch

from tests.test_cli import one_line, tinsmith, tiny_model  # noqa: F401 - the fixture is used by name
from tinsmith.models import loading
from tinsmith.models.loading import resolve_dtype
from tinsmith.server.config import ConfigError, ServerConfig, load_config
from tinsmith.server.startup import StartupError, check_precision


def test_dtype_defaults_to_auto_and_takes_every_source(tmp_path):
    assert ServerConfig().dtype == "auto"
    assert load_config(None, {"TINSMITH_DTYPE": "BFloat16"}).dtype == "bfloat16"
    yaml = tmp_path / "c.yaml"
    yaml.write_text("dtype: float16\n")
    assert load_config({"config": str(yaml)}, {}).dtype == "float16"
    assert load_config({"config": str(yaml), "dtype": "float32"}, {"TINSMITH_DTYPE": "bfloat16"}).dtype == "float32"


def test_an_unknown_dtype_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config({"dtype": "fp8"}, {})
    assert e.value.message == "--dtype must be 'auto', 'bfloat16', 'float16' or 'float32' (got 'fp8')"


def test_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16


def test_every_dtype_this_cpu_supports_passes_the_start_up_check():
    for name in ("auto", "bfloat16", "float16", "float32"):
        check_precision("cpu", name)


def test_a_dtype_the_device_cannot_compute_in_is_one_line(monkeypatch):
    real = loading.probe_dtype

    def no_half(dtype, device):  # a build whose half-precision kernels are missing
        if dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'\nmore detail')
        real(dtype, device)

    monkeypatch.setattr(loading, "probe_dtype", no_half)
    with pytest.raises(StartupError) as e:
        check_precision("cpu", "float16")
    text = str(e.value)
    assert "\n" not in text and text.startswith("--dtype float16 (float16) does not work on --device cpu")
    assert "not implemented for 'Half'" in text and "float32 works everywhere" in text


@pytest.mark.parametrize("args, expected", [
    (["--dtype", "fp8"], "tinsmith: --dtype must be 'auto', 'bfloat16', 'float16' or 'float32' (got 'fp8')"),
    (["--device", "nodev"], "tinsmith: --device nodev is not usable here"),
])
def test_serve_refuses_a_bad_dtype_or_device_in_one_line_before_loading(tmp_path, tiny_model, args, expected):  # noqa: F811
    proc = tinsmith("serve", "--data-dir", str(tmp_path / "data"), "--base-model", str(tiny_model), *args)
    assert proc.returncode == 2
    assert one_line(proc).startswith(expected)
    assert not (tmp_path / "data").exists()
