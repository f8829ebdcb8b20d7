"""Decoder-only language models in TensorFlow's core API whose variables carry Hugging Face's PyTorch names, and
the checkpoints (config.json + safetensors) they read and write.

    architectures.py    the supported architectures; a checkpoint's config.json read and checked (no TensorFlow)
    gpt2_config.py      GPT-2's typed config and its weights' names and shapes (no TensorFlow)
    llama_config.py     Llama's and Qwen2's typed config, weights' names and shapes, rotary frequencies (no TensorFlow)
    ops.py              what every decoder computes with: LayerNorm, RMSNorm, GELU, SwiGLU, the projection, rotary
                        positions, causal (grouped-query) attention, the token loss, cost
    gpt2.py             the GPT-2 decoder (GPT2LMHeadModel)
    llama.py            the Llama / Qwen2 decoder (LlamaForCausalLM, Qwen2ForCausalLM)
    safetensors_io.py   safetensors headers, the index of shards, the tensor checks and a streaming writer
    pretrained.py       build (preset or checkpoint), load_pretrained, save_pretrained

docs/model.md describes the checkpoints and the loader.
"""
