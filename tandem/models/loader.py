"""Checkpoint loading: HF-format directory (config.json, tokenizer.json, safetensors) -> a model
on the target device in the run dtype.

`inspect_checkpoint` validates everything it can without touching device memory: the files, every
safetensors header against its file size, the layer and expert counts of config.json against the
tensors the headers hold, config.json's integers against sanity limits, and every tensor name and
shape against a meta-device instance of the model. `load_checkpoint` then checks the weights fit in
RAM (on CPU), materialises the model and copies the tensors in (memory-mapped reads, converted to
the run dtype). Every checkpoint problem raises `CheckpointError` with a one-line message naming the
file (and the key of config.json). Nothing in the directory is executed (`auto_map` is ignored) and
nothing is written there.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from tandem.models.base import CausalLM
from tandem.models.registry import get_model_class, supported_model_types
from tandem.tokenizer import describe_json

logger = logging.getLogger("tandem")

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
# safetensors dtype name -> bytes per element
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


# Sanity limits on config.json's integers: key -> (smallest, largest). The largest are several
# times the biggest released models (noted per key), so no real checkpoint comes near them, while
# a typo or a corrupted file is refused in one line instead of building a model for minutes.
CONFIG_INT_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),  # deepest: Llama-3.1-405B 126, Qwen3-235B 94, DeepSeek-V3 61
    "hidden_size": (1, 65536),  # widest: Nemotron-4-340B 18432, Llama-3.1-405B 16384, DeepSeek 7168
    "intermediate_size": (1, 262144),  # Nemotron-4-340B 73728, Llama-3.1-405B 53248, DeepSeek 18432
    "moe_intermediate_size": (1, 262144),  # per expert: DeepSeek-V3 2048, Qwen3-235B 1536
    "num_attention_heads": (1, 1024),  # DeepSeek-V3 / Llama-3.1-405B 128
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),  # Gemma 256, DeepSeek MLA 192, Qwen3 128
    "num_experts": (0, 16384),  # 0: dense; Qwen3-Next 512, Kimi-K2 384, DeepSeek-V3 256, Qwen3 128
    "num_local_experts": (0, 16384),
    "num_experts_per_tok": (1, 1024),  # 8-10 in released models
    "decoder_sparse_step": (1, 1024),  # at most the layer count
    "vocab_size": (1, 1 << 22),  # largest: Gemma-3 262144, Qwen3 151936, DeepSeek 129280
    "max_position_embeddings": (1, 1 << 26),  # longest: Llama-4-Scout 10M, DeepSeek-V4 1M, Qwen3 256K
}  # fmt: skip
CONFIG_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "use_sliding_window")
CONFIG_POSITIVE_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # model.layers.N.* (HF) and layers.N.* (native)
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")  # mlp.experts.E.* (per-expert tensors)


class CheckpointError(Exception):
    """A checkpoint directory that cannot be loaded; the message is one line naming the file."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    key: str = ""  # its name in the file, where the model names it otherwise (CausalLM.checkpoint_name)


@dataclass(frozen=True)
class CheckpointInfo:
    model_dir: Path
    config: dict[str, Any]
    model_type: str
    weight_files: tuple[Path, ...]
    tensors: dict[str, TensorEntry]  # every tensor of the checkpoint, by name
    unused: tuple[str, ...]  # checkpoint tensors the model legitimately ignores (e.g. rotary caches)
    total_bytes: int  # tensor data bytes of the checkpoint

    @property
    def model_class(self) -> type[CausalLM]:
        return get_model_class(self.model_type)


@dataclass(frozen=True)
class LoadReport:
    model_type: str
    model_dir: Path
    num_tensors: int
    bytes_read: int
    seconds: float
    dtype: torch.dtype
    device: str

    def summary(self) -> str:
        return (
            f"Loaded {self.model_type} from {self.model_dir}: {self.num_tensors} tensors, "
            f"{self.bytes_read / 2**30:.2f} GiB in {self.seconds:.1f} s"
        )


