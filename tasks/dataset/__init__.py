"""The prepare stage: a text dataset -> verified TFRecord shards + `manifest.json` under
`storage_root/datasets/<fingerprint>/`, in bounded memory, in one task or fanned out over Airflow mapped tasks, with
byte-identical output either way.

One job per module, in the order the data flows:
- `sources`: the `dataset` setting -> files (size, mtime, path relative to the dataset's base);
- `readers`: documents streamed from a byte range (text, JSON Lines) or row groups (Parquet) of one file;
- `split`: the keyed-hash draws (validation split, BPE sample) that need no global pass;
- `tokenizer`: the tokenizer plan, loading, and BPE training on a bounded sample;
- `encode`: documents -> token ids appended to per-split streams, in batches bounded in bytes;
- `units`: the corpus cut into work units and lanes (one mapped task each), and tokenizing one unit;
- `shards`: the units' streams as one stream per split, cut into equal TFRecord shards;
- `publish`: fingerprint, cache check, staging and publishing (the manifest last);
- `stage`: the three steps the DAG runs (plan, lanes, finish) and `prepare_dataset`, all of them in one process;
- `checks`: what the later steps read back from XCom and storage, checked against the run's storage and policy;
- the documents (core/document.py) they hand each other: `plan` (by XCom: `DatasetPlan`, `PreparedDataset`),
  `records` (the lanes' units, the whole plan, a unit's result, a lane's result) and `manifest` (`manifest.json`).
"""
