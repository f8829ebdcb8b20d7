"""Stands in for `python -m trainer.evaluate` with the same command line and output contract, without TF.

It reports the loss recorded in `<model>/fixture_eval.json` (written by run_fixtures) and exits 3 naming the file
when the model has none, like the real entry point does for a missing model; it hangs for `hang_s` seconds when
that file says so. Each call is appended to
`$TFMW_FIXTURE_EVALUATE_CALLS` (TFMW_* is inherited by evaluation processes) so tests can count evaluations.
"""

import argparse
import math
import os
import sys
import time

from trainer.storage import exists, join, read_json, write_json_atomic


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--manifest", "--output"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with open(os.environ["TFMW_FIXTURE_EVALUATE_CALLS"], "a") as calls:
        calls.write(args.model + "\n")
    recorded = join(args.model, "fixture_eval.json")
    if not exists(recorded):
        print(f"error: no model at {args.model} ({recorded} missing)", file=sys.stderr)
        return 3
    validation = read_json(args.manifest)["splits"]["validation"]
    recorded = read_json(recorded)
    if recorded.get("hang_s"):  # a stuck evaluation, for the tests that end it
        print(f"evaluating as pid {os.getpid()} of run {os.environ.get('TFMW_RUN_KEY')}", flush=True)
        time.sleep(recorded["hang_s"])
    eval_loss = recorded["eval_loss"]
    print(f"evaluated {validation['sequences']} sequences: loss {eval_loss:.4f}", flush=True)
    write_json_atomic(args.output, {"eval_loss": eval_loss, "perplexity": math.exp(eval_loss),
                                    "eval_tokens": validation["tokens"], "eval_time_s": 1.25,
                                    "nats_per_char": eval_loss / 3,  # as if each token spelled 3 characters
                                    "known_words": {"greedy": 1.0, "top_k": 0.75, "words": {"greedy": 4, "top_k": 4}},
                                    "samples": [{"prompt": "To be, or not", "greedy": " to be, that is",
                                                 "top_k": f" the question of {recorded.get('voice', 'a fixture')}"}]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
