"""The method registry (``ropescale.scaling``): every declaration a method makes is checked against what it
claims, so a wrong entry for a new method fails here, and a method added to the registry is picked up by the
naming scheme, ``from_hf``/``to_hf``, the config writer and reader, transformers' rope types and the command line
without touching them (shown with a method registered in a fresh process).

What the declarations are checked against: transformers' own ``ROPE_INIT_FUNCTIONS`` (``transformers_native``),
the tables stock transformers builds for a type (``stock == "same"``: the same table as ropescale's, to float32
rounding), the written config read back (``written_type``, ``aliases``), the parameters' config keys
(``HF_KEYS``), and the methods' own tables (``dynamic``/``length_dependent``: whether the table changes with
the length).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers import modeling_rope_utils as rope_utils  # noqa: E402

import ropescale.hf  # noqa: E402,F401  (registers ropescale's rope types)
from ropescale import config as config_lib, scaling  # noqa: E402
from ropescale.hf import rope_types  # noqa: E402
from ropescale.scaling import RopeType  # noqa: E402
from support import methods  # noqa: E402

DIM, BASE, ORIGINAL = 16, 10000.0, 64


def instance(cls, **fields):
    return methods.instance(cls, pairs=DIM // 2, original=ORIGINAL, **fields)


METHODS = sorted(methods.registered())


@pytest.mark.parametrize("rope_type", METHODS)
def test_every_name_of_a_method_parses_back_to_it(rope_type):
    cls = scaling.METHODS[rope_type]
    for name in (cls.rope_type, *cls.aliases, *((cls.written_type,) if cls.written_type else ())):
        parsed = RopeType.parse(name)
        assert (parsed.method, parsed.resonance, parsed.rerope) == (cls, False, False), name
        rerope = RopeType.parse(RopeType.join(name, True))
        assert (rerope.method, rerope.resonance, rerope.rerope, rerope.table) == (cls, False, True, name)
    resonant = RopeType.parse(RopeType.table_name(cls, resonance=True))
    assert (resonant.method, resonant.resonance) == (cls, True)
    for name in cls.cli_names:
        assert RopeType.parse(name).method is cls


@pytest.mark.parametrize("rope_type", METHODS)
@pytest.mark.parametrize("resonance", [False, True])
def test_to_hf_and_from_hf_round_trip_and_name_every_key(rope_type, resonance):
    method = instance(scaling.METHODS[rope_type], resonance=resonance)
    params = method.to_hf(base=BASE)
    read = scaling.from_hf(params, ORIGINAL)
    torch.testing.assert_close(read.inv_freq(DIM, BASE, 4 * ORIGINAL, dtype=torch.float64),
                               method.inv_freq(DIM, BASE, 4 * ORIGINAL, dtype=torch.float64), rtol=1e-12, atol=0)
    required, optional = scaling.HF_KEYS[rope_type]
    assert not required & optional
    hf_keys = {p.hf_key for p in type(method).parameters() if p.hf_key}
    assert required | optional == hf_keys | set(type(method).unread_keys)  # unread: accepted, read by no table
    assert required <= set(params) | {"original_max_position_embeddings"}


@pytest.mark.parametrize("rope_type", METHODS)
@pytest.mark.parametrize("resonance", [False, True])
def test_the_written_config_reads_back_as_the_method(rope_type, resonance):
    method = instance(scaling.METHODS[rope_type], resonance=resonance)
    written = config_lib.write(method, BASE, DIM, ORIGINAL)
    parsed = config_lib.read(written.rope_parameters, written.max_position_embeddings, written.entry, DIM)
    for seq_len in (None, ORIGINAL // 2, 4 * ORIGINAL):
        torch.testing.assert_close(parsed.method.inv_freq(DIM, parsed.base, seq_len, dtype=torch.float64),
                                   method.inv_freq(DIM, BASE, seq_len, dtype=torch.float64), rtol=1e-12, atol=0)
    name = RopeType.parse(written.rope_parameters["rope_type"])
    # "refused": a type stock engines do not know; "same"/"plain": a type they serve with their own code.
    assert name.is_stock == (type(method).stock != "refused" and not (resonance and type(method).resonance_type))
    # The method is recorded in ropescale's entry where a stock engine serves its written type with its own code.
    assert (written.entry is not None) == (type(method).stock == "same" and name.is_stock)


@pytest.mark.parametrize("rope_type", METHODS)
def test_transformers_native_is_what_transformers_has(rope_type):
    cls = scaling.METHODS[rope_type]
    if rope_type == "default":  # transformers computes plain RoPE in each model's rotary class, not through the dict
        assert cls.transformers_native and rope_type not in rope_utils.ROPE_INIT_FUNCTIONS
    elif cls.transformers_model_type:  # HunYuan's ntk_alpha: named in transformers' model files, left to them
        import inspect

        from transformers import PreTrainedModel

        assert not cls.transformers_native and rope_type not in rope_utils.ROPE_INIT_FUNCTIONS
        assert f'"{rope_type}"' in inspect.getsource(PreTrainedModel._init_weights)
    else:
        registered = rope_utils.ROPE_INIT_FUNCTIONS.get(rope_type)
        assert registered is not None
        assert (registered is not rope_types._init_function) == cls.transformers_native
    for name in (*cls.aliases, RopeType.table_name(cls, True) if cls.resonance_type else None):
        if name is not None:
            assert name in rope_types.ROPESCALE_ROPE_TYPES and name in rope_utils.ROPE_INIT_FUNCTIONS


@pytest.mark.parametrize("rope_type", [t for t in METHODS if scaling.METHODS[t].stock == "same"
                                       and scaling.METHODS[t].transformers_native])
def test_a_stock_type_is_the_same_table_in_stock_transformers(rope_type):
    """``stock == "same"``: transformers' own init function for the written type gives ropescale's table."""
    method = instance(scaling.METHODS[rope_type])
    params, _ = method.stock_parameters(BASE, DIM)
    config = LlamaConfig(hidden_size=DIM * 2, num_attention_heads=2, head_dim=DIM, max_position_embeddings=4 * ORIGINAL,
                         rope_parameters=dict(params))
    inv_freq, factor = rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    torch.testing.assert_close(inv_freq.double(), method.inv_freq(DIM, BASE, dtype=torch.float64), rtol=2e-6, atol=0)
    assert factor == pytest.approx(method.attention_factor, rel=1e-6)


@pytest.mark.parametrize("rope_type", METHODS)
def test_dynamic_and_length_dependent_say_whether_the_table_follows_the_length(rope_type):
    method = instance(scaling.METHODS[rope_type])
    tables = [method.inv_freq(DIM, BASE, n, dtype=torch.float64) for n in (ORIGINAL // 2, 4 * ORIGINAL, 8 * ORIGINAL)]
    changes = not all(torch.equal(tables[0], t) for t in tables[1:])
    assert method.length_dependent == changes
    scales = not torch.equal(tables[1], tables[2])  # past the original length: a dynamic scale keeps growing
    assert method.dynamic == scales


@pytest.mark.parametrize("rope_type", METHODS)
@pytest.mark.parametrize("resonance", [False, True])
def test_two_tables_long_table_and_is_plain_say_what_the_tables_do(rope_type, resonance):
    # The facts engine adapters ask of a method (llama.cpp's longrope, verify's hypotheses), checked against its
    # tables: two tables switch once, at the original length; the long one is the table past it, at every length.
    method = instance(scaling.METHODS[rope_type], resonance=resonance)
    short, long = ORIGINAL // 2, ORIGINAL + 1
    table = {n: method.inv_freq(DIM, BASE, n, dtype=torch.float64) for n in (short, ORIGINAL, long, 4 * ORIGINAL)}
    switches = not torch.equal(table[ORIGINAL], table[long]) and torch.equal(table[short], table[ORIGINAL]) \
        and torch.equal(table[long], table[4 * ORIGINAL])
    assert method.two_tables == (switches and not method.dynamic)
    everywhere = method.long_table()
    assert type(everywhere) is type(method) and not everywhere.two_tables
    for n in (short, long):
        assert torch.equal(everywhere.inv_freq(DIM, BASE, n, dtype=torch.float64),
                           table[long] if method.two_tables else table[n])
    plain = scaling.Default().inv_freq(DIM, BASE, dtype=torch.float64)
    assert method.is_plain == (torch.equal(table[short], plain) and torch.equal(table[4 * ORIGINAL], plain)
                               and method.attention_factor_for(4 * ORIGINAL) == 1.0), rope_type
    assert scaling.RopeType.parse(scaling.RopeType.table_name(type(method), resonance)).unscaled == method.is_plain


def test_register_refuses_a_taken_name_and_never_inherits_a_declaration():
    with pytest.raises(TypeError, match="'linear' is taken"):
        @scaling.register("linear")
        @dataclasses.dataclass(frozen=True)
        class Twice(scaling.Linear):
            pass
    with pytest.raises(TypeError, match="reserved prefix"):
        scaling.register("resonance_linear2")(type("R", (scaling.Linear,), {}))
    with pytest.raises(TypeError, match="stock must be"):
        scaling.register("linear2", stock="native")
    assert {"Twice", "R"}.isdisjoint(cls.__name__ for cls in scaling.METHODS.values())
    # DynamicYaRN subclasses YaRN but declares none of YaRN's stock behaviour: register's defaults, not YaRN's.
    assert (scaling.DynamicYaRN.stock, scaling.DynamicYaRN.transformers_native,
            scaling.DynamicYaRN.vllm_rotary_class, scaling.DynamicYaRN.cli_names) == ("refused", False, None,
                                                                                    ("dynamic_yarn",))


# A new method, registered in a fresh process before ropescale.hf is imported: linear scaling under a new name.
_NEW_METHOD = textwrap.dedent('''
    import dataclasses, json, sys
    from typing import ClassVar
    import torch
    from ropescale import ops, scaling

    @scaling.register("halved", aliases=("halved_alias",))
    @dataclasses.dataclass(frozen=True)
    class Halved(scaling.RopeScaling):
        """Every frequency divided by factor, under a name of its own."""
        factor: float = scaling.parameter(1.0, required=True, cli="--factor", help="s")

        def _table(self, dim, base, seq_len, dtype):
            return ops.default_inv_freq(dim, base, dtype=dtype) / self.factor

    import ropescale.hf
    from ropescale import cli, config as config_lib
    from transformers import modeling_rope_utils as rope_utils
    method = scaling.from_hf({"rope_type": "halved_alias", "factor": 2.0})
    written = config_lib.write(method, 100.0, 8, 16, attention="rerope",
                               parameters=config_lib.check_attention("rerope", {"window": 4}))
    read = config_lib.read(written.rope_parameters, 16, written.entry, 8)
    out = {"method": repr(method), "written": written.rope_parameters["rope_type"], "read": repr(read.method),
           "resonance_registered": "resonance_halved" in rope_utils.ROPE_INIT_FUNCTIONS,
           "rerope_registered": "rerope_halved" in ropescale.hf.ROPESCALE_ROPE_TYPES,
           "cli": cli.main(["table", "--method", "halved", "--factor", "2", "--dim", "8", "--json"])}
    print("RESULT " + json.dumps(out))
''')


def test_a_new_method_is_found_everywhere_from_its_registration(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-c", _NEW_METHOD], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    (line,) = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out == {"method": "Halved(resonance=False, factor=2.0)", "written": "rerope_halved",
                   "read": "Halved(resonance=False, factor=2.0)", "resonance_registered": True,
                   "rerope_registered": True, "cli": 0}


_HOSTILE = {
    float: (float("nan"), float("inf"), -float("inf"), True, "4", [4.0]),
    int: (float("nan"), float("inf"), 0.5, -1, True, "4096"),
    bool: ("yes", 1, None, float("nan")),
    tuple: ((), (float("nan"),) * (DIM // 2), (-1.0,) * (DIM // 2), "abc", 4.0),
    str: ("Request", "steps", "", None, 1, float("nan"), ["request"]),
}


@pytest.mark.parametrize("rope_type", METHODS)
def test_every_parameter_of_every_method_refuses_hostile_values(rope_type):
    """The dataclass checks every path shares (hf.patch, from_hf, the CLI, the vLLM plugin): a hostile value of
    any parameter of any registered method is refused with a ValueError naming the method and the field."""
    cls = scaling.METHODS[rope_type]
    for p in cls.parameters():
        for value in _HOSTILE[p.kind]:
            with pytest.raises(ValueError, match=f"{cls.__name__}: {p.name}") as err:
                instance(cls, **{p.name: value})
            assert repr(value)[:20] in str(err.value) or p.kind is tuple, (p.name, value, err.value)
            if p.hf_key:  # and from a config, with the rope type named
                with pytest.raises(ValueError, match=f"from_hf: rope_type {rope_type!r}"):
                    scaling.from_hf({**instance(cls).to_hf(), p.hf_key: value}, ORIGINAL)
