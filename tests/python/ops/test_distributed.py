"""ropescale's ops on DTensors (ropescale.sharding), on a 2-rank gloo group on CPU: every op's DTensor result
equals the op on the full tensors for heads-, batch- and sequence-sharded inputs (and the gradients of the
differentiable rotations), in-place ops refuse a layout they cannot keep, a ReRoPE- and a YaRN-patched tiny
Llama under tensor parallelism (DTensor q/k/v) gives the single-process logits, and one FSDP2 training step
of every patch kind equals the single-process step.

One pair of spawned processes runs every check (``support.two_ranks``); each test below reads its check's outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.distributed.is_available():
    pytest.skip("this torch is built without torch.distributed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

import ropescale  # noqa: E402
from ropescale import hf, ops, scaling  # noqa: E402
from support import two_ranks  # noqa: E402
from support.tiny_lm import STATIC, ids, tiny  # noqa: E402

WORLD = two_ranks.WORLD
R = Replicate()


# ---------------------------------------------------------------------------------------------
# Helpers (run on each rank)


def dt(tensor, mesh, placement):
    """The full tensor (equal on every rank) as a DTensor with ``placement``."""
    return distribute_tensor(tensor, mesh, [placement])


def assert_same(result, expected, placement, exact=True):
    """``result`` is a DTensor laid out as ``placement`` (so no rank gathered anything) holding ``expected``."""
    assert isinstance(result, DTensor), type(result)
    assert result.placements == (placement,), f"placements {result.placements}, expected {(placement,)}"
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.full_tensor(), expected, **tolerance)


B, HQ, HKV, L, D = 2, 4, 2, 6, 16


def rotation_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, HQ, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    inv_freq = ops.default_inv_freq(D, 10000.0)
    positions = torch.stack([torch.arange(L) + 3, torch.arange(L) * 5])  # [B, L], a row each
    angles = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)
    return q, k, positions, inv_freq, angles.cos(), angles.sin()


# operand layout -> (placement of a [B, ...] table, of a one-row table); tables' seq dim: 1 for [B, L, w], 0 for [L, w]
ROTATION_LAYOUTS = {
    "replicated": (R, (R, R)),
    "heads": (Shard(1), (R, R)),
    "batch": (Shard(0), (Shard(0), R)),
    "sequence": (Shard(2), (Shard(1), Shard(0))),
}


def check_rotation(mesh, rank):
    """Every rotary op, out of place and in place, on each layout, with batch-wide and one-row tables."""
    q, k, positions, inv_freq, cos, sin = rotation_inputs()
    for layout, (operand, (batch_table, one_row_table)) in ROTATION_LAYOUTS.items():
        for rows in ("batch", "one_row"):
            if rows == "batch":
                c, s, p, table = cos, sin, positions, batch_table
            else:  # the first row's table, 2-D / 1-D
                c, s, p, table = cos[0], sin[0], positions[0], one_row_table
            cd, sd, pd, fd = dt(c, mesh, table), dt(s, mesh, table), dt(p, mesh, table), dt(inv_freq, mesh, R)
            where = f"{layout} layout, {rows} tables"
            qd, kd = dt(q, mesh, operand), dt(k, mesh, operand)
            try:
                assert_same(ops.apply_rotary(qd, cd, sd), ops.apply_rotary(q, c, s), operand)
                for got, want in zip(ops.apply_rotary_qk(qd, kd, cd, sd), ops.apply_rotary_qk(q, k, c, s)):
                    assert_same(got, want, operand)
                assert_same(ops.apply_rotary_pos(qd, pd, fd, 1.25), ops.apply_rotary_pos(q, p, inv_freq, 1.25), operand)
                for got, want in zip(ops.apply_rotary_pos_qk(qd, kd, pd, fd, 0.5),
                                     ops.apply_rotary_pos_qk(q, k, p, inv_freq, 0.5)):
                    assert_same(got, want, operand)
                # in place: the DTensors keep their layout and hold the rotated values
                x, want = qd.clone(), ops.apply_rotary(q, c, s)
                ops.apply_rotary_(x, cd, sd)
                assert_same(x, want, operand)
                x, y = qd.clone(), kd.clone()
                ops.apply_rotary_qk_(x, y, cd, sd)
                want = ops.apply_rotary_qk(q, k, c, s)
                assert_same(x, want[0], operand)
                assert_same(y, want[1], operand)
                x = qd.clone()
                ops.apply_rotary_pos_(x, pd, fd, 1.25)
                assert_same(x, ops.apply_rotary_pos(q, p, inv_freq, 1.25), operand)
                x, y = qd.clone(), kd.clone()
                ops.apply_rotary_pos_qk_(x, y, pd, fd, 0.5)
                want = ops.apply_rotary_pos_qk(q, k, p, inv_freq, 0.5)
                assert_same(x, want[0], operand)
                assert_same(y, want[1], operand)
            except AssertionError as error:
                raise AssertionError(f"{where}: {error}") from error


def check_rotation_mixed_and_partial(mesh, rank):
    """q and k laid out differently (q on heads, k replicated: GQA with fewer kv heads than ranks), plain
    tables under implicit replication, and a Partial sum (the rotation is linear: no all-reduce first)."""
    from torch.distributed.tensor.experimental import implicit_replication

    q, k, positions, inv_freq, cos, sin = rotation_inputs(seed=1)
    qd, kd = dt(q, mesh, Shard(1)), dt(k, mesh, R)
    want = ops.apply_rotary_qk(q, k, cos[:1], sin[:1])
    with implicit_replication():  # plain cos/sin taken as replicated
        got = ops.apply_rotary_qk(qd, kd, cos[:1], sin[:1])
    assert_same(got[0], want[0], Shard(1))
    assert_same(got[1], want[1], R)
    # Partial: each rank holds a summand; the rotation of the sum is the sum of the rotations
    part = torch.randn(B, HQ, L, D, generator=torch.Generator().manual_seed(10 + rank))
    total = part.clone()
    dist.all_reduce(total)
    xd = DTensor.from_local(part, mesh, [Partial()])
    got = ops.apply_rotary_pos(xd, dt(positions, mesh, R), dt(inv_freq, mesh, R))
    assert_same(got, ops.apply_rotary_pos(total, positions, inv_freq), Partial(), exact=False)
    # in place with a batch-wide table given replicated: DTensor shards the table, never x
    x = dt(q, mesh, Shard(0))
    ops.apply_rotary_pos_(x, dt(positions, mesh, R), dt(inv_freq, mesh, R), 2.0)
    assert_same(x, ops.apply_rotary_pos(q, positions, inv_freq, 2.0), Shard(0))


def check_rotation_redistributed(mesh, rank):
    """A layout no rule lists (q sharded on head_dim) is redistributed by DTensor: still the right result."""
    q, k, positions, inv_freq, cos, sin = rotation_inputs(seed=2)
    got = ops.apply_rotary_qk(dt(q, mesh, Shard(3)), dt(k, mesh, Shard(3)), dt(cos, mesh, R), dt(sin, mesh, R))
    for g, want in zip(got, ops.apply_rotary_qk(q, k, cos, sin)):
        torch.testing.assert_close(g.full_tensor(), want, rtol=0, atol=0)
        assert Shard(3) not in g.placements


def check_rotation_gradients(mesh, rank):
    """Gradients through apply_rotary_qk and apply_rotary_pos_qk on DTensors equal the full tensors' ones."""
    q, k, positions, inv_freq, cos, sin = rotation_inputs(seed=3)
    g = torch.Generator().manual_seed(4)
    wq, wk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)

    def grads(q, k, wq, wk, rotate):
        q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        oq, ok = rotate(q, k)
        ((oq * wq).sum() + (ok * wk).sum()).backward()
        return q.grad, k.grad

    for layout, (operand, (batch_table, _)) in ROTATION_LAYOUTS.items():
        want = grads(q, k, wq, wk, lambda a, b: ops.apply_rotary_qk(a, b, cos, sin))
        cd, sd = dt(cos, mesh, batch_table), dt(sin, mesh, batch_table)
        got = grads(dt(q, mesh, operand), dt(k, mesh, operand), dt(wq, mesh, operand), dt(wk, mesh, operand),
                    lambda a, b: ops.apply_rotary_qk(a, b, cd, sd))
        for a, b in zip(got, want):
            assert_same(a, b, operand)
        want = grads(q, k, wq, wk, lambda a, b: ops.apply_rotary_pos_qk(a, b, positions, inv_freq, 0.75))
        pd, fd = dt(positions, mesh, batch_table), dt(inv_freq, mesh, R)
        got = grads(dt(q, mesh, operand), dt(k, mesh, operand), dt(wq, mesh, operand), dt(wk, mesh, operand),
                    lambda a, b: ops.apply_rotary_pos_qk(a, b, pd, fd, 0.75))
        for a, b in zip(got, want):
            assert_same(a, b, operand)


