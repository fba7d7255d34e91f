"""Hostile inputs to the frequency ops, one table: each row fails with the same message from the
real op and from its fake kernel (FakeTensorMode, torch.compile): the table ops' Python fakes run
the op's own checks, the inv_freq-taking ops' Meta kernels the same C++ checks as their CPU
kernels. Rows marked fake=False check data (inv_freq values) or have no fake (the int-returning
effective_context_length)."""

import math
import re

import pytest
import torch

from support.bad_input import row, suite
from ropescale import ops

R = torch.ops.ropescale
nan, inf = float("nan"), float("inf")
f = ops.default_inv_freq(16, 1e4)
LIMIT = "2147483647"

ROWS = [
    # NaN / inf scalars
    row("base nan", R.default_inv_freq, 64, nan, message="default_inv_freq: base must be > 1, got nan"),
    row("base inf", R.linear_inv_freq, 64, inf, 2.0, message="linear_inv_freq: base must be > 1, got inf"),
    row("base 1", R.ntk_inv_freq, 64, 1.0, 2.0, message="ntk_inv_freq: base must be > 1, got 1"),
    row("factor nan", R.yarn_inv_freq, 64, 1e4, nan, 128, message="yarn_inv_freq: factor must be >= 1, got nan"),
    row("factor inf", R.dynamic_ntk_inv_freq, 64, 1e4, inf, 128, 256, message="factor must be >= 1, got inf"),
    row("factor 0.5", R.llama3_inv_freq, 64, 1e4, 0.5, 1.0, 4.0, 128, message="llama3_inv_freq: factor must be >= 1"),
    # sizes
    row("odd dim", R.default_inv_freq, 63, 1e4, message="dim must be a positive even number, got 63"),
    row("dim 0", R.linear_inv_freq, 0, 1e4, 2.0, message="dim must be a positive even number, got 0"),
    row("dim 2 ntk", R.ntk_inv_freq, 2, 1e4, 2.0, message="ntk_inv_freq: dim must be > 2"),
    row("original 0", R.yarn_inv_freq, 64, 1e4, 2.0, 0, message="original_max_position must be > 0, got 0"),
    row("seq_len -1", R.dynamic_ntk_inv_freq, 64, 1e4, 2.0, 128, -1, message="seq_len must be >= 0, got -1"),
    row("longrope short", R.longrope_inv_freq, 8, 1e4, [1.0], [1.0] * 4, 16, 8,
        message="short_factor must have dim/2 = 4 entries, got 1"),
    row("integer dtype", R.default_inv_freq, 64, 1e4, dtype=torch.int64, message="inv_freq tables are floating point"),
    # proportional's own argument: a fraction of the head in (0, 1]
    *(row(f"proportional partial_rotary_factor {shown}", R.proportional_inv_freq, 64, 1e4, 2.0, p,
          message=re.escape(f"proportional_inv_freq: partial_rotary_factor must be in (0, 1], got {shown}"))
      for p, shown in ((0.0, "0"), (-0.5, "-0.5"), (1.5, "1.5"), (nan, "nan"), (inf, "inf"))),
    row("head_dim 0", R.proportional_inv_freq, 0, 1e4, 1.0, 0.25,
        message="proportional_inv_freq: head_dim must be a positive even number, got 0"),
    row("factor 0.5 proportional", R.proportional_inv_freq, 64, 1e4, 0.5, 0.25,
        message="proportional_inv_freq: factor must be >= 1, got 0.5"),
    # the inv_freq-taking ops: metadata
    row("inv_freq 2-D", R.similarity_decay, f[None], 10, message="similarity_decay: inv_freq must be 1-D"),
    row("int inv_freq", R.feature_gap, f.long(), 4, 8, message="feature_gap: inv_freq must be floating point"),
    row("int inv_freq resonance", R.resonance_inv_freq, f.int(), message="resonance_inv_freq: inv_freq must be floating point"),
    row("negative distance", R.similarity_decay, f, -1, message="similarity_decay: max_distance must be >= 0, got -1"),
    row("original -1", R.resonance_inv_freq, f, -1, message="original_max_position must be >= 0, got -1"),
    row("train 0", R.feature_gap, f, 0, 8, message="feature_gap: train_length must be > 0, got 0"),
    row("test < train", R.feature_gap, f, 8, 4, message="test_length must be >= train_length"),
    # huge sizes: refused at once (they would run for days, or forever near 2^62)
    row("decay 2^62", R.similarity_decay, f, 2**62, message=f"similarity_decay: max_distance must be <= {LIMIT}"),
    row("gap 1e11", R.feature_gap, f, 64, 10**11, message=f"feature_gap: test_length must be <= {LIMIT}"),
    row("gap 2^62", R.feature_gap, f, 64, 2**62, message=f"feature_gap: test_length must be <= {LIMIT}"),
    row("context 2^62", R.effective_context_length, f, 2**62,
        message=f"effective_context_length: max_distance must be <= {LIMIT}", fake=False),
    row("base bound 2^40", R.base_lower_bound, 2**40, 128, message=f"base_lower_bound: context_length must be <= {LIMIT}", fake=False),
    # data: inv_freq values (real op only)
    row("nan inv_freq", R.similarity_decay, torch.tensor([1.0, nan]), 4, message="inv_freq must be finite and >= 0, got nan", fake=False),
    row("negative inv_freq", R.feature_gap, torch.tensor([1.0, -0.5]), 4, 8, message="inv_freq must be finite and >= 0", fake=False),
]


