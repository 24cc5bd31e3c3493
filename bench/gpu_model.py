"""Qwen2.5-shaped checkpoints built locally, for hosts with no network and no Qwen files.

    python -m bench.gpu_model --shape qwen2.5-0.5b --out DIR

The model is `Qwen2ForCausalLM` with Qwen2.5's published geometry and random bf16
weights. The tokenizer is synthetic but has Qwen2.5's vocabulary size (151,936 ids) and
its chat template with function calling: the byte-level alphabet and the ChatML special
tokens come first (so text round-trips character by character, as with `ajet-tiny`), the
rest of the ids are filler tokens that no text encodes to but that the model can sample,
so the embedding, the LM head and the sampler have the real width. The chat template and
the response template are `ajet-tiny`'s, which follow the Qwen2.5 format.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "QWEN25_VOCAB_SIZE", "build_qwen25_shaped"]

QWEN25_VOCAB_SIZE = 151_936

#: Qwen2.5's config.json geometry (hidden, layers, heads, KV heads, MLP, context).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    # for the CPU smoke run of the script: the same tokenizer, a small body
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128,
                  max_position_embeddings=4096, tie_word_embeddings=True),
}

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _tiny_templates() -> tuple[str, str | None]:
    """ajet-tiny's chat template and response template, read from a built tiny checkpoint."""
    from transformers import AutoTokenizer

    from ajet.engine.tiny import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_checkpoint(Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp)
        return tok.chat_template, getattr(tok, "response_template", None)


def filler_vocab(size: int) -> dict[str, int]:
    """Specials, the 256 byte-level symbols, then filler pairs and triples of symbols."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = [*_SPECIALS, *symbols]
    seen = set(tokens)
    for a in symbols:
        for b in symbols:
            for c in ("", *symbols):
                if len(tokens) >= size:
                    return {t: i for i, t in enumerate(tokens)}
                token = a + b + c
                if token not in seen:
                    seen.add(token)
                    tokens.append(token)
    raise ValueError(f"cannot fill a vocabulary of {size}")


def build_qwen25_shaped(out: Path, shape: str = "qwen2.5-0.5b", *, seed: int = 0) -> Path:
    """Write a random-weight Qwen2.5-shaped checkpoint with a 151,936-id tokenizer to `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

    chat_template, response_template = _tiny_templates()
    vocab = filler_vocab(QWEN25_VOCAB_SIZE)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = chat_template
    if response_template is not None:
        tokenizer.response_template = response_template
    config = Qwen2Config(vocab_size=QWEN25_VOCAB_SIZE, torch_dtype="bfloat16",
                         pad_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
                         bos_token_id=None, initializer_range=0.02, **SHAPES[shape])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, is_main_process=True)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "gpu_model.json").write_text(json.dumps(
        {"shape": shape, "parameters": params, "vocab_size": QWEN25_VOCAB_SIZE, "seed": seed}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    build_qwen25_shaped(args.out, args.shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