def check_rotation_in_place_refusals(mesh, rank):
    """In place, a layout the rotation cannot keep is refused with the alternatives named."""
    q, k, positions, inv_freq, cos, sin = rotation_inputs(seed=5)
    cd, sd = dt(cos, mesh, R), dt(sin, mesh, R)
    x = dt(q, mesh, Shard(3))
    with pytest.raises(RuntimeError, match=r"apply_rotary_: DTensor layout not supported in place "
                       r"\(x \(Shard\(dim=3\)\)\).*head_dim.*call the out-of-place apply_rotary .*shard heads "
                       r"\(dim 1\), or call \.to_local\(\)"):
        ops.apply_rotary_(x, cd, sd)
    x, y = dt(q, mesh, Shard(1)), dt(k, mesh, Shard(3))
    with pytest.raises(RuntimeError, match=r"apply_rotary_pos_qk_: DTensor layout not supported in place "
                       r"\(q \(Shard\(dim=1\)\), k \(Shard\(dim=3\)\)\).*head_dim.*out-of-place apply_rotary_pos_qk"):
        ops.apply_rotary_pos_qk_(x, y, dt(positions, mesh, R), dt(inv_freq, mesh, R))
    # a batch-wide table cannot follow q sharded on batch and k replicated (k needs every row)
    x, y = dt(q, mesh, Shard(0)), dt(k, mesh, R)
    with pytest.raises(RuntimeError, match=r"apply_rotary_qk_: DTensor layout not supported in place"):
        ops.apply_rotary_qk_(x, y, cd, sd)
    torch.testing.assert_close(y.full_tensor(), k)  # untouched


