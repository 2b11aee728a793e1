"""Makes small random models in Hugging Face format with ``transformers``,
their tokenizer trained by ``tokenizers`` on generated text: no download.
Shared by the vLLM end-to-end checks (python/vllm_tests) and the engine's
reference checks against transformers (python/engine_tests).

    python make_model.py DIR [--size tiny|small|100m|mini] [--seed N]
                             [--arch llama|qwen2|qwen3|phi3|gemma2|deepseek_v2]
                             [--chat STYLE]

The default (``make(dir, size, seed)``: ``--arch llama``, no ``--chat``) is
the vLLM checks' model: a random Llama with a byte-level BPE tokenizer that
adds no special tokens and has no chat template. ``tiny`` (4 layers, hidden
256, head_dim 64, 2 KV heads; starts fast) is the end-to-end tests' size;
``small`` (4 layers, hidden 512, 8 heads, head_dim 64, 2 KV heads; 15.5 M
parameters as ``gemma2``, 15.8 M as ``llama``, 19.6 M as ``deepseek_v2``)
is the size for the hybrid and MLA end-to-end tests; ``100m`` (12 layers,
hidden 768, head_dim 64; named for 100 M parameters, 76 M as ``llama`` or
``gemma2`` and 94 M as ``deepseek_v2`` with the 595 tokens the plain
tokenizer learns) is scripts/bench-vllm's; ``mini`` (2 layers, hidden 128,
head_dim 32) the engine checks'. head_dim 32 or 64: vLLM's CPU attention
takes 32, 64, 80, 96, 112, 128, ...

Architectures (the model classes of transformers, their config.json as
``save_pretrained`` writes it):

- ``llama``: ``LlamaForCausalLM``.
- ``qwen2``: ``Qwen2ForCausalLM`` (q/k/v projections with biases), rope
  theta 1e6.
- ``qwen3``: ``Qwen3ForCausalLM`` (q_norm/k_norm; an explicit head_dim of
  twice hidden/heads; tied input and output embeddings, as the small Qwen3
  checkpoints), rope theta 1e6.
- ``phi3``: ``Phi3ForCausalLM`` (fused ``qkv_proj`` and ``gate_up_proj``).
- ``gemma2``: ``Gemma2ForCausalLM``, a hybrid model: ``layer_types``
  alternate ``sliding_attention`` and ``full_attention`` (from layer 0), a
  sliding window of :data:`SLIDING_WINDOW` (64) tokens, so prompts of a
  few hundred tokens outrun it (vLLM's hybrid KV cache manager then keeps
  two KV cache groups); head_dim 64 whatever the size,
  ``query_pre_attn_scalar`` 64, tied embeddings, Gemma 2's logit
  soft-capping. With ``num_key_value_heads`` 2 (``tiny``, ``small``,
  ``mini``) tensor parallel 2 splits the KV heads.
- ``deepseek_v2``: ``DeepseekV2ForCausalLM``, an MLA model: ``kv_lora_rank``
  512, ``qk_rope_head_dim`` 64 (a KV cache row of 576 values, the only head
  size vLLM's CPU MLA backend takes), ``q_lora_rank`` None,
  ``qk_nope_head_dim`` and ``v_head_dim`` 64, whatever the size;
  ``first_k_dense_replace`` = the layer count, so every layer has a dense
  MLP (no MoE). ``num_key_value_heads`` is set to the head count (MLA has
  one latent per token, shared by all heads).

``llama``, ``gemma2`` and ``deepseek_v2`` take the plain tokenizer
(``chat=None``: test models, not chat models; ``bos_token_id`` 1,
``eos_token_id`` 2, and ``pad_token_id`` 0 for ``gemma2`` and
``deepseek_v2``); every arch takes a chat style. Gemma's weights are drawn differently (always, not only with
``random_vectors``): Gemma scales the embeddings by sqrt(hidden) and its
norms multiply by ``1 + w``, so the embeddings get std 0.01 (0.08 gives a
model that repeats one token), the norms ``w`` around 0 (std 0.1) and the
final norm's ``w`` around 2 (scale about 3, as ``random_vectors`` does
for the others).

Chat styles (``chat=``): the tokenizer's special tokens, whether it adds a
BOS to text, its pre-tokenizer and its chat template, after the real
checkpoints of that family:

- ``llama3``: byte-level BPE with Llama 3's split pattern;
  ``<|begin_of_text|>`` added to every text (tokenizer.json's
  TemplateProcessing and ``add_bos_token: true``); the Meta Llama 3
  Instruct template (``<|start_header_id|>role<|end_header_id|>\\n\\n
  content<|eot_id|>``); EOS ids ``<|end_of_text|>`` and ``<|eot_id|>``.
- ``qwen2``: byte-level BPE with Qwen2's split pattern and NFC; no BOS;
  Qwen2 Instruct's ChatML template (a default system message when the
  conversation has none); EOS ``<|im_end|>``.
- ``chatml``: as ``qwen2`` with a plain ChatML template, saved as
  ``chat_template.jinja`` (transformers 5's own file) where the others keep
  the template in tokenizer_config.json, as published checkpoints do.
- ``phi3``: a SentencePiece-style BPE (``▁`` for spaces, byte fallback
  ``<0x00>``..``<0xFF>``) as Llama 2 and Phi-3 have; no BOS; Phi-3's
  ``<|user|>\\n...<|end|>\\n<|assistant|>\\n`` template.

``rope_scaling`` sets rope parameters beyond theta (e.g. yarn);
``legacy_rope_config`` rewrites config.json's ``rope_parameters`` (what
transformers 5 writes) as ``rope_theta`` + ``rope_scaling`` (what
transformers 4 wrote, and what most published checkpoints carry);
transformers reads both the same (checked here). ``random_vectors`` also
draws the 1-D weights (norm scales around 1, biases around 0), which the
default leaves at transformers' init (ones and zeros), so an engine that
drops one of them gives other outputs; the final norm's scales are drawn
around 3, which spreads the logits (greedy near-ties become rare).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

#: Words the tokenizer is trained on and the prompts are made of.
WORDS = ["".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 7)) for i in range(1500)]

#: Words outside ASCII that :func:`prose` mixes in (the chat styles'
#: tokenizers are trained on prose, so they know these characters).
FOREIGN = ["café", "naïve", "Zürich", "señor", "日本語", "Ωmega", "straße", "résumé"]

SIZES = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
    ),
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "mini": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
}

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "deepseek_v2")

#: The archs that take the plain tokenizer (``chat=None``).
PLAIN_ARCHS = ("llama", "gemma2", "deepseek_v2")

#: ``gemma2``'s sliding window, in tokens.
SLIDING_WINDOW = 64

#: Meta Llama 3 Instruct's template (``| trim`` binds to the content).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

#: Qwen2 Instruct's template: ChatML with a default system message.
QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Plain ChatML, with whitespace control and attribute access.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

#: Phi-3 mini instruct's template.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Per chat style: special tokens trained in first (ids from 0) and added
#: last; the tokenizer's bos/eos/unk/pad; the config's bos and eos ids (by
#: token); the template; whether text gets a BOS; whether the template is
#: kept in tokenizer_config.json (else chat_template.jinja).
CHAT_STYLES: dict[str, dict[str, Any]] = {
    "llama3": dict(
        front=[],
        end=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        unk=None,
        pad=None,
        config_bos="<|begin_of_text|>",
        config_eos=["<|end_of_text|>", "<|eot_id|>"],
        template=LLAMA3_TEMPLATE,
        add_bos=True,
        template_in_config=True,
    ),
    "qwen2": dict(
        front=[],
        end=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        unk=None,
        pad="<|endoftext|>",
        config_bos="<|endoftext|>",
        config_eos="<|im_end|>",
        template=QWEN2_TEMPLATE,
        add_bos=False,
        template_in_config=True,
    ),
    "chatml": dict(
        front=[],
        end=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        unk=None,
        pad="<|endoftext|>",
        config_bos="<|endoftext|>",
        config_eos="<|im_end|>",
        template=CHATML_TEMPLATE,
        add_bos=False,
        template_in_config=False,
    ),
    "phi3": dict(
        front=["<unk>", "<s>", "</s>"],
        end=["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        bos="<s>",
        eos="<|endoftext|>",
        unk="<unk>",
        pad="<|endoftext|>",
        config_bos="<s>",
        config_eos=["<|endoftext|>", "<|end|>"],
        template=PHI3_TEMPLATE,
        add_bos=False,
        template_in_config=True,
    ),
}


def text(seed: int, words: int) -> str:
    """A reproducible text of ``words`` words drawn from :data:`WORDS`."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def prose(seed: int, words: int) -> str:
    """A reproducible text of about ``words`` words: sentences with capitals,
    commas, numbers, a few non-ASCII words and paragraph breaks."""
    rng = random.Random(seed)
    out: list[str] = []
    sentence = 0
    for _ in range(words):
        r = rng.random()
        w = str(rng.randrange(10_000)) if r < 0.05 else rng.choice(FOREIGN) if r < 0.08 else rng.choice(WORDS)
        if sentence == 0:
            w = w.capitalize()
            if out:
                out.append("\n\n" if rng.random() < 0.2 else " ")
        elif rng.random() < 0.1:
            out.append(",")
        out.append((" " if sentence else "") + w)
        sentence += 1
        if sentence >= 3 and rng.random() < 0.15:
            out.append(rng.choice(".?!"))
            sentence = 0
    return "".join(out) + ("" if sentence == 0 else ".")


