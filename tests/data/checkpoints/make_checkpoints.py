"""How the checkpoints in this folder were made. Written by ropescale main at a77b43e (transformers 5.23.0,
torch 2.14.1, CPU, one thread); kept so that a reader sees how the data came about.

DO NOT REGENERATE THIS DATA TO MAKE A FAILING TEST PASS. It is the record of what today's code writes and
reads: ``tests/python/adapters/test_checkpoint_compat.py`` checks that every checkpoint here still reloads to
the same logits, the same parsed method, the same tables and the same vLLM classification. A change that
fails it changes what users' saved checkpoints mean; fix the change, or, where the difference is intended,
say so in its own commit and issue, and add a new case rather than rewriting an old one.

One directory per case: a tiny LlamaForCausalLM (vocab 32, hidden 8, 4 heads of dim 8 with 2 KV heads,
intermediate 16, one layer, tied embeddings, float32, ``max_position_embeddings`` 16, ``rope_theta`` 100 so
every pair turns within 40 positions) with ONE set of weights (seed 0; projections and embeddings times 10 so
attention is sharp and RoPE shows in the logits), written the way a user writes it:

- ``ropescale extend base DST ...`` through ``ropescale.cli.main`` (the user path for most methods);
- ``ropescale.hf.patch(model, method)`` + ``save_pretrained`` where ``extend`` cannot say the method
  (YaRN with ``mscale``/``mscale_all_dim``/betas/``truncate=False``);
- plain transformers ``save_pretrained`` for checkpoints ropescale did not write but reads (third-party
  ``yarn``/``longrope``/``dynamic``), and a hand edit of ``config.json`` reproducing what ropescale wrote
  before ca5d0b7 (``rope_type: ntk``) for the one legacy format no writer of today produces.

Each directory also holds ``expected.json`` (how it was written, the 40 input ids, the ``repr`` of
``ropescale.config.read_config(config)``, its ``inv_freq`` in float64 for ``seq_len`` None/8/40 and attention
factors, and the classification ``ropescale.vllm`` makes at engine start from the config) and
``expected.safetensors`` (``logits``: float32 ``[1, 40, 32]`` of the reloaded model after
``ropescale.hf.patch(model)``). Before writing anything the script checks that the data tells the methods
apart: the logits of any two cases differ by more than 1e-4 (at a77b43e: at least 5.06e-3), except the groups in
``SAME_TABLE``, which run one table written in different ways (there: an exact match).

Usage (from the repository root; refuses to write into an existing case directory):

    PYTHONPATH=python python tests/data/checkpoints/make_checkpoints.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COMMIT = "a77b43e"

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 32, 8, 4, 2, 8, 16, 1
ORIGINAL = 16  # max_position_embeddings of the base model: the 40-token input passes it
BASE_THETA = 100.0
LENGTH = 40
TABLE_LENGTHS = (None, 8, 40)  # inv_freq(seq_len=...) recorded per case
LONGROPE = {"short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.0, 2.0, 3.0, 4.0]}

# name: how it is written: ("base",) | ("extend", [options]) | ("patch", method factory) |
# ("transformers", rope_parameters, max_position_embeddings) | ("edit", rope_parameters, max_position_embeddings)
CASES: dict[str, tuple] = {
    # plain RoPE, as transformers writes it (no ropescale in it): hf.patch reads Default
    "default": ("base",),
    "resonance": ("extend", ["--method", "resonance"]),
    "linear": ("extend", ["--method", "linear", "--factor", "4"]),
    "ntk": ("extend", ["--method", "ntk", "--factor", "4"]),
    # Dynamic NTK factor 3, not 2: at length 40 factor 2 gives NTK-aware 4's base exactly (2 * 40/16 - 1 = 4).
    "dynamic_ntk": ("extend", ["--method", "dynamic_ntk", "--factor", "3", "--max-length", "64"]),
    "yarn": ("extend", ["--method", "yarn", "--factor", "4"]),
    "dynamic_yarn": ("extend", ["--method", "dynamic_yarn", "--max-length", "64"]),
    "llama3": ("extend", ["--method", "llama3", "--factor", "4"]),
    "longrope": ("extend", ["--method", "longrope", "--longrope-factors", "{factors}", "--factor", "4"]),
    "resonance_yarn": ("extend", ["--method", "resonance_yarn", "--factor", "4"]),
    "resonance_longrope": ("extend", ["--method", "longrope", "--longrope-factors", "{factors}", "--factor", "4",
                                      "--resonance"]),
    "resonance_linear": ("extend", ["--method", "linear", "--factor", "4", "--resonance"]),
    "resonance_ntk": ("extend", ["--method", "ntk", "--factor", "4", "--resonance"]),
    "resonance_dynamic_ntk": ("extend", ["--method", "dynamic_ntk", "--factor", "3", "--resonance"]),
    "resonance_dynamic_yarn": ("extend", ["--method", "dynamic_yarn", "--floor", "1.5", "--resonance",
                                          "--max-length", "64"]),
    "resonance_llama3": ("extend", ["--method", "llama3", "--factor", "4", "--resonance"]),
    "yarn_target_vllm": ("extend", ["--method", "yarn", "--factor", "4", "--target", "vllm"]),
    "resonance_yarn_target_vllm": ("extend", ["--method", "yarn", "--factor", "4", "--resonance",
                                              "--target", "vllm"]),
    "rerope": ("extend", ["--method", "rerope", "--window", "8", "--max-length", "64"]),
    "leaky_rerope_logn_yarn": ("extend", ["--method", "yarn", "--factor", "4", "--window", "8", "--leaky-k", "4",
                                          "--logn"]),
    "rerope_ntk": ("extend", ["--method", "ntk", "--factor", "4", "--window", "8"]),
    "rerope_dynamic_yarn": ("extend", ["--method", "dynamic_yarn", "--window", "8", "--max-length", "64"]),
    "rerope_longrope": ("extend", ["--method", "longrope", "--longrope-factors", "{factors}", "--factor", "4",
                                   "--window", "8", "--leaky-k", "2"]),
    "yarn_mscale_patch": ("patch", lambda scaling: scaling.YaRN(
        factor=4.0, original_max_position=ORIGINAL, beta_fast=16.0, beta_slow=2.0, truncate=False, mscale=0.707,
        mscale_all_dim=1.0)),
    "thirdparty_yarn": ("transformers", {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": ORIGINAL, "rope_theta": BASE_THETA}, 64),
    "thirdparty_longrope": ("transformers", {"rope_type": "longrope", **LONGROPE, "factor": 4.0,
                                             "original_max_position_embeddings": ORIGINAL,
                                             "rope_theta": BASE_THETA}, 64),
    "thirdparty_dynamic": ("transformers", {"rope_type": "dynamic", "factor": 3.0, "rope_theta": BASE_THETA},
                           ORIGINAL),
    # What ropescale wrote for NTK-aware before ca5d0b7 (hf.patch then kept max_position_embeddings).
    "legacy_ntk": ("edit", {"rope_type": "ntk", "factor": 4.0, "rope_theta": BASE_THETA}, ORIGINAL),
}
# Groups of cases that run the same table by design, written differently (the logits of all others must differ).
SAME_TABLE = [{"ntk", "legacy_ntk"}, {"yarn", "yarn_target_vllm", "thirdparty_yarn"},
              {"resonance_yarn", "resonance_yarn_target_vllm"}, {"longrope", "thirdparty_longrope"},
              {"dynamic_ntk", "thirdparty_dynamic"}]


def base_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=ORIGINAL, rope_parameters={"rope_type": "default", "rope_theta": BASE_THETA},
        tie_word_embeddings=True, dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the default init: the rotation shows in the logits
        for name, p in model.named_parameters():
            if "proj" in name or "embed" in name:
                p.mul_(10.0)
    return model


def input_ids() -> list[int]:
    return torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(1234)).tolist()


def describe(parsed, rope_parameters, max_position_embeddings, entry, model_max_length) -> dict:
    """What ropescale.vllm decides from the config at engine start, from the config-level parts that import
    without vLLM: ``rotary.get_rope``'s "ropescale's rotary or vLLM's" and ``attention.needs_pre_rope``."""
    from ropescale import config as config_lib
    from ropescale.hf.rope_types import ROPESCALE_ROPE_TYPES

    rope_type = (rope_parameters or {}).get("rope_type", "default")
    ours = (rope_type in tuple(t for t in ROPESCALE_ROPE_TYPES if t != "ntk")
            or (isinstance(entry, dict) and config_lib.METHOD_KEY in entry))
    return {
        "ropescale_rotary": bool(ours),
        "pre_rope": bool(parsed.attention == "rerope" or parsed.per_length),
        "per_length": bool(parsed.per_length),
        "length_free": bool(parsed.length_free),
        "dynamic": bool(parsed.method.dynamic),
        "recorded": bool(parsed.recorded),
        "attention": parsed.attention,
        "max_model_len": config_lib.vllm_max_model_len(rope_parameters, max_position_embeddings, model_max_length),
    }


