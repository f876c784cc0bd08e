"""GGUF files as export sources, judged from their header alone (the metadata and the tensor table, no tensor data)
before anything is converted: an architecture that specrt exports, read by transformers' GGUF loader or, for the
mixtures it does not read (Mixtral, a llama file with experts; OLMoE; Granite MoE), by specrt.export.gguf_moe; every
tensor of a type that the `gguf` package dequantizes (both readers call it); no MTP layer (`nextn` tensors). The
header is walked here rather than by `gguf.GGUFReader`, which makes arrays of every vocabulary entry first: 11 s for
Gemma 3's 262,144 tokens, against 0.2 s."""
from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from specrt.errors import UnknownSourceError

MAGIC = b"GGUF"
# GGUF metadata value types: the fixed-size ones by their struct format; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# the file's `general.architecture` -> transformers' model_type, where they differ (transformers' GGUF loader)
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
FILE_NAMES = {"qwen3_moe": "qwen3moe"}   # transformers' loader lists it by its model type; files name it so
# the token ids that end a sequence, as llama.cpp stops on them: end of sequence, of a turn, of a message
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # rows first (torch's order): (N, K) for a weight of K inputs
    type: str                # the GGML type's name: "Q4_K", "F32", ... or "type N" for one gguf does not know
    offset: int = 0          # of its data, from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict           # scalars and strings; numeric arrays as numpy arrays; string arrays as their length
    tensors: tuple[TensorInfo, ...]
    data_start: int = 0      # where the tensor data begins

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def eos_token_ids(self) -> list[int]:
        ids = [int(self.metadata[k]) for k in EOS_KEYS if k in self.metadata]
        return list(dict.fromkeys(ids))

    @property
    def parameters(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.tensors)

    def rows(self, t: TensorInfo) -> np.ndarray:
        """The stored bytes of tensor `t`, one row of its blocks per output row: (N, bytes per row), uint8, mapped
        from the file (nothing is read until used)."""
        import gguf
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]]
        n = int(np.prod(t.shape[:-1]))
        return np.memmap(self.path, np.uint8, "r", self.data_start + t.offset, (n, t.shape[-1] // block * size))


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (versions 2 and 3); UnknownSourceError if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _parse(path, m)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise UnknownSourceError(f"{path} is not a readable GGUF file ({e})") from e


def _parse(path: Path, m) -> GGUFHeader:
    import gguf
    if m[:4] != MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; specrt reads versions 2 and 3")
    pos, metadata = 24, {}
    for _ in range(n_kv):
        key, pos = _string(m, pos)
        (kind,) = struct.unpack_from("<I", m, pos)
        metadata[key], pos = _value(m, pos + 4, kind)
    if "general.architecture" not in metadata:
        raise ValueError("its metadata has no general.architecture")
    known = {t.value: t.name for t in gguf.GGMLQuantizationType}
    tensors = []
    for _ in range(n_tensors):
        name, pos = _string(m, pos)
        (n_dims,) = struct.unpack_from("<I", m, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
        kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        shape = tuple(reversed(dims))                          # ggml lists the fastest dimension (K) first
        tensors.append(TensorInfo(name, shape, known.get(kind, f"type {kind}"), offset))
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or align < 1:   # GGUF's spec: a uint32, a multiple of 8 (default 32)
        raise ValueError(f"its general.alignment is {align!r}, where GGUF needs a positive integer (a multiple of 8; "
                         "32 when the key is absent): the writer that made the file set it wrong; write it again "
                         "(gguf's GGUFWriter writes 32) or remove the key")
    return GGUFHeader(path, metadata, tuple(tensors), (pos + align - 1) // align * align)


def _string(m, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, pos)
    return m[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(m, pos: int, kind: int):
    if kind in SCALARS:
        return struct.unpack_from(SCALARS[kind], m, pos)[0], pos + struct.calcsize(SCALARS[kind])
    if kind == STRING:
        return _string(m, pos)
    if kind != ARRAY:
        raise ValueError(f"a metadata value of unknown type {kind}")
    item, count = struct.unpack_from("<IQ", m, pos)
    pos += 12
    if item in SCALARS:
        dtype = np.dtype(SCALARS[item])
        values = np.frombuffer(m, dtype, count, pos).copy()
        return values, pos + count * dtype.itemsize
    if item != STRING:
        raise ValueError(f"a metadata array of type {item}")
    for _ in range(count):   # a vocabulary or merges: walked, not kept (transformers reads them itself)
        (n,) = struct.unpack_from("<Q", m, pos)
        pos += 8 + n
    return count, pos


@cache
def dequantized(type_name: str) -> bool:
    """Whether the gguf package dequantizes tensors of this GGML type (one zero block tried)."""
    import gguf
    kind = getattr(gguf.GGMLQuantizationType, type_name, None)
    if kind is None or kind not in gguf.GGML_QUANT_SIZES:
        return False
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[kind][1], np.uint8), kind)
    except (NotImplementedError, ValueError):
        return False
    return True


def model_type(architecture: str) -> str:
    return MODEL_TYPES.get(architecture, architecture)


# the file's general.architecture -> transformers' model_type (a llama file with experts is Mixtral)
MOE_ARCHITECTURES = {"olmoe": "olmoe", "granitemoe": "granitemoe", "llama": "mixtral"}
PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")   # older converters' Mixtral files


def moe_type(header: GGUFHeader) -> str | None:
    """The registered model type of a mixture that specrt.export.gguf_moe reads, or None (a file transformers'
    loader reads)."""
    arch = header.architecture
    if arch == "llama" and not header.metadata.get("llama.expert_count"):
        return None
    return MOE_ARCHITECTURES.get(arch)


def check_moe(header: GGUFHeader, name: str) -> None:
    """UnknownSourceError naming what specrt.export.gguf_moe does not read in a file of one of its architectures."""
    arch = header.architecture
    old = [t.name for t in header.tensors if PER_EXPERT.fullmatch(t.name)]
    if old:
        raise UnknownSourceError(f"{name} keeps one tensor per expert ({old[0]}, ...), as llama.cpp's converter did "
                                 "before it stacked them (ffn_gate_exps); convert the checkpoint again with a "
                                 "current llama.cpp, or export the checkpoint directory")
    shared = [t.name for t in header.tensors if "_shexp." in t.name]
    if shared:
        raise UnknownSourceError(f"{name} is a {arch!r} file with shared experts ({shared[0]}, ...): Granite MoE "
                                 "with shared experts is not implemented; export a model without them")
    if not header.metadata.get(f"{arch}.expert_count"):
        raise UnknownSourceError(f"{name} is a {arch!r} file without experts (no {arch}.expert_count): a dense "
                                 f"{arch} model is not an architecture specrt exports")


def exported_architectures() -> list[str]:
    """The GGUF architectures that specrt exports: registered ones that transformers' GGUF loader reads, and the
    mixtures that specrt.export.gguf_moe reads."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from specrt.export.architectures import REGISTRY
    names = (FILE_NAMES.get(a, a) for a in GGUF_SUPPORTED_ARCHITECTURES)
    return sorted({a for a in names if model_type(a) in REGISTRY} | set(MOE_ARCHITECTURES))


def check_gguf(path: str | Path, name: str | None = None) -> GGUFHeader:
    """The header of a GGUF file that specrt exports; UnknownSourceError naming the architecture, the mixture of
    experts or the tensor types (with their tensors) that it does not."""
    header = read_header(path)
    name = name or str(path)
    arch = header.architecture
    nextn = sorted({t.name.split(".nextn.")[0] for t in header.tensors if ".nextn." in t.name})
    if nextn:   # llama.cpp writes MTP layers for GLM-4.5 (glm4moe) and its kin; its DeepSeek-V3 converter drops them
        raise UnknownSourceError(
            f"{name} is a {arch!r} GGUF file with an MTP layer ({nextn[0]}.nextn.*), which specrt does not read: "
            "llama.cpp writes such layers only for architectures that specrt does not export as targets (GLM-4.5's "
            "glm4moe: shared experts, sigmoid routing with an expert bias); for --method mtp, export a checkpoint "
            "directory that ships the module (docs/drafters.md)")
    supported = exported_architectures()
    if arch not in supported:
        raise UnknownSourceError(f"{name} is a GGUF file of architecture {arch!r}, which specrt does not export; "
                                 f"GGUF architectures it exports: {', '.join(supported)}")
    if moe_type(header):   # a mixture that transformers' loader does not read (a llama file with experts)
        check_moe(header, name)
    elif arch == "llama" and header.metadata.get("general.name") == "mistral":
        raise UnknownSourceError(f"{name}: transformers' GGUF loader reads a llama file whose general.name is "
                                 "exactly 'mistral' as a Mistral model, and then fails (the gguf package has no "
                                 "'mistral' tensor names); a file with any other name loads as the llama model it is")
    refused: dict[str, list[str]] = {}
    for t in header.tensors:
        if not dequantized(t.type):
            refused.setdefault(t.type, []).append(t.name)
    if refused:
        what = "; ".join(f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)} tensors)"
                         for kind, names in sorted(refused.items()))
        raise UnknownSourceError(f"{name} holds tensors of types that the gguf package does not dequantize ({what}); "
                                 "requantize the file to a type it does (Q8_0, Q4_K_M, F16, ...)")
    return header
