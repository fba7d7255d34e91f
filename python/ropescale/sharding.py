"""DTensor sharding rules for ropescale's tensor ops (docs/DESIGN.md, "Distributed").

A tensor-parallel model (``torch.distributed.tensor.parallel``) hands ropescale's ops DTensors; DTensor
runs an op on each rank's local shards only when the op has a sharding rule saying which layouts are
valid, and redistributes the inputs (collectives) to the cheapest valid layout otherwise. The rules
below, one per op, registered with ``torch.distributed.tensor.experimental.register_sharding``, list
the layouts the math allows on one mesh dimension (DTensor combines them over the mesh's dimensions):

- rotation (``apply_rotary*``, the ``_pos`` and ``_qk`` forms): every operand replicated, sharded on
  heads (dim 1) or batch (dim 0), or a ``Partial`` sum (the rotation is linear), with the tables
  (cos/sin, positions, inv_freq) replicated; a table with one row per batch element is sharded on
  its dim 0 with the batch instead (a one-row table stays replicated); or every operand sharded on
  the sequence (dim 2) with cos/sin (positions) sharded on their sequence dim. Outputs keep the
  operands' layouts.
- ``rerope_attention``: q, k, v sharded on heads (dim 1: when Hq == Hkv, or Hkv divides evenly over
  the mesh's ranks, so each rank holds whole GQA groups) or on batch (dim 0, positions with it), or
  q (and its positions) sharded on the sequence with k, v and their positions replicated (DTensor
  gathers sequence-sharded keys: each query needs every key); or all replicated. ``out`` and ``lse``
  are sharded like q.
- ``rerope_attention_paged``: q and both caches sharded on heads (dim 1), the metadata, tables and
  scale factors replicated, or all replicated (the token dim packs requests: it is not sharded).
- ``rerope_cache_write_``: the caches and key/value sharded on heads, or all replicated.

The in-place ops cannot redistribute what they write: the tensors they mutate must already be in a
layout above, or the op refuses with an error naming the alternatives (the out-of-place op, which
DTensor redistributes, or ``.to_local()``).

:func:`context_parallel_active` says whether PyTorch's context parallelism (ring attention) is on, for the
refusals of what it would compute wrong (``ropescale.hf.patch``; docs/DESIGN.md, "Context parallelism").

Importing ``torch.distributed.tensor`` costs seconds, and DTensors exist only once it is imported, so
``import ropescale`` does not import it: the rules are registered right after it is imported (at once
when it already is), through a one-shot import hook. :func:`register` does it by hand.
"""

from __future__ import annotations

import itertools
import sys
import threading
import warnings

import torch

__all__ = ["register", "registered", "context_parallel_active"]

_lock = threading.Lock()
_registered = False

# ---------------------------------------------------------------------------------------------
# Context parallelism (torch.distributed.tensor.experimental.context_parallel): the sequence of q, k, v and of the
# user's buffers (input ids, labels, position ids) split over ranks, F.scaled_dot_product_attention turned into ring
# attention. PyTorch keeps it in private modules, whose path has moved once, so both paths are looked up.

_CONTEXT_PARALLEL_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
                             "torch.distributed.tensor.experimental._attention")