def _few(names: list[str] | set[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _read_config(model_dir: Path) -> dict[str, Any]:
    return read_config_file(model_dir / "config.json")


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json as a dict; CheckpointError naming the file when it is missing or not a JSON
    object."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json; is this an HF-format model directory?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise CheckpointError(f"{path}: cannot parse config.json ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json is not a JSON object")
    return config


def supported_model_type(config: dict[str, Any], path: Path) -> str:
    """config.json's model_type; CheckpointError naming the file when Tandem has no model for it."""
    model_type = config.get("model_type")
    if model_type not in supported_model_types():
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported; "
                              f"supported: {', '.join(supported_model_types())}")  # fmt: skip
    return model_type


def check_config(config: dict[str, Any], path: Path) -> None:
    """Refuse config.json values no model has, before anything is built from them: integers of the
    wrong type or outside `CONFIG_INT_LIMITS`, non-boolean flags, non-positive epsilons; and
    head counts that do not divide. Absent (or null) keys are left to the architecture."""
    for key, (low, high) in CONFIG_INT_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"{path}: {key} must be an integer, got {describe_json(value)}")
        shown = describe_json(value).removeprefix("the number ")  # a 400-digit number is cut short
        if value < low:
            raise CheckpointError(f"{path}: {key} {shown} must be {'positive' if low else 'non-negative'}")
        if value > high:
            raise CheckpointError(f"{path}: {key} {shown} is above the limit of {high} (far beyond any "
                                  "released model); is config.json corrupt?")  # fmt: skip
    for key in CONFIG_BOOL_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{path}: {key} must be true or false, got {describe_json(value)}")
    for key in CONFIG_POSITIVE_FLOAT_KEYS:
        value = config.get(key)
        if value is not None and not _positive_finite(value):
            raise CheckpointError(f"{path}: {key} must be a finite positive number, got {describe_json(value)}")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads} (each KV head serves a whole group of query heads)")  # fmt: skip
    head_dim = config.get("head_dim")
    if head_dim and head_dim % 2:
        raise CheckpointError(f"{path}: head_dim {head_dim} must be even (rotary embedding rotates pairs)")


