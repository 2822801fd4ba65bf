"""Tokenizers built offline from kvlab's runtime-trained tiny BPE, with a BOS token and a chosen
chat template (local model directories for the prompt-format tests)."""

from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from kvlab.models.scaffolding.tokenizer import tiny_tokenizer

BOS = "<|endoftext|>"


def bos_tokenizer(chat_template: str | None = None):
    """The tiny BPE with BOS = ``<|endoftext|>`` added in front by tokenization, and ``chat_template``."""
    bpe = Tokenizer.from_str(tiny_tokenizer().backend_tokenizer.to_str())
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token="<|im_end|>", chat_template=chat_template
    )
