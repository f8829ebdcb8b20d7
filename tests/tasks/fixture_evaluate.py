"""Stands in for `python -m trainer.evaluate` with the same command line and output contract, without TF.

Each rank (TF_CONFIG, as the launcher sets it) reports its part of the run's sample (`--eval-tokens` of the
manifest's validation split, trainer/eval_sample.py's identity): every sequence scores the loss recorded in
`<model>/fixture_eval.json` (written by run_fixtures), plus and minus its `spread` on alternate sequences when it
gives one, so the parts combine to that loss. A rank exits 3 naming the file when the model has none, like the real
entry point does for a missing model, and when the file names it in `fail_rank`; it hangs for `hang_s` seconds
when that file says so. Each call is appended to `$TFMW_FIXTURE_EVALUATE_CALLS` (TFMW_* is inherited by
evaluation processes) so tests can count evaluations (one line per model, from rank 0).
"""

import argparse
import os
import sys
import time

from core.storage import exists, join, read_json, write_json_atomic
from trainer.runtime import worker_identity


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--manifest", "--output"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--eval-tokens", type=int, default=1_000_000)
    args = parser.parse_args()
    me = worker_identity()
    if me.rank == 0:
        with open(os.environ["TFMW_FIXTURE_EVALUATE_CALLS"], "a") as calls:
            calls.write(args.model + "\n")
    recorded = join(args.model, "fixture_eval.json")
    if not exists(recorded):
        print(f"error: no model at {args.model} ({recorded} missing)", file=sys.stderr)
        return 3
    recorded = read_json(recorded)
    if recorded.get("fail_rank") == me.rank:
        print(f"error: rank {me.rank} lost its model files", file=sys.stderr)
        return 3
    if recorded.get("hang_s"):  # a stuck evaluation, for the tests that end it
        print(f"evaluating as pid {os.getpid()} of run {os.environ.get('TFMW_RUN_KEY')}", flush=True)
        time.sleep(recorded["hang_s"])
    from core.eval_result import EvalPart, combine, part_url  # after the hang's line: the tests wait for it
    from trainer.data import load_manifest
    from trainer.eval_sample import sample_identity

    sample = sample_identity(load_manifest(args.manifest), args.eval_tokens)  # pinned as trainer.evaluate reads it
    low, high = (me.rank * sample["sequences"] // me.num_workers,
                 (me.rank + 1) * sample["sequences"] // me.num_workers)
    eval_loss, spread = recorded["eval_loss"], recorded.get("spread", 0.0)
    losses = [eval_loss + (spread if index % 2 else -spread) for index in range(low, high)]
    print(f"rank {me.rank} evaluated {len(losses)} of {sample['sequences']} sequences: loss {eval_loss:.4f}",
          flush=True)
    block = sample["tokens"] // max(sample["sequences"], 1)
    part = {"rank": me.rank, "num_workers": me.num_workers, "model": args.model, "sample": sample,
            "sequences": len(losses), "sequence_losses": losses, "scored_tokens": len(losses) * (block - 1),
            "characters": len(losses) * (block - 1) * 3,  # as if each token spelled 3 characters
            "read_bytes": len(losses) * block * 2, "read_time_s": 0.01, "eval_time_s": 1.25}
    if me.rank == 0:
        part.update({"known_words": {"greedy": 1.0, "top_k": 0.75, "words": {"greedy": 4, "top_k": 4}},
                     "samples": [{"prompt": "To be, or not", "greedy": " to be, that is",
                                  "top_k": f" the question of {recorded.get('voice', 'a fixture')}"}]})
    output = part_url(args.output, me.rank, me.num_workers)
    written = EvalPart.from_json(part, output)  # what trainer.evaluate writes, typed as it makes it
    write_json_atomic(output, combine([written]).to_json() if me.num_workers == 1 else written.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
