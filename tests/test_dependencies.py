"""The extras ask for the versions the code is written for."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")   # Python 3.11+

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def extras() -> dict[str, dict[str, Requirement]]:
    table = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {extra: {r.name: r for r in map(Requirement, reqs)} for extra, reqs in table.items()}


def test_onnxruntime_binds_integer_element_types():
    """engines.base binds buffers with ONNX element types as integers (ONNX_TYPES), which IOBinding takes from
    onnxruntime 1.20 (microsoft/onnxruntime#22306): the cpu extra excludes the versions before it. The gpu extra
    starts at 1.26, the first with the public OrtValue.from_dlpack that the CUDA engines' shared weights need
    (engines.static.DLPACK_ORT)."""
    from specrt.engines.static import DLPACK_ORT
    got = extras()
    spec = got["cpu"]["onnxruntime"].specifier
    assert "1.20.0" in spec and "1.19.2" not in spec and "1.18.1" not in spec, str(spec)
    spec = got["gpu"]["onnxruntime-gpu"].specifier
    assert f"{DLPACK_ORT}.0" in spec and "1.25.1" not in spec and "1.20.0" not in spec, str(spec)


def test_tensorrt_stays_on_the_api_the_backend_is_written_for():
    spec = extras()["gpu"]["tensorrt"].specifier
    assert "10.0.1" in spec and "10.13.0" in spec and "11.0.0" not in spec and "9.3.0" not in spec, str(spec)