def _positive_finite(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return 0 < float(value) < math.inf  # NaN fails too
    except OverflowError:  # an integer beyond any float
        return False


def _indices(pattern: re.Pattern[str], names: Any) -> set[int]:
    return {int(m.group(1)) for name in names if (m := pattern.search(name))}


def _covers(indices: set[int], n: Any) -> bool:
    """indices include 0..n-1 (checked without building range(n): n may be absurd). A count that
    is not an integer passes here: `check_config` refuses it with the key's name."""
    if not isinstance(n, int) or isinstance(n, bool):
        return True
    return n <= len(indices) and all(i in indices for i in range(n))


def _held(indices: set[int], what: str) -> str:
    """'layers 0..3', '3 layers (0, 1, 5)' or 'no layer tensors'."""
    if not indices:
        return f"no {what} tensors"
    if len(indices) == max(indices) + 1:
        return f"{what}s 0..{max(indices)}"
    first = sorted(indices)
    more = ", ..." if len(first) > 4 else ""
    return f"{len(first)} {what}s ({', '.join(map(str, first[:4]))}{more})"


def check_layout(config: dict[str, Any], tensors: dict[str, TensorEntry], model_dir: Path) -> None:
    """Compare the layer and expert counts config.json promises with the tensors the safetensors
    headers hold, before a model is built: building 200000 layers (even on the meta device) takes
    minutes and gigabytes, while the headers answer at once."""
    layers = config.get("num_hidden_layers")
    if not _covers(held := _indices(LAYER_INDEX, tensors), layers):
        raise CheckpointError(f"{model_dir}: config.json says num_hidden_layers {layers} but the safetensors hold "
                              f"{_held(held, 'layer')}; does config.json belong to these weights?")  # fmt: skip
    key = next((k for k in ("num_experts", "num_local_experts") if config.get(k)), None)
    experts = config.get(key) if key else None
    held = _indices(_EXPERT_INDEX, tensors)
    # Only per-expert layouts (mlp.experts.E.*) can be counted; fused [E, ...] expert tensors are
    # checked by shape against the model instead (_match_tensors).
    fused = key is not None and not held and any(".experts." in name for name in tensors)
    if not fused and not _covers(held, experts):
        raise CheckpointError(f"{model_dir}: config.json says {key} {experts} but the safetensors hold "
                              f"{_held(held, 'expert')}; does config.json belong to these weights?")  # fmt: skip


def _weight_files(model_dir: Path) -> tuple[tuple[Path, ...], dict[str, str] | None]:
    """-> (safetensors files, the index's weight_map when sharded)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: cannot read the shard index ({e})") from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).is_file():
                names = [k for k, v in weight_map.items() if v == shard]
                raise CheckpointError(
                    f"{index_path}: shard {shard} is missing from {model_dir} (it holds {_few(names)})"
                )
        return tuple(model_dir / s for s in shards), weight_map
    files = tuple(sorted(model_dir.glob("*.safetensors")))
    if files:
        return files, None
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{model_dir / pickles[0]}: pickle checkpoints are not loaded; convert to safetensors"
        )
    raise CheckpointError(f"{model_dir}: missing weights (no *.safetensors files and no {INDEX_FILE})")


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header ourselves and check every tensor's data lies inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header); re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors file (header of {header_len} bytes, file of {size}); "
                "re-download it"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name}") from None
        if dtype not in _DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{path}: corrupt safetensors header: {name} has data_offsets "
                                  f"[{begin}, {end}] for {nbytes} bytes of {dtype}{list(shape)}")  # fmt: skip
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: {name} ends at byte {data_start + end} "
                f"but the file has {size} bytes; re-download it"
            )
        entries[name] = TensorEntry(path, dtype, shape, nbytes)
    return entries


def _read_tensor_index(files: tuple[Path, ...], weight_map: dict[str, str] | None) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name} is also in {tensors[name].file.name}")
            tensors[name] = entry
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].file.name != Path(shard).name:
                raise CheckpointError(f"{files[0].parent / INDEX_FILE}: weight_map puts {name} in {shard}, "
                                      "but that shard does not hold it")  # fmt: skip
    return tensors


def _model_names(cls: type[CausalLM], tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The tensor index under the model's parameter names (`checkpoint_name`), each entry keeping
    its name in the file."""
    out: dict[str, TensorEntry] = {}
    for key, entry in tensors.items():
        name = cls.checkpoint_name(key)
        if name in out:
            raise CheckpointError(f"{entry.file}: tensors {out[name].key or name} and {key} are both {name}")
        out[name] = replace(entry, key=key) if name != key else entry
    return out


def build_meta_model(cls: type[CausalLM], config: dict[str, Any], dtype: torch.dtype, config_path: Path) -> CausalLM:
    """The model config.json describes, on the meta device (no memory); CheckpointError naming the
    file when the architecture refuses the config."""
    try:
        with torch.device("meta"):
            return cls(config, dtype)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def _match_tensors(
    model: CausalLM, info_tensors: dict[str, TensorEntry], config: dict[str, Any], model_dir: Path
) -> tuple[str, ...]:
    """Check names and shapes against the (meta) model; -> checkpoint names the model ignores."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    ignored = model.ignored_checkpoint_keys()
    tied = bool(config.get("tie_word_embeddings", False))
    unused = [
        n for n in info_tensors
        if n not in expected and (any(s in n for s in ignored) or (tied and n == "lm_head.weight"))
    ]  # fmt: skip
    present = set(info_tensors) - set(unused)
    missing, unexpected = set(expected) - present, present - set(expected)
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint is missing "
                              f"{len(missing)} tensor(s) the model needs: {_few(missing)}; "
                              "does config.json belong to these weights?")  # fmt: skip
    if unexpected:
        name = sorted(unexpected)[0]
        raise CheckpointError(f"{info_tensors[name].file}: {len(unexpected)} unexpected tensor(s) "
                              f"for model_type {config.get('model_type')!r}: {_few(unexpected)}")  # fmt: skip
    for name, shape in expected.items():
        entry = info_tensors[name]
        if entry.shape != shape:
            raise CheckpointError(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, "
                                  f"expected {list(shape)} from config.json")  # fmt: skip
    return tuple(sorted(unused))


def inspect_checkpoint(model_dir: str | Path) -> CheckpointInfo:
    """Validate a checkpoint directory without allocating device memory (no tensor data is read)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    config = _read_config(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"{model_dir / 'tokenizer.json'}: missing tokenizer.json")
    model_type = supported_model_type(config, model_dir / "config.json")
    files, weight_map = _weight_files(model_dir)
    tensors = _model_names(get_model_class(model_type), _read_tensor_index(files, weight_map))
    quantized = next((n for n, e in tensors.items() if e.dtype.startswith("F8")), None)
    if quantized is not None:
        e = tensors[quantized]
        raise CheckpointError(f"{e.file}: tensor {e.key or quantized} is {e.dtype}: FP8 / FP4 weights (DeepSeek's "
                              "native checkpoints) cannot be loaded yet; use a bf16 checkpoint, or plan from its "
                              "config.json alone")
    check_layout(config, tensors, model_dir)  # first: a config for other weights is the likelier cause
    check_config(config, model_dir / "config.json")
    model = build_meta_model(get_model_class(model_type), config, torch.float32, model_dir / "config.json")
    unused = _match_tensors(model, tensors, config, model_dir)
    total = sum(e.nbytes for n, e in tensors.items() if n not in unused)
    return CheckpointInfo(model_dir, config, model_type, files, tensors, unused, total)


def available_host_memory() -> int | None:
    """Bytes of RAM this process can still allocate: MemAvailable of /proc/meminfo, at most the
    cgroup (v2) memory limit inside a container. None where neither exists (not Linux)."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        # The limit, not limit - memory.current: the current charge includes page cache the kernel
        # reclaims (a just-downloaded checkpoint), so it would refuse loads that fit.
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            available = int(limit) if available is None else min(available, int(limit))
    except (OSError, ValueError):
        pass
    return available


def check_host_memory(nbytes: int, what: str, advice: str) -> None:
    """Raise MemoryError (one line: the need, what is available, what to change) when `nbytes`
    more bytes of RAM cannot be had; say nothing where the available memory is unknown."""
    available = available_host_memory()
    if available is not None and nbytes > available:
        raise MemoryError(f"{what} need {nbytes / 2**30:.2f} GiB but this machine has {max(available, 0) / 2**30:.2f} "
                          f"GiB of RAM available (MemAvailable / cgroup limit); {advice}")  # fmt: skip


def _reset_buffers(model: torch.nn.Module) -> None:
    """Recompute non-persistent buffers (rotary inv_freq) that `to_empty` left uninitialised."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


class TensorSink(Protocol):
    """Where some checkpoint tensors go instead of the model's parameters (routed experts kept in
    RAM: tandem/offload/cpu_executor.py `OffloadedExperts`)."""

    def prepare(self, model: torch.nn.Module) -> None:
        """On the meta model, before it is materialised: take out the modules this sink holds."""

    def wants(self, name: str) -> bool: ...

    def take(self, name: str, tensor: torch.Tensor) -> None: ...

    def install(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """After every tensor was read."""


@torch.no_grad()
def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    progress: bool = True,
    sink: TensorSink | None = None,
    info: CheckpointInfo | None = None,
) -> tuple[CausalLM, LoadReport]:
    """Validate (see `inspect_checkpoint`; `info`: the caller's inspection of `model_dir`, not
    repeated), then build the model on `device` in `dtype` and fill it.

    Floating-point checkpoint tensors are converted to `dtype`; the tensors `sink` wants go to it
    instead. The model is returned in eval mode with no KV cache bound.
    """
    start = time.perf_counter()
    info = info if info is not None else inspect_checkpoint(model_dir)
    model = build_meta_model(info.model_class, info.config, dtype, info.model_dir / "config.json")
    if sink is not None:
        sink.prepare(model)
    if torch.device(device).type == "cpu":  # on CUDA the engine checks the GPU before loading
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        check_host_memory(nbytes, f"{info.model_dir}: the weights in {str(dtype).removeprefix('torch.')}",
                          "free memory, load in a smaller --dtype or use a smaller model")
    model.to_empty(device=device)
    _reset_buffers(model)
    model.eval()
    targets = model.state_dict(keep_vars=True)  # name -> Parameter on device
    sunk = sorted(n for n in info.tensors if n not in targets and n not in info.unused and sink and sink.wants(n))
    by_file: dict[Path, list[str]] = {}
    for name in sorted([*targets, *sunk]):
        by_file.setdefault(info.tensors[name].file, []).append(name)
    total = sum(info.tensors[n].nbytes for names in by_file.values() for n in names)
    bytes_read = 0
    with tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              disable=not progress) as bar:
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in names:
                        # Memory-mapped read; copy_ converts dtype and moves to the device.
                        tensor = f.get_tensor(info.tensors[name].key or name)
                        if name in targets:
                            targets[name].copy_(tensor)
                        else:
                            sink.take(name, tensor)  # type: ignore[union-attr]
                        bytes_read += info.tensors[name].nbytes
                        bar.update(info.tensors[name].nbytes)
            except (OSError, SafetensorError) as e:
                raise CheckpointError(f"{path}: cannot read tensors ({e})") from None
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    if sink is not None:
        sink.install(model, torch.device(device), dtype)
    report = LoadReport(
        model_type=info.model_type,
        model_dir=info.model_dir,
        num_tensors=len(targets) + len(sunk),
        bytes_read=bytes_read,
        seconds=time.perf_counter() - start,
        dtype=dtype,
        device=str(device),
    )
    logger.info(report.summary())
    return model, report
