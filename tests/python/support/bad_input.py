"""The runner of the table-driven bad-input suites (test_bad_input_*.py): every row runs against
the real op on CPU tensors AND against its fake kernel (FakeTensorMode: the Meta kernel, or the
Python fake of the table ops), and must fail with the same message on both. Rows that need the
data (position ranges, inv_freq values) or a device mix (which dispatches the real call to the
Meta kernel itself) run on the real op only, and say so."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map


@dataclasses.dataclass
class Row:
    id: str
    call: Callable[..., Any]  # call(*args, **kwargs)
    args: tuple
    kwargs: dict
    message: str  # a regular expression
    fake: bool = True  # False: a data check or a device mix, real op only


def row(id, call, *args, message, fake=True, **kwargs) -> Row:
    return Row(id, call, args, kwargs, message, fake)


def run_real(r: Row) -> None:
    with pytest.raises(RuntimeError, match=r.message):
        r.call(*r.args, **r.kwargs)


def run_fake(r: Row) -> None:
    with FakeTensorMode() as mode:
        args = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, r.args)
        kwargs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, r.kwargs)
        with pytest.raises(RuntimeError, match=r.message):
            r.call(*args, **kwargs)


def parametrize(rows: list[Row]):
    return pytest.mark.parametrize("r", rows, ids=[r.id for r in rows])


def escape(text: str) -> str:
    return re.escape(text)


def suite(rows: list[Row]):
    """The two tests of a bad-input suite, for a module to bind as ``test_real_op, test_fake_kernel``:
    every row against the real op, and the rows that can be, against the fake kernel."""

    @parametrize(rows)
    def test_real_op(r):
        run_real(r)

    @parametrize([r for r in rows if r.fake])
    def test_fake_kernel(r):
        run_fake(r)

    return test_real_op, test_fake_kernel