def expected_of(directory: Path, ids: list[int]) -> tuple[dict, torch.Tensor]:
    """Reload ``directory`` as a user does, patch it, and record what it computes."""
    from transformers import AutoModelForCausalLM

    import ropescale.hf
    from ropescale import config as config_lib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ReRoPE checkpoints warn until patched
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ropescale.hf.patch(model)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()
    config = model.config
    parsed = config_lib.read_config(config)
    rotary_dim = config_lib.rotary_dim_of(config)
    key = lambda n: "none" if n is None else str(n)  # noqa: E731
    params = config.rope_parameters
    entry = getattr(config, config_lib.CONFIG_KEY, None)
    served = getattr(config, config_lib.SERVED_LENGTH_KEY, None)
    # vLLM's get_rope: config.read(rope_parameters, max_position, entry, rotary_dim)
    engine = config_lib.read(params, config.max_position_embeddings, entry, rotary_dim)
    assert repr(engine) == repr(parsed)
    expected = {
        "rope_type": params.get("rope_type"),
        "input_ids": ids,
        "read_config_repr": repr(parsed),
        "rotary_dim": rotary_dim,
        "base": parsed.base,
        "inv_freq": {key(n): parsed.method.inv_freq(rotary_dim, parsed.base, seq_len=n, dtype=torch.float64).tolist()
                     for n in TABLE_LENGTHS},
        "attention_factor": {key(n): parsed.method.attention_factor_for(n) for n in TABLE_LENGTHS},
        "vllm": describe(parsed, params, config.max_position_embeddings, entry, served),
    }
    return expected, logits


