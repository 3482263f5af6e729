"""A tiny chat model for the cross-tokenizer drafter's tests: a real (in-process trained)
byte-level BPE tokenizer with Qwen's special tokens and chat template, and a random-weight Qwen2
over its vocabulary.

The tokenizer is byte-level, so the random model's output regularly splits multi-byte UTF-8
characters across tokens, which the drafter's translation through text must handle.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .hf_runner import ModelRunner

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_CONTEXT_TOKENS = 256

# Qwen2.5's template without tools: a default system turn, `<|im_start|>role\n...<|im_end|>\n`.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "You are a helpful assistant. Hello, how are you today?",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e co\u00fbte 5 \u20ac; \u00fcber na\u00efve \u00e5ngstr\u00f6m.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0 \U0001f680\U0001f916 \u2014 \u00ab quotes \u00bb",
    "def add(a, b):\n    return a + b\n",
]


def build_chat_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE (256 byte tokens, a few dozen merges, 3 special tokens) with Qwen's chat
    template; eos is `<|im_end|>` as in Qwen2.5-Instruct."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def build_chat_runner(tokenizer: PreTrainedTokenizerFast, seed: int = 0, name: str = "tiny") -> ModelRunner:
    """A random-weight Qwen2 (a tiny Qwen2 config) over `tokenizer`'s vocabulary, with a
    256-token context and Qwen's EOS ids (`<|im_end|>`, `<|endoftext|>`)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CHAT_CONTEXT_TOKENS,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # sharpen the output: confident, diverse argmaxes
        model.lm_head.weight.mul_(8.0)
    eos = ("<|im_end|>", "<|endoftext|>")
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in eos]
    return ModelRunner(model, tokenizer, name=name)
