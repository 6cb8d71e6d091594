"""The built-in demo model: a deterministic chat corpus with checkable answers, its tokenizer, and
the scripts that train a small reasoning `qwen3_moe` target, a dense `qwen3` draft model and a
DSpark-style block drafter on it, and measure them. See `tandem/assets/demo/README.md`."""
