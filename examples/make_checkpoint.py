"""Write a small Llama-style checkpoint that ``kvtier serve DIR`` loads: random weights in a tiny
config, saved by transformers' own ``save_pretrained`` (``config.json`` and
``model.safetensors``), with a byte-level BPE tokenizer trained here on a few sentences and a
chat template (``tokenizer.json``, ``tokenizer_config.json``/``chat_template.jinja``).

Nothing is downloaded. The weights are random, so the model's replies are noise: the
checkpoint is there to exercise the path a real one takes (config import, safetensors
loading, the checkpoint's tokenizer and chat template, the weights' digest in every storage
key).

    python examples/make_checkpoint.py DIR [--seed N]
    kvtier serve DIR --storage file --storage-dir kvtier-data/ckpt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

SPECIALS = ["<s>", "</s>"]
CORPUS = [
    "A KV cache keeps the attention keys and values of tokens a model has already read.",
    "Requests that share a prefix, such as a system prompt, can skip recomputing it.",
    "The device tier is fast and small, the host tier larger, storage larger still.",
    "You are a helpful assistant. Answer briefly and say what you do not know.",
]
# A chat template in the style of the common ones: one block per message, then the opening of
# the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte has a token, so any text encodes) with a few merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )


def make_model(vocab_size: int, bos: int, eos: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where to write the checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()

    hf_logging.disable_progress_bar()
    tokenizer = make_tokenizer()
    bos, eos = tokenizer.convert_tokens_to_ids(SPECIALS)
    model = make_model(len(tokenizer), bos, eos, args.seed)
    model.save_pretrained(args.dir)  # config.json + model.safetensors
    tokenizer.save_pretrained(args.dir)  # tokenizer.json, its config and the chat template
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dir}: Llama, {params:,} parameters, vocabulary of {len(tokenizer)}")
    for f in sorted(args.dir.iterdir()):
        print(f"  {f.name}")


if __name__ == "__main__":
    main()
