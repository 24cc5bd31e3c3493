"""`ajet-tiny`: a tiny Qwen2-style causal LM with a character-level tokenizer, built here.

Nothing is downloaded. The tokenizer is a Qwen2 (byte-level BPE) tokenizer with no
merges and an alphabet of printable ASCII plus newline and tab, so every such character
is one token; other characters are dropped. The model is `Qwen2ForCausalLM` with
random weights from `torch.manual_seed(seed)`: the same seed and spec give the same
weights. Both are saved as an ordinary Hugging Face checkpoint directory and then loaded
through the same code path as any checkpoint (`policy.load_policy`).

Its chat template is ChatML with function calling in the Qwen2.5 format (tools listed
in the system turn, `<tool_call>` blocks, `<tool_response>` results), and its tokenizer
carries the matching `response_template`, so tool calls run end to end on the embedded
default (`chat_format`). The context (16k positions) fits the job's default prompt and
response lengths.

The directory is `<workdir>/models/ajet-tiny/seed<seed>-<fingerprint>/`; the fingerprint
hashes the spec, alphabet, chat and response templates, so a synced change to this module builds a
fresh checkpoint instead of reusing a stale one. It is written to a `.partial-*` folder
and renamed into place, so a killed build leaves nothing that looks finished, and two
engines building at once both end with one complete directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ajet.engine.plane.chat_format import QWEN25_RESPONSE_TEMPLATE

__all__ = ["TINY_MODEL_NAME", "TinySpec", "build_tiny_checkpoint", "ensure_tiny_model",
           "tiny_model_dir", "tiny_vocab_size"]

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "ajet-tiny"

#: Bump when the build procedure changes in a way the spec does not capture.
_FORMAT_VERSION = 2

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Printable ASCII, then newline and tab: the character vocabulary (byte values).
_ALPHABET_BYTES = (*range(32, 127), 10, 9)

# Qwen2.5-style ChatML with function calling, written for ajet-tiny: tools are listed in
# the system turn as JSON inside <tools></tools>; the assistant calls one with a
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> block; tool results go back as a
# user turn of <tool_response> blocks (consecutive results share one turn). This is the
# format the Qwen2.5 family documents, so `chat_format` parses both the same way.
# No whitespace control in the template: Hugging Face renders with trim_blocks, so a
# newline that must follow a tag is written as an expression, {{ "\n" }}.
_CHAT_TEMPLATE = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' "
    "else none %}"
    "{% if tools %}"
    "<|im_start|>system{{ '\n' }}{% if system %}{{ system }}{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call these functions:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "To call one, answer:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif system is not none %}"
    "<|im_start|>system{{ '\n' }}{{ system }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{{ '\n' }}{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}{{ '\n' }}</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}{{ '\n' }}{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Architecture of ajet-tiny (~0.13 M parameters with the defaults)."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    #: Context: the job defaults (max_prompt_length 8192 + max_response_length 1024) fit,
    #: with room to spare. Rotary positions cost no parameters.
    max_position_embeddings: int = 16384
    #: Std of the normal init. Small, so the untrained policy is close to uniform over
    #: the characters (exploration for RL from scratch).
    initializer_range: float = 0.02


def tiny_vocab_size() -> int:
    """The tokenizer's (and the model's) vocabulary: the special tokens and the alphabet."""
    return len(_SPECIAL_TOKENS) + len(_ALPHABET_BYTES)


def _fingerprint(seed: int, spec: TinySpec) -> str:
    blob = json.dumps({"spec": dataclasses.asdict(spec), "alphabet": _ALPHABET_BYTES,
                       "specials": _SPECIAL_TOKENS, "template": _CHAT_TEMPLATE,
                       "response_template": QWEN25_RESPONSE_TEMPLATE,
                       "format": _FORMAT_VERSION, "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_model_dir(workdir: Path, *, seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Where the checkpoint for this seed and spec lives (built or not)."""
    spec = spec or TinySpec()
    return Path(workdir) / "models" / TINY_MODEL_NAME / f"seed{seed}-{_fingerprint(seed, spec)}"


def build_tiny_checkpoint(target: Path, *, seed: int = 0, spec: TinySpec | None = None) -> None:
    """Write tokenizer and randomly initialised model to `target` (an empty or new folder)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spec = spec or TinySpec()
    byte_to_symbol = bytes_to_unicode()  # the byte-level alphabet Qwen2Tokenizer expects
    symbols = [byte_to_symbol[b] for b in _ALPHABET_BYTES]
    vocab = {token: i for i, token in enumerate([*_SPECIAL_TOKENS, *symbols])}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    # how `tokenizer.parse_response` reads a reply back (content and <tool_call> blocks)
    tokenizer.response_template = QWEN25_RESPONSE_TEMPLATE

    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        pad_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        bos_token_id=None,
    )
    # Seed right before construction: the weights depend on nothing else.
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    target.mkdir(parents=True, exist_ok=True)
    # is_main_process: under torch.distributed, save_pretrained on a rank other than 0
    # would silently skip the weights; every rank may build its own copy here
    model.save_pretrained(target, is_main_process=True)
    tokenizer.save_pretrained(target)
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer_config.json")
               if not (target / name).is_file()]
    if missing:
        raise RuntimeError(f"building {TINY_MODEL_NAME} left out {missing} in {target}")
    (target / "ajet_tiny.json").write_text(json.dumps(
        {"seed": seed, "spec": dataclasses.asdict(spec), "format": _FORMAT_VERSION,
         "parameters": sum(p.numel() for p in model.parameters())}, indent=2))


def ensure_tiny_model(workdir: Path, *, seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Build the ajet-tiny checkpoint once (atomic rename) and return its directory."""
    spec = spec or TinySpec()
    final = tiny_model_dir(workdir, seed=seed, spec=spec)
    if (final / "ajet_tiny.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.parent / f".partial-{final.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    log.info("building %s (seed %d) at %s", TINY_MODEL_NAME, seed, final)
    try:
        build_tiny_checkpoint(partial, seed=seed, spec=spec)
        try:
            partial.rename(final)
        except OSError:
            # Another engine finished the same build first; its copy is identical.
            if not (final / "ajet_tiny.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final
