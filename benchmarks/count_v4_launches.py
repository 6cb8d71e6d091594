"""Count what one batch-1 DeepSeek-V4 decode step launches on the CUDA path, on the CPU: where
the glue launches of a CUDA graph replay come from, without a GPU (issue 18's profile named them;
this attributes each to its source line). A count, not a timing: the H200 profile in
BENCHMARKS.md says what each costs.

The CUDA path is emulated: Triton kernels run in the interpreter (TRITON_INTERPRET=1), the fused
ops are switched on for CPU tensors, the model's `_kernel` (--attention-backend triton) is on, and
the routed experts run the grouped executor's small-batch Triton path. Every aten op is attributed
to its innermost frame under tandem/ ; every Triton launch is counted once (aten ops inside the
interpreter's launch are not counted).

    python benchmarks/count_v4_launches.py [--dtype bf16] [--by line|op] [--layers 4] [--prefix-caching]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
REPO = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO)
sys.path.insert(0, REPO + "/benchmarks")
sys.path.insert(0, REPO + "/tests")  # triton_interp's numpy shim

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FREE = {  # aten ops that launch no CUDA kernel
    "view", "_unsafe_view", "reshape", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "select", "slice", "split", "split_with_sizes", "unbind", "chunk", "alias", "detach",
    "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "view_as", "unflatten", "flatten",
    "_reshape_alias", "diagonal", "narrow", "expand_as", "movedim", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "resolve_conj", "resolve_neg",
}


class Counter(TorchDispatchMode):
    """(source line, op) -> calls, for every aten op while active (not inside a Triton launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = collections.Counter()
        self.paused = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *a):
        self.active = False
        return super().__exit__(*a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            name = func.overloadpacket.__name__
            if name in ("to", "_to_copy", "contiguous", "type_as", "float", "reshape") and _same(out, args):
                name = "noop-" + name
                FREE.add(name)
            self.rows[(where(), name)] += 1
        return out


def _same(out, args) -> bool:
    """The op returned (a view of) one of its inputs: no kernel."""
    if not isinstance(out, torch.Tensor):
        return False
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
               for a in args)


def where() -> str:
    """The innermost frame of the call stack inside tandem/, as `path:line function`."""
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.startswith(REPO + "/tandem/"):
            return f"{fr.filename[len(REPO) + 1:]}:{fr.lineno} {fr.name}"
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--by", default="line")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--prefix-caching", action="store_true", help="the engine's prefix caching on (snapshots)")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    from triton.runtime import interpreter
    from triton_interp import numpy24_scalar_index

    from tandem.kernels import fused
    from tandem.kernels.moe_grouped import GroupedMoEExecutor
    import bench_v4
    from bench_gpu import materialize_random, model_dir
    from tandem import SamplingParams
    from tandem.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine
    from tandem.models.deepseek_v4 import DeepseekV4ForCausalLM

    counter = Counter()
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *a, **k):
        if counter.active and not counter.paused:
            counter.rows[(where(), "triton:" + self.fn.__name__)] += 1
        counter.paused += 1
        try:
            return run(self, *a, **k)
        finally:
            counter.paused -= 1

    interpreter.InterpretedFunction.run = counted_run
    use_fused = fused.use_fused
    fused.use_fused = lambda x, *o: use_fused(_Cuda(x), *o)

    cfg = bench_v4.shape("tiny", args.layers)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, dtype)
    model = materialize_random(model, "cpu")
    bench_v4.randomize_routing_(model)
    with model_dir(cfg) as path:
        config = EngineConfig(model=ModelConfig(str(path), dtype, "cpu", max_model_len=512),
                              cache=CacheConfig(kv_cache_memory=8 << 20, enable_prefix_caching=args.prefix_caching),
                              scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
                              runner=RunnerConfig())
        engine = LLMEngine(config, model=model)
    model._kernel = True
    for block in model.moe_blocks().values():
        block.set_executor(GroupedMoEExecutor(block.experts, small_batch=True))

    state = {"on": False}
    fwd, logits = model.forward, model.compute_logits

    def forward(*a, **k):
        if not state["on"]:
            return fwd(*a, **k)
        with counter:
            return fwd(*a, **k)

    def compute_logits(h):
        if not state["on"]:
            return logits(h)
        with counter:
            return logits(h)

    model.forward, model.compute_logits = forward, compute_logits
    g = torch.Generator().manual_seed(0)
    engine.add_request("r", torch.randint(0, cfg["vocab_size"], (args.prompt,), generator=g).tolist(),
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with numpy24_scalar_index():
        for i in range(4):
            engine.step()
        state["on"] = True
        engine.step()
    report(counter.rows, args.by)


class _Cuda:
    """Proxy making use_fused see a CUDA tensor."""

    def __init__(self, x):
        self._x = x

    is_cuda = True

    def __getattr__(self, n):
        return getattr(self._x, n)


def report(rows: collections.Counter, by: str) -> None:
    """Launching ops by source line (or by op), most first, and the total."""
    kernels = {k: v for k, v in rows.items() if k[1] not in FREE and v}
    total = sum(kernels.values())
    if by == "op":
        per = collections.Counter()
        for (w, op), n in kernels.items():
            per[op] += n
        for op, n in per.most_common():
            print(f"{n:5d}  {op}")
    else:
        per = collections.defaultdict(collections.Counter)
        for (w, op), n in kernels.items():
            per[w][op] += n
        for w, ops in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"{sum(ops.values()):5d}  {w}:  " + ", ".join(f"{op} x{n}" for op, n in ops.most_common()))
    triton = sum(v for (w, op), v in kernels.items() if op.startswith("triton:"))
    print(f"TOTAL launching ops: {total} ({triton} Triton, {total - triton} aten); "
          f"free ops: {sum(v for k, v in rows.items() if k[1] in FREE)}")


if __name__ == "__main__":
    main()
