"""Probe whether the demo target copies a word group (written to find out why v1-v3 copied no
names in the JSON family; it now checks that v4 does).

    python -m tandem.demo.probe tandem/assets/demo

Two measurements on the training-side model (`load_causal_lm`), on CPU (about 6 s):

- **copied**: teacher-forced on held-out JSON chats, how many of the name and city tokens of the
  assistant turns the target predicts (argmax) right.
- **moved**: one JSON record, one field asked for (`What is the "city" in this record? {...}`);
  the field's value runs over its whole word group while the rest of the prompt stays the same.
  Per layer, the share of the answer position's hidden-state energy that varies with the value
  (variance across values / mean square). Near 0 means no attention carried the value to where the
  answer is written; v3 moves a city (9-31%) and not a name (0.1-0.3%), v4 (dense name drills)
  moves both (names 48-78% at layers 3-7).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from tandem.demo import text
from tandem.demo.corpus import _CITIES, _NAMES, EVAL_SEED, Example, _assistant, make_example
from tandem.demo.eval import load_causal_lm
from tandem.demo.modeling import CausalLM
from tandem.demo.train import group_token_ids

_GROUPS = {"name": ("names", _NAMES), "city": ("cities", _CITIES)}


@torch.no_grad()
def copied(model: CausalLM, tok, tok_json: str, n: int = 40) -> dict[str, dict[str, int]]:
    """Name and city tokens of `n` held-out JSON chats' assistant turns, teacher-forced: right / total."""
    ids_of = {field: set(group_token_ids(tok_json, group)) for field, (group, _) in _GROUPS.items()}
    out = {field: {"right": 0, "total": 0} for field in _GROUPS}
    for i in range(n):
        ids, mask = text.encode_example(tok, make_example(EVAL_SEED, i, "json"))
        logits, _ = model(torch.tensor([ids]))
        pred = logits[0].argmax(-1).tolist()
        for p in range(1, len(ids)):
            for field, group in ids_of.items():
                if mask[p] and ids[p] in group:
                    out[field]["total"] += 1
                    out[field]["right"] += int(pred[p - 1] == ids[p])
    return out


@torch.no_grad()
def moved(model: CausalLM, tok, field: str, values: list[str]) -> dict[str, Any]:
    """One-record prompts asking for `field`, whose value runs over `values`: per layer, the share
    of the answer position's hidden state that varies with the value, and how many it copies."""
    states, right = [], 0
    for v in values:
        rec = {"name": "ann", "age": 50, "city": "Oslo", field: v}
        ex = Example("recall", [{"role": "user", "content": f'What is the "{field}" in this record? {json.dumps(rec)}'},
                                _assistant("", v, True)], {"text": v})
        prompt = text.render_prompt(ex) + f'<think>\nThe "{field}" field: "'
        ids = tok.encode(prompt, add_special_tokens=False).ids
        logits, hidden = model(torch.tensor([ids]))
        states.append(torch.stack([h[0, -1].float() for h in hidden]))
        right += int(tok.id_to_token(int(logits[0, -1].argmax())) == v)
    h = torch.stack(states)  # [values, layers, hidden]
    share = h.var(0).sum(-1) / h.pow(2).mean(0).sum(-1)
    return {"copied": right, "values": len(values), "moved_by_layer": [round(float(x), 4) for x in share]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tandem.demo.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--n", type=int, default=40, help="held-out JSON chats for the teacher-forced count")
    args = ap.parse_args(argv)
    d = Path(args.model_dir)
    tok_json = (d / "tokenizer.json").read_text()
    tok = text.load_tokenizer(d / "tokenizer.json")
    model = load_causal_lm(d).eval()
    report = {"copied": copied(model, tok, tok_json, args.n),
              "moved": {field: moved(model, tok, field, list(values)) for field, (_, values) in _GROUPS.items()}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
