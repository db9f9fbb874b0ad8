"""The front end: a model in, its decode graph out.

    models.py          load_model: a shipped name, a .gguf file, a Hugging Face folder or hub id
    hub.py             a hub id's config, weights and tokenizer downloaded into the Hugging Face cache
    gguf_tokenizer.py  the tokenizer of a .gguf file as a Hugging Face tokenizer
    arch.py            the architecture table: what differs per architecture (k_norm, RoPE bases, ...)
    capture.py         torch.export of the decoder with an explicit KV interface (the decode graph)
"""
