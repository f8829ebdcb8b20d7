"""The worker side: what runs inside each worker (data, model, training, evaluation, preflight, exports)."""
