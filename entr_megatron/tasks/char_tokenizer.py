"""A character-level tokenizer built locally with `tokenizers`, and a tiny model config to match.

    tok = build_char_tokenizer()                       # transformers.PreTrainedTokenizerFast
    save_char_tokenizer(tok, "run/model")              # tokenizer.json + tokenizer_config.json + special_tokens_map.json
    write_tiny_model_config("run/model", tok)          # config.json (qwen3), vocab = len(tok)
    AutoTokenizer.from_pretrained("run/model")         # loads it back

One token per character (digits, operators, lowercase letters, a few marks), the
special tokens <pad> <s> </s> <unk>, and the tool markers <calc> </calc> <result>
</result> as single (non-special) tokens, so that a tiny model can emit a tool call
as one id and the engine can stop on it. Encoding adds <s> in front.
transformers and tokenizers are imported lazily (the "hf" extra).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = [
    "BOS", "CHARS", "EOS", "PAD", "TOOL_TOKENS", "UNK",
    "build_char_tokenizer", "load_tokenizer", "save_char_tokenizer", "write_tiny_model_config",
]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TOOL_TOKENS = ("<calc>", "</calc>", "<result>", "</result>")
CHARS = "0123456789+-*/%^()=.,?: " + "abcdefghijklmnopqrstuvwxyz"
"""Every character the tokenizer knows; anything else encodes to <unk>."""
MODEL_TYPES = ("qwen3", "llama")


def build_char_tokenizer(chars: str = CHARS, tool_tokens: tuple[str, ...] = TOOL_TOKENS) -> Any:
    """The character tokenizer as a `transformers.PreTrainedTokenizerFast` (ids: specials, tool markers, chars).

    tool_tokens: the markers that become single non-special tokens (default the calculator's;
    the Hermes tool tasks pass `tasks.tools.TOOL_TOKENS`)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, processors

    if len(set(chars)) != len(chars):
        raise ValueError(f"chars has repeated characters: {chars!r}")
    entries = SPECIAL_TOKENS + tuple(tool_tokens) + tuple(chars)
    if len(set(entries)) != len(entries):
        raise ValueError(f"tool_tokens {tuple(tool_tokens)!r} repeat each other, a special token or a character")
    vocab = {t: i for i, t in enumerate(entries)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character is its own word; tool markers and specials are matched whole before this.
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in tool_tokens])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def save_char_tokenizer(tokenizer: Any, directory: str) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    # transformers 5 folds the special-token map into tokenizer_config.json; older readers
    # and other tools still look for the separate file.
    path = os.path.join(directory, "special_tokens_map.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, f, indent=2)


def load_tokenizer(directory: str) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(directory)` with a clear error when it is missing."""
    import transformers

    if not os.path.exists(os.path.join(directory, "tokenizer.json")) and not os.path.exists(
        os.path.join(directory, "tokenizer_config.json")
    ):
        raise ValueError(f"{directory!r} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return transformers.AutoTokenizer.from_pretrained(directory)


def write_tiny_model_config(
    model_dir: str,
    tokenizer: Any,
    *,
    model_type: str = "qwen3",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 128,
    tie_word_embeddings: bool = True,
    save_tokenizer: bool = True,
) -> str:
    """Writes config.json of a tiny causal LM whose vocabulary is exactly `tokenizer`'s (and,
    by default, the tokenizer next to it); returns the path of config.json. No weights:
    engines and learners initialise them at random from the config."""
    import transformers

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    cls = transformers.Qwen3Config if model_type == "qwen3" else transformers.LlamaConfig
    config = cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    os.makedirs(model_dir, exist_ok=True)
    config.save_pretrained(model_dir)
    if save_tokenizer:
        save_char_tokenizer(tokenizer, model_dir)
    return os.path.join(model_dir, "config.json")
