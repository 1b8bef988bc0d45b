"""Platform detection and the guarded torch_npu import. Tests that need "no accelerator" pretend it,
so they hold on a GPU machine too."""

import importlib

import pytest
import torch

from executor.platform import create_platform, detect_device_type, npu_runtime, resolve_dtype
from executor.platform import platform as platform_module
from executor.platform.npu_runtime import NpuUnavailableError
from executor.platform.platform import cpu_has_fast_bf16


@pytest.fixture
def fresh_npu_import(monkeypatch):
    """Pretend torch_npu is installed and make its import fail with `error`."""
    npu_runtime.torch_npu.cache_clear()
    monkeypatch.setattr(npu_runtime, "is_torch_npu_installed", lambda: True)

    def failing_import(error):
        real_import = importlib.import_module

        def import_module(name, *args):
            if name == "torch_npu":
                raise error
            return real_import(name, *args)

        monkeypatch.setattr(npu_runtime.importlib, "import_module", import_module)

    yield failing_import
    npu_runtime.torch_npu.cache_clear()


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(npu_runtime, "is_torch_npu_installed", lambda: False)
    npu_runtime.torch_npu.cache_clear()
    yield
    npu_runtime.torch_npu.cache_clear()


def test_auto_falls_back_to_cpu_without_an_accelerator(no_accelerator):
    assert detect_device_type("auto") == "cpu"
    platform = create_platform("auto")
    assert platform.device == torch.device("cpu") and platform.device_type == "cpu"
    assert platform.memory_info_bytes() is None
    platform.synchronize()  # a no-op on the CPU, but callable


def test_auto_prefers_cuda_when_torch_sees_it(monkeypatch):
    monkeypatch.setattr(npu_runtime, "npu_is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_device_type("auto") == "cuda"


def test_forcing_a_missing_device_is_a_clear_error(no_accelerator):
    with pytest.raises(NpuUnavailableError, match="torch_npu, which is not installed"):
        detect_device_type("npu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        detect_device_type("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        detect_device_type("tpu")


def test_missing_cann_libraries_say_to_source_set_env(fresh_npu_import):
    fresh_npu_import(ImportError("libhccl.so: cannot open shared object file"))
    with pytest.raises(NpuUnavailableError, match="set_env.sh") as err:
        npu_runtime.torch_npu()
    assert "libhccl.so" in str(err.value)
    assert npu_runtime.npu_is_available() is False


def test_cuda_build_of_torch_says_to_use_the_cpu_build(fresh_npu_import):
    fresh_npu_import(RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda"))
    with pytest.raises(NpuUnavailableError, match="CPU build of torch"):
        npu_runtime.torch_npu()


def test_dtype_names():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8")


@pytest.mark.parametrize(
    "flags, expected",
    [("fpu avx2 fma", False), ("fpu avx2 avx512f avx512_bf16", True), ("fpu avx512f amx_tile amx_bf16", True)],
)
def test_cpu_has_fast_bf16_reads_the_bf16_matrix_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_has_fast_bf16(cpuinfo) is expected


def test_auto_dtype_is_bf16_on_accelerators_and_follows_the_cpu_flags_on_the_cpu(monkeypatch):
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "npu") is torch.bfloat16
    monkeypatch.setattr(platform_module, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(platform_module, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16


def test_nothing_outside_the_platform_imports_torch_npu():
    import re
    from pathlib import Path

    direct_import = re.compile(r"^\s*(import torch_npu|from torch_npu\b)", re.MULTILINE)
    root = Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(root))
        for folder in ("executor", "module", "ops", "models", "benchmarks")
        for path in (root / folder).rglob("*.py")
        if direct_import.search(path.read_text()) and "platform" not in path.parts
    ]
    assert offenders == []
