"""What a checkpoint of the actor costs the run: written at once (trainer.checkpoint_async=false) against in the
background (true, the default), with the product's own functions (components/checkpoint.py).

    python bench/checkpoint.py --preset qwen2.5-0.5b --device cuda --out checkpoint-0.5b.json
    python bench/checkpoint.py --preset qwen2.5-0.5b --device cpu --tokens 32 --reps 2

The actor is the product's trained model (master weights in float32, AdamW). Each of --reps rounds, after a
warm-up step: one AdamW step on random tokens (`update_rms_ratio`: the RMS of the step's change over the RMS
of the weights, so every row shows the policy moved), then
- at once: `save_role_checkpoint`, which the run waited for at every checkpoint (`at_once_s`);
- in the background: `role_state(host_copy=True)`, which the run still waits for (`stall_s`, the checkpoint
  stage's timing_s/checkpoint_actor; on a GPU the first round also allocates the page-locked host memory that
  the later rounds reuse, as the product's actor does), then a thread writes the part (`write_s`) while this thread does the next
  step's work before its update (--work forward passes of the actor, as the reference and log-prob stages
  would): `work_alone_s` against `work_beside_s` says how much the writing slows that work down. The next
  update waits for the rest of the writing: `waited_s`;
- the part written in the background holds the same bytes as the one written at once (`same_bytes`).
The run's time saved per checkpoint is at_once_s - stall_s - waited_s - (work_beside_s - work_alone_s).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, machine_info, make_random_model  # noqa: E402


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", default=None, help="default: /tmp/rlhf-bench-models/<preset>")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row of the random training batch")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--work", type=int, default=4, help="forward passes standing in for the next step's work")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import fsspec
    import torch

    from components.checkpoint import role_state, save_role_checkpoint, write_role_state
    from components.models import load_causal_lm
    from components.precision import Precision, prepare_trained_model

    started = time.perf_counter()
    model_dir = make_random_model(args.model_dir or f"/tmp/rlhf-bench-models/{args.preset}", args.preset)
    on_gpu = args.device == "cuda"
    precision = Precision.of("bfloat16" if on_gpu else "float32", "float32")
    model = load_causal_lm(str(model_dir), dtype=precision.master, compute_dtype=precision.compute, device=args.device)
    prepare_trained_model(model, precision, False, shard=False)
    updater = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
                              scheduler=None, updates=0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.tokens), generator=generator).to(args.device)

    def synchronize() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def update() -> float:
        before = [p.detach().clone() for p in model.parameters()]
        model(ids, labels=ids).loss.backward()
        updater.optimizer.step()
        updater.optimizer.zero_grad(set_to_none=True)
        updater.updates += 1
        with torch.no_grad():
            change = sum(float((p.detach() - b).float().square().sum()) for p, b in zip(model.parameters(), before))
            size = sum(float(b.float().square().sum()) for b in before)
        return (change / size) ** 0.5

    def work() -> float:
        synchronize()
        begun = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.work):
                model(ids)
        synchronize()
        return time.perf_counter() - begun

    update()  # warm-up: AdamW's state exists from here on
    work()
    setup_s = time.perf_counter() - started
    fs = fsspec.filesystem("file")
    rows, buffers = [], {}  # the page-locked host memory, reused by each copy after the first (as the product does)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-checkpoint-", dir=args.dir) as folder:
        for rep in range(args.reps):
            rms = update()
            synchronize()
            t0 = time.perf_counter()
            save_role_checkpoint(fs, f"{folder}/at-once-{rep}", model, updater)
            t1 = time.perf_counter()
            state = role_state(model, updater, host_copy=True, host_buffers=buffers)
            t2 = time.perf_counter()
            written: dict[str, float] = {}

            def write(state=state, rep=rep, written=written) -> None:
                begun = time.perf_counter()
                write_role_state(fs, f"{folder}/background-{rep}", state)
                written["s"], written["end"] = time.perf_counter() - begun, time.perf_counter()

            thread = threading.Thread(target=write)
            thread.start()
            work_beside = work()
            work_end = time.perf_counter()
            thread.join()
            del state
            work_alone = work()
            same = _digests(Path(folder, f"at-once-{rep}")) == _digests(Path(folder, f"background-{rep}"))
            rows.append({"at_once_s": t1 - t0, "stall_s": t2 - t1, "write_s": written["s"],
                         "work_alone_s": work_alone, "work_beside_s": work_beside,
                         "waited_s": max(0.0, written["end"] - work_end), "update_rms_ratio": rms, "same_bytes": same})
            print(f"rep {rep}: at once {t1 - t0:.2f} s; background: stall {t2 - t1:.2f} s, write {written['s']:.2f} s, "
                  f"work {work_alone:.2f} s alone / {work_beside:.2f} s beside, next update waited "
                  f"{rows[-1]['waited_s']:.2f} s; update RMS ratio {rms:.1e}; same bytes {same}", flush=True)
            fs.rm(f"{folder}/at-once-{rep}", recursive=True)
            fs.rm(f"{folder}/background-{rep}", recursive=True)
    summary = {key: statistics.mean(row[key] for row in rows) for key in rows[0] if key != "same_bytes"}
    summary["same_bytes"] = all(row["same_bytes"] for row in rows)
    emit({"bench": "checkpoint", "preset": args.preset, "device": args.device, "rows": args.rows,
          "tokens": args.tokens, "work": args.work, "parameters": sum(p.numel() for p in model.parameters()),
          "setup_s": setup_s, "machine": machine_info(), "reps": rows, "mean": summary}, args.out)


if __name__ == "__main__":
    main()
