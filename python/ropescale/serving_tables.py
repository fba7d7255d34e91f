"""Each step's tables for a batch of requests, engine-neutral: the tables by length (:class:`TableCache`), a step's
tables cut where rows of one request need different tables (:class:`StepTables`, :func:`cut_segments`), a step's
per-request rotation in buffers at fixed addresses (:class:`RequestRotaryTables`, :func:`rotate_per_request`) and the
engines' native default table (:func:`native_inv_freq`). :mod:`ropescale.serving` is the public path of these names;
the plan they serve is its :class:`PreRopePlan`."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
import torch

from . import ops



def native_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """The default table as engines compute it for a native model (vLLM's ``RotaryEmbedding``, transformers'
    default rope): ``1 / base ** (2i / d)`` in float32 arithmetic, which differs from ropescale's correctly rounded
    ``default_inv_freq`` in the last bit of about a third of the entries."""
    return 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim))



@dataclasses.dataclass(frozen=True)
class Segments:
    """A step's requests cut where their rows need different tables (see :func:`cut_segments`), as the op takes
    them: segment i is rows ``query_start_loc[i]:query_start_loc[i+1]``, the last rows of a sequence of
    ``seq_lens[i]`` keys, over the pages of request ``request[i]`` (an index into vLLM's block table)."""

    request: torch.Tensor  # int64 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]


@dataclasses.dataclass(frozen=True)
class StepTables:
    """What ``rerope_attention_paged`` takes for one step's requests: ``inv_freq`` ``[P]`` (a static table)
    or ``[S, P]`` (segment s's table), ``scale_factors`` ``[S]`` (segment s's attention factor squared; None
    for a static table) and ``scale_factor``, a static table's attention factor squared (1 when per segment).
    ``segments`` is None when every request is one segment (vLLM's own lengths and block table then serve).
    ``temperature``: DCA's temperature of the step's query rows, float32, row t's at ``temperature[t]`` (the factor
    of that token's query and of the key it writes, :meth:`PreRopePlan.temperature_factors`; the buffer may be
    longer than the step), None without one."""

    inv_freq: torch.Tensor
    scale_factors: torch.Tensor | None
    scale_factor: float
    segments: Segments | None = None
    temperature: torch.Tensor | None = None


def cut_segments(seq_lens: list[int], query_lens: list[int] | None = None, prompt_lens: list[int] | None = None,
                 request_lens: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """``(request, rows, seq_len, table_len)`` per segment: the length whose table each query row takes, as
    one transformers forward over the prompt and then one per generated token compute it (``hf.patch``), however
    vLLM chunks, batches or recomputes the request. A row at position ``p`` of a request whose prompt has ``P``
    tokens takes the table at ``max(P, p + 1)``: every prompt row the whole prompt's (a chunk of a long prompt
    scheduled beside other requests is not computed under a smaller scale), every later row its own length's
    (a decode step; several such rows in one step, after a preemption's recompute or as speculative tokens, are
    one segment each). Without prompt lengths (``prompt_lens`` None) each request takes its current length's.

    ``request_lens`` (a per-request method: each request's planned length, prompt + max new tokens) replaces that
    rule: every row of request i takes the table at ``request_lens[i]``, one segment per request."""
    out = []
    for request, seq_len in enumerate(seq_lens):
        rows = query_lens[request] if query_lens is not None else 1
        if request_lens is not None:
            out.append((request, max(rows, 0), seq_len, max(int(request_lens[request]), 1)))
            continue
        prompt = prompt_lens[request] if prompt_lens is not None else None
        if rows <= 0 or prompt is None:
            out.append((request, max(rows, 0), seq_len, max(seq_len, 1)))
            continue
        first = seq_len - rows
        prompt_end = min(seq_len, prompt)
        if first < prompt_end:
            out.append((request, prompt_end - first, prompt_end, prompt))
        out.extend((request, 1, position + 1, position + 1) for position in range(max(first, prompt), seq_len))
    return out


class TableCache:
    """A plan's tables by length (``hf.patch``'s ``state.table(seq_len)``: the method's float32 table and
    its attention factor at ``seq_len`` = largest position + 1), and each step's tables on ``device``.

    Every tensor a step hands the attention op lives at an address that never changes (CUDA graphs replay
    the addresses they captured): a static table is computed once; per-request tables are written into two
    buffers of ``rows`` rows (vLLM's ``max_num_seqs``; grown, outside any graph, if a step has more
    requests), from pinned host memory without waiting for the device. Lengths come from the host
    (:func:`host_seq_lens`): a step never reads the device."""

    def __init__(self, plan: "serving.PreRopePlan", device: torch.device | str = "cpu", rows: int = 0,
                 max_lengths: int = 4096) -> None:
        self.plan, self.device, self.max_lengths = plan, torch.device(device), max_lengths
        self._by_length: OrderedDict[int | None, tuple[torch.Tensor, float]] = OrderedDict()
        self._on_device: dict[tuple[int | None, torch.device], tuple[torch.Tensor, float]] = {}
        self._last: tuple[tuple[int, ...] | None, StepTables] | None = None
        self._inv_freq = self._factors = None
        if plan.length_dependent and rows > 0:
            self._allocate(rows)
        self.computed = 0  # tables computed so far (tests count them)

    def _allocate(self, rows: int) -> None:
        self._inv_freq = torch.zeros(rows, self.plan.rotary_dim // 2, dtype=torch.float32, device=self.device)
        self._factors = torch.ones(rows, dtype=torch.float32, device=self.device)

    def table(self, seq_len: int | None, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """The float32 table and the attention factor at ``seq_len`` (None, or any length for a table that does
        not depend on it: the static table), on the host or on ``device`` (copies kept: every layer of a forward
        asks for the same one)."""
        if not self.plan.length_dependent:
            seq_len = None
        if device is not None and torch.device(device).type != "cpu":
            key = (seq_len, torch.device(device))
            hit = self._on_device.get(key)
            if hit is None:
                if len(self._on_device) > 8:
                    self._on_device.clear()
                inv_freq, factor = self.table(seq_len)
                hit = self._on_device[key] = (inv_freq.to(device), factor)
            return hit
        hit = self._by_length.get(seq_len)
        if hit is not None:
            self._by_length.move_to_end(seq_len)
            return hit
        plan = self.plan
        inv_freq = plan.method.inv_freq(plan.rotary_dim, plan.base, seq_len=seq_len)
        factor = float(plan.method.attention_factor_for(seq_len))
        self.computed += 1
        self._by_length[seq_len] = (inv_freq, factor)
        if len(self._by_length) > self.max_lengths:
            self._by_length.popitem(last=False)
        return inv_freq, factor

    def prompt_digest(self, prompt_len: int, max_new_tokens: int = 0) -> str:
        """A digest of the table (and attention factor) a prompt of ``prompt_len`` tokens, in a request that may
        generate ``max_new_tokens``, is computed under (the one :func:`cut_segments` gives its rows,
        :meth:`PreRopePlan.table_length`): equal digests, equal results for the prompt's cached pages."""
        inv_freq, factor = self.table(self.plan.table_length(prompt_len, max_new_tokens))
        digest = hashlib.sha256(inv_freq.to(torch.float32).contiguous().numpy().tobytes())
        digest.update(repr(factor).encode())
        return digest.hexdigest()[:32]

    def step(self, seq_lens: list[int], query_lens: list[int] | None = None,
             prompt_lens: list[int] | None = None, request_lens: list[int] | None = None) -> StepTables:
        """The tables for requests of lengths ``seq_lens`` (this step's: computed + scheduled tokens, host
        integers) with ``query_lens`` rows each and prompts of ``prompt_lens`` tokens, and for a per-request method
        planned lengths ``request_lens`` (:func:`cut_segments`; a padded request's 0 rows get any valid table)."""
        if not self.plan.length_dependent:
            if self._last is None:
                inv_freq, factor = self.table(None)
                self._last = (None, StepTables(inv_freq.to(self.device), None, factor * factor))
            return self._last[1]
        if self.plan.per_request and request_lens is None:
            raise RuntimeError(f"ropescale: {type(self.plan.method).__name__}(per='request') needs each request's "
                               "planned length (prompt + max new tokens), and this step has none")
        cut = cut_segments(seq_lens, query_lens, prompt_lens, request_lens if self.plan.per_request else None)
        split = len(cut) != len(seq_lens)
        key = tuple(cut) if split else tuple(seg[3] for seg in cut)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        count = len(cut)
        rows = [self.table(seg[3]) for seg in cut]
        if self._inv_freq is None or self._inv_freq.shape[0] < count:
            self._allocate(max(count, 1))
        inv_freq, factors = self._inv_freq[:count], self._factors[:count]
        if rows:
            host_freq = torch.stack([r[0] for r in rows])
            host_factors = torch.tensor([r[1] * r[1] for r in rows], dtype=torch.float32)
            if self.device.type != "cpu":  # asynchronous copies need page-locked sources
                host_freq, host_factors = host_freq.pin_memory(), host_factors.pin_memory()
            inv_freq.copy_(host_freq, non_blocking=True)
            factors.copy_(host_factors, non_blocking=True)
        pieces = None
        if split:  # fresh tensors: only mixed steps split, and vLLM captures graphs for single-token decode only
            starts = [0]
            for seg in cut:
                starts.append(starts[-1] + seg[1])
            pieces = Segments(
                torch.tensor([seg[0] for seg in cut], dtype=torch.int64).to(self.device, non_blocking=True),
                torch.tensor(starts, dtype=torch.int32).to(self.device, non_blocking=True),
                torch.tensor([seg[2] for seg in cut], dtype=torch.int32).to(self.device, non_blocking=True))
        tables = StepTables(inv_freq, factors, 1.0, pieces)
        self._last = (key, tables)
        return tables


class RequestRotaryTables:
    """A step's per-request rotation for an engine's rotary layer (:func:`rotated_at_write`): ``request_index``
    (int32 ``[max_tokens]``: token t's request), ``inv_freq`` (float32 ``[max_requests, rotary_dim / 2]``: request r's
    table, the plan's at its planned length) and ``attention_factors`` (float32 ``[max_requests]``), what
    ``ops.apply_rotary_per_request`` takes; ``native`` (bool ``[max_requests]``, the op's ``native_angles``):
    request r's table is the model's own (the default table, factor 1: a request that fits the trained length), so
    its row holds the engines' own float32 ``inv_freq`` (:func:`native_inv_freq`) and its angles are formed as their
    native tables form them: such a request is the native model as an engine serves it (engines and transformers
    form the native angles in float32, ropescale's tables in double: 2.4e-4 rad apart at 8k).

    The three tensors are allocated once, at the engine's largest step, and written in place every step (from
    pinned host memory, without waiting for the device): a compiled graph and a CUDA graph read them at the
    addresses they captured, and nothing inside a step reads the host. Tokens past the step (an engine's padding)
    keep request 0, a valid row. Tables come from the plan's :class:`TableCache` (computed once per length)."""

    def __init__(self, plan: "serving.PreRopePlan", device: torch.device | str, max_tokens: int, max_requests: int) -> None:
        if not plan.per_request:
            raise ValueError("RequestRotaryTables: the plan's method has no table per request")
        self.plan, self.device = plan, torch.device(device)
        self.max_tokens, self.max_requests = max(int(max_tokens), 1), max(int(max_requests), 1)
        self.tables = TableCache(plan)
        native, factor = self.tables.table(1)  # a valid row for every slot until a step writes it
        self.request_index = torch.zeros(self.max_tokens, dtype=torch.int32, device=self.device)
        self.inv_freq = native.to(self.device).repeat(self.max_requests, 1)
        self.attention_factors = torch.full((self.max_requests,), factor, dtype=torch.float32, device=self.device)
        self.native = torch.zeros(self.max_requests, dtype=torch.bool, device=self.device)
        self._default = torch.ops.ropescale.default_inv_freq(plan.rotary_dim, plan.base)
        self._native_inv_freq = native_inv_freq(plan.rotary_dim, plan.base)
        self._native_lengths: dict[int, bool] = {}
        self._last: tuple | None = None

    def is_native(self, length: int) -> bool:
        """Whether the plan's table at ``length`` is the model's own: the default table, attention factor 1."""
        if length not in self._native_lengths:
            inv_freq, factor = self.tables.table(self.plan.table_length(length, 0))
            self._native_lengths[length] = factor == 1.0 and torch.equal(inv_freq, self._default)
        return self._native_lengths[length]

    def update(self, request_lens: list[int], query_lens: list[int]) -> None:
        """This step's requests, in the order the step packs their tokens: request r has ``query_lens[r]`` tokens
        and the planned length ``request_lens[r]`` (prompt + max new tokens)."""
        count, tokens = len(request_lens), sum(max(int(n), 0) for n in query_lens)
        if count > self.max_requests or tokens > self.max_tokens:
            raise RuntimeError(f"ropescale: a step of {count} requests and {tokens} tokens is larger than the "
                               f"per-request rotation's buffers ({self.max_requests} requests, {self.max_tokens} "
                               "tokens: the engine's max_num_seqs and max_num_batched_tokens)")
        key = (tuple(int(n) for n in request_lens), tuple(int(n) for n in query_lens))
        if key == self._last:
            return
        native = [self.is_native(length) for length in request_lens]
        rows = [(self._native_inv_freq, 1.0) if is_native else self.tables.table(self.plan.table_length(length, 0))
                for length, is_native in zip(request_lens, native)]
        index = torch.repeat_interleave(torch.arange(count, dtype=torch.int32),
                                        torch.tensor([max(int(n), 0) for n in query_lens], dtype=torch.int64))
        host = [index]
        if rows:
            host += [torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.float32),
                     torch.tensor(native, dtype=torch.bool)]
        if self.device.type != "cpu":  # asynchronous copies need page-locked sources
            host = [t.pin_memory() for t in host]
        self.request_index[:tokens].copy_(host[0], non_blocking=True)
        if rows:
            self.inv_freq[:count].copy_(host[1], non_blocking=True)
            self.attention_factors[:count].copy_(host[2], non_blocking=True)
            self.native[:count].copy_(host[3], non_blocking=True)
        self._last = key


def rotate_per_request(tables: RequestRotaryTables, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor | None, head_size: int, interleaved: bool, in_place: bool):
    """An engine rotary layer's forward for a ``per="request"`` table (vLLM's and SGLang's contract: ``query``
    ``[T, Hq * head_size]``, ``key`` ``[T, Hkv * head_size]`` or None): every token turned with its request's table
    and attention factor from ``tables`` (``ops.apply_rotary_per_request``), in place or not."""
    positions = positions.flatten()
    tokens = positions.shape[0]
    index = tables.request_index[:tokens]
    q = query.view(tokens, -1, head_size)
    k = key.view(tokens, -1, head_size) if key is not None else None
    arguments = (positions, index, tables.inv_freq, tables.attention_factors, interleaved)
    if in_place:
        ops.apply_rotary_per_request_(q, k, *arguments, native_angles=tables.native)
        return query, key
    q, k = ops.apply_rotary_per_request(q, k, *arguments, native_angles=tables.native)
    return q.reshape(query.shape), (k.reshape(key.shape) if key is not None else None)


def times_rows(x: torch.Tensor, factors: torch.Tensor, n: int) -> torch.Tensor:
    """``x``'s first ``n`` rows (its first dim: tokens) each times its row of ``factors`` (float32, at least ``n``
    rows), formed in float32 (float64 for float64) and rounded once to x's dtype: ``hf.patch``'s DCA temperature on
    q and k, the same float32 product."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = factors[:n].to(device=x.device, dtype=compute).view(n, *([1] * (x.dim() - 1)))
    return (x[:n].to(compute) * rows).to(x.dtype)
