"""A checkpoint's tokenizer, and prompts as the model was trained to read them.

Instruct models (SmolLM2-Instruct, Qwen3) were fine-tuned on chat-formatted text: a bare question
reaches them out of distribution. `encode_prompt` wraps the text as one user turn with the
tokenizer's own chat template (transformers' `apply_chat_template`, generation prompt appended)
where the tokenizer has one, and tokenises the plain text otherwise (base models, the self-trained
arithmetic policy).
"""

from __future__ import annotations

import os

from .checkpoint import CheckpointError


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer through `transformers.AutoTokenizer` (local files only); a pad token is
    set to EOS where the tokenizer has none (padding positions are masked everywhere they are used)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no tokenizer could be loaded ({e})") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def encode_prompt(tok, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of `text` as a prompt: one user turn in the chat template (when asked and the tokenizer
    has one), followed by the assistant's turn opening; else the plain text."""
    if chat_template and has_chat_template(tok):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        # transformers 5 returns a BatchEncoding-like mapping where 4.x returned a list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tok(text)["input_ids"])
