"""How many token positions the update computes for a rollout file, with and without the padding cuts.

    python bench/padding.py .rlhf/runs/<run>/steps/<k>/rollout.parquet --micro-batch 16

"Padded": every micro-batch as wide as the whole batch (prompts left-padded to the longest prompt,
responses right-padded to the longest response), rows in shuffled order, as before the cuts.
"Cut": each mini-batch's rows ordered by length and each micro-batch cut to its own longest row
(`components.batch.PaddingPlan`, what `Actor.update` and `Critic.update` do now). "Real": tokens that
exist. CPU only, no model: a count, not a timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def count(path: str, micro_batch: int, mini_batch: int | None, seed: int = 0) -> dict:
    import pyarrow.parquet as pq
    import torch

    from components.batch import PaddingPlan, build_sequence_batch

    table = pq.read_table(path, columns=["prompt_ids", "response_ids"])
    batch = build_sequence_batch(table.column("prompt_ids"), table.column("response_ids"), pad_token_id=0)
    plan = PaddingPlan(batch)
    mini_batch = mini_batch or batch.size
    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
    padded = cut = 0
    for mini in order.split(mini_batch):
        chunks = max(1, -(-len(mini) // micro_batch))
        padded += sum(len(rows) * batch.input_ids.shape[1] for rows in mini.tensor_split(chunks))
        ordered = mini[torch.argsort(plan.lengths[mini], descending=True, stable=True)]
        for rows in ordered.tensor_split(chunks):
            drop, width = plan.bounds(rows)
            cut += len(rows) * (batch.prompt_length - drop + width)
    return {"file": path, "rows": batch.size, "width": batch.input_ids.shape[1], "real": int(plan.lengths.sum()),
            "padded": padded, "cut": cut}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--mini-batch", type=int, default=None, help="default: the whole file")
    args = parser.parse_args()
    for path in args.files:
        c = count(path, args.micro_batch, args.mini_batch)
        print(f"{c['file']}: {c['rows']} rows, width {c['width']}: real tokens {c['real']}; positions computed "
              f"padded {c['padded']} ({c['real'] / c['padded']:.2f} real), cut {c['cut']} "
              f"({c['real'] / c['cut']:.2f} real): {c['padded'] / c['cut']:.2f}x fewer")


if __name__ == "__main__":
    main()