# Every table op (ops.TABLE_OPS: a new method's op is covered without a row written here) called with valid
# arguments built from its schema by argument name, then with each standard argument made hostile: the same
# messages as the rows above, from the checks the table ops share.
_VALID = {"dim": 64, "base": 1e4, "factor": 2.0, "original_max_position": 128, "seq_len": 256, "beta_fast": 32.0,
          "beta_slow": 1.0, "truncate": True, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "short_factor": [1.0] * 32, "long_factor": [2.0] * 32, "head_dim": 64, "partial_rotary_factor": 0.25,
          "extrapolation_factor": 1.0}
_HOSTILE = {"dim": (63, "dim must be a positive even number, got 63"), "base": (nan, "base must be > 1, got nan"),
            "head_dim": (63, "head_dim must be a positive even number, got 63"),
            "factor": (nan, "factor must be >= 1, got nan"),
            "original_max_position": (0, "original_max_position must be > 0, got 0")}


def _valid_arguments(name: str) -> list:
    schema = getattr(R, name).default._schema
    missing = [a.name for a in schema.arguments if not a.kwarg_only and a.name not in _VALID]
    assert not missing, f"{name}: give _VALID a valid value of {missing}"
    return [_VALID[a.name] for a in schema.arguments if not a.kwarg_only]


def _generated_rows() -> list:
    rows = []
    for name in ops.TABLE_OPS:
        schema = [a.name for a in getattr(R, name).default._schema.arguments if not a.kwarg_only]
        for arg, (value, message) in _HOSTILE.items():
            if arg in schema:
                args = _valid_arguments(name)
                args[schema.index(arg)] = value
                rows.append(row(f"{name} {arg}={value}", getattr(R, name), *args,
                                message=f"{name}: {re.escape(message)}"))
        rows.append(row(f"{name} integer dtype", getattr(R, name), *_valid_arguments(name), dtype=torch.int64,
                        message="inv_freq tables are floating point"))
    return rows


@pytest.mark.parametrize("name", ops.TABLE_OPS)
def test_every_table_op_takes_the_generated_valid_arguments(name):
    """The generated rows start from a call that succeeds: a new op's argument needs a valid value first."""
    assert getattr(R, name)(*_valid_arguments(name)).shape == (32,)


ROWS += _generated_rows()

test_real_op, test_fake_kernel = suite(ROWS)


def test_fake_kernels_give_the_real_shapes():
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert R.yarn_inv_freq(64, 1e4, 4.0, 128).shape == (32,)
        ff = mode.from_tensor(f)
        assert R.similarity_decay(ff, 10).shape == (11,) and R.similarity_decay(ff, 10).dtype == torch.float64
        assert R.feature_gap(ff, 4, 8).shape == (8,) and R.resonance_inv_freq(ff).shape == (8,)
