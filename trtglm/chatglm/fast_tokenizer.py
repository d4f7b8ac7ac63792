"""ChatGLM3's tokenizer as a Hugging Face fast tokenizer (tokenizer.json), with the same ids as trtglm's.

ChatGLM3's own Hugging Face tokenizer is code shipped with the model (tokenization_chatglm.py), which
`AutoTokenizer.from_pretrained` loads only with trust_remote_code; NVIDIA's client tools do not pass it.
`write_fast_tokenizer` writes a folder that loads without it: SentencePiece's BPE pieces and merges
(each merge ranked by the score of the piece it makes, as SentencePiece ranks them), its dummy "▁"
prefix and byte fallback, ChatGLM3's nine special tokens after the pieces, and `[gMASK] sop` before
every encoding that adds special tokens. Special-token text in a prompt stays plain text, as
trtglm's tokenizer keeps it (so ChatGLM3's nine tokens are plain vocabulary there, which decoding
shows rather than skips); only `</s>` and `<unk>`, the end and pad tokens that NVIDIA's clients look
up by encoding their text, are matched as tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from trtglm.chatglm.tokenizer import PROMPT_PREFIX, ChatGLMTokenizer

SPACE = "\u2581"  # SentencePiece's whitespace mark


def fast_tokenizer(tokenizer: ChatGLMTokenizer):
    """A `tokenizers.Tokenizer` giving `tokenizer`'s ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    sp = tokenizer.sp
    vocab = {sp.id_to_piece(i): i for i in range(tokenizer.sp_vocab_size)}
    vocab.update(tokenizer.special_ids)
    model = Tokenizer(BPE(vocab, _merges(tokenizer), unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                          byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    model.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    prefix = " ".join(PROMPT_PREFIX)
    model.post_processor = processors.TemplateProcessing(
        single=f"{prefix} $A", pair=f"{prefix} $A $B",
        special_tokens=[(token, tokenizer.special_ids[token]) for token in PROMPT_PREFIX])
    model.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False)
                              for i in (sp.eos_id(), sp.unk_id())])
    return model


def _merges(tokenizer: ChatGLMTokenizer) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked by the merged piece's score (highest first)."""
    sp = tokenizer.sp
    pieces = {sp.id_to_piece(i): sp.get_score(i) for i in range(tokenizer.sp_vocab_size)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))}
    merges = [(score, piece, (piece[:cut], piece[cut:])) for piece, score in pieces.items()
              for cut in range(1, len(piece)) if piece[:cut] in pieces and piece[cut:] in pieces]
    return [pair for _, _, pair in sorted(merges, key=lambda m: (-m[0], m[1]))]


def write_fast_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json for `tokenizer_dir`'s ChatGLM3 tokenizer into `out_dir`."""
    tokenizer = ChatGLMTokenizer(tokenizer_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast_tokenizer(tokenizer).save(str(out / "tokenizer.json"))
    sp = tokenizer.sp
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": sp.id_to_piece(sp.eos_id()),
              "unk_token": sp.id_to_piece(sp.unk_id()), "pad_token": sp.id_to_piece(sp.unk_id()),
              "padding_side": "left",
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
