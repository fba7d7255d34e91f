"""llama.cpp's own converter on a tiny model that has no tokenizer (the conformance matrix's llama.cpp columns).

``convert_hf_to_gguf.py`` needs each family's tokenizer, and most families' converters accept only the tokenizers
they know (a GPT-2 BPE is matched by a hash of its encodings). The matrix's tiny models have none: they get a tiny
sentencepiece vocabulary (:func:`sentencepiece_model`), and the converter runs in a process of its own where every
model class reads its vocabulary from it (``python -m ropescale._llamacpp_convert CONVERTER DIR --outfile ...``).
Only the vocabulary step is replaced: the rope keys go through the converter's own code, which is what the matrix
checks (verify's probe passes token ids, so the vocabulary's text never matters).
"""

from __future__ import annotations

import struct

TOKENIZER = "tokenizer.model"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    """A protobuf field: ``wire`` 0 (a varint, already encoded), 2 (length-delimited) or 5 (32 bits)."""
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def sentencepiece_model(vocab_size: int) -> bytes:
    """A sentencepiece ``ModelProto`` of ``vocab_size`` pieces (``<unk>``, ``<s>``, ``</s>``, a newline, then letters
    and numbered words), written field by field (sentencepiece's protobuf module needs the protobuf package). The
    newline piece is the one llama.cpp's SPM vocabulary looks up when it loads (its line feed)."""
    if vocab_size < 5:
        raise ValueError(f"a sentencepiece vocabulary of {vocab_size} pieces: at least 5 (3 special, a newline, a word)")
    normal, unknown, control = 1, 2, 3  # sentencepiece's piece types
    pieces = [("<unk>", unknown), ("<s>", control), ("</s>", control), ("\n", normal)]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = ["\u2581" + a for a in letters] + letters
    pieces += [(words[i] if i < len(words) else f"\u2581w{i}", normal) for i in range(vocab_size - len(pieces))]
    body = b"".join(_field(1, 2, _field(1, 2, text.encode()) + _field(2, 5, struct.pack("<f", -float(i)))
                           + _field(3, 0, _varint(kind))) for i, (text, kind) in enumerate(pieces))
    # trainer spec: BPE, the size, unk/bos/eos ids 0/1/2 and no pad (-1 as protobuf's 64-bit varint)
    trainer = (_field(3, 0, _varint(2)) + _field(4, 0, _varint(vocab_size)) + _field(40, 0, _varint(0))
               + _field(41, 0, _varint(1)) + _field(42, 0, _varint(2)) + _field(43, 0, _varint(2 ** 64 - 1)))
    normalizer = _field(1, 2, b"identity") + _field(3, 0, _varint(1))
    return body + _field(2, 2, trainer) + _field(3, 2, normalizer)


def main(argv: list[str]) -> None:
    """Runs the converter ``argv[0]`` with ``argv[1:]``, every model class reading its vocabulary from the directory's
    sentencepiece ``tokenizer.model`` (this process only)."""
    import runpy
    import sys
    from pathlib import Path

    if not argv:
        raise SystemExit("usage: python -m ropescale._llamacpp_convert CONVERTER_SCRIPT DIR [converter options]")
    script = Path(argv[0])
    sys.path.insert(0, str(script.parent))  # the converter's own `conversion` package beside it
    import conversion

    find = conversion.get_model_class

    def with_tiny_vocabulary(*args, **kwargs):
        cls = find(*args, **kwargs)
        cls.set_vocab = lambda self: self._set_vocab_sentencepiece()
        return cls

    conversion.get_model_class = with_tiny_vocabulary  # the script imports it by name when it runs, below
    sys.argv = [str(script)] + argv[1:]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