def attention_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, D, generator=g)
    k, v = torch.randn(B, HKV, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g)
    q_positions = torch.stack([torch.arange(L), torch.arange(L) * 3 - 2])  # row 1 starts with padding
    return q, k, v, q_positions, q_positions.clone(), ops.default_inv_freq(D, 10000.0)


def check_rerope_attention(mesh, rank):
    """rerope_attention on heads, batch and query-sequence layouts (ReRoPE and Leaky ReRoPE); layouts no rule
    lists are redistributed: all three inputs sharded on the sequence (each query needs every key), and GQA
    heads that do not split into whole groups (12 q heads over 3 kv heads: DTensor gives rank 0 kv heads 0-1
    and q heads 0-5, and its local op would pair q head 3 with kv head 1, not 0)."""
    q, k, v, qp, kp, inv_freq = attention_inputs()
    layouts = {  # (q, k/v, q positions, k positions) -> out/lse
        "replicated": (R, R, R, R),
        "heads": (Shard(1), Shard(1), R, R),
        "batch": (Shard(0), Shard(0), Shard(0), Shard(0)),
        "query sequence": (Shard(2), R, Shard(1), R),
    }
    redistributed = {"sequence": (Shard(2), Shard(2), Shard(1), Shard(1)), "heads": (Shard(1), Shard(1), R, R)}
    gen = torch.Generator().manual_seed(7)
    q12, k3, v3 = (torch.randn(B, h, L, D, generator=gen) for h in (12, 3, 3))
    for leaky_k in (0.0, 2.0):
        want = ops.rerope_attention(q, k, v, qp, kp, inv_freq, 3, leaky_k)
        for layout, (qpl, kvpl, qppl, kppl) in layouts.items():
            got = ops.rerope_attention(dt(q, mesh, qpl), dt(k, mesh, kvpl), dt(v, mesh, kvpl), dt(qp, mesh, qppl),
                                       dt(kp, mesh, kppl), dt(inv_freq, mesh, R), 3, leaky_k)
            try:
                for g, w in zip(got, want):
                    assert_same(g, w, qpl, exact=False)
            except AssertionError as error:
                raise AssertionError(f"{layout} layout, leaky_k={leaky_k}: {error}") from error
        for (layout, (qpl, kvpl, qppl, kppl)), (a, b, c) in zip(redistributed.items(), ((q, k, v), (q12, k3, v3))):
            want = ops.rerope_attention(a, b, c, qp, kp, inv_freq, 3, leaky_k)
            got = ops.rerope_attention(dt(a, mesh, qpl), dt(b, mesh, kvpl), dt(c, mesh, kvpl), dt(qp, mesh, qppl),
                                       dt(kp, mesh, kppl), dt(inv_freq, mesh, R), 3, leaky_k)
            for g, w in zip(got, want):
                torch.testing.assert_close(g.full_tensor(), w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"redistributed {layout} layout, leaky_k={leaky_k}: {m}")