def dump(expected: dict) -> str:
    """JSON, one top-level key a line (floats as Python writes them: they read back exactly)."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in expected.items()) + "\n}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where the case directories go (default: here)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import ropescale
    import ropescale.hf
    from ropescale import cli, scaling

    print(f"ropescale from {ropescale.__file__}", file=sys.stderr)
    clash = [name for name in CASES if (args.out / name).exists()]
    if clash:
        raise SystemExit(f"{args.out}: {', '.join(clash)} exist; this script never overwrites the recorded data "
                         "(write to another --out to compare)")
    ids = input_ids()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        base_model().save_pretrained(base)
        factors = tmp / "longrope_factors.json"
        factors.write_text(json.dumps(LONGROPE))
        for name, how in CASES.items():
            dst = tmp / name
            if how[0] == "base":
                shutil.copytree(base, dst)
                command = "LlamaForCausalLM(LlamaConfig(...)).save_pretrained (the base every case starts from)"
            elif how[0] == "extend":
                options = [o.replace("{factors}", str(factors)) for o in how[1]]
                assert cli.main(["extend", str(base), str(dst), *options]) == 0
                command = "ropescale extend base DST " + " ".join(
                    o.replace("{factors}", "factors.json") for o in how[1])
            elif how[0] == "patch":
                model = AutoModelForCausalLM.from_pretrained(base).eval()
                method = how[1](scaling)
                ropescale.hf.patch(model, method)
                model.save_pretrained(dst)
                command = f"ropescale.hf.patch(AutoModelForCausalLM.from_pretrained(base), {method!r}); save_pretrained"
            elif how[0] == "transformers":
                model = AutoModelForCausalLM.from_pretrained(base).eval()
                model.config.rope_parameters = dict(how[1])
                model.config.max_position_embeddings = how[2]
                model.save_pretrained(dst)
                command = (f"transformers only: config.rope_parameters = {how[1]}, max_position_embeddings = "
                           f"{how[2]}; save_pretrained")
            elif how[0] == "edit":
                shutil.copytree(base, dst)
                config = json.loads((dst / "config.json").read_text())
                config["rope_parameters"] = dict(how[1])
                config["max_position_embeddings"] = how[2]
                (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
                command = (f"base config.json edited to what ropescale wrote before ca5d0b7: rope_parameters = "
                           f"{how[1]}, max_position_embeddings = {how[2]}")
            else:
                raise AssertionError(how)
            expected, logits = expected_of(dst, ids)
            expected = {"case": name, "written_by": f"ropescale main at {COMMIT}; do not regenerate",
                        "how": command, **expected}
            (dst / "expected.json").write_text(dump(expected))
            save_file({"logits": logits.contiguous()}, str(dst / "expected.safetensors"))
            results[name] = (expected, logits)
            print(f"{name:28s} {expected['rope_type']:22s} {expected['vllm']}", file=sys.stderr)

        # The data must tell the methods apart: distinct tables give distinct logits on this input.
        names, margin = list(results), float("inf")
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                diff = (results[a][1] - results[b][1]).abs().max().item()
                if any({a, b} <= group for group in SAME_TABLE):
                    print(f"same table: {a} / {b}: max |diff| {diff:.2e}", file=sys.stderr)
                    assert diff < 1e-5, (a, b, diff)
                else:
                    margin = min(margin, diff)
                    assert diff > 1e-4, f"{a} and {b} give the same logits ({diff:.2e}): the data cannot tell them"
        print(f"smallest max |diff| between cases with different tables: {margin:.2e}", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        for name in CASES:
            shutil.copytree(tmp / name, args.out / name)  # copies: extend hard-links the weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
