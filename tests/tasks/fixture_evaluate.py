"""Stands in for `python -m trainer.evaluate` with the same command line and output contract, without TF.

It reports the loss recorded in `<model>/fixture_eval.json` (written by run_fixtures) and exits 3 naming the file
when the model has none, like the real entry point does for a missing model. Each call is appended to
`$FIXTURE_EVALUATE_CALLS` so tests can count evaluations.
"""

import argparse
import math
import os
import sys

from trainer.storage import exists, join, read_json, write_json_atomic


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--manifest", "--output"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with open(os.environ["FIXTURE_EVALUATE_CALLS"], "a") as calls:
        calls.write(args.model + "\n")
    recorded = join(args.model, "fixture_eval.json")
    if not exists(recorded):
        print(f"error: no model at {args.model} ({recorded} missing)", file=sys.stderr)
        return 3
    validation = read_json(args.manifest)["splits"]["validation"]
    eval_loss = read_json(recorded)["eval_loss"]
    print(f"evaluated {validation['sequences']} sequences: loss {eval_loss:.4f}", flush=True)
    write_json_atomic(args.output, {"eval_loss": eval_loss, "perplexity": math.exp(eval_loss),
                                    "eval_tokens": validation["tokens"], "eval_time_s": 1.25,
                                    "samples": ["To be, or not to be"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
