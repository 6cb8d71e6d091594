"""`--cpu-moe-act-dtype int8` through the engine: the flag, the offload config's checks, the
loader's sink building int8-activation layers, and a CPU run of the demo model with it (the
kernel's own numbers are tests/test_cpu_experts.py's)."""

import logging

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.builtin import DEMO_DIR
from tandem.cli import build_parser, offload_config
from tandem.config import OffloadConfig
from tandem.models.loader import build_meta_model, inspect_checkpoint
from tandem.offload.cpu_executor import CpuMoEExecutor, OffloadedExperts
from tandem.offload.placement import plan_placement

cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")

PROMPT = "<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|im_start|>assistant\n"


def test_the_flag_maps_to_the_offload_config():
    args = build_parser().parse_args(["serve", "--cpu-moe", "--cpu-moe-dtype", "mxfp4", "--cpu-moe-act-dtype", "int8"])
    assert offload_config(args) == OffloadConfig(cpu_moe=True, cpu_moe_dtype="mxfp4", cpu_moe_act_dtype="int8")
    assert offload_config(build_parser().parse_args(["serve", "--cpu-moe"])).cpu_moe_act_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-moe-act-dtype", "int4"])


def test_the_config_refuses_what_the_mode_does_not_cover():
    with pytest.raises(ValueError, match="--cpu-moe-act-dtype must be one of auto, int8"):
        OffloadConfig(cpu_moe_act_dtype="fp8")
    for fmt in ("fp32", "bf16", "int8"):
        with pytest.raises(ValueError, match=f"not --cpu-moe-dtype {fmt}: use --cpu-moe-dtype int4 or mxfp4"):
            OffloadConfig(cpu_moe=True, cpu_moe_dtype=fmt, cpu_moe_act_dtype="int8")
    OffloadConfig(cpu_moe=True, cpu_moe_dtype="auto", cpu_moe_act_dtype="int8")  # checked once resolved


def _sink(cfg: OffloadConfig):
    info = inspect_checkpoint(DEMO_DIR)
    meta = build_meta_model(info.model_class, info.config, torch.float32, DEMO_DIR / "config.json")
    return meta, OffloadedExperts(plan_placement(meta, torch.float32, cfg, None, 0), offload=cfg)


def test_the_sink_builds_int8_activation_layers():
    meta, sink = _sink(OffloadConfig(cpu_moe=True, cpu_moe_dtype="int4", cpu_moe_act_dtype="int8"))
    sink.prepare(meta)
    assert sink.layers and all(layer.act_dtype == "int8" for layer in sink.layers.values())
    meta, sink = _sink(OffloadConfig(cpu_moe=True, cpu_moe_act_dtype="int8"))  # auto: fp32 experts on a CPU run
    with pytest.raises(ValueError, match="cover int4 and mxfp4 expert weights, not fp32"):
        sink.prepare(meta)


def test_demo_model_runs_with_int8_activations(caplog):
    kw = dict(device="cpu", dtype="float32", kv_cache_memory="64MiB", max_model_len=1024, cpu_moe=True,
              cpu_moe_threads=2, cpu_moe_dtype="int4")
    with caplog.at_level(logging.WARNING, logger="tandem"):
        llm = LLM(str(DEMO_DIR), cpu_moe_act_dtype="int8", **kw)
    assert "--cpu-moe-act-dtype int8" in caplog.text and "LOSSY" in caplog.text
    executors = [b.executor for b in llm.engine.model.moe_blocks().values()]
    assert all(isinstance(ex, CpuMoEExecutor) and ex.layer.act_dtype == "int8" for ex in executors)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    tokens = llm.generate([PROMPT], params)[0].token_ids
    exact = LLM(str(DEMO_DIR), **kw).generate([PROMPT], params)[0].token_ids
    assert len(tokens) == 16
    assert tokens[:4] == exact[:4]  # a small perturbation: the first greedy tokens hold