def check_rerope_paged(mesh, rank):
    """rerope_attention_paged and rerope_cache_write_ with heads sharded and replicated; a write into caches
    sharded on pages is refused."""
    g = torch.Generator().manual_seed(6)
    requests = [(2, 5), (7, 7)]  # (q_len, seq_len): a chunk of a prefill and a whole prefill
    blocks, block_size = 5, 4
    key_cache, value_cache = (torch.randn(blocks, HKV, block_size, D, generator=g) for _ in range(2))
    block_table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([seq for _, seq in requests], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2, 9], dtype=torch.int32)
    q = torch.randn(9, HQ, D, generator=g)
    inv_freq = ops.default_inv_freq(D, 10000.0)
    tables = torch.stack([inv_freq, inv_freq / 2])  # a table per request
    factors = torch.tensor([1.0, 1.5])
    for layout, heads in (("replicated", R), ("heads", Shard(1))):
        args = (q, key_cache, value_cache, block_table, seq_lens, query_start_loc, tables, 3)
        want = ops.rerope_attention_paged(*args, leaky_k=2.0, scale_factors=factors)
        dargs = [dt(t, mesh, heads if i < 3 else R) for i, t in enumerate(args[:7])]
        got = ops.rerope_attention_paged(*dargs, 3, leaky_k=2.0, scale_factors=dt(factors, mesh, R))
        for a, b in zip(got, want):
            assert_same(a, b, heads)
        # write: key/value rows [T, Hkv, D] into the pages
        key, value = torch.randn(3, HKV, D, generator=g), torch.randn(3, HKV, D, generator=g)
        slots = torch.tensor([1, -1, 18])
        kc, vc = key_cache.clone(), value_cache.clone()
        ops.rerope_cache_write_(kc, vc, key, value, slots)
        kcd, vcd = dt(key_cache, mesh, heads), dt(value_cache, mesh, heads)
        ops.rerope_cache_write_(kcd, vcd, dt(key, mesh, heads), dt(value, mesh, heads), dt(slots, mesh, R))
        assert_same(kcd, kc, heads)
        assert_same(vcd, vc, heads)
    kcd, vcd = dt(key_cache, mesh, Shard(0)), dt(value_cache, mesh, Shard(0))
    with pytest.raises(RuntimeError, match=r"rerope_cache_write_: DTensor layout not supported in place \(key_cache "
                       r"\(Shard\(dim=0\)\), value_cache \(Shard\(dim=0\)\)\): the caches are written replicated or "
                       r"sharded on heads.*shard both caches on heads \(dim 1\) or replicate them, "
                       r"or call \.to_local\(\)"):
        ops.rerope_cache_write_(kcd, vcd, dt(key, mesh, R), dt(value, mesh, R), dt(slots, mesh, R))


def _tp_model(method, mesh=None, **patch):
    model = hf.patch(tiny("llama", attn_implementation="eager"), method, **patch)
    if mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"q_proj": ColwiseParallel(use_local_output=False), "k_proj": ColwiseParallel(use_local_output=False),
                "v_proj": ColwiseParallel(use_local_output=False), "o_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer.self_attn, mesh, plan)
    return model