def context_parallel_active() -> bool:
    """Whether PyTorch's context parallelism is on in this process: inside ``context_parallel(mesh, ...)``, or its
    dispatcher enabled for a module-wrapper ``_ContextParallel`` plan. Both enable its DTensor handler for the fused
    attention kernels, which is what this looks for; False when PyTorch's module is not even imported (no cost)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return False
    handlers = getattr(getattr(dtensor.DTensor, "_op_dispatcher", None), "_custom_op_handlers", None) or {}
    for name in _CONTEXT_PARALLEL_MODULES:
        module = sys.modules.get(name)
        handler = getattr(module, "_sdpa_handler", None)
        if handler is not None and any(h is handler for h in handlers.values()):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Layouts. A rule gets the ops' arguments with every tensor replaced by its DTensorSpec (placements,
# global shape, mesh) and returns [(output placements, input placements)] for one mesh dimension, the
# inputs being the tensor arguments in schema order.


def _placements():
    # Lazy: torch.distributed.tensor costs seconds to import and is there only once DTensors are (the rules run
    # on DTensor inputs only, so it is imported by then).
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate(), Shard


def _is_spec(value) -> bool:
    return hasattr(value, "placements") and hasattr(value, "tensor_meta")


def _tensors(args, kwargs) -> list:
    return [a for a in (*args, *kwargs.values()) if _is_spec(a)]


def _describe(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _linear_partials(operands) -> list:
    """The Partial placements an operand holds that a linear map preserves (sum, avg)."""
    Partial, _, _ = _placements()
    found = []
    for spec in operands:
        for p in spec.placements:
            if type(p) is Partial and p.reduce_op in ("sum", "avg") and p not in found:
                found.append(p)
    return found


def _rotation_layouts(operands, tables) -> list[tuple[tuple, tuple]]:
    """[(operand placements, table placements)] the rotation allows on one mesh dim. ``tables``: per table
    tensor, (batch dim when it has one row per batch element, else None; its sequence dim, or None for
    inv_freq, which is always replicated)."""
    _, R, Shard = _placements()
    batch_wide = any(batch is not None for batch, _ in tables)
    replicated = tuple(R for _ in tables)
    free = [R, Shard(1), *([] if batch_wide else [Shard(0)]), *_linear_partials(operands)]
    layouts = [(combo, replicated) for combo in itertools.product(free, repeat=len(operands))]
    if batch_wide:
        layouts.append(((Shard(0),) * len(operands), tuple(R if b is None else Shard(b) for b, _ in tables)))
    layouts.append(((Shard(2),) * len(operands), tuple(R if s is None else Shard(s) for _, s in tables)))
    return layouts


def _cos_sin_dims(spec):
    """cos/sin: [seq, w] or [batch or 1, seq, w]."""
    return (0 if spec.ndim == 3 and spec.shape[0] > 1 else None), spec.ndim - 2


def _positions_dims(spec):
    """positions: [seq] or [batch or 1, seq]."""
    return (0 if spec.ndim == 2 and spec.shape[0] > 1 else None), spec.ndim - 1


def _in_place(op: str, names, mutated, layouts, takes: str, alternatives: str):
    """The layouts that keep every mutated tensor's placements on every mesh dim. Refuses, naming
    ``alternatives``, a held layout the op does not take, and one ambiguous over mesh dims (two dims placing
    the first mutated tensor alike and another differently: DTensor keeps only the first in place)."""
    held = [tuple(spec.placements[d] for spec in mutated) for d in range(mutated[0].mesh.ndim)]
    allowed = {operands for operands, _ in layouts}
    reason = None
    if any(placement not in allowed for placement in held):
        reason = takes
    elif any(a[0] == b[0] and a != b for a, b in itertools.combinations(held, 2)):
        reason = "two mesh dims place the first tensor alike and another differently, which DTensor cannot keep"
    if reason is not None:
        layout = ", ".join(f"{n} {_describe(s.placements)}" for n, s in zip(names, mutated))
        raise RuntimeError(f"{op}: DTensor layout not supported in place ({layout}): {reason}. An in-place op "
                           f"cannot redistribute the tensors it writes: {alternatives}, or call .to_local() on the "
                           "DTensors and pass plain tensors")
    return [layout for layout in layouts if layout[0] in held]


_ROTATION_TAKES = ("the rotation takes each operand replicated, sharded on heads (dim 1) or batch (dim 0), or a "
                   "Partial sum, or every operand sharded alike on batch or on the sequence (dim 2) with the tables "
                   "sharded with them; never on head_dim (dim 3: rotation pairs span it)")


def _rotation_rule(op: str, operand_names: tuple[str, ...], table_kind: str, in_place: bool):
    def rule(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        operands, tables = tensors[: len(operand_names)], tensors[len(operand_names):]
        if table_kind == "cos_sin":
            dims = [_cos_sin_dims(t) for t in tables]
        else:  # positions, inv_freq
            dims = [_positions_dims(tables[0]), (None, None)]
        layouts = _rotation_layouts(operands, dims)
        if in_place:
            alternatives = f"call the out-of-place {op[:-1]} (DTensor redistributes its inputs), shard heads (dim 1)"
            layouts = _in_place(op, operand_names, operands, layouts, _ROTATION_TAKES, alternatives)
            return [([], [*placed, *table]) for placed, table in layouts]
        return [([*placed], [*placed, *table]) for placed, table in layouts]

    return rule


def _whole_groups(q, kv) -> bool:
    """Whether sharding heads keeps GQA groups whole: q head h reads kv head h // (Hq / Hkv), and a rank's
    local op pairs its heads the same way only when both counts split evenly (DTensor's uneven chunks pair
    others: Hq 12, Hkv 3 on 2 ranks puts q heads 0-5 with kv heads 0-1, and the local op pairs q head 3
    with kv head 1, not 0). Heads may be split over several mesh dims, so Hkv must divide by the mesh's
    rank count (exact on a 1-D mesh, conservative on more)."""
    hq, hkv = q.shape[1], kv.shape[1]
    return hq == hkv or hkv % q.mesh.size() == 0


def _rerope_attention(*args, **kwargs):
    _, R, Shard = _placements()
    q, k, v, q_positions, k_positions, inv_freq = _tensors(args, kwargs)
    layouts = [([R, R], [R, R, R, R, R, R]),
               ([Shard(0), Shard(0)], [Shard(0)] * 5 + [R]),
               # queries split over the sequence, each attending every key (keys gathered)
               ([Shard(2), Shard(2)], [Shard(2), R, R, Shard(1), R, R])]
    if _whole_groups(q, k):
        layouts.append(([Shard(1), Shard(1)], [Shard(1)] * 3 + [R] * 3))
    return layouts


def _rerope_attention_paged(*args, **kwargs):
    _, R, Shard = _placements()
    # q, key_cache, value_cache, block_table, seq_lens, query_start_loc, inv_freq[, scale_factors]
    tensors = _tensors(args, kwargs)
    q, key_cache = tensors[0], tensors[1]
    metadata = [R] * (len(tensors) - 3)
    layouts = [([R, R], [R] * len(tensors))]
    if _whole_groups(q, key_cache):
        layouts.append(([Shard(1), Shard(1)], [Shard(1)] * 3 + metadata))
    return layouts


def _rerope_cache_write_(*args, **kwargs):
    _, R, Shard = _placements()
    key_cache, value_cache, key, value, slot_mapping = _tensors(args, kwargs)
    layouts = [((R, R), (R, R, R)), ((Shard(1), Shard(1)), (Shard(1), Shard(1), R))]
    layouts = _in_place("rerope_cache_write_", ("key_cache", "value_cache"), [key_cache, value_cache], layouts,
                        "the caches are written replicated or sharded on heads (dim 1), both alike",
                        "shard both caches on heads (dim 1) or replicate them")
    return [([], [*caches, *rest]) for caches, rest in layouts]


def _rules() -> dict:
    rules = {}
    for base, operands in (("apply_rotary", ("x",)), ("apply_rotary_qk", ("q", "k"))):
        for pos in (False, True):
            name = base.replace("apply_rotary", "apply_rotary_pos") if pos else base
            for in_place in (False, True):
                op = name + "_" * in_place
                rules[op] = _rotation_rule(op, operands, "positions" if pos else "cos_sin", in_place)
    rules["rerope_attention"] = _rerope_attention
    rules["rerope_attention_paged"] = _rerope_attention_paged
    rules["rerope_cache_write_"] = _rerope_cache_write_
    return rules


# ---------------------------------------------------------------------------------------------
# Registration


def registered() -> bool:
    """Whether the rules are registered with DTensor."""
    return _registered


def register() -> bool:
    """Registers the rules with DTensor (idempotent). False when torch has no ``torch.distributed`` or no
    ``register_sharding``; DTensor then refuses DTensor inputs to ropescale's ops (pass ``.to_local()``)."""
    global _registered
    with _lock:
        if _registered:
            return True
        if not torch.distributed.is_available():
            return False
        try:
            # Lazy: torch.distributed.tensor is heavy, and register_sharding absent from some torch builds.
            from torch.distributed.tensor.experimental import register_sharding
        except ImportError:
            return False
        ops = torch.ops.ropescale
        for name, rule in _rules().items():
            register_sharding(getattr(ops, name).default)(rule)
        _registered = True
        return True


def _register_quietly() -> None:
    try:
        register()
    except Exception as error:  # never break the import of torch.distributed.tensor that triggered it
        warnings.warn(f"ropescale: DTensor sharding rules not registered ({type(error).__name__}: {error}); DTensor "
                      "inputs to ropescale's ops will be refused: call .to_local() on them", stacklevel=2)


_TARGET = "torch.distributed.tensor"


class _AfterImport:
    """A one-shot ``sys.meta_path`` finder: finds ``torch.distributed.tensor`` through the other finders and
    wraps its loader's ``exec_module`` so that the rules are registered once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec

        def exec_module(module):
            try:
                execute(module)
            except BaseException:
                _install()  # a later import may succeed
                raise
            _register_quietly()

        loader.exec_module = exec_module  # this module's own loader instance
        return spec


_hook = _AfterImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def _install() -> None:
    if _TARGET in sys.modules:
        _register_quietly()
    elif torch.distributed.is_available() and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


_install()
