"""GPU tests: never run in CI (no GPU there). On a GPU machine: `python -m pytest tests/gpu -q`.

Every test here needs CUDA and skips with that reason without it; the two-GPU tests also need two GPUs."""

import os
import sys

import pytest
import torch

# tests/gpu imports the support modules of tests/ by their own names (never the repository root: its top-level
# `agents/` folder would shadow the OpenAI Agents SDK).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run on the GPU machine, never in CI)")
        here = os.path.dirname(os.path.abspath(__file__))
        for item in items:  # this hook sees the whole session's items: mark only the ones in tests/gpu
            if str(item.path).startswith(here + os.sep):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A small random Llama in SmolLM2's vocabulary (the tokenizer from SLIME_ENV_GPU_TOKENIZER on a machine without
    the package), saved to a folder every role loads."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = os.environ.get("SLIME_ENV_GPU_TOKENIZER")
    if folder:
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        from slime_env.offline_tokenizers import smollm2

        tok = smollm2()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
