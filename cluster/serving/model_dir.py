"""A model directory that vLLM (or any transformers loader) opens: one of raykv's random-weight
Llamas (cluster/serving/model.py) saved with `save_pretrained`, plus a byte-level tokenizer.

Nothing can be downloaded here, so the model is built from a config and the tokenizer from the
256 byte values: every text encodes, one token per byte, with no merges. The same preset and seed
give the same weights as raykv's own engine, so the two compute the same KV for the same tokens.
"""

from __future__ import annotations

import json
import os

from cluster.serving.model import build_llama

BOS, EOS = "<s>", "</s>"
# A plain chat template: the OpenAI chat endpoints need one.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
DONE_FILE = "raykv-model.json"


def byte_tokenizer():
    """A PreTrainedTokenizerFast over bytes: id b is the byte b, then <s> (256) and </s> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet()), "GPT-2's byte map moved"
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    vocab.update({BOS: len(vocab), EOS: len(vocab) + 1})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)



def byte_symbols() -> list[str]:
    """GPT-2's byte-level symbol of each byte value: printable bytes stand for themselves, the
    others take the code points from 256 up, in byte order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def save_model_dir(path: str, preset: str = "small-llama", seed: int = 0) -> str:
    """Write the preset's Llama (float32) and the byte tokenizer under `path`; idempotent.

    Returns `path`. A directory written before with the same preset and seed is kept.
    """
    stamp = os.path.join(path, DONE_FILE)
    wanted = {"preset": preset, "seed": seed}
    if os.path.exists(stamp):
        with open(stamp) as file:
            if json.load(file) == wanted:
                return path
    model, _ = build_llama(preset, seed)
    tokenizer = byte_tokenizer()
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(stamp, "w") as file:
        json.dump(wanted, file)
    return path