def _train_tokenizer(chat: str | None, vocab_size: int) -> Any:
    """A ``tokenizers.Tokenizer`` for the chat style (None: the vLLM
    checks' plain byte-level BPE)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if chat is None:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator((text(i, 200) for i in range(300)), trainer=trainer)
        return tok

    style = CHAT_STYLES[chat]
    corpus = [prose(i, 200) for i in range(300)]
    if chat == "phi3":
        # SentencePiece-style: trained on "▁"-prefixed words, then byte
        # fallback tokens <0x00>..<0xFF> placed after the leading specials
        # (as in Llama 2 and Phi-3), every other id shifted up by 256.
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=style["front"])
        tok.train_from_iterator(corpus, trainer=trainer)
        data = json.loads(tok.to_str())
        old = data["model"]["vocab"]
        front = len(style["front"])
        vocab = {t: i for t, i in old.items() if i < front}
        vocab.update({f"<0x{b:02X}>": front + b for b in range(256)})
        vocab.update({t: i + 256 for t, i in old.items() if i >= front})
        data["model"]["vocab"] = vocab
        data["model"]["byte_fallback"] = True
        tok = Tokenizer.from_str(json.dumps(data))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        split = LLAMA3_SPLIT if chat == "llama3" else QWEN2_SPLIT
        tok = Tokenizer(models.BPE())
        if chat != "llama3":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=style["front"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens(style["end"])
    return tok


def _save_tokenizer(dir: Path, tok: Any, chat: str | None) -> None:
    from transformers import PreTrainedTokenizerFast

    if chat is None:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(dir)
        return
    style = CHAT_STYLES[chat]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=style["bos"],
        eos_token=style["eos"],
        unk_token=style["unk"],
        pad_token=style["pad"],
        add_bos_token=style["add_bos"],
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=style["template"],
    )
    fast.save_pretrained(dir, save_jinja_files=not style["template_in_config"])
    # transformers 5 keeps add_bos_token in tokenizer.json's post-processor
    # only; published checkpoints also state it in tokenizer_config.json.
    path = dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["add_bos_token"] = style["add_bos"]
    cfg["add_eos_token"] = False
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _config(
    arch: str, dims: dict[str, Any], tok: Any, chat: str, max_position_embeddings: int, rope: dict[str, Any]
) -> Any:
    """The transformers config of a chat-style model."""
    from transformers import LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    style = CHAT_STYLES[chat]

    def ids(t: str | list[str] | None) -> int | list[int] | None:
        if t is None:
            return None
        return [tok.token_to_id(x) for x in t] if isinstance(t, list) else tok.token_to_id(t)

    common: dict[str, Any] = dict(
        **{**dims, "vocab_size": tok.get_vocab_size()},
        max_position_embeddings=max_position_embeddings,
        bos_token_id=ids(style["config_bos"]),
        eos_token_id=ids(style["config_eos"]),
        pad_token_id=ids(style["pad"]),
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope})
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6, **rope})
    if arch == "qwen3":
        head_dim = 2 * dims["hidden_size"] // dims["num_attention_heads"]
        return Qwen3Config(
            **common,
            head_dim=head_dim,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, **rope},
        )
    if arch == "phi3":
        return Phi3Config(
            **common,
            original_max_position_embeddings=max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope},
        )
    if arch in ("gemma2", "deepseek_v2"):
        return _new_arch_config(arch, common, rope)
    raise ValueError(f"unknown arch {arch!r} (one of {ARCHS})")


def _new_arch_config(arch: str, common: dict[str, Any], rope: dict[str, Any]) -> Any:
    """The config of a ``gemma2`` or ``deepseek_v2`` model; ``common``: the
    size's dims (vocab_size the tokenizer's), max_position_embeddings, the
    token ids and the dtype."""
    from transformers import DeepseekV2Config, Gemma2Config

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    layers = common["num_hidden_layers"]
    if arch == "gemma2":
        return Gemma2Config(
            **common,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=SLIDING_WINDOW,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            rope_parameters=rope_parameters,
        )
    if arch == "deepseek_v2":
        return DeepseekV2Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]},
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=layers,
            # Unused (no MoE layer): small, should a reader build them.
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=common["intermediate_size"] // 4,
            rope_parameters=rope_parameters,
        )
    raise ValueError(f"not a new arch: {arch!r}")


def _legacy_rope_config(dir: Path) -> None:
    """Rewrites config.json's ``rope_parameters`` as ``rope_theta`` and
    ``rope_scaling`` (null for plain rope), as transformers 4 wrote them."""
    path = dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    else:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make(
    dir: Path,
    size: str = "tiny",
    seed: int = 0,
    *,
    arch: str = "llama",
    chat: str | None = None,
    max_position_embeddings: int = 4096,
    rope_scaling: dict[str, Any] | None = None,
    legacy_rope_config: bool = False,
    random_vectors: bool = False,
) -> None:
    """Writes a random model of ``arch`` and its tokenizer (``chat``
    style, None for the plain one) into ``dir``. ``make(dir, size, seed)``
    is the vLLM checks' Llama, unchanged."""
    import torch
    from transformers import (
        AutoConfig,
        DeepseekV2ForCausalLM,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (one of {ARCHS})")
    if chat is None and (arch not in PLAIN_ARCHS or rope_scaling):
        raise ValueError(f"the plain tokenizer (chat=None) is for {PLAIN_ARCHS}, no rope_scaling; pick a chat style")
    dims = SIZES[size]
    dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(chat, dims["vocab_size"])
    _save_tokenizer(dir, tok, chat)
    torch.manual_seed(seed)
    if chat is None and arch == "llama":
        config = LlamaConfig(
            **{**dims, "vocab_size": tok.get_vocab_size()},
            max_position_embeddings=max_position_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            torch_dtype="float32",  # type: ignore[call-arg]  # as before (older transformers)
        )
    elif chat is None:
        common: dict[str, Any] = dict(
            **{**dims, "vocab_size": tok.get_vocab_size()},
            max_position_embeddings=max_position_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            dtype="float32",
        )
        config = _new_arch_config(arch, common, {})
    else:
        config = _config(arch, dims, tok, chat, max_position_embeddings, rope_scaling or {})
    cls = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "deepseek_v2": DeepseekV2ForCausalLM,
    }[arch]
    model = cls(config)
    # Larger weights than the default init: a random model whose logits are
    # not all near-equal, so greedy outputs differ when the KV differs.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        if arch == "gemma2":
            # Gemma scales the embeddings by sqrt(hidden) and its norms
            # multiply by 1 + w (module docstring).
            for name, p in model.named_parameters():
                if name == "model.embed_tokens.weight":
                    p.normal_(0.0, 0.01)
                elif name == "model.norm.weight":
                    p.normal_(2.0, 0.3)
                elif p.dim() == 1 and "norm" in name:
                    p.normal_(0.0, 0.1)
        elif random_vectors:
            for name, p in model.named_parameters():
                if name == "model.norm.weight":
                    # Logits three times as spread: greedy near-ties rarer.
                    p.normal_(3.0, 0.3)
                elif p.dim() == 1 and "norm" in name:
                    p.normal_(1.0, 0.1)
                elif p.dim() == 1:
                    p.normal_(0.0, 0.08)
    model.save_pretrained(dir, safe_serialization=True)
    if legacy_rope_config:
        _legacy_rope_config(dir)
        loaded = AutoConfig.from_pretrained(dir)
        if loaded.rope_parameters != config.rope_parameters:
            raise AssertionError(f"legacy config reads back as {loaded.rope_parameters}, not {config.rope_parameters}")
    meta: dict[str, Any] = {"size": size, "seed": seed}
    if chat is not None:
        meta.update(arch=arch, chat=chat)
    elif arch != "llama":
        meta.update(arch=arch)
    (dir / "kvtier-model.json").write_text(json.dumps(meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument(
        "--chat",
        choices=sorted(CHAT_STYLES),
        default=None,
        help=f"tokenizer and chat template style (default: the plain tokenizer, {', '.join(PLAIN_ARCHS)} only)",
    )
    a = ap.parse_args()
    make(a.dir, a.size, a.seed, arch=a.arch, chat=a.chat, random_vectors=a.chat is not None)


if __name__ == "__main__":
    main()
