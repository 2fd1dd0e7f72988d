"""Writes the GRPO recipe's data for verl (docs/rl.md, section 10): train.parquet and val.parquet.

One row per prompt of ``loopline.train.rewards.PROMPTS`` (Python statements left open inside a
bracket), in verl's RLHFDataset schema: ``prompt`` (one user message; the recipe's chat template
passes its text through unchanged), ``data_source``, ``reward_model.ground_truth`` (the prompt
text, which tools/verl_grpo_reward.py scores against). ``--repeat`` repeats the train prompts so an
epoch holds enough batches.

    python tools/verl_grpo_data.py --out /tmp/verl_grpo_data
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from loopline.train.rewards import PROMPTS

DATA_SOURCE = "loopline_python_closes"


def rows(prompts: list[str]) -> list[dict]:
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p}], "ability": "code",
             "reward_model": {"style": "rule", "ground_truth": p}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    ap.add_argument("--repeat", type=int, default=8, help="copies of the train prompts (default 8)")
    ap.add_argument("--val", type=int, default=6, help="prompts held out for validation (default 6)")
    args = ap.parse_args()
    if args.repeat < 1 or not 1 <= args.val < len(PROMPTS):
        ap.error(f"--repeat must be >= 1 and --val in 1..{len(PROMPTS) - 1}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = list(PROMPTS[:-args.val]), list(PROMPTS[-args.val:])
    pd.DataFrame(rows(train * args.repeat)).to_parquet(out / "train.parquet")
    pd.DataFrame(rows(val)).to_parquet(out / "val.parquet")
    print(f"{len(train) * args.repeat} train rows, {len(val)} val rows in {out}")


if __name__ == "__main__":
    main()