def check_tensor_parallel(mesh, rank):
    """A YaRN- and a ReRoPE-patched tiny Llama (GQA 4/2) with q/k/v column-parallel as DTensors (heads sharded)
    and o_proj row-parallel gives the single-process logits; ropescale's ReRoPE op sees the DTensors."""
    from torch.distributed.tensor.experimental import implicit_replication

    x = ids(batch=2, length=20)
    seen = []
    originals = {name: getattr(ops, name) for name in ("apply_rotary_qk", "rerope_attention")}

    def recording(name):
        def op(q, *args, **kwargs):
            seen.append((name, tuple(q.placements) if isinstance(q, DTensor) else None))
            return originals[name](q, *args, **kwargs)
        return op

    try:
        for name in originals:
            setattr(ops, name, recording(name))
        # A static method is the rotary module's table: the model's own rotation runs (no ropescale op sees q).
        for method, patch, op in ((STATIC["yarn"], {}, None),
                                  (None, {"attention": "rerope", "window": 6}, "rerope_attention"),
                                  (None, {"attention": "rerope", "window": 6, "leaky_k": 4.0}, "rerope_attention")):
            with torch.no_grad():
                want = _tp_model(method, **patch)(x, use_cache=False).logits
                seen.clear()
                # cos/sin and positions are the model's plain tensors: replicated
                with implicit_replication():
                    got = _tp_model(method, mesh, **patch)(x, use_cache=False).logits
            assert (not seen) if op is None else (seen and all(s == (op, (Shard(1),)) for s in seen)), seen
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)


FSDP_KINDS = {
    "yarn_sdpa": (STATIC["yarn"], {}),
    "dynamic_yarn": (scaling.DynamicYaRN(original_max_position=16), {}),
    "rerope": (None, {"attention": "rerope", "window": 6}),
    "leaky_rerope": (None, {"attention": "rerope", "window": 6, "leaky_k": 4.0}),
}


def check_fsdp(mesh, rank):
    """One FSDP2 step (fully_shard on every layer and the model; each rank a half batch) of every patch kind
    gives the single-process full-batch loss and gradients."""
    from torch.distributed.fsdp import fully_shard

    x = ids(batch=4, length=24)  # past the 16 positions Dynamic-YaRN starts scaling at
    for kind, (method, patch) in FSDP_KINDS.items():
        reference = hf.patch(tiny("llama"), method, **patch).train()
        want = reference(x, labels=x).loss
        want.backward()
        model = hf.patch(tiny("llama"), method, **patch).train()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        half = x[rank * 2:(rank + 1) * 2]
        loss = model(half, labels=half).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        try:
            torch.testing.assert_close(mean / WORLD, want.detach(), rtol=1e-5, atol=1e-6)
            for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                assert isinstance(p, DTensor), name
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-4, atol=1e-6, msg=name)
        except AssertionError as error:
            raise AssertionError(f"{kind}: {error}") from error


CHECKS = {f.__name__: f for f in (
    check_rotation, check_rotation_mixed_and_partial, check_rotation_redistributed, check_rotation_gradients,
    check_rotation_in_place_refusals, check_rerope_attention, check_rerope_paged, check_tensor_parallel, check_fsdp,
)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks.run(tmp_path_factory.mktemp("ranks"), __name__, CHECKS)


@pytest.mark.parametrize("name", list(CHECKS))
def test_on_two_ranks(ranks, name):
    two_ranks.assert_passed(ranks, name)


# ---------------------------------------------------------------------------------------------
# Registration (this process: no group needed)


def test_rules_are_registered_once_torch_distributed_tensor_is_imported():
    assert ropescale.sharding.registered()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("apply_rotary", "apply_rotary_", "apply_rotary_qk", "apply_rotary_qk_", "apply_rotary_pos",
                 "apply_rotary_pos_", "apply_rotary_pos_qk", "apply_rotary_pos_qk_", "rerope_attention",
                 "rerope_attention_paged", "rerope_cache_write_"):
        assert getattr(torch.ops.ropescale, name).default in propagator.op_strategy_funcs, name


def test_import_ropescale_does_not_import_torch_distributed_tensor():
    """The rules wait for torch.distributed.tensor (seconds to import) and register when it comes."""
    code = textwrap.dedent("""
        import sys
        import ropescale
        assert "torch.distributed.tensor" not in sys.modules, "imported by ropescale"
        assert not ropescale.sharding.registered()
        import torch.distributed.tensor
        assert ropescale.sharding.registered()
    """)
    python_dir = os.path.dirname(os.path.dirname(ops.__file__))
    env = dict(os.environ, PYTHONPATH=python_dir + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
